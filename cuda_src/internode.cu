// Internode (hierarchical) high-throughput dispatch and combine: NVLink inside a node, one network
// transfer per (token, node) across nodes.
//
// Ranks are numbered node by node: rank = node * L + local (L ranks per node, N nodes, R = N * L).
// The ranks with the same local index on every node form a rail; a token crosses between nodes only
// along its source's rail.
//
// Any batch through buffers of fixed size: the rows move in rounds. Round w takes the source tokens
// [w * K, (w + 1) * K) of every rank (K, round_tokens, a multiple of kRoundUnitTokens, is what the host worked
// out from the buffers' sizes and the largest batch), so a partition of the RDMA buffer holds one round of one
// source's rows, and the combine's landing region one round of every other local rank's copies. Every call runs the
// same rounds on every rank: as many as the largest token count of any rank needs (each count message carries its
// source's count). The host launches each round's kernels; a round's rows may overwrite the previous round's only
// once their readers are done with them, and the readers say so (below). The scan keeps, for every multiple of
// kRoundUnitTokens, how many tokens before it go to each rank and each node (unit_prefix, in the handle), so a
// round's rows on the sources' side are found without a search (a receiver or forwarder searches its rows' source
// tokens, which ascend).
//
// Dispatch (rank s = (m, i) sends its T tokens):
//   scan:   each token's position among the tokens sent to each rank (send_pos) and to each node
//           (node_pos, with the inverse node_list), the counts, and unit_prefix.
//   counts: s puts one count message to every rank: what it sends to that rank, to its node, to each
//           rank of its node, per expert, and its token count.
//   notify: each rank waits for every count message and lays out its plan (rank prefix, per-expert
//           counts, the largest token count); the host may wait for the received count here.
//   then per round w, two kernels:
//   send:   s puts its round's tokens once per destination node n, with their routing and their position
//           at every rank of n (absolute, and from the round's first), into partition m of rank (n, i)'s
//           receive region (the forwarder), at the token's node position less the round's first; first
//           a header (the round's first node position and its rows) with the round's signal, then the
//           rows in chunks, each chunk then its signal (put, fence, signal; for its own node, where it
//           is the forwarder, and for a forwarder this GPU addresses, it writes the rows in place and
//           raises the signal). Before round w > 0 it waits until every rank has released round w - 1.
//   pull:   each rank reads, over NVLink, the headers and chunks that reached its node's forwarders, and
//           copies the rows that name it to their place in its output, ordered by source rank, then
//           token. A forwarder also keeps each of its rows' positions from the round's first at every
//           local rank, and its source token (the handle's forward_pos, forward_src), for the combine.
//           Then it releases the round to every source (a signal).
// Combine (the reverse, per round w):
//   push:    each rank writes every row it received in the round into the NVL landing region of the
//            forwarder the row came through, in the section of (this rank, the source's node), at the
//            row's place among this rank's rows of the round from that source, unless that forwarder is
//            itself (its forward reads those from x); then raises a flag there. Before round w > 0 it
//            waits until every local forwarder has released the region.
//   forward: each forwarder sums, in FP32, the copies its node holds of each row of the round it
//            forwarded, and puts one BF16 partial per (token, node) back into partition n of the
//            source's receive region (chunks with signals, as the dispatch; its own tokens' partials, and
//            those for a source this GPU addresses, in place); then releases the landing region to its
//            node's ranks. Before round w > 0 it waits until every source on its rail has released the
//            partitions.
//   reduce:  each source sums the partials of every node its tokens of the round went to, and the
//            biases; then releases the round to the forwarders on its rail.
// A combine row (a pushed copy, or a partial on the wire) is the BF16 hidden, the top-k weights (float32),
// then a tag (int32; cuep/modes/internode.py sizes it, combine_row_bytes).
// The order of the sums. DeepEP V1's combine (no order given): a forwarder adds its node's copies by local
// rank, a source its partials by node and then the biases. ElasticBuffer's (DeepEP V2's hybrid order, bit
// for bit; the order arrays given): a pushed copy's tag is the highest top-k lane its rank holds, and its
// weights are zero on the lanes it does not hold; a forwarder adds its copies in increasing order of their
// tags from FP32 zero and rounds once; a source starts from the biases, adds each node's partial in
// increasing order of that node's highest lane and rounds once, and takes each lane's weight from the
// partial of its expert's node.
//
// Over a network only NVSHMEM's portable device API crosses nodes (puts, fences, signals, signal waits,
// quiet), so any transport serves; data is never inferred from the arrival of a later write. Ranks of one
// node read and write each other's buffers directly (nvshmem_ptr addresses, passed in node_rdma/node_nvl),
// and so do ranks of other nodes that NVSHMEM maps (its P2P transport: nodes of one host or one NVLink
// domain), where a row written straight into the peer's buffer spares the staging copy and the put
// (OutgoingChunk; CUEP_INTERNODE_PUTS keeps the network's path there, to test it).
//
// Every call starts with the device barrier (cuda_src/barrier.cu), so no rank writes into a buffer
// that a peer still reads from the previous call. Calls are numbered on the device (kStateCall, equal
// on every rank), and a call's rounds after it: a signal is set to its round's number (round_number),
// never reset, and a wait is for >= it.
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
#include <cuep/search.cuh>
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
constexpr int kRoundUnitTokens = CUEP_ROUND_UNIT_TOKENS;
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
constexpr int kCountTokens = kCountToNodeRanks + kMaxRanksPerNode;  // the source's token count
static_assert(kCountTokens < kCountHeaderWords, "the count header holds the source's token count");
// The dispatch's row copies (the send's from x, the pull's into recv_x): the 16-byte vectors each lane has in
// flight per step. 14 a lane make 7 KB a warp per step: a 7168-element FP8 row in one step, a BF16
// row in two. Each warp of these kernels waits out one memory round trip per step, and on few SMs those waits
// set the pace. The send and the pull still fit the 128 registers a thread of their 512-thread blocks may take
// (no spill), except the send of the build across hosts, whose calls into NVSHMEM's linked transfer code keep
// more registers live: it keeps 8 (tests/test_compile.py checks that no internode kernel spills).
constexpr int kRowCopyBatch = 14;
#if CUEP_NETWORK
constexpr int kSendCopyBatch = 8;
#else
constexpr int kSendCopyBatch = kRowCopyBatch;
#endif
// Traffic counters (uint64): rows and bytes sent to other nodes, by dispatches and by combines.
constexpr int kTrafficDispatchRows = 0, kTrafficDispatchBytes = 1, kTrafficCombineRows = 2,
              kTrafficCombineBytes = 3;
static_assert(kTrafficCombineBytes < CUEP_TRAFFIC_WORDS, "the host allocates too few traffic words");
static_assert(kTrafficDispatchBytes == kTrafficDispatchRows + 1 && kTrafficCombineBytes == kTrafficCombineRows + 1,
              "OutgoingChunk::deliver counts a chunk's bytes in the word after its rows");
// A round's number: the call's in the high bits, one more than the round's index in the low ones.
constexpr int kRoundBits = CUEP_ROUND_BITS;

struct Topology {
    int rank, num_ranks, node, num_nodes, local, ranks_per_node;
};

// Offsets (bytes) in every rank's RDMA buffer; cuep/modes/internode.py lays it out.
struct RdmaLayout {
    int64_t count_signals;    // uint64 [R]: the call whose count message source s put here
    int64_t chunk_signals;    // uint64 [N][kMaxChunks]: the round whose chunk c of partition n landed here
    int64_t round_signals;    // uint64 [N]: the round whose header of partition n landed here
    int64_t rows_released;    // uint64 [R]: the dispatch round whose rows rank q is done with (at a source)
    int64_t partials_released;  // uint64 [N]: the combine round whose partials source (m, local) is done with
    int64_t headers;          // RoundHeader [N]: the round's header of partition n (its first, its rows)
    int64_t header_staging;   // RoundHeader [N]: this rank's outgoing headers, by destination node
    int64_t counts;           // int32 [R][kCountWords]: count messages, by source
    int64_t count_staging;    // int32 [R][kCountWords]: this rank's outgoing count messages
    int64_t send;             // [N - 1] partitions of partition_bytes: outgoing rows, by destination node (the
                              // own node's rows go in place: send_partition)
    int64_t recv;             // [N] partitions: incoming rows, by the node they came from
    int64_t partition_bytes;
};

// A partition's rows in a round: the node position of its first row at the source, and how many.
struct RoundHeader {
    int32_t first, rows;
};
static_assert(sizeof(RoundHeader) == CUEP_HEADER_BYTES, "the host lays out headers of another size");

// Offsets (bytes) in every rank's NVL buffer, used by the combine.
struct NvlLayout {
    int64_t push_done;        // uint64 [L]: the round whose pushes local rank j finished here
    int64_t released;         // uint64 [L]: the round whose landing rows local forwarder i released
    int64_t landing;          // landing rows: sections of round_tokens rows, by (pushing rank, source node),
                              // none for the forwarder's own copies (landing_section)
    int64_t landing_bytes;
};

// The send partition of rows for node `node` (not this rank's own: those are written in place, so the own node has
// none), and the landing section at local forwarder `forwarder` of pushing rank `pusher`'s copies from source node
// `node` (not the forwarder's own: its forward reads those from the combine's input, so it has none).
// cuep/modes/internode.py sizes both regions (send_partitions, landing_sections).
static __device__ __forceinline__ int send_partition(int node, int own_node) {
    return node < own_node ? node : node - 1;
}
static __device__ __forceinline__ int landing_section(int pusher, int forwarder, int node, int num_nodes) {
    return (pusher < forwarder ? pusher : pusher - 1) * num_nodes + node;
}

// Where each part of a dispatch's plan (one int32 array, written by notify) starts, in words.
struct PlanLayout {
    int32_t recv_prefix;      // [R + 1] first output row of each source rank
    int32_t per_expert;       // [E / R] rows per local expert, aligned
    int32_t forward_prefix;   // [N + 1] as a forwarder: first forwarded row of each source node
    int32_t words;
};
constexpr int kPlanNumRecv = 0;      // plan[0]: rows this rank receives
constexpr int kPlanNumForward = 1;   // plan[1]: rows this rank forwards
constexpr int kPlanMaxTokens = CUEP_PLAN_MAX_TOKENS;  // the largest token count of any rank (sets the rounds)
static_assert(kPlanMaxTokens > kPlanNumForward, "the plan's words follow each other");

// The round a kernel moves: its index, the rounds of the call, the source tokens of each.
struct Round {
    int index, count, tokens;
};

// What the scan counted, for every multiple of kRoundUnitTokens: `[units + 1, R + N]` int32, the tokens
// before it that go to each rank, then to each node (the last row: every token).
struct UnitPrefix {
    const int32_t* counts;
    int units;
};

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
// source token, then the token's position among the rows each rank of the destination node receives
// from its source (-1: none), then the same position less that of the round's first such row.
// cuep/modes/internode.py sizes it (dispatch_row_bytes).
struct RowShape {
    int64_t hidden_bytes, scales, topk_idx, topk_weights, src, pos, round_pos;

    __device__ RowShape(int64_t hidden, int num_scales, int num_topk, int ranks_per_node)
        : hidden_bytes(hidden),
          scales(hidden),
          topk_idx(scales + 4 * num_scales),
          topk_weights(topk_idx + 4 * num_topk),
          src(topk_weights + 4 * num_topk),
          pos(src + 4),
          round_pos(pos + 4 * ranks_per_node) {}
};

struct ScanArgs {
    const bool* is_token_in_rank;  // [T, R]
    int num_tokens;
    Topology topo;
    int32_t* send_pos;             // [T, R]
    int32_t* node_pos;             // [T, N]
    int32_t* node_list;            // [N, T]: node_list[n][p] = the token at position p to node n
    int32_t* counts;               // [R + N]: tokens to each rank, then to each node
    int32_t* unit_prefix;          // [ceil(T / kRoundUnitTokens) + 1, R + N] (UnitPrefix)
};

struct CountsArgs {
    const int32_t* counts;
    const int32_t* num_tokens_per_expert;  // [E]
    int num_experts, num_tokens;
    Topology topo;
    uint8_t* rdma;
    RdmaLayout layout;
    const uint64_t* state;
};

struct SendArgs {
    TokenRows tokens;
    const int32_t* send_pos;
    const int32_t* node_list;
    UnitPrefix prefix;
    Topology topo;
    uint8_t* rdma;                         // this rank's RDMA buffer (symmetric address)
    RdmaLayout layout;
    int64_t row_bytes;
    int chunk_rows;
    int direct_peers;                      // write straight to forwarders this GPU addresses (OutgoingChunk)
    Round round;
    const uint64_t* state;
    uint64_t* traffic;
    Status status;
    uint64_t timeout_ns;
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
    uint8_t* rdma;              // this rank's RDMA buffer (symmetric address): the sources' release signals
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
    int32_t* forward_src;       // [forward_capacity], or null with forward_pos
    int forward_capacity;
    Round round;
    uint64_t* state;
    Status status;
    uint64_t timeout_ns;
};

// This rank's combine input, as its push and its forward read it: the rows it received and their top-k weights.
struct CombineInput {
    const uint8_t* x;
    const int32_t* recv_src_idx;
    int num_rows;                   // the rows of x and recv_src_idx (fewer than received after an overflow)
    int64_t hidden_bytes;
    const float* topk_weights;      // [num_rows, num_topk], or null
    int num_topk;
    const int64_t* order_topk_idx;  // [num_rows, num_topk] local ids, -1 on others' lanes (null when no rows)
    int ordered;                    // V2's order (the ids above), else V1's
};

struct PushArgs {
    const uint64_t* node_nvl;   // [L] each local rank's NVL buffer as this GPU addresses it
    NvlLayout nvl;
    Topology topo;
    const int32_t* plan;
    PlanLayout plan_layout;
    CombineInput input;
    int64_t landing_row_bytes;
    Round round;
    uint64_t* state;
    Status status;
    uint64_t timeout_ns;
};

struct ForwardArgs {
    uint8_t* nvl;
    const uint64_t* node_nvl;
    NvlLayout nvl_layout;
    uint8_t* rdma;
    RdmaLayout layout;
    Topology topo;
    const int32_t* plan;
    PlanLayout plan_layout;
    const int32_t* forward_pos;
    const int32_t* forward_src;
    int forward_rows;           // rows of forward_pos and forward_src
    CombineInput input;         // this rank's own copies (V2's order: the copies summed by tag, else by local rank)
    int64_t landing_row_bytes, row_bytes;
    int chunk_rows;
    int direct_peers;           // write straight to sources this GPU addresses (OutgoingChunk)
    Round round;
    uint64_t* state;
    uint64_t* traffic;
    Status status;
    uint64_t timeout_ns;
};

struct ReduceArgs {
    uint8_t* rdma;
    RdmaLayout layout;
    Topology topo;
    const int32_t* node_pos;
    UnitPrefix prefix;
    int num_tokens;
    int64_t hidden_bytes;
    int num_topk;
    int64_t row_bytes;
    int chunk_rows;
    const __nv_bfloat16* bias0;
    const __nv_bfloat16* bias1;
    const int64_t* order_topk_idx;  // [num_tokens, num_topk] the dispatch's global ids; null: V1's order
    int experts_per_node;
    __nv_bfloat16* combined_x;
    float* combined_topk_weights;
    Round round;
    uint64_t* state;
    Status status;
    uint64_t timeout_ns;
};

// The call a kernel belongs to: one more than the calls this rank finished.
static __device__ __forceinline__ uint64_t this_call(const uint64_t* state) {
    return ld_volatile_global(state + kStateCall) + 1;
}

// The number a round's signals are set to (and its predecessor's, less one): greater than every
// earlier round's, of this call and of every earlier one.
static __device__ __forceinline__ uint64_t round_number(uint64_t call, int round) {
    return (call << kRoundBits) | static_cast<uint64_t>(round + 1);
}

// The last block of a round's kernel (thread 0) runs `release` (what the round's readers tell the
// writers), then, in the call's last round, records the call as finished.
template <typename Release>
static __device__ __forceinline__ void finish_round(uint64_t* state, uint64_t call, const Round& round,
                                                    bool last_kernel_of_round, Release release) {
    if (last_block_done(state, kStateBlocksDone)) {
        state[kStateBlocksDone] = 0;
        release();
        if (last_kernel_of_round && round.index + 1 == round.count)
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

// Tokens before `token` (a multiple of kRoundUnitTokens, or past the last) that go to `column` (a rank,
// or R + a node).
static __device__ __forceinline__ int count_before(const UnitPrefix& prefix, int columns, int64_t token, int column) {
    const int64_t unit = min(token / kRoundUnitTokens, static_cast<int64_t>(prefix.units));
    return prefix.counts[unit * columns + column];
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

// A chunk of a round's rows this rank sends to node `node`, at byte `offset` of its partition: the send's rows to
// their forwarder, the forward's partials to their source, both the rank of this rail there (`pe`), into partition
// topo.node of its receive region (`target`, a symmetric address). The calling warp writes the rows at `staged`:
// straight at the target when this GPU addresses it (`written`), that is this rank's own receive region
// (`to_self`), or, with `direct_peers`, a peer's that NVSHMEM maps (its P2P transport: another node of one host,
// or of one NVLink domain), which spares a copy of the rows and the put; else in partition `node` of its send
// region, for a put.
struct OutgoingChunk {
    uint8_t* target;
    uint8_t* staged;
    int pe;
    bool to_self, written;

    __device__ __forceinline__ OutgoingChunk(uint8_t* rdma, const RdmaLayout& layout, const Topology& topo, int node,
                                             int64_t offset, int direct_peers)
        : target(rdma + layout.recv + topo.node * layout.partition_bytes + offset),
          pe(node * topo.ranks_per_node + topo.local),
          to_self(node == topo.node) {
        uint8_t* direct =
            to_self ? target : direct_peers ? static_cast<uint8_t*>(nvshmem_ptr(target, pe)) : nullptr;
        written = direct != nullptr;
        staged = written ? direct
                         : rdma + layout.send + send_partition(node, topo.node) * layout.partition_bytes + offset;
    }

    // Once the warp wrote the chunk's `rows` rows: `signal` (a symmetric address) set to `value` at the target
    // behind them, raised there if the warp wrote them there, else with a put of the rows (put_with_signal);
    // rows for another node counted in `traffic` (rows, then bytes).
    __device__ __forceinline__ void deliver(int rows, int64_t row_bytes, uint64_t* signal, uint64_t value,
                                            uint64_t* traffic, int lane) const {
        const int64_t bytes = rows * row_bytes;
        if (written) {
            __threadfence_system();  // each lane's rows, before the signal below
            __syncwarp();
            if (lane == 0)
                st_release_sys_global(static_cast<uint64_t*>(nvshmem_ptr(signal, pe)), value);
            __syncwarp();
        } else {
            put_with_signal(target, staged, bytes, signal, value, pe);
        }
        if (!to_self && lane == 0) {
            atomicAdd(reinterpret_cast<unsigned long long*>(traffic), rows);
            atomicAdd(reinterpret_cast<unsigned long long*>(traffic + 1), bytes);
        }
    }
};

// Chunks of `rows` rows, `chunk_rows` each.
static __device__ __forceinline__ int chunks_of(int rows, int chunk_rows) {
    return (rows + chunk_rows - 1) / chunk_rows;
}

// Called by every warp of the grid: the send's or the forward's (Args: SendArgs, ForwardArgs) outgoing chunks of one
// round (`number`), node n's `rows_to[n]` rows in chunks of args.chunk_rows (`chunk_prefix`: their prefix over
// nodes), dealt to the warps in turn. A warp has `write_rows(n, first_slot, rows, staged)` write a chunk's rows at
// `staged` (OutgoingChunk), then delivers them with the chunk's signal, counted in `traffic` (the rows' kind in
// args.traffic). The staging is reused by the next round: every put of this one must have read it before the
// warp returns.
template <typename Args, typename WriteRows>
static __device__ __forceinline__ void deliver_chunks(const Args& args, const int* chunk_prefix, const int32_t* rows_to,
                                                      uint64_t number, uint64_t* traffic, WriteRows write_rows) {
    const Topology& topo = args.topo;
    const int N = topo.num_nodes, lane = threadIdx.x % kWarpSize;
    const int num_chunks = chunk_prefix[N];
    const int first_warp = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize, num_warps = gridDim.x * kWarpsPerBlock;
    for (int item = first_warp; item < num_chunks; item += num_warps) {
        const int n = find_range(chunk_prefix, N + 1, item);
        const int chunk = item - chunk_prefix[n];
        const int first_slot = chunk * args.chunk_rows;
        const int rows = min(args.chunk_rows, rows_to[n] - first_slot);
        const int64_t offset = static_cast<int64_t>(first_slot) * args.row_bytes;
        const OutgoingChunk out(args.rdma, args.layout, topo, n, offset, args.direct_peers);
        write_rows(n, first_slot, rows, out.staged);
        out.deliver(rows, args.row_bytes, chunk_signal(args.rdma, args.layout, topo.node, chunk), number, traffic,
                    lane);
    }
    if (lane == 0)
        nvshmem_quiet();
}

// Block-wide: thread p < `count` waits until `flags[p]` reaches `target`, recording `peer_of(p)` and `phase`
// on a timeout. True unless some wait timed out.
template <typename PeerOf>
static __device__ __forceinline__ bool wait_for_each(const uint64_t* flags, int count, uint64_t target,
                                                     uint64_t deadline_ns, const Status& status, PeerOf peer_of,
                                                     int phase) {
    const int p = static_cast<int>(threadIdx.x);
    const bool timed_out = p < count && !wait_at_least(flags + p, target, deadline_ns, status, peer_of(p), phase);
    return !__syncthreads_or(timed_out);
}

}  // namespace cuep

namespace cuep::internode {

// ---------------------------------------------------------------------------------------------
// Scan: block c < R scans column c of is_token_in_rank; block R + n scans node n (any of its ranks).

__global__ void __launch_bounds__(kNumThreads, 1) scan(const ScanArgs args) {
    __shared__ int warp_counts[kWarpsPerBlock + 1];
    const Topology& topo = args.topo;
    const int column = blockIdx.x, num_tokens = args.num_tokens;
    const int columns = topo.num_ranks + topo.num_nodes;
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
            if (t % kRoundUnitTokens == 0)
                args.unit_prefix[static_cast<int64_t>(t / kRoundUnitTokens) * columns + column] = position;
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
    if (threadIdx.x == 0) {
        args.counts[column] = running;
        const int units = (num_tokens + kRoundUnitTokens - 1) / kRoundUnitTokens;
        args.unit_prefix[static_cast<int64_t>(units) * columns + column] = running;
    }
}

// ---------------------------------------------------------------------------------------------
// Counts (one block): each warp stages this rank's count message to rank q and puts it with q's count
// signal.

__global__ void __launch_bounds__(kNumThreads, 1) counts(const CountsArgs args) {
    const Topology& topo = args.topo;
    const uint64_t call = this_call(args.state);
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    const int num_local_experts = args.num_experts / topo.num_ranks;
    for (int q = warp; q < topo.num_ranks; q += kWarpsPerBlock) {
        const int q_node = q / topo.ranks_per_node;
        int32_t* message = at<int32_t>(args.rdma, args.layout.count_staging) + static_cast<int64_t>(q) * kCountWords;
        for (int w = lane; w < kCountHeaderWords + num_local_experts; w += kWarpSize) {
            int32_t value = 0;
            if (w == kCountToRank)
                value = args.counts[q];
            else if (w == kCountToNode)
                value = args.counts[topo.num_ranks + q_node];
            else if (w < kCountToNodeRanks + topo.ranks_per_node)
                value = args.counts[q_node * topo.ranks_per_node + (w - kCountToNodeRanks)];
            else if (w == kCountTokens)
                value = args.num_tokens;
            else if (w >= kCountHeaderWords)
                value = args.num_tokens_per_expert[q * num_local_experts + (w - kCountHeaderWords)];
            message[w] = value;
        }
        int32_t* slot = at<int32_t>(args.rdma, args.layout.counts) + static_cast<int64_t>(topo.rank) * kCountWords;
        uint64_t* signal = at<uint64_t>(args.rdma, args.layout.count_signals) + topo.rank;
        put_with_signal(slot, message, sizeof(int32_t) * (kCountHeaderWords + num_local_experts), signal, call, q);
    }
    // The staging is reused by the next call: every put of this one must have read it.
    if (lane == 0)
        nvshmem_quiet();
}

}  // namespace cuep::internode

// ---------------------------------------------------------------------------------------------
// Send (one round): block 0's first warps put the round's headers; then every warp takes chunks
// (destination node n, chunk c) in turn, writes their rows into the send partition of node n and puts them
// to the forwarder (n, local) with the chunk's signal; its own node's rows go straight into its receive
// region, and those for a forwarder this GPU addresses straight into the forwarder's (OutgoingChunk).

namespace cuep {

// One warp writes token t's row (routing and positions included) at `row`; `round_first[q]`: the tokens
// this rank sent to rank q before the round.
static __device__ void stage_row(const SendArgs& args, const RowShape& shape, int t, int dst_node,
                                 const int32_t* round_first, uint8_t* row, int lane) {
    const TokenRows& tokens = args.tokens;
    const Topology& topo = args.topo;
    warp_copy<true, kSendCopyBatch>(row, tokens.x + t * tokens.hidden_bytes, tokens.hidden_bytes, lane);
    auto* scales = at<float>(row, shape.scales);
    for (int s = lane; s < tokens.num_scales; s += kWarpSize)
        scales[s] = tokens.scales[t * tokens.scale_token_stride + s * tokens.scale_channel_stride];
    for (int k = lane; k < tokens.num_topk; k += kWarpSize) {
        at<int32_t>(row, shape.topk_idx)[k] = static_cast<int32_t>(tokens.topk_idx[t * tokens.num_topk + k]);
        at<float>(row, shape.topk_weights)[k] =
            tokens.topk_weights != nullptr ? tokens.topk_weights[t * tokens.num_topk + k] : 0.0f;  // ids without weights
    }
    if (lane == 0)
        *at<int32_t>(row, shape.src) = t;
    if (lane < topo.ranks_per_node) {
        const int q = dst_node * topo.ranks_per_node + lane;
        const int position = args.send_pos[static_cast<int64_t>(t) * topo.num_ranks + q];
        at<int32_t>(row, shape.pos)[lane] = position;
        at<int32_t>(row, shape.round_pos)[lane] = position < 0 ? -1 : position - round_first[q];
    }
}

}  // namespace cuep

namespace cuep::internode {

__global__ void __launch_bounds__(kNumThreads, 1) send(const SendArgs args) {
    __shared__ int chunk_prefix[kMaxRanks + 1];
    __shared__ int32_t node_first[kMaxRanks];  // the round's first node position of each destination node
    __shared__ int32_t node_rows[kMaxRanks];   // and its rows to that node
    __shared__ int32_t round_first[kMaxRanks];
    const Topology& topo = args.topo;
    const int L = topo.ranks_per_node, N = topo.num_nodes, R = topo.num_ranks;
    const uint64_t call = this_call(args.state);
    const uint64_t number = round_number(call, args.round.index);
    const uint64_t deadline_ns = globaltimer_ns() + args.timeout_ns;
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    // The previous round's rows at every forwarder are overwritten below: every rank must have read them.
    if (args.round.index > 0 &&
        !wait_for_each(at<const uint64_t>(args.rdma, args.layout.rows_released), R, number - 1, deadline_ns,
                       args.status, [](int q) { return q; }, kPhaseInternodeReleased))
        return;
    const int64_t first_token = static_cast<int64_t>(args.round.index) * args.round.tokens;
    const int64_t end_token = first_token + args.round.tokens;
    for (int q = threadIdx.x; q < R; q += kNumThreads)
        round_first[q] = count_before(args.prefix, R + N, first_token, q);
    if (threadIdx.x == 0) {
        chunk_prefix[0] = 0;
        for (int n = 0; n < N; ++n) {
            node_first[n] = count_before(args.prefix, R + N, first_token, R + n);
            node_rows[n] = count_before(args.prefix, R + N, end_token, R + n) - node_first[n];
            chunk_prefix[n + 1] = chunk_prefix[n] + chunks_of(node_rows[n], args.chunk_rows);
        }
    }
    __syncthreads();
    // Every forwarder learns the round's rows from its header, even when there are none.
    if (blockIdx.x == 0) {
        for (int n = warp; n < N; n += kWarpsPerBlock) {
            auto* staged = at<RoundHeader>(args.rdma, args.layout.header_staging) + n;
            if (lane == 0)
                *staged = RoundHeader{node_first[n], node_rows[n]};
            put_with_signal(at<RoundHeader>(args.rdma, args.layout.headers) + topo.node, staged, sizeof(RoundHeader),
                            at<uint64_t>(args.rdma, args.layout.round_signals) + topo.node, number,
                            n * L + topo.local);
        }
    }
    const RowShape shape(args.tokens.hidden_bytes, args.tokens.num_scales, args.tokens.num_topk, L);
    // This rank forwards its own node's rows itself: they are written in place, as are those for a forwarder this
    // GPU addresses; the others are staged, then put.
    deliver_chunks(args, chunk_prefix, node_rows, number, args.traffic + kTrafficDispatchRows,
                   [&](int n, int first_slot, int rows, uint8_t* staged) {
        const int32_t* tokens =
            args.node_list + static_cast<int64_t>(n) * args.tokens.num_tokens + node_first[n] + first_slot;
        for (int first_row = 0; first_row < rows; first_row += kWarpSize) {
            // The rows' tokens, a warp's worth at once.
            const int batch = min(kWarpSize, rows - first_row);
            const int lane_token = lane < batch ? tokens[first_row + lane] : 0;
            for (int b = 0; b < batch; ++b)
                stage_row(args, shape, __shfl_sync(kFullWarpMask, lane_token, b), n, round_first,
                          staged + (first_row + b) * args.row_bytes, lane);
        }
    });
}

// ---------------------------------------------------------------------------------------------
// Notify (one block): wait for every source's count message, then write this rank's plan.

__global__ void __launch_bounds__(kNumThreads, 1) notify(const NotifyArgs args) {
    const Topology& topo = args.topo;
    const PlanLayout& pl = args.plan_layout;
    const int L = topo.ranks_per_node, N = topo.num_nodes, R = topo.num_ranks;
    const uint64_t call = this_call(args.state);
    const uint64_t deadline_ns = globaltimer_ns() + args.timeout_ns;
    if (!wait_for_each(at<const uint64_t>(args.rdma, args.layout.count_signals), R, call, deadline_ns, args.status,
                       [](int s) { return s; }, kPhaseInternodeCounts))
        return;
    const auto* counts = at<const int32_t>(args.rdma, args.layout.counts);
    const auto count = [&](int source, int word) {
        return ld_volatile_global(counts + static_cast<int64_t>(source) * kCountWords + word);
    };
    int32_t* plan = args.plan;
    const int num_local_experts = args.num_experts / R;
    if (threadIdx.x == 0) {
        int sum = 0, max_tokens = 0;
        for (int source = 0; source < R; ++source) {
            plan[pl.recv_prefix + source] = sum;
            sum += count(source, kCountToRank);
            max_tokens = max(max_tokens, count(source, kCountTokens));
        }
        plan[pl.recv_prefix + R] = sum;
        plan[kPlanNumRecv] = sum;
        plan[kPlanMaxTokens] = max_tokens;
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
}

}  // namespace cuep::internode

// ---------------------------------------------------------------------------------------------
// Pull (one round): every block reads the round's headers at this node's forwarders; then every warp
// takes chunks (local forwarder i, source node m, chunk c) in turn, waits for the chunk's signal at the
// forwarder, and copies the rows that name this rank; the last block releases the round to every source.

namespace cuep {

// One warp copies a landed row (at `row`, read over NVLink) into output row k.
static __device__ void copy_out(const PullArgs& args, const RowShape& shape, const uint8_t* row, int k, int lane) {
    const RecvArrays& recv = args.recv;
    const auto word = [&](int64_t offset, int index) {
        return ld_volatile_global(reinterpret_cast<const int32_t*>(row + offset) + index);
    };
    // The routing of the first kWarpSize lanes and the source token are read before the hidden bytes, so that
    // their loads wait in the copy's shadow, not after it.
    const int num_local_experts = args.num_experts / args.topo.num_ranks;
    const int first_expert = args.topo.rank * num_local_experts;
    const bool lane_has_topk = lane < args.num_topk;
    const int lane_expert = lane_has_topk ? word(shape.topk_idx, lane) : -1;
    const int lane_weight = lane_has_topk ? word(shape.topk_weights, lane) : 0;
    const int src = word(shape.src, 0);
    warp_copy<false, kRowCopyBatch>(recv.x + k * args.hidden_bytes, row, args.hidden_bytes, lane);
    for (int s = lane; s < args.num_scales; s += kWarpSize)
        recv.scales[static_cast<int64_t>(k) * args.num_scales + s] = __int_as_float(word(shape.scales, s));
    for (int j = lane; j < args.num_topk; j += kWarpSize) {
        const bool preloaded = j == lane;
        const int expert = preloaded ? lane_expert : word(shape.topk_idx, j);
        const bool local = expert >= first_expert && expert < first_expert + num_local_experts;
        const int64_t out = static_cast<int64_t>(k) * args.num_topk + j;
        if (recv.topk_idx != nullptr)
            recv.topk_idx[out] = local ? expert - first_expert : -1;
        if (recv.topk_weights != nullptr)
            recv.topk_weights[out] = local ? __int_as_float(preloaded ? lane_weight : word(shape.topk_weights, j)) : 0.0f;
    }
    if (lane == 0 && recv.src_idx != nullptr)
        recv.src_idx[k] = src;
}

}  // namespace cuep

namespace cuep::internode {

__global__ void __launch_bounds__(kNumThreads, 1) dispatch(const PullArgs args) {
    __shared__ int chunk_prefix[kMaxRanks + 1];
    __shared__ int32_t recv_prefix[kMaxRanks + 1];
    __shared__ RoundHeader headers[kMaxRanks];
    const Topology& topo = args.topo;
    const PlanLayout& pl = args.plan_layout;
    const int L = topo.ranks_per_node, N = topo.num_nodes;
    const uint64_t call = this_call(args.state);
    const uint64_t number = round_number(call, args.round.index);
    const uint64_t deadline_ns = globaltimer_ns() + args.timeout_ns;
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    for (int r = threadIdx.x; r <= topo.num_ranks; r += kNumThreads)
        recv_prefix[r] = args.plan[pl.recv_prefix + r];
    // Partition p = i * N + m: source node m's rows at local forwarder i.
    const int p = threadIdx.x;
    bool timed_out = false;
    if (p < L * N) {
        const int i = p / N, m = p % N;
        auto* forwarder = reinterpret_cast<uint8_t*>(args.node_rdma[i]);
        timed_out = !wait_at_least(at<const uint64_t>(forwarder, args.layout.round_signals) + m, number, deadline_ns,
                                   args.status, m * L + i, kPhaseInternodeRows);
        if (!timed_out) {
            const auto* header = at<const int32_t>(forwarder, args.layout.headers) + 2 * m;
            headers[p] = RoundHeader{ld_volatile_global(header), ld_volatile_global(header + 1)};
        }
    }
    // A header that never came (recorded): no rows are read, but the blocks still finish the round together.
    const bool headers_in = !__syncthreads_or(timed_out);
    if (threadIdx.x == 0) {
        chunk_prefix[0] = 0;
        for (int item = 0; item < L * N; ++item)
            chunk_prefix[item + 1] =
                chunk_prefix[item] + (headers_in ? chunks_of(headers[item].rows, args.chunk_rows) : 0);
    }
    __syncthreads();
    const int num_recv = recv_prefix[topo.num_ranks];
    const int num_rows = args.recv.num_rows;
    if (args.round.index == 0 && blockIdx.x == 0 && threadIdx.x == 0) {
        if (num_recv > num_rows)
            args.status.record(kStatusOverflow, num_recv);
        // Every rank sees the same largest batch: a dispatch whose rounds were set without it (num_worst_tokens)
        // and do not fit it is reported on every rank, and every rank's call still ends, so their calls stay
        // numbered alike.
        const int max_tokens = args.plan[kPlanMaxTokens];
        if (max_tokens > static_cast<int64_t>(args.round.count) * args.round.tokens)
            args.status.record(kStatusRoundTokens, max_tokens);
    }
    const RowShape shape(args.hidden_bytes, args.num_scales, args.num_topk, L);
    const int num_chunks = chunk_prefix[L * N];
    const int first_warp = blockIdx.x * kWarpsPerBlock + warp, num_warps = gridDim.x * kWarpsPerBlock;
    bool arrived = true;
    for (int item = first_warp; item < num_chunks && arrived; item += num_warps) {
        const int part = find_range(chunk_prefix, L * N + 1, item);
        const int i = part / N, m = part % N, chunk = item - chunk_prefix[part];
        const int source = m * L + i;
        auto* forwarder = reinterpret_cast<uint8_t*>(args.node_rdma[i]);
        if (lane == 0)
            arrived = wait_at_least(chunk_signal(forwarder, args.layout, m, chunk), number, deadline_ns, args.status,
                                    source, kPhaseInternodeRows);
        arrived = __shfl_sync(kFullWarpMask, arrived, 0);
        if (!arrived)
            break;
        const int first_slot = chunk * args.chunk_rows;
        const int rows = min(args.chunk_rows, headers[part].rows - first_slot);
        const uint8_t* partition = forwarder + args.layout.recv + m * args.layout.partition_bytes;
        const bool own_rail = i == topo.local && args.forward_pos != nullptr;
        const auto row_at = [&](int r) { return partition + static_cast<int64_t>(first_slot + r) * args.row_bytes; };
        // A forwarder keeps each row's positions at its node's ranks and its source token; the lanes read them for
        // a warp's worth of rows at once, not one row's latency after another.
        if (own_rail) {
            const int first_forward = args.plan[pl.forward_prefix + m] + headers[part].first + first_slot;
            for (int e = lane; e < rows * (L + 1); e += kWarpSize) {
                const int r = e / (L + 1), j = e % (L + 1), f = first_forward + r;
                if (f >= args.forward_capacity)
                    continue;
                if (j < L)
                    args.forward_pos[static_cast<int64_t>(f) * L + j] =
                        ld_volatile_global(reinterpret_cast<const int32_t*>(row_at(r) + shape.round_pos) + j);
                else
                    args.forward_src[f] = ld_volatile_global(reinterpret_cast<const int32_t*>(row_at(r) + shape.src));
            }
        }
        for (int first_row = 0; first_row < rows; first_row += kWarpSize) {
            // The rows' positions at this rank, a warp's worth at once.
            const int batch = min(kWarpSize, rows - first_row);
            const int lane_position =
                lane < batch
                    ? ld_volatile_global(reinterpret_cast<const int32_t*>(row_at(first_row + lane) + shape.pos) +
                                         topo.local)
                    : -1;
            for (int b = 0; b < batch; ++b) {
                const int position = __shfl_sync(kFullWarpMask, lane_position, b);
                const int k = recv_prefix[source] + position;
                if (position >= 0 && k < num_rows)
                    copy_out(args, shape, row_at(first_row + b), k, lane);
            }
        }
    }
    // Rows past the received ones (num_worst_tokens) name no expert, and the forwarding record's rows past the
    // forwarded ones no row.
    if (args.round.index == 0) {
        const int64_t first_thread = static_cast<int64_t>(blockIdx.x) * kNumThreads + threadIdx.x;
        const int64_t num_threads = static_cast<int64_t>(gridDim.x) * kNumThreads;
        for (int64_t e = first_thread + static_cast<int64_t>(num_recv) * args.num_topk;
             e < static_cast<int64_t>(num_rows) * args.num_topk; e += num_threads) {
            if (args.recv.topk_idx != nullptr)
                args.recv.topk_idx[e] = -1;
            if (args.recv.topk_weights != nullptr)
                args.recv.topk_weights[e] = 0.0f;
        }
        if (args.forward_pos != nullptr) {
            const int64_t forwarded = min(args.plan[kPlanNumForward], args.forward_capacity);
            for (int64_t e = first_thread + forwarded * L; e < static_cast<int64_t>(args.forward_capacity) * L;
                 e += num_threads)
                args.forward_pos[e] = -1;
            for (int64_t f = first_thread + forwarded; f < args.forward_capacity; f += num_threads)
                args.forward_src[f] = -1;
        }
    }
    // This rank is done with the round's rows at every forwarder of its node: each source may send the next
    // round (the signal goes to the source, which waits for every rank's).
    finish_round(args.state, call, args.round, true, [&] {
        for (int s = 0; s < topo.num_ranks; ++s)
            nvshmemx_signal_op(at<uint64_t>(args.rdma, args.layout.rows_released) + topo.rank, number,
                               NVSHMEM_SIGNAL_SET, s);
        nvshmem_quiet();  // delivered before the next call's barrier: no late, smaller number lands after it
    });
}

// Received rows [first, end) of x came from `source` in the round, in its token order. A dispatch that overflowed
// num_worst_tokens (recorded) left only num_rows rows: none past them.
static __device__ __forceinline__ int2 round_rows_from(const CombineInput& input, const int32_t* plan,
                                                       const PlanLayout& pl, int source, const Round& round) {
    const int begin = min(plan[pl.recv_prefix + source], input.num_rows);
    const int end = min(plan[pl.recv_prefix + source + 1], input.num_rows);
    const int64_t first_token = static_cast<int64_t>(round.index) * round.tokens;
    const int first = lower_bound(input.recv_src_idx, begin, end, first_token);
    return make_int2(first, lower_bound(input.recv_src_idx, first, end, first_token + round.tokens));
}

// Whether this rank's copy of received row k carries top-k lane `lane`: in V2's order only the lanes whose expert
// is local (the copy's weights are zero on the others, and its tag is the highest lane it holds), in V1's every lane.
static __device__ __forceinline__ bool holds_lane(const CombineInput& input, int64_t k, int lane) {
    return !input.ordered || (lane < input.num_topk && input.order_topk_idx[k * input.num_topk + lane] >= 0);
}

// The forward's and the reduce's sums (warp_sum_bf16_rows): each lane asks for 4 vectors of 2 rows at once, as
// the intranode combine's reduction does.
constexpr int kSumUnroll = 4;
constexpr int kSumRowsPerLoad = 2;

// ---------------------------------------------------------------------------------------------
// Combine push (one round): every warp takes this rank's received rows of the round that came through another
// forwarder in turn and writes each, with its top-k weights, into that forwarder's landing rows (a forwarder
// reads its own copies from x); the last block then raises this rank's flag at each forwarder of the node.

__global__ void __launch_bounds__(kNumThreads, 1) push(const PushArgs args) {
    __shared__ int32_t round_first[kMaxRanks];       // first received row of each source in the round
    __shared__ int32_t round_prefix[kMaxRanks + 1];  // the round's rows pushed, prefix over sources
    const Topology& topo = args.topo;
    const CombineInput& input = args.input;
    const int L = topo.ranks_per_node, N = topo.num_nodes, R = topo.num_ranks;
    const uint64_t call = this_call(args.state);
    const uint64_t number = round_number(call, args.round.index);
    const uint64_t deadline_ns = globaltimer_ns() + args.timeout_ns;
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    // The landing rows are overwritten below: every forwarder of the node must be done with the last round's.
    const bool landing_free =
        args.round.index == 0 ||
        wait_for_each(at<const uint64_t>(reinterpret_cast<const uint8_t*>(args.node_nvl[topo.local]),
                                         args.nvl.released),
                      L, number - 1, deadline_ns, args.status, [&](int i) { return topo.node * L + i; },
                      kPhaseInternodeReleased);
    for (int s = threadIdx.x; s < R; s += kNumThreads) {
        const int2 rows = round_rows_from(input, args.plan, args.plan_layout, s, args.round);
        round_first[s] = rows.x;
        // The rows that came through this rank itself, its forward reads from x.
        round_prefix[s + 1] = s % L == topo.local ? 0 : rows.y - rows.x;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        round_prefix[0] = 0;
        for (int s = 0; s < R; ++s)
            round_prefix[s + 1] += round_prefix[s];
    }
    __syncthreads();
    const int round_rows = landing_free ? round_prefix[R] : 0;  // a timeout (recorded): push nothing
    for (int item = blockIdx.x * kWarpsPerBlock + warp; item < round_rows; item += gridDim.x * kWarpsPerBlock) {
        const int source = find_range(round_prefix, R + 1, item);
        const int m = source / L, i = source % L;
        const int j = item - round_prefix[source];
        const int64_t k = round_first[source] + j;
        const int64_t section = landing_section(topo.local, i, m, N);
        const int64_t slot = section * args.round.tokens + j;
        uint8_t* landing = reinterpret_cast<uint8_t*>(args.node_nvl[i]) + args.nvl.landing + slot * args.landing_row_bytes;
        warp_copy(landing, input.x + k * input.hidden_bytes, input.hidden_bytes, lane);
        const bool held = holds_lane(input, k, lane);
        if (input.topk_weights != nullptr)
            for (int w = lane; w < input.num_topk; w += kWarpSize)
                reinterpret_cast<float*>(landing + input.hidden_bytes)[w] =
                    holds_lane(input, k, w) ? input.topk_weights[k * input.num_topk + w] : 0.0f;
        if (input.ordered) {
            const uint32_t held_lanes = __ballot_sync(kFullWarpMask, held);
            if (lane == 0)
                reinterpret_cast<int32_t*>(landing + input.hidden_bytes)[input.num_topk] = 31 - __clz(held_lanes);
        }
    }
    finish_round(args.state, call, args.round, false, [&] {
        for (int i = 0; i < L; ++i)
            st_release_sys_global(at<uint64_t>(reinterpret_cast<uint8_t*>(args.node_nvl[i]), args.nvl.push_done) +
                                      topo.local, number);
    });
}

// ---------------------------------------------------------------------------------------------
// Combine forward (one round): wait for every local rank's pushes, then every warp takes chunks (source
// node m, chunk c) of the round's rows this rank forwarded, sums each row's copies (the landed ones, and this
// rank's own from x) into the send partition of node m, and puts the chunk back to the source (m, local) with the
// chunk's signal (this rank's own rows are summed straight into its receive region, and those for a source
// this GPU addresses into the source's: OutgoingChunk); the last block releases the landing rows to the
// node's ranks.

__global__ void __launch_bounds__(kNumThreads, 1) forward(const ForwardArgs args) {
    __shared__ int chunk_prefix[kMaxRanks + 1];
    __shared__ int32_t round_first[kMaxRanks];  // the round's first forwarded row of each source node
    __shared__ int32_t round_rows[kMaxRanks];
    __shared__ int2 own_rows[kMaxRanks];        // the rows of x from source (m, local) in the round: [first, end)
    const Topology& topo = args.topo;
    const PlanLayout& pl = args.plan_layout;
    const CombineInput& input = args.input;
    const bool ordered = input.ordered;  // not from the ids' address: a rank with no rows has none
    const int L = topo.ranks_per_node, N = topo.num_nodes;
    const uint64_t call = this_call(args.state);
    const uint64_t number = round_number(call, args.round.index);
    const uint64_t deadline_ns = globaltimer_ns() + args.timeout_ns;
    const int lane = threadIdx.x % kWarpSize;
    bool ok = wait_for_each(at<const uint64_t>(args.nvl, args.nvl_layout.push_done), L, number, deadline_ns,
                            args.status, [&](int j) { return topo.node * L + j; }, kPhaseInternodePushed);
    // The partials of the last round at each source are overwritten below: it must be done with them.
    if (ok && args.round.index > 0 &&
        !wait_for_each(at<const uint64_t>(args.rdma, args.layout.partials_released), N, number - 1, deadline_ns,
                       args.status, [&](int m) { return m * L + topo.local; }, kPhaseInternodeReleased))
        ok = false;
    const int64_t first_token = static_cast<int64_t>(args.round.index) * args.round.tokens;
    for (int m = threadIdx.x; m < N; m += kNumThreads) {
        // Each source's forwarded rows come in its token order. After a dispatch whose batch its rounds did not
        // fit (recorded, raised by the next call) the plan may count more rows than were kept.
        const int begin = min(args.plan[pl.forward_prefix + m], args.forward_rows);
        const int end = min(args.plan[pl.forward_prefix + m + 1], args.forward_rows);
        const int first = lower_bound(args.forward_src, begin, end, first_token);
        round_first[m] = first;
        round_rows[m] = lower_bound(args.forward_src, first, end, first_token + args.round.tokens) - first;
        own_rows[m] = round_rows_from(input, args.plan, pl, m * L + topo.local, args.round);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        chunk_prefix[0] = 0;
        for (int m = 0; m < N; ++m)  // after a timeout (recorded) nothing is forwarded
            chunk_prefix[m + 1] = chunk_prefix[m] + (ok ? chunks_of(round_rows[m], args.chunk_rows) : 0);
    }
    __syncthreads();
    const uint8_t* landing = args.nvl + args.nvl_layout.landing;
    const int num_vectors = static_cast<int>(input.hidden_bytes / sizeof(int4));
    // The partials of this rank's own tokens are summed in place, as are those for a source this GPU addresses; the
    // others are staged, then put.
    deliver_chunks(args, chunk_prefix, round_rows, number, args.traffic + kTrafficCombineRows,
                   [&](int m, int first_slot, int rows, uint8_t* staged) {
        for (int r = 0; r < rows; ++r) {
            const int f = round_first[m] + first_slot + r;
            const int position = lane < L ? args.forward_pos[static_cast<int64_t>(f) * L + lane] : -1;
            // Lane j < L: local rank j's copy of the row, landed, or this rank's own, row own_k of x (none past
            // the rows a dispatch that overflowed left, recorded).
            const uint8_t* copy = nullptr;
            int64_t own_k = -1;
            if (position >= 0 && lane == topo.local) {
                own_k = own_rows[m].x + position;
                if (own_k < own_rows[m].y)
                    copy = input.x + own_k * input.hidden_bytes;
                else
                    own_k = -1;
            } else if (position >= 0) {
                copy = landing + (static_cast<int64_t>(landing_section(lane, topo.local, m, N)) * args.round.tokens +
                                  position) * args.landing_row_bytes;
            }
            own_k = __shfl_sync(kFullWarpMask, own_k, topo.local);
            const uint32_t holders = __ballot_sync(kFullWarpMask, copy != nullptr);
            const int num_copies = __popc(holders);
            // Each holder's place among the holders: by local rank, or (V2's order) by tag, distinct since one
            // lane has one expert's rank. The own copy's tag is what its push would have written.
            int place = __popc(holders & ((1u << lane) - 1u));
            if (ordered) {
                const int own_tag =
                    own_k >= 0 ? 31 - __clz(__ballot_sync(kFullWarpMask, holds_lane(input, own_k, lane))) : -1;
                const int tag = copy == nullptr ? 0
                                : lane == topo.local
                                    ? own_tag
                                    : ld_volatile_global(reinterpret_cast<const int32_t*>(copy + input.hidden_bytes) +
                                                         input.num_topk);
                place = 0;
                for (uint32_t left = holders; left != 0; left &= left - 1) {
                    const int other = __ffs(left) - 1;
                    const int other_tag = __shfl_sync(kFullWarpMask, tag, other);
                    place += other_tag < tag || (other_tag == tag && other < lane);
                }
            }
            const int own_place = own_k >= 0 ? __shfl_sync(kFullWarpMask, place, topo.local) : -1;
            // Lane c holds the copy placed c-th.
            uint64_t placed = 0;
            for (int c = 0; c < num_copies; ++c) {
                const int holder = __ffs(__ballot_sync(kFullWarpMask, copy != nullptr && place == c)) - 1;
                const uint64_t address = __shfl_sync(kFullWarpMask, reinterpret_cast<uint64_t>(copy), holder);
                if (lane == c)
                    placed = address;
            }
            const auto copy_at = [&](int c) {
                return reinterpret_cast<const uint8_t*>(__shfl_sync(kFullWarpMask, placed, c));
            };
            uint8_t* out = staged + r * args.row_bytes;
            warp_sum_bf16_rows<kSumUnroll, kSumRowsPerLoad>(
                reinterpret_cast<int4*>(out), num_vectors, num_copies,
                [&](int c) { return reinterpret_cast<const int4*>(copy_at(c)); }, NoAddend{}, NoAddend{}, lane);
            // The weights in the same order: a landed copy's as pushed, the own copy's as its push would have
            // pushed them.
            for (int k0 = 0; k0 < input.num_topk; k0 += kWarpSize) {
                const int k = k0 + lane;
                float sum = 0.0f;
                for (int c = 0; c < num_copies; ++c) {
                    const uint8_t* copy_c = copy_at(c);
                    if (k >= input.num_topk)
                        continue;
                    if (c == own_place)
                        sum += input.topk_weights != nullptr && holds_lane(input, own_k, k)
                                   ? input.topk_weights[own_k * input.num_topk + k]
                                   : 0.0f;
                    else
                        sum += __int_as_float(
                            ld_volatile_global(reinterpret_cast<const int32_t*>(copy_c + input.hidden_bytes) + k));
                }
                if (k < input.num_topk)
                    reinterpret_cast<float*>(out + input.hidden_bytes)[k] = sum;
            }
        }
    });
    finish_round(args.state, call, args.round, false, [&] {
        for (int j = 0; j < L; ++j)
            st_release_sys_global(at<uint64_t>(reinterpret_cast<uint8_t*>(args.node_nvl[j]), args.nvl_layout.released) +
                                      topo.local, number);
    });
}

// ---------------------------------------------------------------------------------------------
// Combine reduce (one round): every warp takes this rank's tokens of the round in turn, waits for the
// partial of each node the token went to, and writes their FP32 sum plus the biases; the last block
// releases the round to the forwarders on this rank's rail.

// Source node n's partial at `slot` of its round in this rank's receive region.
static __device__ __forceinline__ const uint8_t* partial_row(const ReduceArgs& args, int n, int slot) {
    return args.rdma + args.layout.recv + n * args.layout.partition_bytes + static_cast<int64_t>(slot) * args.row_bytes;
}

__global__ void __launch_bounds__(kNumThreads, 1) combine(const ReduceArgs args) {
    __shared__ int32_t node_first[kMaxRanks];
    __shared__ const uint8_t* token_partials[kWarpsPerBlock][kMaxRanks];  // a warp's token's partials, in order
    static_assert(sizeof(token_partials) + sizeof(node_first) <= 48 * 1024, "static shared memory past 48 KB");
    const Topology& topo = args.topo;
    const int N = topo.num_nodes, R = topo.num_ranks;
    const uint64_t call = this_call(args.state);
    const uint64_t number = round_number(call, args.round.index);
    const uint64_t deadline_ns = globaltimer_ns() + args.timeout_ns;
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    const int64_t first_token = static_cast<int64_t>(args.round.index) * args.round.tokens;
    for (int n = threadIdx.x; n < N; n += kNumThreads)
        node_first[n] = count_before(args.prefix, R + N, first_token, R + n);
    __syncthreads();
    const int num_vectors = static_cast<int>(args.hidden_bytes / sizeof(int4));
    const int end_token = static_cast<int>(min(first_token + args.round.tokens, static_cast<int64_t>(args.num_tokens)));
    for (int t = static_cast<int>(first_token) + blockIdx.x * kWarpsPerBlock + warp; t < end_token;
         t += gridDim.x * kWarpsPerBlock) {
        bool arrived = true;
        for (int n = lane; n < N; n += kWarpSize) {
            const int position = args.node_pos[static_cast<int64_t>(t) * N + n];
            if (position >= 0 && arrived)
                arrived = wait_at_least(
                    chunk_signal(args.rdma, args.layout, n, (position - node_first[n]) / args.chunk_rows), number,
                    deadline_ns, args.status, n * topo.ranks_per_node + topo.local, kPhaseInternodePartials);
        }
        if (!__all_sync(kFullWarpMask, arrived))
            break;
        // The token's partials in the order they are added, listed in this warp's slots. V1's: by node. V2's (order
        // arrays given): in the order of each node's highest lane (lane k < num_topk names its expert's node, and
        // represents it when no higher lane names the same), at most num_topk of them, each lane's weight from its
        // own node's partial; a node the dispatch never sent to (ids changed since) adds nothing.
        const bool ordered = args.order_topk_idx != nullptr;
        int num_partials = 0;
        __syncwarp();  // the warp's last token is done reading the slots
        if (ordered) {
            int node_of_lane = -1;
            if (lane < args.num_topk) {
                const int64_t id = args.order_topk_idx[static_cast<int64_t>(t) * args.num_topk + lane];
                const int64_t node = id >= 0 ? id / args.experts_per_node : -1;
                node_of_lane = node < N ? static_cast<int>(node) : -1;  // past the experts: flagged, no node
            }
            const uint32_t same_node = __match_any_sync(kFullWarpMask, node_of_lane);
            const int position = node_of_lane >= 0 ? args.node_pos[static_cast<int64_t>(t) * N + node_of_lane] : -1;
            const uint8_t* own = position >= 0 ? partial_row(args, node_of_lane, position - node_first[node_of_lane])
                                               : nullptr;
            const bool represents = own != nullptr && ((same_node >> lane) >> 1) == 0;
            const uint32_t lanes = __ballot_sync(kFullWarpMask, represents);
            if (represents)
                token_partials[warp][__popc(lanes & ((1u << lane) - 1))] = own;
            num_partials = __popc(lanes);
            if (args.combined_topk_weights != nullptr && lane < args.num_topk) {
                float weight = 0.0f;
                if (own != nullptr) {
                    const auto* own_weights = reinterpret_cast<const int32_t*>(own + args.hidden_bytes);
                    weight = __int_as_float(ld_volatile_global(own_weights + lane));
                }
                args.combined_topk_weights[static_cast<int64_t>(t) * args.num_topk + lane] = weight;
            }
        } else {
            for (int base = 0; base < N; base += kWarpSize) {
                const int n = base + lane;
                const int position = n < N ? args.node_pos[static_cast<int64_t>(t) * N + n] : -1;
                const uint32_t present = __ballot_sync(kFullWarpMask, position >= 0);
                if (position >= 0)
                    token_partials[warp][num_partials + __popc(present & ((1u << lane) - 1))] =
                        partial_row(args, n, position - node_first[n]);
                num_partials += __popc(present);
            }
        }
        __syncwarp();
        const int64_t token_vectors = static_cast<int64_t>(t) * num_vectors;
        const auto add_biases = [&](float (&acc)[kBf16PerVector], int v) {
            if (args.bias0 != nullptr)
                accumulate_bf16x8(acc, ld_nc_global(reinterpret_cast<const int4*>(args.bias0) + token_vectors + v));
            if (args.bias1 != nullptr)
                accumulate_bf16x8(acc, ld_nc_global(reinterpret_cast<const int4*>(args.bias1) + token_vectors + v));
        };
        const auto partial_at = [&](int p) { return reinterpret_cast<const int4*>(token_partials[warp][p]); };
        auto* out = reinterpret_cast<int4*>(args.combined_x) + token_vectors;
        if (ordered)  // V2: from the biases
            warp_sum_bf16_rows<kSumUnroll, kSumRowsPerLoad>(out, num_vectors, num_partials, partial_at, add_biases,
                                                            NoAddend{}, lane);
        else
            warp_sum_bf16_rows<kSumUnroll, kSumRowsPerLoad>(out, num_vectors, num_partials, partial_at, NoAddend{},
                                                            add_biases, lane);
        if (args.combined_topk_weights != nullptr && !ordered) {
            for (int k = lane; k < args.num_topk; k += kWarpSize) {
                float sum = 0.0f;
                for (int p = 0; p < num_partials; ++p)
                    sum += __int_as_float(ld_volatile_global(
                        reinterpret_cast<const int32_t*>(token_partials[warp][p] + args.hidden_bytes) + k));
                args.combined_topk_weights[static_cast<int64_t>(t) * args.num_topk + k] = sum;
            }
        }
    }
    // This rank is done with the round's partials: the forwarders on its rail may send the next round's.
    finish_round(args.state, call, args.round, true, [&] {
        for (int n = 0; n < N; ++n)
            nvshmemx_signal_op(at<uint64_t>(args.rdma, args.layout.partials_released) + topo.node, number,
                               NVSHMEM_SIGNAL_SET, n * topo.ranks_per_node + topo.local);
        nvshmem_quiet();  // delivered before the next call's barrier: no late, smaller number lands after it
    });
}

}  // namespace cuep::internode
