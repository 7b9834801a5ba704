// Every inline-assembly wrapper, named by operation, memory order, scope and state space.
#pragma once

#include <cuep/common.cuh>

namespace cuep {

// `value`, with the work behind it done whatever branch later drops it: the compiler cannot sink it into
// a branch past this (volatile) statement. Where a select drops a cheap value (a LogFMT channel's level
// for a zero), it would otherwise branch around the work per element, each branch a divergence region.
__device__ __forceinline__ int unconditional(int value) {
    asm volatile("" : "+r"(value));
    return value;
}

// Nanoseconds from the GPU's global timer; used only to bound waits, so its coarse tick is fine.
__device__ __forceinline__ uint64_t globaltimer_ns() {
    uint64_t now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    return now;
}

__device__ __forceinline__ uint64_t ld_acquire_sys_global(const uint64_t* ptr) {
    uint64_t value;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
    return value;
}

__device__ __forceinline__ uint32_t ld_acquire_sys_global(const uint32_t* ptr) {
    uint32_t value;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    return value;
}

// Adds to a counter that peers poll, released behind this thread's earlier writes and those it has
// synchronised with (a __syncwarp before it covers the warp's lanes). One MEMBAR.ALL.SYS and a
// reduction, where __threadfence_system() + atomicAdd_system costs MEMBAR.SC.SYS, an L1 invalidation
// and an atomic's round trip (sm_90 SASS).
__device__ __forceinline__ void red_release_sys_add(uint32_t* ptr, uint32_t value) {
    asm volatile("red.release.sys.global.add.u32 [%0], %1;" :: "l"(ptr), "r"(value) : "memory");
}

// Orders this thread's earlier memory operations (and those it synchronised with) before its later ones,
// GPU-wide: with a later strong write, a release pattern. Its cost is the writes still in flight.
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

// Adds to a GPU-wide counter, returning the old value; this thread's later memory operations follow it
// (acquire), while its earlier writes may still be in flight.
__device__ __forceinline__ uint64_t atom_add_acquire_gpu(uint64_t* ptr, uint64_t value) {
    uint64_t old;
    asm volatile("atom.acquire.gpu.global.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(ptr), "l"(value) : "memory");
    return old;
}

__device__ __forceinline__ int64_t ld_volatile_global(const int64_t* ptr) {
    int64_t value;
    asm volatile("ld.volatile.global.s64 %0, [%1];" : "=l"(value) : "l"(ptr));
    return value;
}

__device__ __forceinline__ int32_t ld_volatile_global(const int32_t* ptr) {
    int32_t value;
    asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(value) : "l"(ptr));
    return value;
}

__device__ __forceinline__ int64_t ld_nc_no_allocate_global(const int64_t* ptr) {
    int64_t value;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.s64 %0, [%1];" : "=l"(value) : "l"(ptr));
    return value;
}

__device__ __forceinline__ int32_t ld_nc_no_allocate_global(const int32_t* ptr) {
    int32_t value;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.s32 %0, [%1];" : "=r"(value) : "l"(ptr));
    return value;
}

__device__ __forceinline__ int4 ld_volatile_global(const int4* ptr) {
    int4 v;
    asm volatile("ld.volatile.global.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
    return v;
}

__device__ __forceinline__ int4 ld_nc_no_allocate_global(const int4* ptr) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
    return v;
}

__device__ __forceinline__ void st_release_sys_global(uint64_t* ptr, uint64_t value) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(ptr), "l"(value) : "memory");
}

// A store a peer may be polling for: strong (relaxed, system scope), so the 64-bit word lands whole.
__device__ __forceinline__ void st_relaxed_sys_global(uint64_t* ptr, uint64_t value) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" :: "l"(ptr), "l"(value) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys_global(int32_t* ptr, int32_t value) {
    asm volatile("st.relaxed.sys.global.s32 [%0], %1;" :: "l"(ptr), "r"(value) : "memory");
}

__device__ __forceinline__ uint64_t ld_volatile_global(const uint64_t* ptr) {
    uint64_t value;
    asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(value) : "l"(ptr));
    return value;
}

__device__ __forceinline__ ulonglong2 ld_volatile_global(const ulonglong2* ptr) {
    ulonglong2 v;
    asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(v.x), "=l"(v.y) : "l"(ptr));
    return v;
}

// Load of data a peer wrote during this kernel, after an acquire of its flag: cached in L2 only, so no
// line this SM cached earlier can be stale.
__device__ __forceinline__ int4 ld_cg_global(const int4* ptr) { return __ldcg(ptr); }

// An L2 cache policy that evicts first the lines it is applied to: for data read or written once,
// so that it leaves L2 to data still waiting to be read (the combine's landed rows).
__device__ __forceinline__ uint64_t evict_first_policy() {
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

// Load of data a peer wrote during this kernel, after an acquire of its flag (relaxed at GPU scope,
// so served by L2, never by a stale L1 line), under L2 cache policy `policy`.
__device__ __forceinline__ int4 ld_relaxed_gpu_global(const int4* ptr, uint64_t policy) {
    int4 v;
    asm volatile("ld.relaxed.gpu.global.L2::cache_hint.v4.s32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr), "l"(policy));
    return v;
}

// Store that this SM will not read again (no L1 allocation), under L2 cache policy `policy`.
__device__ __forceinline__ void st_global(int4* ptr, const int4& v, uint64_t policy) {
    asm volatile("st.global.L1::no_allocate.L2::cache_hint.v4.s32 [%0], {%1, %2, %3, %4}, %5;"
                 :: "l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "l"(policy) : "memory");
}

// Store that will not be read again by this SM: skip L1 allocation.
__device__ __forceinline__ void st_na_global(int4* ptr, const int4& v) {
    asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};"
                 :: "l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// Load of data read once by this kernel. The aggressive form skips L1 and prefetches 256 bytes into
// L2; it is only valid for memory no one writes during the kernel, so it stays opt-in.
template <typename T>
__device__ __forceinline__ T ld_nc_global(const T* ptr) {
    if constexpr (kAggressivePtx)
        return ld_nc_no_allocate_global(ptr);
    else
        return ld_volatile_global(ptr);
}

// ---------------------------------------------------------------------------------------------
// Asynchronous copies into shared memory, one 16-byte vector per instruction (sm_80 and later, so
// every arch cuep builds). Unlike the bulk copies below they stay in the generic proxy, and they are
// ordered after the issuing thread's earlier instructions: an acquire before them orders their reads
// as it would a plain load's.

// 16 bytes global -> shared (cached in L2 only, as ld_cg_global), in flight until cp_async_wait_all.
__device__ __forceinline__ void cp_async_16(void* shared, const void* global) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                 :: "r"(static_cast<uint32_t>(__cvta_generic_to_shared(shared))), "l"(global) : "memory");
}

// This thread's asynchronous copies have landed in shared memory (other lanes' need a __syncwarp too).
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// ---------------------------------------------------------------------------------------------
// Bulk (TMA) copies, Hopper path only: one thread moves a contiguous run of bytes (a multiple of 16,
// both ends 16-byte aligned) between global memory, a peer's included, and shared memory. Each body
// is discarded (`if constexpr`) unless kEnableSM90Features, so these instructions never reach the PTX
// of an older arch; called without the Hopper path (a broken invariant: callers test the same
// switch), they trap. The L2 prefetch at the end (bulk_prefetch_l2) is a hint instead: it does nothing there.

__device__ __forceinline__ uint32_t shared_address(const void* ptr) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* barrier, uint32_t arrivals) {
    if constexpr (kEnableSM90Features)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(shared_address(barrier)), "r"(arrivals)
                     : "memory");
    else
        __trap();
}

// Makes initialised mbarriers visible to the bulk-copy unit.
__device__ __forceinline__ void fence_mbarrier_init() {
    if constexpr (kEnableSM90Features)
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    else
        __trap();
}

// Global -> shared; `barrier` completes its current phase once the bytes have landed.
__device__ __forceinline__ void bulk_load(void* shared, const void* global, uint32_t bytes, uint64_t* barrier) {
    if constexpr (kEnableSM90Features) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                     :: "r"(shared_address(barrier)), "r"(bytes) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(shared_address(shared)), "l"(global), "r"(bytes), "r"(shared_address(barrier))
                     : "memory");
    } else {
        __trap();
    }
}

__device__ __forceinline__ void mbarrier_wait(uint64_t* barrier, uint32_t parity) {
    if constexpr (kEnableSM90Features) {
        uint32_t done = 0;
        while (!done)
            asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                         " selp.u32 %0, 1, 0, p;\n}"
                         : "=r"(done) : "r"(shared_address(barrier)), "r"(parity) : "memory");
    } else {
        __trap();
    }
}

// Shared -> global, as one bulk group.
__device__ __forceinline__ void bulk_store(void* global, const void* shared, uint32_t bytes) {
    if constexpr (kEnableSM90Features) {
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                     :: "l"(global), "r"(shared_address(shared)), "r"(bytes) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    } else {
        __trap();
    }
}

// This thread's bulk stores, all but the kNewestPending newest, have finished reading shared memory
// (it may be overwritten).
template <int kNewestPending = 0>
__device__ __forceinline__ void bulk_stores_read() {
    if constexpr (kEnableSM90Features)
        asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(kNewestPending) : "memory");
    else
        __trap();
}

// This thread's bulk stores are complete.
__device__ __forceinline__ void bulk_stores_done() {
    if constexpr (kEnableSM90Features)
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    else
        __trap();
}

// Asks L2 for `bytes` (a positive multiple of 16) of this GPU's global memory from `global` (16-byte aligned), as
// one bulk request that holds no register and that nothing waits for. A hint: without the Hopper path it does nothing.
__device__ __forceinline__ void bulk_prefetch_l2(const void* global, uint32_t bytes) {
    if constexpr (kEnableSM90Features)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(global), "r"(bytes) : "memory");
}

}  // namespace cuep
