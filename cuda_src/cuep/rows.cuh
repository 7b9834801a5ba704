// The row walk of the kernels that move rows between the ranks of one node: the intranode pull
// dispatch, cached dispatch and combine (intranode.cu), and the NVLink ceiling probe (probe.cu),
// which times the same walk with nothing else around it.
#pragma once

#include <cuep/common.cuh>

namespace cuep {

// Rows come grouped by source rank: rank_prefix[num_ranks + 1] is the prefix sum of the rows of each
// source. Walking them in order would send every warp of every rank to the same source at once,
// leaving the other links idle; instead each warp starts on a different source (staggered by rank
// and warp) and claims rows from per-source counters (next_row[source], zero before the walk),
// moving on to the next source when one is exhausted. `copy_row(source, row, j, lane)` moves row
// `row` = rank_prefix[source] + j and returns false to stop this warp (a wait timed out). Rows of
// `skip_source` are left out. kWarpsPerBlock: the launch's warps per block.
//
// A warp claims kRowsPerClaim rows at a time. With `tapered_warps` > 0 (the combine's pushers: that
// many warps share the sources) a warp that has claimed from a source before takes kLargeClaimRows
// while more than kLargeClaimRounds rounds of such claims are left there for all of them. Each of
// their claims ends in a release of its rows' arrivals, which waits for the warp's stores to land:
// fewer claims keep more bytes in flight, and small claims at the end keep the last rows from landing
// long after the rest. `on_claim(lane)` runs after a claim is requested and before its answer is read: the
// combine releases the previous claim's arrivals there, so the release overlaps the claim's round
// trip. Measured at EP4 (combine, eager us): claims of 2 rows, released at the next row 482.8-483.2;
// released at the claim's end 481.0; tapered 4 then 2, 477.1-477.5; with the release overlapping the
// next claim 475.6-476.6. Tapered 8 or 3 then 2: 481.0 or 477.6; one or three rounds of large claims:
// 477.9-478.6 or 478.4; claims of 1 row: 493.7.
constexpr int kRowsPerClaim = 2;
constexpr int kLargeClaimRows = 4;
constexpr int kLargeClaimRounds = 2;

struct NoClaimHook {
    __device__ void operator()(int) const {}
};

template <int kWarpsPerBlock, typename CopyRow, typename OnClaim = NoClaimHook>
__device__ __forceinline__ void for_each_row_spread_over_sources(int32_t* next_row, const int32_t* rank_prefix,
                                                                 int rank, int num_ranks, CopyRow copy_row,
                                                                 int skip_source = -1, int tapered_warps = 0,
                                                                 OnClaim on_claim = {}) {
    const int lane = threadIdx.x % kWarpSize;
    const int warp = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize;
    const int large_claims_above = kLargeClaimRounds * kLargeClaimRows * (tapered_warps / num_ranks);
    int source = (rank + 1 + warp) % num_ranks;
    int claimed_to = -1;  // where this warp's last claim on `source` ended; -1 before its first
    for (int exhausted = 0; exhausted < num_ranks;) {
        if (source == skip_source) {
            source = (source + 1) % num_ranks;
            ++exhausted;
            continue;
        }
        const int segment = rank_prefix[source + 1] - rank_prefix[source];
        const int size = tapered_warps > 0 && claimed_to >= 0 && segment - claimed_to > large_claims_above
                             ? kLargeClaimRows
                             : kRowsPerClaim;
        int first = 0;
        if (lane == 0)
            first = atomicAdd(next_row + source, size);
        on_claim(lane);
        first = __shfl_sync(kFullWarpMask, first, 0);
        claimed_to = first + size;
        if (first >= segment) {
            source = (source + 1) % num_ranks;
            ++exhausted;
            claimed_to = -1;
            continue;
        }
        const int last = min(first + size, segment);
        for (int j = first; j < last; ++j)
            if (!copy_row(source, rank_prefix[source] + j, j, lane))
                return;
    }
}

}  // namespace cuep
