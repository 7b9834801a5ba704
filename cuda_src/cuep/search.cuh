// Searches in ascending arrays, shared by the families that find a received row's source (its range in a
// prefix sum of rows per source) or the rows of a round (a token bound in ascending source tokens):
// intranode.cu, internode.cu, elastic.cu.
#pragma once

#include <cuep/common.cuh>

namespace cuep {

// The last index k < count with prefix[k] <= value (prefix[0] <= value): the range [prefix[k], prefix[k + 1])
// holding `value`, empty ranges passed over, the last one, k = count - 1, taken as open-ended.
__device__ __forceinline__ int find_range(const int32_t* prefix, int count, int value) {
    int low = 0, high = count - 1;
    while (low < high) {
        const int mid = (low + high + 1) / 2;
        if (prefix[mid] <= value)
            low = mid;
        else
            high = mid - 1;
    }
    return low;
}

// The first index in [low, high) whose value is at least `key`, or high.
__device__ __forceinline__ int lower_bound(const int32_t* values, int low, int high, int64_t key) {
    while (low < high) {
        const int mid = low + (high - low) / 2;
        if (values[mid] < key)
            low = mid + 1;
        else
            high = mid;
    }
    return low;
}

// Warp-wide lower_bound: each step probes kWarpSize evenly spaced values at once.
__device__ __forceinline__ int warp_lower_bound(const int32_t* values, int lo, int hi, int64_t key, int lane) {
    while (hi - lo > kWarpSize) {
        const int step = (hi - lo + kWarpSize - 1) / kWarpSize;
        const int probe = lo + lane * step;
        const int below = __popc(__ballot_sync(kFullWarpMask, probe < hi && values[probe] < key));
        if (below == 0)
            return lo;
        const int base = lo;
        lo = base + (below - 1) * step + 1;
        hi = min(hi, base + below * step);
    }
    return lo + __popc(__ballot_sync(kFullWarpMask, lo + lane < hi && values[lo + lane] < key));
}

}  // namespace cuep
