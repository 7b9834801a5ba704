// Copy loops, written once for every family. Each loads a batch of elements, then stores it: a store
// is ordered after the loads before it, so a loop that alternated them would wait out one memory
// latency per element, where a batch waits one per batch. Over NVLink a copy is bound by the bytes a
// warp keeps in flight, which the batch sets.
#pragma once

#include <cuep/common.cuh>
#include <cuep/ptx.cuh>

namespace cuep {

// Elements [0, count) moved by `store(i, load(i))`, this thread taking first, first + step, ...: it
// loads kBatch of them before storing any (the last batch predicated). Size the batch to the
// registers a thread has at the launch's block size: a larger one spills.
template <typename T, int kBatch, typename Load, typename Store>
__device__ __forceinline__ void batched_copy(int first, int step, int count, const Load& load, const Store& store) {
    for (int base = first; base < count; base += kBatch * step) {
        T values[kBatch];
#pragma unroll
        for (int i = 0; i < kBatch; ++i)
            if (base + i * step < count)
                values[i] = load(base + i * step);
#pragma unroll
        for (int i = 0; i < kBatch; ++i)
            if (base + i * step < count)
                store(base + i * step, values[i]);
    }
}

// 16-byte vectors each lane of warp_copy has in flight per step: 2 KB a warp, which the combine's pushers
// keep (more was slower for them: docs/performance-log.md). kBatch overrides it: the ceiling probe
// compares batches, and the kernels whose copies gain from more in flight name their own (intranode
// kTokenCopyBatch).
constexpr int kWarpCopyBatch = 4;

// One warp copies `num_bytes` (a multiple of 16) from src to dst, lane `lane` taking every
// kWarpSize-th vector: batched_copy's loop over the warp's vectors, with the addresses formed from
// the row's pointers (through batched_copy's indices the intranode kernels compile to other code).
// kReadOnly: nothing writes src during this kernel, so the read-once load path may be used.
template <bool kReadOnly = true, int kBatch = kWarpCopyBatch>
__device__ __forceinline__ void warp_copy(void* dst, const void* src, int64_t num_bytes, int lane) {
    auto* out = static_cast<int4*>(dst);
    const auto* in = static_cast<const int4*>(src);
    const auto load = [](const int4* ptr) {
        if constexpr (kReadOnly)
            return ld_nc_global(ptr);
        else
            return ld_volatile_global(ptr);
    };
    const int num_vectors = static_cast<int>(num_bytes / sizeof(int4));
    for (int i = lane; i < num_vectors; i += kBatch * kWarpSize) {
        int4 v[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u)
            if (i + u * kWarpSize < num_vectors)
                v[u] = load(in + i + u * kWarpSize);
#pragma unroll
        for (int u = 0; u < kBatch; ++u)
            if (i + u * kWarpSize < num_vectors)
                st_na_global(out + i + u * kWarpSize, v[u]);
    }
}

constexpr int kMaxBulkStages = 16;

// One thread's pipeline of bulk (TMA) copies through `stages` chunks of shared memory, kept full across
// rows: a chunk is loaded as soon as a stage is free; once stages - 1 loads are in flight the oldest is
// stored (after it has landed) before the next load, which takes the stage stored one step earlier, once
// that store has read it (bulk_stores_read<1>). Unlike a warp's copy, the bytes in flight take no
// registers. Hopper path only (the bulk instructions trap elsewhere); the thread initialises `landed`
// (init) before its first copy and calls complete() before it releases what it copied. kMaxStages
// bounds `stages` (it sizes the per-stage destinations the thread keeps).
template <int kMaxStages = kMaxBulkStages>
struct BulkRing {
    uint8_t* chunks;      // [stages][chunk_bytes]
    uint64_t* landed;     // [stages] mbarriers, one phase per load
    int chunk_bytes, stages;
    uint32_t parity = 0;  // bit s: the phase of landed[s] to wait for next
    int next = 0;         // the stage the next load takes
    int loading = 0;      // loads issued and not yet stored (the oldest is at next - loading)
    uint8_t* dst[kMaxStages] = {};
    uint32_t bytes[kMaxStages] = {};

    __device__ void store_oldest() {
        const int s = (next - loading + stages) % stages;
        mbarrier_wait(landed + s, (parity >> s) & 1u);
        parity ^= 1u << s;
        bulk_store(dst[s], chunks + static_cast<int64_t>(s) * chunk_bytes, bytes[s]);
        --loading;
    }

    __device__ void load(uint8_t* to, const uint8_t* from, uint32_t num_bytes) {
        if (loading == stages - 1)
            store_oldest();
        bulk_stores_read<1>();  // stage `next`: read by its store, issued one step earlier
        bulk_load(chunks + static_cast<int64_t>(next) * chunk_bytes, from, num_bytes, landed + next);
        dst[next] = to;
        bytes[next] = num_bytes;
        next = (next + 1) % stages;
        ++loading;
    }

    __device__ void copy_row(uint8_t* to, const uint8_t* from, int64_t num_bytes) {
        for (int64_t offset = 0; offset < num_bytes; offset += chunk_bytes)
            load(to + offset, from + offset, static_cast<uint32_t>(min(static_cast<int64_t>(chunk_bytes),
                                                                       num_bytes - offset)));
    }

    __device__ void init() {
        for (int s = 0; s < stages; ++s)
            mbarrier_init(landed + s, 1);
        fence_mbarrier_init();
    }

    // Every copy issued so far has been written (visible to this thread, so a release of its covers them).
    __device__ void complete() {
        while (loading > 0)
            store_oldest();
        bulk_stores_done();
    }
};

}  // namespace cuep
