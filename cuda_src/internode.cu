// Internode (hierarchical) high-throughput dispatch and combine: NVLink inside a node, one network
// transfer per (token, node) across nodes.
//
// Ranks are numbered node by node: rank = node * L + local (L ranks per node, N nodes, R = N * L).
// The ranks with the same local index on every node form a rail; a token crosses between nodes only
// along its source's rail.
//
// Dispatch (rank s = (m, i) sends its T tokens):
//   scan:   each token's position among the tokens sent to each rank (send_pos) and to each node
//           (node_pos, with the inverse node_list), and the counts.
//   send:   s puts one count message to every rank (what it sends to that rank, to its node, to each
//           rank of its node, and per expert), then each token once per destination node n, with its
//           routing and its position at every rank of n, into partition m of rank (n, i)'s receive
//           region (the forwarder), at slot node_pos. Rows go in chunks of consecutive slots, each
//           chunk then its signal (put, fence, signal), so a chunk is complete when its signal is.
//   notify: each rank waits for every count message and lays out its plan (rank prefix, per-expert
//           counts, where the combine lands rows); the host may wait for the received count here.
//   pull:   each rank reads, over NVLink, the chunks that reached its node's forwarders (their
//           signals say when), and copies the rows that name it to their place in its output,
//           ordered by source rank, then token. A forwarder also keeps each of its rows' positions
//           (the handle's forward_pos) for the combine.
// Combine (the reverse):
//   push:    each rank writes every row it received into the NVL landing region of the forwarder
//            the row came through, then raises a flag there.
//   forward: each forwarder sums, in FP32, the copies its node holds of each row it forwarded, and
//            puts one BF16 partial per (token, node) back into partition n of the source's receive
//            region (chunks with signals, as the dispatch).
//   reduce:  each source sums the partials of every node its token went to, and the biases.
//
// Only NVSHMEM's portable device API crosses nodes (puts, fences, signals, signal waits, quiet), so any
// transport serves; data is never inferred from the arrival of a later write. Ranks of one node
// read and write each other's buffers directly (nvshmem_ptr addresses, passed in node_rdma/node_nvl).
//
// Every call starts with the device barrier (cuda_src/barrier.cu), so no rank writes into a buffer
// that a peer still reads from the previous call. Calls are numbered on the device (kStateCall, equal
// on every rank): a signal is set to the call's number, never reset, and a wait is for >= it.
//
// Every wait is bounded (cuep/sync.cuh); a timed-out wait records the peer and phase in `status`.
// The constants come from cuep/kernels/internode.py (CUEP_* macros), which mirrors the argument
// structs below field for field; cuep/modes/internode.py lays out the buffers and sequences calls.

// Two builds (cuep/network.cuh says why): for ranks on one host, NVSHMEM's device code inlined whole;
// across hosts (CUEP_NETWORK), its transfer code linked from libnvshmem_device.a, IBGDA included.
#if !CUEP_NETWORK
#define NVSHMEM_ENABLE_ALL_DEVICE_INLINING
#endif
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cuep/bf16.cuh>
#include <cuep/common.cuh>
#include <cuep/copy.cuh>
#include <cuep/network.cuh>
#include <cuep/ptx.cuh>
#include <cuep/sync.cuh>

namespace cuep {

constexpr int kNumThreads = CUEP_NUM_THREADS;
constexpr int kWarpsPerBlock = kNumThreads / kWarpSize;
constexpr int kMaxRanks = CUEP_MAX_RANKS;
constexpr int kMaxRanksPerNode = CUEP_MAX_RANKS_PER_NODE;
constexpr int kMaxLocalExperts = CUEP_MAX_LOCAL_EXPERTS;
constexpr int kMaxChunks = CUEP_MAX_CHUNKS;
constexpr int kCountHeaderWords = CUEP_COUNT_HEADER_WORDS;
constexpr int kCountWords = CUEP_COUNT_WORDS;
constexpr int kStateCall = 0;        // internode calls finished on this rank
constexpr int kStateBlocksDone = 1;  // blocks of the running kernel that are done
static_assert(kStateBlocksDone < CUEP_STATE_WORDS, "the host allocates too few state words");
static_assert(kNumThreads >= kMaxRanks, "the notify block gives each source a thread");
static_assert(kMaxRanksPerNode <= kWarpSize, "a warp's lanes cover the ranks of a node");
static_assert(kCountWords >= kCountHeaderWords + kMaxLocalExperts && kCountWords % 4 == 0,
              "a count message holds its header and the per-expert counts, in whole 16-byte vectors");
// Count message words (int32), sent by each source to each rank q.
constexpr int kCountToRank = 0;        // tokens to q
constexpr int kCountToNode = 1;        // tokens to q's node
constexpr int kCountToNodeRanks = 2;   // then tokens to each rank of q's node
// Traffic counters (uint64): rows and bytes put to other nodes, by dispatches and by combines.
constexpr int kTrafficDispatchRows = 0, kTrafficDispatchBytes = 1, kTrafficCombineRows = 2,
              kTrafficCombineBytes = 3;
static_assert(kTrafficCombineBytes < CUEP_TRAFFIC_WORDS, "the host allocates too few traffic words");

struct Topology {
    int rank, num_ranks, node, num_nodes, local, ranks_per_node;
};

// Offsets (bytes) in every rank's RDMA buffer; cuep/modes/internode.py lays it out.
struct RdmaLayout {
    int64_t count_signals;    // uint64 [R]: the call whose count message source s put here
    int64_t chunk_signals;    // uint64 [N][kMaxChunks]: the call whose chunk c of partition n landed here
    int64_t counts;           // int32 [R][kCountWords]: count messages, by source
    int64_t count_staging;    // int32 [R][kCountWords]: this rank's outgoing count messages
    int64_t send;             // [N] partitions of partition_bytes: outgoing rows, by destination node
    int64_t recv;             // [N] partitions: incoming rows, by the node they came from
    int64_t partition_bytes;
};

// Offsets (bytes) in every rank's NVL buffer, used by the combine.
struct NvlLayout {
    int64_t push_done;        // uint64 [L]: the combine whose pushes local rank j finished here
    int64_t landing;          // landing rows: pushed copies, grouped by pushing rank, then source node
    int64_t landing_bytes;
};

// Where each part of a dispatch's plan (one int32 array, written by notify) starts, in words.
struct PlanLayout {
    int32_t recv_prefix;      // [R + 1] first output row of each source rank
    int32_t per_expert;       // [E / R] rows per local expert, aligned
    int32_t forward_prefix;   // [N + 1] as a forwarder: first row of each source node's partition
    int32_t part_rows;        // [L * N] rows in partition m of local forwarder i
    int32_t push_offsets;     // [L * N] as a pusher: first landing row at forwarder i of source node m's rows
    int32_t forward_offsets;  // [L * N] as a forwarder: first landing row here of local j's rows from node m
    int32_t landing_rows;     // [L] landing rows a combine fills at forwarder i
    int32_t words;
};
constexpr int kPlanNumRecv = 0;      // plan[0]: rows this rank receives
constexpr int kPlanNumForward = 1;   // plan[1]: rows this rank forwards

struct TokenRows {
    const uint8_t* x;
    int64_t hidden_bytes;
    const float* scales;
    int64_t scale_token_stride, scale_channel_stride;
    int num_scales, num_topk;
    const int64_t* topk_idx;
    const float* topk_weights;
    int num_tokens;
};

// A dispatched row on the wire: the hidden bytes, FP8 scales, top-k ids (int32) and weights, the
// source token, then the token's position among the rows each rank of the destination node
// receives from its source (-1: none). cuep/modes/internode.py sizes it (dispatch_row_bytes).
struct RowShape {
    int64_t hidden_bytes, scales, topk_idx, topk_weights, src, pos;

    __device__ RowShape(int64_t hidden, int num_scales, int num_topk)
        : hidden_bytes(hidden),
          scales(hidden),
          topk_idx(scales + 4 * num_scales),
          topk_weights(topk_idx + 4 * num_topk),
          src(topk_weights + 4 * num_topk),
          pos(src + 4) {}
};

struct ScanArgs {
    const bool* is_token_in_rank;  // [T, R]
    int num_tokens;
    Topology topo;
    int32_t* send_pos;             // [T, R]
    int32_t* node_pos;             // [T, N]
    int32_t* node_list;            // [N, T]: node_list[n][p] = the token at position p to node n
    int32_t* counts;               // [R + N]: tokens to each rank, then to each node
};

struct SendArgs {
    TokenRows tokens;
    const int32_t* send_pos;
    const int32_t* node_list;
    const int32_t* counts;
    const int32_t* num_tokens_per_expert;  // [E], or null: no count messages (a cached dispatch)
    int num_experts;
    Topology topo;
    uint8_t* rdma;                         // this rank's RDMA buffer (symmetric address)
    RdmaLayout layout;
    int64_t row_bytes;
    int chunk_rows;
    const uint64_t* state;
    uint64_t* traffic;
    Status status;
};

struct NotifyArgs {
    uint8_t* rdma;
    RdmaLayout layout;
    Topology topo;
    int num_experts, expert_alignment;
    int32_t* plan;
    PlanLayout plan_layout;
    const uint64_t* state;
    Status status;
    uint64_t timeout_ns;
};

struct RecvArrays {
    uint8_t* x;
    float* scales;
    int64_t* topk_idx;
    float* topk_weights;
    int32_t* src_idx;
    int num_rows;
};

struct PullArgs {
    const uint64_t* node_rdma;  // [L] each local rank's RDMA buffer as this GPU addresses it
    RdmaLayout layout;
    Topology topo;
    int64_t row_bytes;
    int chunk_rows;
    int64_t hidden_bytes;
    int num_scales, num_topk, num_experts;
    const int32_t* plan;
    PlanLayout plan_layout;
    RecvArrays recv;
    int32_t* forward_pos;       // [forward_capacity, L], or null (a cached dispatch keeps its handle's)
    int forward_capacity;
    uint64_t* state;
    Status status;
    uint64_t timeout_ns;
};

struct PushArgs {
    const uint64_t* node_nvl;   // [L] each local rank's NVL buffer as this GPU addresses it
    NvlLayout nvl;
    Topology topo;
    const int32_t* plan;
    PlanLayout plan_layout;
    const uint8_t* x;
    int64_t hidden_bytes;
    const float* topk_weights;
    int num_topk;
    int64_t landing_row_bytes;
    uint64_t* state;
    Status status;
};

struct ForwardArgs {
    uint8_t* nvl;
    NvlLayout nvl_layout;
    uint8_t* rdma;
    RdmaLayout layout;
    Topology topo;
    const int32_t* plan;
    PlanLayout plan_layout;
    const int32_t* forward_pos;
    int64_t hidden_bytes;
    int num_topk;
    int64_t landing_row_bytes, row_bytes;
    int chunk_rows;
    const uint64_t* state;
    uint64_t* traffic;
    Status status;
    uint64_t timeout_ns;
};

struct ReduceArgs {
    uint8_t* rdma;
    RdmaLayout layout;
    Topology topo;
    const int32_t* node_pos;
    int num_tokens;
    int64_t hidden_bytes;
    int num_topk;
    int64_t row_bytes;
    int chunk_rows;
    const __nv_bfloat16* bias0;
    const __nv_bfloat16* bias1;
    __nv_bfloat16* combined_x;
    float* combined_topk_weights;
    uint64_t* state;
    Status status;
    uint64_t timeout_ns;
};

// The call a kernel belongs to: one more than the calls this rank finished.
static __device__ __forceinline__ uint64_t this_call(const uint64_t* state) {
    return ld_volatile_global(state + kStateCall) + 1;
}

// The last block of a call's last kernel records the call as finished.
static __device__ __forceinline__ void finish_call(uint64_t* state, uint64_t call) {
    if (last_block_done<Scope::kSystem>(state, kStateBlocksDone)) {
        state[kStateBlocksDone] = 0;
        state[kStateCall] = call;
    }
}

template <typename T>
static __device__ __forceinline__ T* at(uint8_t* base, int64_t offset) {
    return reinterpret_cast<T*>(base + offset);
}

template <typename T>
static __device__ __forceinline__ const T* at(const uint8_t* base, int64_t offset) {
    return reinterpret_cast<const T*>(base + offset);
}

static __device__ __forceinline__ uint64_t* chunk_signal(uint8_t* rdma, const RdmaLayout& layout, int node, int chunk) {
    return at<uint64_t>(rdma, layout.chunk_signals) + static_cast<int64_t>(node) * kMaxChunks + chunk;
}

// Index of the range [prefix[k], prefix[k + 1]) holding `value`, prefix[0] <= value < prefix[count].
static __device__ __forceinline__ int find_range(const int32_t* prefix, int count, int value) {
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

// Block-wide: the number of threads before this one whose `flag` is set; `total` gets the block's.
// `warp_counts` is shared scratch of kWarpsPerBlock + 1 ints.
static __device__ __forceinline__ int block_exclusive_count(bool flag, int* warp_counts, int& total) {
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    const uint32_t ballot = __ballot_sync(kFullWarpMask, flag);
    if (lane == 0)
        warp_counts[warp] = __popc(ballot);
    __syncthreads();
    if (threadIdx.x == 0) {
        int sum = 0;
        for (int w = 0; w < kWarpsPerBlock; ++w) {
            const int count = warp_counts[w];
            warp_counts[w] = sum;
            sum += count;
        }
        warp_counts[kWarpsPerBlock] = sum;
    }
    __syncthreads();
    const int before = warp_counts[warp] + __popc(ballot & ((1u << lane) - 1u));
    total = warp_counts[kWarpsPerBlock];
    __syncthreads();  // the scratch is reused by the next call
    return before;
}

// Put `bytes` at `src` (this rank's symmetric memory) to `dst` on `pe` and set `signal` there to
// `value` once they have landed: put, fence, signal from the calling warp, behind the warp's stores.
static __device__ __forceinline__ void put_with_signal(void* dst, const void* src, size_t bytes, uint64_t* signal,
                                                       uint64_t value, int pe) {
    __syncwarp();
    __threadfence_system();  // the NIC (or a peer's copy engine) reads what the warp's lanes just wrote
    put_then_signal_warp(dst, src, bytes, signal, value, pe);
}

// Chunks of `rows` rows, `chunk_rows` each.
static __device__ __forceinline__ int chunks_of(int rows, int chunk_rows) {
    return (rows + chunk_rows - 1) / chunk_rows;
}

}  // namespace cuep

namespace cuep::internode {

// ---------------------------------------------------------------------------------------------
// Scan: block c < R scans column c of is_token_in_rank; block R + n scans node n (any of its ranks).

__global__ void __launch_bounds__(kNumThreads, 1) scan(const ScanArgs args) {
    __shared__ int warp_counts[kWarpsPerBlock + 1];
    const Topology& topo = args.topo;
    const int column = blockIdx.x, num_tokens = args.num_tokens;
    const bool node_column = column >= topo.num_ranks;
    const int node = column - topo.num_ranks;
    int running = 0;
    for (int base = 0; base < num_tokens; base += kNumThreads) {
        const int t = base + threadIdx.x;
        bool in = false;
        if (t < num_tokens) {
            const bool* row = args.is_token_in_rank + static_cast<int64_t>(t) * topo.num_ranks;
            if (node_column) {
                for (int l = 0; l < topo.ranks_per_node; ++l)
                    in |= row[node * topo.ranks_per_node + l];
            } else {
                in = row[column];
            }
        }
        int total;
        const int position = running + block_exclusive_count(in, warp_counts, total);
        if (t < num_tokens) {
            if (node_column) {
                args.node_pos[static_cast<int64_t>(t) * topo.num_nodes + node] = in ? position : -1;
                if (in)
                    args.node_list[static_cast<int64_t>(node) * num_tokens + position] = t;
            } else {
                args.send_pos[static_cast<int64_t>(t) * topo.num_ranks + column] = in ? position : -1;
            }
        }
        running += total;
    }
    if (threadIdx.x == 0)
        args.counts[column] = running;
}

}  // namespace cuep::internode

// ---------------------------------------------------------------------------------------------
// Send: block 0's warps first put the count messages (non-cached dispatch); then every warp takes
// chunks (destination node n, chunk c) in turn, writes their rows into the send partition n and puts
// them to the forwarder (n, local) with the chunk's signal.

namespace cuep {

// One warp: this rank's count message to rank q, staged, then put with q's count signal.
static __device__ void send_counts(const SendArgs& args, int q, uint64_t call, int lane) {
    const Topology& topo = args.topo;
    const int q_node = q / topo.ranks_per_node;
    const int num_local_experts = args.num_experts / topo.num_ranks;
    int32_t* message = at<int32_t>(args.rdma, args.layout.count_staging) + static_cast<int64_t>(q) * kCountWords;
    for (int w = lane; w < kCountHeaderWords + num_local_experts; w += kWarpSize) {
        int32_t value = 0;
        if (w == kCountToRank)
            value = args.counts[q];
        else if (w == kCountToNode)
            value = args.counts[topo.num_ranks + q_node];
        else if (w < kCountToNodeRanks + topo.ranks_per_node)
            value = args.counts[q_node * topo.ranks_per_node + (w - kCountToNodeRanks)];
        else if (w >= kCountHeaderWords)
            value = args.num_tokens_per_expert[q * num_local_experts + (w - kCountHeaderWords)];
        message[w] = value;
    }
    int32_t* slot = at<int32_t>(args.rdma, args.layout.counts) + static_cast<int64_t>(topo.rank) * kCountWords;
    uint64_t* signal = at<uint64_t>(args.rdma, args.layout.count_signals) + topo.rank;
    put_with_signal(slot, message, sizeof(int32_t) * (kCountHeaderWords + num_local_experts), signal, call, q);
}

// One warp writes token t's row (routing and positions included) at `row`.
static __device__ void stage_row(const SendArgs& args, const RowShape& shape, int t, int dst_node, uint8_t* row,
                                 int lane) {
    const TokenRows& tokens = args.tokens;
    const Topology& topo = args.topo;
    warp_copy(row, tokens.x + t * tokens.hidden_bytes, tokens.hidden_bytes, lane);
    auto* scales = at<float>(row, shape.scales);
    for (int s = lane; s < tokens.num_scales; s += kWarpSize)
        scales[s] = tokens.scales[t * tokens.scale_token_stride + s * tokens.scale_channel_stride];
    for (int k = lane; k < tokens.num_topk; k += kWarpSize) {
        at<int32_t>(row, shape.topk_idx)[k] = static_cast<int32_t>(tokens.topk_idx[t * tokens.num_topk + k]);
        at<float>(row, shape.topk_weights)[k] = tokens.topk_weights[t * tokens.num_topk + k];
    }
    if (lane == 0)
        *at<int32_t>(row, shape.src) = t;
    if (lane < topo.ranks_per_node)
        at<int32_t>(row, shape.pos)[lane] =
            args.send_pos[static_cast<int64_t>(t) * topo.num_ranks + dst_node * topo.ranks_per_node + lane];
}

}  // namespace cuep

namespace cuep::internode {

__global__ void __launch_bounds__(kNumThreads, 1) send(const SendArgs args) {
    __shared__ int chunk_prefix[kMaxRanks + 1];
    const Topology& topo = args.topo;
    const uint64_t call = this_call(args.state);
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    if (args.num_tokens_per_expert != nullptr && blockIdx.x == 0)
        for (int q = warp; q < topo.num_ranks; q += kWarpsPerBlock)
            send_counts(args, q, call, lane);
    if (threadIdx.x == 0) {
        chunk_prefix[0] = 0;
        for (int n = 0; n < topo.num_nodes; ++n)
            chunk_prefix[n + 1] = chunk_prefix[n] + chunks_of(args.counts[topo.num_ranks + n], args.chunk_rows);
    }
    __syncthreads();
    const RowShape shape(args.tokens.hidden_bytes, args.tokens.num_scales, args.tokens.num_topk);
    const int num_chunks = chunk_prefix[topo.num_nodes];
    const int first_warp = blockIdx.x * kWarpsPerBlock + warp, num_warps = gridDim.x * kWarpsPerBlock;
    bool sent = false;
    for (int item = first_warp; item < num_chunks; item += num_warps) {
        const int n = find_range(chunk_prefix, topo.num_nodes + 1, item);
        const int chunk = item - chunk_prefix[n];
        const int rows_to_node = args.counts[topo.num_ranks + n];
        const int first_slot = chunk * args.chunk_rows;
        const int rows = min(args.chunk_rows, rows_to_node - first_slot);
        const int64_t offset = static_cast<int64_t>(first_slot) * args.row_bytes;
        uint8_t* staged = args.rdma + args.layout.send + n * args.layout.partition_bytes + offset;
        for (int r = 0; r < rows; ++r) {
            const int t = args.node_list[static_cast<int64_t>(n) * args.tokens.num_tokens + first_slot + r];
            stage_row(args, shape, t, n, staged + r * args.row_bytes, lane);
        }
        uint8_t* landing = args.rdma + args.layout.recv + topo.node * args.layout.partition_bytes + offset;
        const int64_t bytes = rows * args.row_bytes;
        put_with_signal(landing, staged, bytes, chunk_signal(args.rdma, args.layout, topo.node, chunk), call,
                        n * topo.ranks_per_node + topo.local);
        sent = true;
        if (n != topo.node && lane == 0) {
            atomicAdd(reinterpret_cast<unsigned long long*>(args.traffic + kTrafficDispatchRows), rows);
            atomicAdd(reinterpret_cast<unsigned long long*>(args.traffic + kTrafficDispatchBytes), bytes);
        }
    }
    // The staging is reused by the next call: every put of this one must have read it.
    if ((sent || (blockIdx.x == 0 && args.num_tokens_per_expert != nullptr)) && lane == 0)
        nvshmem_quiet();
}

// ---------------------------------------------------------------------------------------------
// Notify (one block): wait for every source's count message, then write this rank's plan.

__global__ void __launch_bounds__(kNumThreads, 1) notify(const NotifyArgs args) {
    const Topology& topo = args.topo;
    const PlanLayout& pl = args.plan_layout;
    const int L = topo.ranks_per_node, N = topo.num_nodes, R = topo.num_ranks;
    const uint64_t call = this_call(args.state);
    const uint64_t deadline_ns = globaltimer_ns() + args.timeout_ns;
    const uint64_t* signals = at<uint64_t>(args.rdma, args.layout.count_signals);
    const int s = threadIdx.x;
    const bool timed_out = s < R && !wait_at_least(signals + s, call, deadline_ns, args.status, s,
                                                     kPhaseInternodeCounts);
    if (__syncthreads_or(timed_out))
        return;
    const auto* counts = at<const int32_t>(args.rdma, args.layout.counts);
    const auto count = [&](int source, int word) {
        return ld_volatile_global(counts + static_cast<int64_t>(source) * kCountWords + word);
    };
    int32_t* plan = args.plan;
    const int num_local_experts = args.num_experts / R;
    if (threadIdx.x == 0) {
        int sum = 0;
        for (int source = 0; source < R; ++source) {
            plan[pl.recv_prefix + source] = sum;
            sum += count(source, kCountToRank);
        }
        plan[pl.recv_prefix + R] = sum;
        plan[kPlanNumRecv] = sum;
        sum = 0;
        for (int m = 0; m < N; ++m) {
            plan[pl.forward_prefix + m] = sum;
            sum += count(m * L + topo.local, kCountToNode);
        }
        plan[pl.forward_prefix + N] = sum;
        plan[kPlanNumForward] = sum;
    }
    for (int e = threadIdx.x; e < num_local_experts; e += kNumThreads) {
        int sum = 0;
        for (int source = 0; source < R; ++source)
            sum += count(source, kCountHeaderWords + e);
        plan[pl.per_expert + e] = (sum + args.expert_alignment - 1) / args.expert_alignment * args.expert_alignment;
    }
    for (int item = threadIdx.x; item < L * N; item += kNumThreads)
        plan[pl.part_rows + item] = count((item % N) * L + item / N, kCountToNode);
    // The combine's landing rows at forwarder i hold, for each local rank j in turn, the rows j
    // received from the sources on i's rail, by source node: both sides derive the offsets from the
    // count messages (each source told every rank of a node what it sends to each rank of it).
    if (threadIdx.x < L) {
        const int i = threadIdx.x;
        int row = 0;
        for (int j = 0; j < L; ++j) {
            for (int m = 0; m < N; ++m) {
                if (j == topo.local)
                    plan[pl.push_offsets + i * N + m] = row;
                if (i == topo.local)
                    plan[pl.forward_offsets + j * N + m] = row;
                row += count(m * L + i, kCountToNodeRanks + j);
            }
        }
        plan[pl.landing_rows + i] = row;
    }
}

}  // namespace cuep::internode

// ---------------------------------------------------------------------------------------------
// Pull: every warp takes chunks (local forwarder i, source node m, chunk c) in turn, waits for the
// chunk's signal at the forwarder, and copies the rows that name this rank.

namespace cuep {

// One warp copies a landed row (at `row`, read over NVLink) into output row k.
static __device__ void copy_out(const PullArgs& args, const RowShape& shape, const uint8_t* row, int k, int lane) {
    const RecvArrays& recv = args.recv;
    warp_copy<false>(recv.x + k * args.hidden_bytes, row, args.hidden_bytes, lane);
    for (int s = lane; s < args.num_scales; s += kWarpSize)
        recv.scales[static_cast<int64_t>(k) * args.num_scales + s] =
            __int_as_float(ld_volatile_global(reinterpret_cast<const int32_t*>(row + shape.scales) + s));
    const int num_local_experts = args.num_experts / args.topo.num_ranks;
    const int first_expert = args.topo.rank * num_local_experts;
    for (int j = lane; j < args.num_topk; j += kWarpSize) {
        const int expert = ld_volatile_global(reinterpret_cast<const int32_t*>(row + shape.topk_idx) + j);
        const bool local = expert >= first_expert && expert < first_expert + num_local_experts;
        const int64_t out = static_cast<int64_t>(k) * args.num_topk + j;
        if (recv.topk_idx != nullptr)
            recv.topk_idx[out] = local ? expert - first_expert : -1;
        if (recv.topk_weights != nullptr)
            recv.topk_weights[out] =
                local ? __int_as_float(ld_volatile_global(reinterpret_cast<const int32_t*>(row + shape.topk_weights) + j))
                      : 0.0f;
    }
    if (lane == 0 && recv.src_idx != nullptr)
        recv.src_idx[k] = ld_volatile_global(reinterpret_cast<const int32_t*>(row + shape.src));
}

}  // namespace cuep

namespace cuep::internode {

__global__ void __launch_bounds__(kNumThreads, 1) dispatch(const PullArgs args) {
    __shared__ int chunk_prefix[kMaxRanks + 1];
    __shared__ int32_t recv_prefix[kMaxRanks + 1];
    const Topology& topo = args.topo;
    const PlanLayout& pl = args.plan_layout;
    const int L = topo.ranks_per_node, N = topo.num_nodes;
    const uint64_t call = this_call(args.state);
    const uint64_t deadline_ns = globaltimer_ns() + args.timeout_ns;
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    for (int r = threadIdx.x; r <= topo.num_ranks; r += kNumThreads)
        recv_prefix[r] = args.plan[pl.recv_prefix + r];
    if (threadIdx.x == 0) {
        chunk_prefix[0] = 0;
        for (int item = 0; item < L * N; ++item)
            chunk_prefix[item + 1] = chunk_prefix[item] + chunks_of(args.plan[pl.part_rows + item], args.chunk_rows);
    }
    __syncthreads();
    const int num_recv = recv_prefix[topo.num_ranks];
    const int num_rows = args.recv.num_rows;
    if (blockIdx.x == 0 && threadIdx.x == 0 && num_recv > num_rows)
        args.status.record(kStatusOverflow, num_recv);
    const RowShape shape(args.hidden_bytes, args.num_scales, args.num_topk);
    const int num_chunks = chunk_prefix[L * N];
    const int first_warp = blockIdx.x * kWarpsPerBlock + warp, num_warps = gridDim.x * kWarpsPerBlock;
    for (int item = first_warp; item < num_chunks; item += num_warps) {
        const int part = find_range(chunk_prefix, L * N + 1, item);
        const int i = part / N, m = part % N, chunk = item - chunk_prefix[part];
        const int source = m * L + i;
        auto* forwarder = reinterpret_cast<uint8_t*>(args.node_rdma[i]);
        bool arrived = true;
        if (lane == 0)
            arrived = wait_at_least(chunk_signal(forwarder, args.layout, m, chunk), call, deadline_ns, args.status,
                                    source, kPhaseInternodeRows);
        if (!__shfl_sync(kFullWarpMask, arrived, 0))
            break;
        const int first_slot = chunk * args.chunk_rows;
        const int rows = min(args.chunk_rows, args.plan[pl.part_rows + part] - first_slot);
        const uint8_t* partition = forwarder + args.layout.recv + m * args.layout.partition_bytes;
        const bool own_rail = i == topo.local && args.forward_pos != nullptr;
        for (int r = 0; r < rows; ++r) {
            const int slot = first_slot + r;
            const uint8_t* row = partition + static_cast<int64_t>(slot) * args.row_bytes;
            const auto* positions = reinterpret_cast<const int32_t*>(row + shape.pos);
            if (own_rail && lane < L) {
                const int f = args.plan[pl.forward_prefix + m] + slot;
                if (f < args.forward_capacity)
                    args.forward_pos[static_cast<int64_t>(f) * L + lane] = ld_volatile_global(positions + lane);
            }
            const int position = ld_volatile_global(positions + topo.local);
            if (position < 0)
                continue;
            const int k = recv_prefix[source] + position;
            if (k < num_rows)
                copy_out(args, shape, row, k, lane);
        }
    }
    // Rows past the received ones (num_worst_tokens) name no expert.
    for (int64_t e = static_cast<int64_t>(blockIdx.x) * kNumThreads + threadIdx.x + static_cast<int64_t>(num_recv) * args.num_topk;
         e < static_cast<int64_t>(num_rows) * args.num_topk; e += static_cast<int64_t>(gridDim.x) * kNumThreads) {
        if (args.recv.topk_idx != nullptr)
            args.recv.topk_idx[e] = -1;
        if (args.recv.topk_weights != nullptr)
            args.recv.topk_weights[e] = 0.0f;
    }
    finish_call(args.state, call);
}

// ---------------------------------------------------------------------------------------------
// Combine push: every warp takes received rows k in turn and writes each, with its top-k weights,
// into the landing rows of the forwarder it came through; the last block then raises this rank's
// flag at each forwarder of the node.

__global__ void __launch_bounds__(kNumThreads, 1) push(const PushArgs args) {
    __shared__ int32_t recv_prefix[kMaxRanks + 1];
    const Topology& topo = args.topo;
    const PlanLayout& pl = args.plan_layout;
    const int L = topo.ranks_per_node, N = topo.num_nodes;
    const uint64_t call = this_call(args.state);
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    for (int r = threadIdx.x; r <= topo.num_ranks; r += kNumThreads)
        recv_prefix[r] = args.plan[pl.recv_prefix + r];
    __syncthreads();
    const int64_t capacity = args.nvl.landing_bytes / args.landing_row_bytes;
    bool fits = true;
    for (int i = 0; i < L; ++i)
        fits &= args.plan[pl.landing_rows + i] <= capacity;
    if (!fits) {
        if (blockIdx.x == 0 && threadIdx.x == 0)
            args.status.record(kStatusLandingRows, args.plan[pl.landing_rows + topo.local]);
    } else {
        const int num_recv = recv_prefix[topo.num_ranks];
        for (int k = blockIdx.x * kWarpsPerBlock + warp; k < num_recv; k += gridDim.x * kWarpsPerBlock) {
            const int source = find_range(recv_prefix, topo.num_ranks + 1, k);
            const int m = source / L, i = source % L;
            const int64_t slot = args.plan[pl.push_offsets + i * N + m] + (k - recv_prefix[source]);
            uint8_t* landing = reinterpret_cast<uint8_t*>(args.node_nvl[i]) + args.nvl.landing + slot * args.landing_row_bytes;
            warp_copy(landing, args.x + k * args.hidden_bytes, args.hidden_bytes, lane);
            for (int j = lane; j < args.num_topk; j += kWarpSize)
                reinterpret_cast<float*>(landing + args.hidden_bytes)[j] =
                    args.topk_weights[static_cast<int64_t>(k) * args.num_topk + j];
        }
    }
    if (last_block_done<Scope::kSystem>(args.state, kStateBlocksDone)) {
        args.state[kStateBlocksDone] = 0;
        for (int i = 0; i < L; ++i)
            st_release_sys_global(at<uint64_t>(reinterpret_cast<uint8_t*>(args.node_nvl[i]), args.nvl.push_done) +
                                      topo.local, call);
    }
}

// ---------------------------------------------------------------------------------------------
// Combine forward: wait for every local rank's pushes, then every warp takes chunks (source node m,
// chunk c) of the rows this rank forwarded, sums each row's landed copies into the send partition m,
// and puts the chunk back to the source (m, local) with the chunk's signal.

__global__ void __launch_bounds__(kNumThreads, 1) forward(const ForwardArgs args) {
    __shared__ int chunk_prefix[kMaxRanks + 1];
    const Topology& topo = args.topo;
    const PlanLayout& pl = args.plan_layout;
    const int L = topo.ranks_per_node, N = topo.num_nodes;
    const uint64_t call = this_call(args.state);
    const uint64_t deadline_ns = globaltimer_ns() + args.timeout_ns;
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    const uint64_t* push_done = at<const uint64_t>(args.nvl, args.nvl_layout.push_done);
    const int j = threadIdx.x;
    const bool timed_out = j < L && !wait_at_least(push_done + j, call, deadline_ns, args.status,
                                                     topo.node * L + j, kPhaseInternodePushed);
    if (threadIdx.x == 0) {
        chunk_prefix[0] = 0;
        for (int m = 0; m < N; ++m)
            chunk_prefix[m + 1] = chunk_prefix[m] + chunks_of(args.plan[pl.forward_prefix + m + 1] -
                                                                  args.plan[pl.forward_prefix + m], args.chunk_rows);
    }
    if (__syncthreads_or(timed_out))
        return;
    // Local ranks that found the landing rows too few pushed nothing (and recorded it): forward
    // nothing either, so the sources time out rather than sum what was never pushed.
    if (args.plan[pl.landing_rows + topo.local] > args.nvl_layout.landing_bytes / args.landing_row_bytes) {
        if (blockIdx.x == 0 && threadIdx.x == 0)
            args.status.record(kStatusLandingRows, args.plan[pl.landing_rows + topo.local]);
        return;
    }
    const uint8_t* landing = args.nvl + args.nvl_layout.landing;
    const int num_vectors = static_cast<int>(args.hidden_bytes / sizeof(int4));
    const int num_chunks = chunk_prefix[N];
    const int first_warp = blockIdx.x * kWarpsPerBlock + warp, num_warps = gridDim.x * kWarpsPerBlock;
    bool sent = false;
    for (int item = first_warp; item < num_chunks; item += num_warps) {
        const int m = find_range(chunk_prefix, N + 1, item);
        const int chunk = item - chunk_prefix[m];
        const int first_slot = chunk * args.chunk_rows;
        const int forward_begin = args.plan[pl.forward_prefix + m];
        const int rows = min(args.chunk_rows, args.plan[pl.forward_prefix + m + 1] - forward_begin - first_slot);
        const int64_t offset = static_cast<int64_t>(first_slot) * args.row_bytes;
        uint8_t* staged = args.rdma + args.layout.send + m * args.layout.partition_bytes + offset;
        for (int r = 0; r < rows; ++r) {
            const int f = forward_begin + first_slot + r;
            const int position = lane < L ? args.forward_pos[static_cast<int64_t>(f) * L + lane] : -1;
            const int64_t copy_row = position >= 0 ? args.plan[pl.forward_offsets + lane * N + m] + position : 0;
            const uint8_t* copies[kMaxRanksPerNode];
            int num_copies = 0;
            for (uint32_t holders = __ballot_sync(kFullWarpMask, position >= 0); holders != 0; holders &= holders - 1) {
                const int64_t row = __shfl_sync(kFullWarpMask, copy_row, __ffs(holders) - 1);
                copies[num_copies++] = landing + row * args.landing_row_bytes;
            }
            uint8_t* out = staged + r * args.row_bytes;
            for (int v = lane; v < num_vectors; v += kWarpSize) {
                float acc[kBf16PerVector] = {};
                for (int c = 0; c < num_copies; ++c)
                    accumulate_bf16x8(acc, ld_volatile_global(reinterpret_cast<const int4*>(copies[c]) + v));
                reinterpret_cast<int4*>(out)[v] = floats_to_bf16x8(acc);
            }
            for (int k = lane; k < args.num_topk; k += kWarpSize) {
                float sum = 0.0f;
                for (int c = 0; c < num_copies; ++c)
                    sum += __int_as_float(ld_volatile_global(
                        reinterpret_cast<const int32_t*>(copies[c] + args.hidden_bytes) + k));
                reinterpret_cast<float*>(out + args.hidden_bytes)[k] = sum;
            }
        }
        uint8_t* target = args.rdma + args.layout.recv + topo.node * args.layout.partition_bytes + offset;
        const int64_t bytes = rows * args.row_bytes;
        put_with_signal(target, staged, bytes, chunk_signal(args.rdma, args.layout, topo.node, chunk), call,
                        m * L + topo.local);
        sent = true;
        if (m != topo.node && lane == 0) {
            atomicAdd(reinterpret_cast<unsigned long long*>(args.traffic + kTrafficCombineRows), rows);
            atomicAdd(reinterpret_cast<unsigned long long*>(args.traffic + kTrafficCombineBytes), bytes);
        }
    }
    if (sent && lane == 0)
        nvshmem_quiet();
}

// ---------------------------------------------------------------------------------------------
// Combine reduce: every warp takes this rank's tokens in turn, waits for the partial of each node the
// token went to, and writes their FP32 sum plus the biases.

__global__ void __launch_bounds__(kNumThreads, 1) combine(const ReduceArgs args) {
    const Topology& topo = args.topo;
    const int N = topo.num_nodes;
    const uint64_t call = this_call(args.state);
    const uint64_t deadline_ns = globaltimer_ns() + args.timeout_ns;
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    const int num_vectors = static_cast<int>(args.hidden_bytes / sizeof(int4));
    for (int t = blockIdx.x * kWarpsPerBlock + warp; t < args.num_tokens; t += gridDim.x * kWarpsPerBlock) {
        bool arrived = true;
        for (int n = lane; n < N; n += kWarpSize) {
            const int slot = args.node_pos[static_cast<int64_t>(t) * N + n];
            if (slot >= 0 && arrived)
                arrived = wait_at_least(chunk_signal(args.rdma, args.layout, n, slot / args.chunk_rows), call,
                                        deadline_ns, args.status, n * topo.ranks_per_node + topo.local,
                                        kPhaseInternodePartials);
        }
        if (!__all_sync(kFullWarpMask, arrived))
            break;
        const int64_t token_vectors = static_cast<int64_t>(t) * num_vectors;
        for (int v = lane; v < num_vectors; v += kWarpSize) {
            float acc[kBf16PerVector] = {};
            for (int n = 0; n < N; ++n) {
                const int slot = args.node_pos[static_cast<int64_t>(t) * N + n];
                if (slot < 0)
                    continue;
                const uint8_t* partial = args.rdma + args.layout.recv + n * args.layout.partition_bytes +
                                         static_cast<int64_t>(slot) * args.row_bytes;
                accumulate_bf16x8(acc, ld_volatile_global(reinterpret_cast<const int4*>(partial) + v));
            }
            if (args.bias0 != nullptr)
                accumulate_bf16x8(acc, ld_nc_global(reinterpret_cast<const int4*>(args.bias0) + token_vectors + v));
            if (args.bias1 != nullptr)
                accumulate_bf16x8(acc, ld_nc_global(reinterpret_cast<const int4*>(args.bias1) + token_vectors + v));
            reinterpret_cast<int4*>(args.combined_x)[token_vectors + v] = floats_to_bf16x8(acc);
        }
        if (args.combined_topk_weights != nullptr) {
            for (int k = lane; k < args.num_topk; k += kWarpSize) {
                float sum = 0.0f;
                for (int n = 0; n < N; ++n) {
                    const int slot = args.node_pos[static_cast<int64_t>(t) * N + n];
                    if (slot >= 0)
                        sum += __int_as_float(ld_volatile_global(reinterpret_cast<const int32_t*>(
                            args.rdma + args.layout.recv + n * args.layout.partition_bytes +
                            static_cast<int64_t>(slot) * args.row_bytes + args.hidden_bytes) + k));
                }
                args.combined_topk_weights[static_cast<int64_t>(t) * args.num_topk + k] = sum;
            }
        }
    }
    finish_call(args.state, call);
}

}  // namespace cuep::internode
