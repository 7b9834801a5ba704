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

// 16-byte vectors each lane of warp_copy has in flight per step: 2 KB a warp (4 KB measured slower:
// NVLink congests).
constexpr int kWarpCopyBatch = 4;

// One warp copies `num_bytes` (a multiple of 16) from src to dst, lane `lane` taking every
// kWarpSize-th vector: batched_copy's loop over the warp's vectors, with the addresses formed from
// the row's pointers (through batched_copy's indices the intranode kernels compile to other code).
// kReadOnly: nothing writes src during this kernel, so the read-once load path may be used.
template <bool kReadOnly = true>
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
    for (int i = lane; i < num_vectors; i += kWarpCopyBatch * kWarpSize) {
        int4 v[kWarpCopyBatch];
#pragma unroll
        for (int u = 0; u < kWarpCopyBatch; ++u)
            if (i + u * kWarpSize < num_vectors)
                v[u] = load(in + i + u * kWarpSize);
#pragma unroll
        for (int u = 0; u < kWarpCopyBatch; ++u)
            if (i + u * kWarpSize < num_vectors)
                st_na_global(out + i + u * kWarpSize, v[u]);
    }
}

}  // namespace cuep
