// DeepEP V2's received layouts (ElasticBuffer, cuep/elastic.py), made on the receiving rank from a
// normal-mode dispatch's compact rows: one row per (source token, this rank), ordered by source rank,
// then source token. No communication.
//
//   count_rows    per chunk of kChunkRows received rows: how many entries name each local expert, and
//                 each row's metadata (`[row, num_topk + 2]`: source rank * num_max_tokens_per_rank +
//                 source token; source rank * num_topk + the highest top-k lane this rank holds; then
//                 per lane its expanded row, or -1).
//   scan_counts   one block: each chunk's first row per expert (in place), the per-expert counts, their
//                 prefix sums (V2's psum_num_recv_tokens_per_expert), the cumulative statistics, and the
//                 prefix sum of the rows from each local index (V2's psum_num_recv_tokens_per_scaleup_rank:
//                 the rows from every node's rank of that index; on one node, from that rank).
//   place_rows    the expanded layout: expert e owns rows [start_e, start_e + count_e), start_e the sum of
//                 the earlier experts' counts rounded up to expert_alignment; within an expert, entries in
//                 received order (so the layout is deterministic). Each compact row is read once and
//                 stored to every expanded row of its lanes, with its FP8 scales (row- or column-major)
//                 and its top-k weight; the padding rows after each expert are zeroed on request.
//   slot_rows     on the sending rank, per (token, lane): the compact row the token landed in on its expert's
//                 rank (V2's dst_buffer_slot_idx), from the dispatch's routing; -1 for lanes without an expert.
//   reduce_rows   combine's first step on an expanded layout: each compact row is the FP32 sum, in
//                 top-k lane order, of its lanes' expanded rows, rounded once (V2's reduction on the
//                 expert's rank), and its per-lane weights are gathered back (0 for other ranks' lanes).
//
// An expanded combine with allow_multiple_reduction=False sends each expanded row back alone, as the rows of
// a normal-mode dispatch whose one "expert" per rank is the token's rank, and sums them there:
//   route_back    on the expert's rank, per expanded row: its token's rank (-1 for padding), and its
//                 (token, lane) as the float token * num_topk + lane, which the dispatch carries as the
//                 row's top-k weight; on the token's rank, no lane's row found yet.
//   index_lanes   on the token's rank, per row received back: which (token, lane) it is.
//   sum_lanes     per token: FP32 from its biases, plus each lane's row in top-k lane order, rounded once
//                 (V2's combine with allow_multiple_reduction=False); a lane whose row did not come back
//                 (outside the contract: a token naming an expert twice) adds nothing.
//
// The received count lives on the GPU (num_rows): without the dispatch's CPU wait, the arrays have more
// rows than were received, and rows past the count are left alone.
#include <cuep/bf16.cuh>
#include <cuep/common.cuh>
#include <cuep/ptx.cuh>
#include <cuep/search.cuh>

namespace cuep {

// From cuep/kernels/elastic.py.
constexpr int kNumThreads = CUEP_NUM_THREADS;
constexpr int kChunkRows = CUEP_CHUNK_ROWS;
constexpr int kMaxLocalExperts = CUEP_MAX_LOCAL_EXPERTS;
constexpr int kMaxTopk = CUEP_MAX_TOPK;
constexpr int kWarps = kNumThreads / kWarpSize;
static_assert(kNumThreads % kWarpSize == 0 && kMaxTopk <= kWarpSize);

// 16-byte vectors a lane has in flight per step of a row copy or reduction, and the rows a reduction loads
// before adding any (warp_sum_bf16_rows), as internode.cu's sums.
constexpr int kRowUnroll = 4;
constexpr int kLaneRowsPerLoad = 2;

struct RowsArgs {
    const int64_t* recv_topk_idx;  // [capacity, num_topk] local expert ids, -1 for other ranks' lanes
    const int32_t* recv_src_idx;   // [capacity] source token of each row
    const int32_t* num_rows;       // rows received (the dispatch's count, on the GPU)
    const int32_t* rank_prefix;    // [num_ranks + 1] rows received from the ranks before each
    int capacity, num_topk, num_local_experts, num_ranks, ranks_per_node, num_max_tokens_per_rank, expert_alignment;
    int num_chunks, expand;        // expand: leave the slot columns to place_rows
    int32_t* chunk_counts;         // [num_chunks, num_local_experts]
    int32_t* metadata;             // [capacity, num_topk + 2]
    int32_t* num_unaligned;        // [num_local_experts] out
    int32_t* psum;                 // [num_local_experts] out: inclusive (aligned) or expanded (see scan_counts)
    int32_t* psum_local;           // [ranks_per_node] out: inclusive, rows from the ranks of each local index
    int32_t* stats;                // [num_local_experts] cumulative, or null
};

struct PlaceArgs {
    const int32_t* num_rows;
    int capacity, num_topk, num_local_experts, expert_alignment, num_chunks;
    const int32_t* chunk_starts;   // [num_chunks, num_local_experts] (scan_counts), or null: slots are in metadata
    const int32_t* num_unaligned;
    const int32_t* psum;           // expanded form: start_e + count_e
    const int64_t* recv_topk_idx;
    int32_t* metadata;
    const uint8_t* x;              // [capacity, row_bytes] compact rows
    int64_t row_bytes;
    const float* scales;           // [capacity, num_scales] or null
    int num_scales;
    const float* weights;          // [capacity, num_topk] or null
    uint8_t* out_x;                // [out_rows, row_bytes]
    float* out_scales;             // element (slot, p) at slot * scale_row_stride + p * scale_col_stride
    int64_t scale_row_stride, scale_col_stride;
    float* out_weights;            // [out_rows] or null
    int out_rows, zero_padding;
};

struct ReduceArgs {
    const int32_t* num_rows;
    int capacity, num_topk;
    const int32_t* metadata;       // [capacity, num_topk + 2]
    const uint8_t* x;              // [expanded rows, row_bytes] bf16
    int64_t row_bytes;
    const float* weights;          // [expanded rows] or null
    uint8_t* out_x;                // [capacity, row_bytes] bf16
    float* out_weights;            // [capacity, num_topk] or null
};

struct SlotArgs {
    const int64_t* topk_idx;           // [num_tokens, num_topk] global expert ids, -1: none
    const int32_t* send_pos;           // [num_tokens, num_ranks] row among those sent to each rank, -1: not sent
    const int32_t* rank_prefix_matrix; // [num_ranks, num_ranks]: [s][d] the rows ranks 0..s sent to d
    int num_tokens, num_topk, num_ranks, rank, experts_per_rank;
    int32_t* slots;                    // [num_tokens, num_topk] out
};

struct RouteBackArgs {
    const int32_t* num_rows;           // compact rows received (on the GPU)
    int capacity, num_topk, num_local_experts, expert_alignment, num_max_tokens_per_rank;
    const int32_t* metadata;           // [capacity, num_topk + 2]
    const int32_t* psum;               // [num_local_experts] expanded form: start_e + count_e
    int expanded_rows;
    int64_t* dest;                     // [expanded_rows] out: the token's rank, -1 for padding rows
    float* lane_tag;                   // [expanded_rows] out: token * num_topk + lane (0 for padding)
    int32_t* lane_rows;                // [num_lanes] out: -1, for index_lanes (this rank's tokens * num_topk)
    int num_lanes;
};

struct LanesArgs {
    const int64_t* recv_topk_idx;      // [capacity] rows received back: the local "expert" (0), -1 past them
    const float* recv_lane_tag;        // [capacity] each row's lane tag (route_back's)
    const uint8_t* x;                  // [capacity, row_bytes] the rows received back, bf16
    int capacity;
    int64_t row_bytes;
    const int64_t* topk_idx;           // [num_tokens, num_topk] the dispatch's global expert ids, -1: none
    int num_tokens, num_topk, num_experts;
    int32_t* lane_rows;                // [num_tokens * num_topk] the row received back for each (token, lane)
    const uint8_t* bias0;              // [num_tokens, row_bytes] bf16, or null
    const uint8_t* bias1;
    uint8_t* out_x;                    // [num_tokens, row_bytes] bf16
};

__device__ __forceinline__ int received_rows(const int32_t* num_rows, int capacity) {
    return min(ld_volatile_global(num_rows), capacity);
}

__device__ __forceinline__ int align_to(int value, int alignment) {
    return (value + alignment - 1) / alignment * alignment;
}

// One warp sums the rows of `x` its lanes name (`row` >= 0; -1: none), in lane order, from `start`'s values,
// then `finish`, in FP32, and writes the sum rounded once to `out` (`num_vectors` 16-byte vectors). `staged`: the
// warp's kMaxTopk row addresses in shared memory, which the sum reads in order.
template <typename Start, typename Finish>
__device__ __forceinline__ void sum_lane_rows(const int4** staged, int row, const uint8_t* x, int64_t row_bytes,
                                              int4* out, int num_vectors, const Start& start, const Finish& finish,
                                              int lane) {
    const uint32_t present = __ballot_sync(kFullWarpMask, row >= 0);
    if (row >= 0)
        staged[__popc(present & ((1u << lane) - 1u))] = reinterpret_cast<const int4*>(x + static_cast<int64_t>(row) *
                                                                                           row_bytes);
    __syncwarp();
    warp_sum_bf16_rows<kRowUnroll, kLaneRowsPerLoad>(out, num_vectors, __popc(present),
                                                     [&](int c) { return staged[c]; }, start, finish, lane);
    __syncwarp();  // the addresses are rewritten for the warp's next row
}

}  // namespace cuep

namespace cuep::elastic {

__global__ void __launch_bounds__(kNumThreads) count_rows(const RowsArgs args) {
    __shared__ int counts[kMaxLocalExperts];
    const int num_experts = args.num_local_experts, num_topk = args.num_topk;
    for (int e = threadIdx.x; e < num_experts; e += kNumThreads)
        counts[e] = 0;
    __syncthreads();
    const int rows = received_rows(args.num_rows, args.capacity);
    const int first = static_cast<int>(blockIdx.x) * kChunkRows, last = min(first + kChunkRows, rows);
    for (int i = first * num_topk + static_cast<int>(threadIdx.x); i < last * num_topk; i += kNumThreads) {
        const int64_t id = args.recv_topk_idx[i];
        if (id >= 0 && id < num_experts)
            atomicAdd(&counts[id], 1);
    }
    for (int row = first + static_cast<int>(threadIdx.x); row < last; row += kNumThreads) {
        const int source = find_range(args.rank_prefix, args.num_ranks, row);
        int highest = -1;
        for (int k = 0; k < num_topk; ++k)
            highest = args.recv_topk_idx[static_cast<int64_t>(row) * num_topk + k] >= 0 ? k : highest;
        int32_t* meta = args.metadata + static_cast<int64_t>(row) * (num_topk + 2);
        meta[0] = source * args.num_max_tokens_per_rank + args.recv_src_idx[row];
        meta[1] = source * num_topk + highest;
        if (!args.expand)
            for (int k = 0; k < num_topk; ++k)
                meta[2 + k] = -1;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < num_experts; e += kNumThreads)
        args.chunk_counts[static_cast<int64_t>(blockIdx.x) * num_experts + e] = counts[e];
}

// psum: with args.expand, start_e + count_e (V2's expanded form: align(psum[e], A) is the next
// expert's first row); otherwise the inclusive sum of the aligned counts.
__global__ void __launch_bounds__(kNumThreads) scan_counts(const RowsArgs args) {
    __shared__ int unaligned[kMaxLocalExperts];
    const int num_experts = args.num_local_experts, alignment = args.expert_alignment;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    for (int e = warp; e < num_experts; e += kWarps) {
        int running = 0;
        for (int first = 0; first < args.num_chunks; first += kWarpSize) {
            const int chunk = first + lane;
            int32_t* count = args.chunk_counts + static_cast<int64_t>(chunk) * num_experts + e;
            const int n = chunk < args.num_chunks ? *count : 0;
            int inclusive = n;
#pragma unroll
            for (int offset = 1; offset < kWarpSize; offset *= 2) {
                const int before = __shfl_up_sync(kFullWarpMask, inclusive, offset);
                inclusive += lane >= offset ? before : 0;
            }
            if (chunk < args.num_chunks)
                *count = running + inclusive - n;
            running += __shfl_sync(kFullWarpMask, inclusive, kWarpSize - 1);
        }
        if (lane == 0) {
            unaligned[e] = running;
            args.num_unaligned[e] = running;
            if (args.stats != nullptr)
                args.stats[e] += running;
        }
    }
    if (threadIdx.x == kNumThreads - 1) {  // one thread, its warp done with its experts
        const int L = args.ranks_per_node, num_nodes = args.num_ranks / L;
        int sum = 0;
        for (int local = 0; local < L; ++local) {
            for (int node = 0; node < num_nodes; ++node) {
                const int source = node * L + local;
                sum += args.rank_prefix[source + 1] - args.rank_prefix[source];
            }
            args.psum_local[local] = sum;
        }
    }
    __syncthreads();
    if (warp != 0)
        return;
    int start = 0;
    for (int first = 0; first < num_experts; first += kWarpSize) {
        const int e = first + lane;
        const int count = e < num_experts ? unaligned[e] : 0, aligned = align_to(count, alignment);
        int inclusive = aligned;
#pragma unroll
        for (int offset = 1; offset < kWarpSize; offset *= 2) {
            const int before = __shfl_up_sync(kFullWarpMask, inclusive, offset);
            inclusive += lane >= offset ? before : 0;
        }
        if (e < num_experts)
            args.psum[e] = start + inclusive - (args.expand ? aligned - count : 0);
        start += __shfl_sync(kFullWarpMask, inclusive, kWarpSize - 1);
    }
}

__global__ void __launch_bounds__(kNumThreads) place_rows(const PlaceArgs args) {
    __shared__ int next_slot[kMaxLocalExperts];
    __shared__ int slots[kChunkRows * kMaxTopk];
    const int num_experts = args.num_local_experts, num_topk = args.num_topk;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int64_t row_vectors = args.row_bytes / static_cast<int64_t>(sizeof(int4));

    if (static_cast<int>(blockIdx.x) >= args.num_chunks) {  // the padding after one expert's rows
        const int e = static_cast<int>(blockIdx.x) - args.num_chunks;
        const int begin = args.psum[e], end = min(align_to(begin, args.expert_alignment), args.out_rows);
        for (int slot = begin + warp; slot < end; slot += kWarps) {
            auto* out = reinterpret_cast<int4*>(args.out_x + static_cast<int64_t>(slot) * args.row_bytes);
            for (int64_t v = lane; v < row_vectors; v += kWarpSize)
                out[v] = make_int4(0, 0, 0, 0);
            if (args.out_scales != nullptr)
                for (int p = lane; p < args.num_scales; p += kWarpSize)
                    args.out_scales[slot * args.scale_row_stride + p * args.scale_col_stride] = 0.0f;
            if (args.out_weights != nullptr && lane == 0)
                args.out_weights[slot] = 0.0f;
        }
        return;
    }

    const int rows = received_rows(args.num_rows, args.capacity);
    const int first = static_cast<int>(blockIdx.x) * kChunkRows, last = min(first + kChunkRows, rows);
    const int entries = max(0, last - first) * num_topk;
    if (args.chunk_starts != nullptr) {
        for (int e = threadIdx.x; e < num_experts; e += kNumThreads)
            next_slot[e] = args.psum[e] - args.num_unaligned[e] +
                           args.chunk_starts[static_cast<int64_t>(blockIdx.x) * num_experts + e];
        __syncthreads();
        // One warp numbers the chunk's entries in received order, 32 at a time: entries naming the same
        // expert take consecutive rows, in lane order, and the group's highest lane moves the expert on.
        if (warp == 0) {
            for (int base = 0; base < entries; base += kWarpSize) {
                const int j = base + lane;
                const int64_t id = j < entries ? args.recv_topk_idx[static_cast<int64_t>(first) * num_topk + j] : -1;
                const int expert = id >= 0 && id < num_experts ? static_cast<int>(id) : -1;
                const uint32_t peers = __match_any_sync(kFullWarpMask, expert);  // every lane: a full-mask intrinsic
                int slot = expert >= 0 ? next_slot[expert] + __popc(peers & ((1u << lane) - 1u)) : -1;
                // Only a token naming one expert twice (outside the contract) can pass the worst case the
                // arrays were sized for without a CPU wait: such entries are dropped, never written past them.
                slot = slot < args.out_rows ? slot : -1;
                __syncwarp();
                if (expert >= 0 && ((peers >> lane) >> 1) == 0)
                    next_slot[expert] += __popc(peers);
                __syncwarp();
                if (j < entries) {
                    slots[j] = slot;
                    args.metadata[static_cast<int64_t>(first + j / num_topk) * (num_topk + 2) + 2 + j % num_topk] = slot;
                }
            }
        }
    } else {
        for (int j = threadIdx.x; j < entries; j += kNumThreads)
            slots[j] = args.metadata[static_cast<int64_t>(first + j / num_topk) * (num_topk + 2) + 2 + j % num_topk];
    }
    __syncthreads();

    // A warp per compact row: each vector is loaded once and stored to every expanded row of the row.
    for (int row = first + warp; row < last; row += kWarps) {
        const int* row_slots = slots + (row - first) * num_topk;
        const auto* in = reinterpret_cast<const int4*>(args.x + static_cast<int64_t>(row) * args.row_bytes);
        for (int64_t v = lane; v < row_vectors; v += kRowUnroll * kWarpSize) {
            int4 values[kRowUnroll];
#pragma unroll
            for (int u = 0; u < kRowUnroll; ++u)
                if (v + u * kWarpSize < row_vectors)
                    values[u] = ld_nc_global(in + v + u * kWarpSize);
            for (int k = 0; k < num_topk; ++k) {
                const int slot = row_slots[k];
                if (slot < 0)
                    continue;
                auto* out = reinterpret_cast<int4*>(args.out_x + static_cast<int64_t>(slot) * args.row_bytes);
#pragma unroll
                for (int u = 0; u < kRowUnroll; ++u)
                    if (v + u * kWarpSize < row_vectors)
                        st_na_global(out + v + u * kWarpSize, values[u]);
            }
        }
        if (args.scales != nullptr) {
            for (int p = lane; p < args.num_scales; p += kWarpSize) {
                const float scale = args.scales[static_cast<int64_t>(row) * args.num_scales + p];
                for (int k = 0; k < num_topk; ++k)
                    if (row_slots[k] >= 0)
                        args.out_scales[row_slots[k] * args.scale_row_stride + p * args.scale_col_stride] = scale;
            }
        }
        if (args.weights != nullptr && args.out_weights != nullptr && lane < num_topk && row_slots[lane] >= 0)
            args.out_weights[row_slots[lane]] = args.weights[static_cast<int64_t>(row) * num_topk + lane];
    }
}

__global__ void __launch_bounds__(kNumThreads) slot_rows(const SlotArgs args) {
    const int64_t entries = static_cast<int64_t>(args.num_tokens) * args.num_topk;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(kNumThreads) + threadIdx.x; i < entries;
         i += static_cast<int64_t>(gridDim.x) * kNumThreads) {
        const int64_t id = args.topk_idx[i];
        int slot = -1;
        const int64_t holder = id >= 0 ? id / args.experts_per_rank : -1;
        if (holder >= 0 && holder < args.num_ranks) {  // an id past the experts was flagged by the layout kernel
            const int64_t token = i / args.num_topk;
            const int first = args.rank > 0 ? args.rank_prefix_matrix[(args.rank - 1) * args.num_ranks + holder] : 0;
            slot = first + args.send_pos[token * args.num_ranks + holder];
        }
        args.slots[i] = slot;
    }
}

__global__ void __launch_bounds__(kNumThreads) reduce_rows(const ReduceArgs args) {
    __shared__ const int4* lane_row[kWarps][kMaxTopk];
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int num_topk = args.num_topk;
    const int rows = received_rows(args.num_rows, args.capacity);
    const int num_vectors = static_cast<int>(args.row_bytes / static_cast<int64_t>(sizeof(int4)));
    for (int row = static_cast<int>(blockIdx.x) * kWarps + warp; row < rows; row += gridDim.x * kWarps) {
        const int slot = lane < num_topk ? args.metadata[static_cast<int64_t>(row) * (num_topk + 2) + 2 + lane] : -1;
        sum_lane_rows(lane_row[warp], slot, args.x, args.row_bytes,
                      reinterpret_cast<int4*>(args.out_x + static_cast<int64_t>(row) * args.row_bytes), num_vectors,
                      NoAddend{}, NoAddend{}, lane);
        if (args.out_weights != nullptr && lane < num_topk)
            args.out_weights[static_cast<int64_t>(row) * num_topk + lane] =
                slot >= 0 && args.weights != nullptr ? args.weights[slot] : 0.0f;
    }
}

// Two loops over disjoint rows, so no order between them: the padding rows (past each expert's count up to
// its aligned end, and past the last expert's) go nowhere; each lane of a received row names its expanded row's
// token. A third clears the map index_lanes fills after the dispatch.
__global__ void __launch_bounds__(kNumThreads) route_back(const RouteBackArgs args) {
    __shared__ int aligned_end[kMaxLocalExperts];
    const int num_experts = args.num_local_experts, num_topk = args.num_topk;
    for (int e = threadIdx.x; e < num_experts; e += kNumThreads)
        aligned_end[e] = align_to(args.psum[e], args.expert_alignment);
    __syncthreads();
    const int64_t stride = static_cast<int64_t>(gridDim.x) * kNumThreads;
    const int64_t first = static_cast<int64_t>(blockIdx.x) * kNumThreads + threadIdx.x;
    for (int64_t i = first; i < args.expanded_rows; i += stride) {
        const int e = lower_bound(aligned_end, 0, num_experts, i + 1);  // the expert whose aligned rows hold i
        if (e == num_experts || i >= args.psum[e]) {
            args.dest[i] = -1;
            args.lane_tag[i] = 0.0f;
        }
    }
    const int64_t entries = static_cast<int64_t>(received_rows(args.num_rows, args.capacity)) * num_topk;
    for (int64_t j = first; j < entries; j += stride) {
        const int32_t* meta = args.metadata + (j / num_topk) * (num_topk + 2);
        const int slot = meta[2 + j % num_topk];
        if (slot < 0 || slot >= args.expanded_rows)
            continue;
        const int source = meta[0] / args.num_max_tokens_per_rank, token = meta[0] % args.num_max_tokens_per_rank;
        args.dest[slot] = source;
        args.lane_tag[slot] = static_cast<float>(token * num_topk + static_cast<int>(j % num_topk));
    }
    for (int64_t lane = first; lane < args.num_lanes; lane += stride)
        args.lane_rows[lane] = -1;
}

__global__ void __launch_bounds__(kNumThreads) index_lanes(const LanesArgs args) {
    const int lanes = args.num_tokens * args.num_topk;
    for (int64_t row = static_cast<int64_t>(blockIdx.x) * kNumThreads + threadIdx.x; row < args.capacity;
         row += static_cast<int64_t>(gridDim.x) * kNumThreads) {
        if (args.recv_topk_idx[row] < 0)
            continue;
        const int lane = static_cast<int>(args.recv_lane_tag[row]);
        if (lane >= 0 && lane < lanes)
            args.lane_rows[lane] = static_cast<int32_t>(row);
    }
}

__global__ void __launch_bounds__(kNumThreads) sum_lanes(const LanesArgs args) {
    __shared__ const int4* lane_row[kWarps][kMaxTopk];
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int num_topk = args.num_topk;
    const int num_vectors = static_cast<int>(args.row_bytes / static_cast<int64_t>(sizeof(int4)));
    for (int t = static_cast<int>(blockIdx.x) * kWarps + warp; t < args.num_tokens; t += gridDim.x * kWarps) {
        const int64_t entry = static_cast<int64_t>(t) * num_topk + lane;
        int row = -1;
        bool unrouted = false;
        if (lane < num_topk) {
            const int64_t id = args.topk_idx[entry];
            unrouted = id < 0;
            row = id >= 0 && id < args.num_experts ? args.lane_rows[entry] : -1;
            row = row < args.capacity ? row : -1;
        }
        // V2 adds a zero row for each lane without an expert: +0.0 once, which turns a sum of -0.0 into +0.0.
        const bool add_zero = __any_sync(kFullWarpMask, unrouted);
        const auto zero_rows = [&](float (&acc)[kBf16PerVector], int) {
            if (add_zero)
#pragma unroll
                for (int c = 0; c < kBf16PerVector; ++c)
                    acc[c] += 0.0f;
        };
        const int64_t token_vectors = static_cast<int64_t>(t) * num_vectors;
        // V2 starts from bias0 + bias1 itself, not from zero: the same but for a sum of -0.0.
        const auto add_biases = [&](float (&acc)[kBf16PerVector], int v) {
            if (args.bias0 != nullptr)
                bf16x8_to_floats(ld_nc_global(reinterpret_cast<const int4*>(args.bias0) + token_vectors + v), acc);
            if (args.bias1 != nullptr)
                accumulate_bf16x8(acc, ld_nc_global(reinterpret_cast<const int4*>(args.bias1) + token_vectors + v));
        };
        sum_lane_rows(lane_row[warp], row, args.x, args.row_bytes, reinterpret_cast<int4*>(args.out_x) + token_vectors,
                      num_vectors, add_biases, zero_rows, lane);
    }
}

}  // namespace cuep::elastic
