// Phase timestamps for performance work: `trace[block][point]` holds the global timer (ns) when a
// block reached `point`. Built only with CUEP_TRACE=1 (`python -m cuep.bench --mode low_latency
// --trace`); otherwise every mark compiles to nothing and `trace` is null. A family that includes it
// passes CUEP_TRACE_POINTS, the row length of `trace` its host allocates, and names its points.
#pragma once

#include <cuep/common.cuh>
#include <cuep/ptx.cuh>

namespace cuep {

constexpr int kTracePoints = CUEP_TRACE_POINTS;  // points per block: TRACE_POINTS of the family's launch module

// The calling thread stamps its block's `point` (after a barrier, when the block or team got there).
__device__ __forceinline__ void trace_mark(uint64_t* trace, int point) {
    if constexpr (kTrace)
        trace[blockIdx.x * kTracePoints + point] = globaltimer_ns();
}

// Thread 0 stamps its block's `point`.
__device__ __forceinline__ void trace_block(uint64_t* trace, int point) {
    if (threadIdx.x == 0)
        trace_mark(trace, point);
}

// Any thread: keeps the latest time one of the block's threads reached `point`. Timestamps only grow,
// so a value left by an earlier launch is always overtaken.
__device__ __forceinline__ void trace_latest(uint64_t* trace, int point) {
    if constexpr (kTrace)
        atomicMax(reinterpret_cast<unsigned long long*>(trace + blockIdx.x * kTracePoints + point),
                  static_cast<unsigned long long>(globaltimer_ns()));
}

}  // namespace cuep
