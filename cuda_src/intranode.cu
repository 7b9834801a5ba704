// Intranode (NVLink) high-throughput dispatch and combine between the ranks of one node.
//
// Every rank owns one symmetric buffer (NVSHMEM symmetric memory; `peer_bases[r]` is rank r's
// buffer as this GPU addresses it over NVLink). It starts with a fixed-size meta region, so the
// regions after it sit at the same offset on every rank:
//
//   [0, kMetaBytes)      SenderMeta: the sender's token count, where its staged arrays start,
//                        send_count[dst] and the per-expert counts from its layout; at its end,
//                        SenderControl: the flags of the protocol below
//   two regions of region_bytes each, used in turn: intranode call k (numbered from 1, equal on
//   every rank) uses region k % 2 (region_offset below) for
//                        non-cached dispatch: staged top-k ids, weights and send lists (no rows)
//                        rows of a dispatch: landing rows, one section per source rank (push form)
//                        combine: landing rows, one section per rank holding copies
//
// Why two regions: a call may write into a peer's region the moment it starts, with no handshake.
// Call k ends on each rank only once every peer has started call k (SenderControl::started), so
// when call k + 1 starts here every peer has finished call k - 1, the last user of the region that
// call k + 1 uses. Each call also clears, before it announces itself, the arrival counters of the
// other region, which the next call counts in.
//
// Any batch through a buffer of fixed size: the kernels that move rows (dispatch_push, combine) go
// through the tokens in rounds, and each round is one call of the protocol above. Round w takes the
// source tokens [w * C, (w + 1) * C) of every rank, where C (round_tokens, a multiple of
// kRoundUnitTokens) is what the host worked out from the region's size: a region holds num_ranks
// sections of C landing rows, one per source (dispatch) or per holder (combine), so a round's rows
// always fit, wherever the tokens go. Every rank knows the largest token count of the dispatch
// (recv_info), so all of them run the same rounds. Between two rounds the blocks of a launch wait
// for each other (end_round), so a round starts only once the previous call has ended here. Which
// rows fall in a round: a sender counts its tokens sent to each destination at every multiple of
// kRoundUnitTokens (send_prefix, written by the stage kernel into the handle); a receiver finds the
// first row of each source past the round in its received source indices (rows come in token order).
//
// Dispatches are also numbered on their own (epochs 1, 2, ...). A non-cached dispatch's header (in
// the meta region, not in a region) is rewritten only once every receiver has finished the previous
// dispatch (SenderControl::done).
//
// Non-cached dispatch: (1) stage (cuep::intranode::stage): copy top-k ids and weights, scan
// is_token_in_rank into per-destination send lists and the send prefixes; (2) barrier; (3) notify:
// each receiver reads every sender's meta and builds its receive plan (rank prefix, per-expert
// counts, landing offsets); the host may wait for the count here to size the outputs; (4) routing
// (cuep::intranode::receive_routing): each receiver reads its rows' source indices, top-k ids and
// weights from the senders' staging; (5) the rows, pushed as a cached dispatch pushes them.
//
// Cached dispatch (one kernel, cuep::intranode::dispatch_push): the senders push each token into its
// receivers' landing rows and the receivers copy them out as they complete; see that kernel.
//
// Combine (push, one kernel, cuep::intranode::combine): each rank writes the rows it received back
// into the landing region of their source, in its own section, counting every row in the source's
// per-chunk arrival counters; meanwhile the source sums, in FP32, the copies of each of its tokens
// as soon as they have landed, adds the optional biases, and writes the result. No barrier: the
// counters order everything.
//
// Each entry has an argument struct (StageArgs, NotifyArgs, RoutingArgs, PushArgs, CombineArgs
// below), mirrored field for field in cuep/kernels/intranode.py, which also defines the sizes both
// sides use (CUEP_* macros, read once below); it takes the struct's fields as its parameters (see
// the entries). The call sequences that launch them are in cuep/modes/intranode.py.
#include <cuep/bf16.cuh>
#include <cuep/common.cuh>
#include <cuep/copy.cuh>
#include <cuep/ptx.cuh>
#include <cuep/rows.cuh>
#include <cuep/search.cuh>
#include <cuep/sync.cuh>

namespace cuep {

// Defined once in cuep/kernels/intranode.py (its CONSTANTS), passed by the JIT as CUEP_* macros.
constexpr int kNumThreads = CUEP_NUM_THREADS;
constexpr int kWarpsPerBlock = kNumThreads / kWarpSize;
constexpr int kMaxRanks = CUEP_MAX_RANKS;  // one NVLink domain; the notify block maps one thread per rank
// Lane r (of a warp) and thread r (of a block) stand for rank r in several places.
static_assert(kNumThreads % kWarpSize == 0 && kMaxRanks <= kWarpSize, "a warp's lanes must cover the ranks");
constexpr int kFloatsPerVector = 4;   // 16 bytes of float32

// Written by a sender's stage kernel at the start of its buffer, read remotely by receivers.
// Offsets are in bytes from the buffer's start (the stage kernel adds its region's base to the
// region-relative offsets the host computes, cuep/modes/intranode.py).
struct SenderMeta {
    int64_t num_tokens;
    int64_t topk_idx_offset, topk_weights_offset, send_lists_offset;
    int32_t send_count[kMaxRanks];
    // followed by int32_t num_tokens_per_expert[num_experts], at most kMaxExperts
};
constexpr int64_t kMetaBytes = CUEP_META_BYTES;
constexpr int kMaxExperts = CUEP_MAX_EXPERTS;

// Arrivals (cached dispatch and combine) are counted per chunk of consecutive rows, at least
// kMinChunkRows long, so that at most kMaxChunks counters serve any row count.
constexpr int kMaxChunks = 1024;
constexpr int kMinChunkRows = 16;
// The cached dispatch's row copies (the pushers' from x, the copy out into recv_x): 16-byte vectors each lane has
// in flight per step, 4 KB a warp. On few SMs each warp's memory round trips set the pace; twice warp_copy's
// default gains there and costs nothing at 128 SMs (docs/performance-log.md, session 60). The combine's pushers
// keep the default.
constexpr int kTokenCopyBatch = 8;

// The protocol's flags, at the end of the meta region (zeroed when the Buffer is made).
struct SenderControl {
    uint64_t meta_epoch;               // newest epoch whose SenderMeta header this sender has published
    uint64_t done[kMaxRanks];          // done[r]: newest dispatch epoch receiver r has finished here
    uint64_t started[kMaxRanks];       // started[r]: newest intranode call rank r has started
    uint64_t pushed[kMaxRanks];        // pushed[r]: newest dispatch call whose rows rank r has all pushed here
    uint32_t arrivals[2][kMaxChunks];  // rows pushed here per chunk (cached dispatch, combine), per region
};
constexpr int64_t kControlBytes = CUEP_CONTROL_BYTES;
constexpr int64_t kControlOffset = kMetaBytes - kControlBytes;
static_assert(sizeof(SenderControl) <= kControlBytes, "SenderControl outgrew its share of the meta region");
static_assert(sizeof(SenderMeta) + kMaxExperts * sizeof(int32_t) <= kControlOffset,
              "the per-expert counts of the largest expert count overrun the protocol's flags");

// Per-rank state on the device (kStateWords uint64 words): the last finished dispatch epoch, the
// blocks of the running kernel that are done with its current round (the last one ends the round),
// the last finished intranode call, the rounds of the running kernel that have ended, and the pusher
// warps of a dispatch that are done with the current round (the last one tells the receivers).
constexpr int kStateEpoch = 0;
constexpr int kStateBlocksDone = 1;
constexpr int kStateCalls = 2;
constexpr int kStateRoundsEnded = 3;
constexpr int kStatePushersDone = 4;
constexpr int kStateWords = CUEP_STATE_WORDS;
static_assert(kStatePushersDone < kStateWords, "the host allocates too few state words");

// What a non-cached dispatch's notify kernel writes for this rank (the handle's recv_info): the rows
// it receives, the copies of its tokens it sends, the largest token count of any rank (which sets the
// rounds of every call with this handle), the rank prefix of its received rows, then the per-expert
// counts.
constexpr int kRecvInfoRows = 0;
constexpr int kRecvInfoCopies = 1;
constexpr int kRecvInfoMaxTokens = 2;
constexpr int kRecvInfoRankPrefix = 3;

// Rounds take whole units of this many source tokens; send_prefix holds a count per unit.
constexpr int kRoundUnitTokens = CUEP_ROUND_UNIT_TOKENS;

__device__ __forceinline__ SenderControl* control_of(uint8_t* buffer) {
    return reinterpret_cast<SenderControl*>(buffer + kControlOffset);
}

// Rank r's SenderControl, as this GPU addresses it.
__device__ __forceinline__ SenderControl* control_of_rank(const uint64_t* peer_bases, int r) {
    return control_of(reinterpret_cast<uint8_t*>(peer_bases[r]));
}

// This rank's next intranode call: the first one a kernel runs.
__device__ __forceinline__ uint64_t next_call(const uint64_t* state) {
    return ld_volatile_global(state + kStateCalls) + 1;
}

// Where intranode call `call`'s region starts in a buffer (the same offset on every rank).
__device__ __forceinline__ int64_t region_offset(uint64_t call, int64_t region_bytes) {
    return kMetaBytes + static_cast<int64_t>(call % 2) * region_bytes;
}

// A round's chunks are at most kRoundUnitTokens rows, so that a chunk never spans two sections
// (the host keeps num_ranks * round_tokens <= kMaxChunks * kRoundUnitTokens).
static_assert(kRoundUnitTokens % kMinChunkRows == 0, "chunks must tile a round's sections");

// The call a wait on pushed rows belongs to: if it times out, the peer to blame is the first one
// that never started the call (its rows may share the awaited chunk with the awaited row's).
struct PushedCall {
    const SenderControl* own;
    uint64_t call;
    int num_ranks;
};

// The calling lane waits until counter `chunk` reaches `expected`, unless `confirmed` (its newest
// confirmed chunk for this peer) says so already, pausing `sleep_ns` between polls. Returns false on a
// timeout, after recording a peer of `pushed` that has not started the call, or else `peer`, and `phase`.
__device__ __forceinline__ bool wait_chunk_count(const uint32_t* counters, int chunk, uint32_t expected,
                                                 int& confirmed, uint64_t deadline_ns, const Status& status,
                                                 const PushedCall& pushed, int peer, int phase,
                                                 uint32_t sleep_ns = 0) {
    if (confirmed == chunk)
        return true;
    if (!wait_at_least_until(counters + chunk, expected, deadline_ns, sleep_ns)) {
        for (int p = 0; p < pushed.num_ranks; ++p) {
            if (ld_acquire_sys_global(&pushed.own->started[p]) < pushed.call) {
                peer = p;
                phase = kPhaseIntranodeStarted;
                break;
            }
        }
        status.record_timeout(peer, phase);
        return false;
    }
    confirmed = chunk;
    return true;
}

// What a receiver needs of one sender, read from the sender's meta at the start of its routing.
struct SourcePlan {
    const int64_t* topk_idx;
    const float* topk_weights;
    const int32_t* send_list;     // the source's list of token indices for this rank
};

// A sender's token rows: hidden bytes and, for FP8, scales (any strides, in floats).
struct TokenRows {
    const uint8_t* x;
    int64_t hidden_bytes;
    const float* scales;
    int64_t scale_token_stride, scale_channel_stride;
    int num_scales;
};

// Where a non-cached dispatch's routing kernel writes what this rank receives besides the rows
// (`[num_rows, ...]` each; the optional arrays are null when not asked for).
struct RecvRouting {
    int64_t* topk_idx;
    float* topk_weights;
    int32_t* src_idx;
};

// ---------------------------------------------------------------------------------------------
// Kernel arguments: one struct per entry, each field described where the kernel uses it. Pointers
// are device addresses; `peer_bases[r]` is rank r's buffer, `state` this rank's kStateWords words,
// `next_row` num_ranks + 1 work counters that are zero between kernels. The launcher passes a
// struct's bytes as the entry's parameters, so its fields must sit where the parameters do: no
// field may fall into a nested struct's tail padding (PushArgs puts pointers after its TokenRows).

// This rank's routing in a non-cached dispatch, and where its stage kernel puts it: offsets relative
// to the call's region in the kernel's arguments (the kernel adds the region's start), from the
// buffer's start once staged.
struct SenderTokens {
    const int64_t* topk_idx;
    const float* topk_weights;
    int num_topk;
    int num_tokens;
    uint8_t* buffer;
    int64_t topk_idx_offset, topk_weights_offset, send_lists_offset;
};

struct StageArgs {
    SenderTokens tokens;
    const bool* is_token_in_rank;
    const int32_t* num_tokens_per_expert;
    int num_experts, num_ranks;
    int32_t* send_pos;
    int32_t* send_prefix;
    const uint64_t* peer_bases;
    int rank;
    int64_t region_bytes;
    const uint64_t* state;
    Status status;
    uint64_t timeout_ns;
};

struct NotifyArgs {
    const uint64_t* peer_bases;
    int rank, num_ranks, num_experts, expert_alignment;
    int32_t* recv_info;
    int32_t* rank_prefix_matrix;
};

struct RoutingArgs {
    int num_topk;
    const uint64_t* peer_bases;
    const int32_t* recv_info;
    int rank, num_ranks, num_experts, num_rows;
    RecvRouting recv;
    uint64_t* state;
    Status status;
    int32_t* next_row;
    uint64_t timeout_ns;
};

struct PushArgs {
    TokenRows rows;
    const int32_t* send_pos;
    const int32_t* send_prefix;
    const int32_t* recv_src_idx;
    int num_tokens;
    int push_warps;
    int deal_by_warp;
    int64_t row_bytes;
    const uint64_t* peer_bases;
    const int32_t* recv_info;
    int rank, num_ranks;
    int64_t region_bytes;
    int round_tokens;
    int num_rows;
    uint8_t* recv_x;
    float* recv_scales;
    uint64_t* state;
    Status status;
    int32_t* next_row;
    uint64_t timeout_ns;
};

struct CombineArgs {
    const uint64_t* peer_bases;
    const int32_t* recv_info;
    const int32_t* send_pos;
    const int32_t* send_prefix;
    const int32_t* recv_src_idx;
    int rank, num_ranks, num_tokens, round_tokens, num_rows;
    const uint8_t* x;
    int64_t hidden_bytes;
    const float* topk_weights;
    int num_topk;
    int64_t landing_row_bytes, region_bytes;
    const __nv_bfloat16* bias0;
    const __nv_bfloat16* bias1;
    const int64_t* order_topk_idx;
    int order_num_topk, experts_per_rank;
    __nv_bfloat16* combined_x;
    float* combined_topk_weights;
    uint64_t* state;
    Status status;
    int32_t* next_row;
    uint64_t timeout_ns;
};

// What a dispatch or combine kernel knows of its call before anything else (see the top of this file).
struct CallStart {
    uint64_t epoch;  // the dispatch epoch a dispatch kernel finishes (a combine's is not used)
    uint64_t call;   // the (first) intranode call it runs
    int64_t region;  // where that call's region starts in every buffer
};

// The first thing every kernel of a call reads: the next dispatch epoch, its call and that call's
// region. (Each kernel then reads the clock for its deadline; where it does so decides how the
// compiler schedules these loads.)
__device__ __forceinline__ CallStart start_call(const uint64_t* state, int64_t region_bytes) {
    CallStart start;
    start.epoch = ld_volatile_global(state + kStateEpoch) + 1;
    start.call = next_call(state);
    start.region = region_offset(start.call, region_bytes);
    return start;
}

// One warp writes `token`'s hidden vector to `dst_x` and its scales (if any) to `dst_scales`.
__device__ __forceinline__ void copy_token(const TokenRows& rows, int token, uint8_t* dst_x, float* dst_scales,
                                           int lane) {
    warp_copy<true, kTokenCopyBatch>(dst_x, rows.x + token * rows.hidden_bytes, rows.hidden_bytes, lane);
    for (int s = lane; s < rows.num_scales; s += kWarpSize)
        dst_scales[s] = rows.scales[token * rows.scale_token_stride + s * rows.scale_channel_stride];
}

// Block-wide: thread p < num_ranks runs `wait_for(p)`, which waits for peer p and returns false (after
// recording the peer) on a timeout. True unless some peer's wait timed out.
template <typename WaitFor>
__device__ __forceinline__ bool wait_for_every_peer(int num_ranks, WaitFor wait_for) {
    const int peer = static_cast<int>(threadIdx.x);
    const bool timed_out = peer < num_ranks && !wait_for(peer);
    return !__syncthreads_or(timed_out);
}

// ---------------------------------------------------------------------------------------------
// Sender side: wait for the buffer, publish the meta header, stage tokens.

// Every block of a non-cached dispatch's stage kernel first waits until each receiver has finished
// dispatch `pulled_epoch`, so that no one still reads this rank's header. Returns false (after
// recording the peer) on a timeout.
__device__ bool wait_until_buffer_free(SenderControl* control, int num_ranks, uint64_t pulled_epoch,
                                       uint64_t deadline_ns, const Status& status) {
    return wait_for_every_peer(num_ranks, [&](int receiver) {
        if (wait_at_least_until(&control->done[receiver], pulled_epoch, deadline_ns))
            return true;
        status.record_timeout(receiver, kPhaseIntranodeReuse);
        return false;
    });
}

// Block 0 of every intranode call, before anything else it publishes: clears the arrival counters of
// the other region, which the next call counts in (the previous call, their last user, has consumed
// every count), then tells every peer that this rank has started `call`.
__device__ void announce_call(SenderControl* own, const uint64_t* peer_bases, int rank, int num_ranks,
                              uint64_t call) {
    for (int c = threadIdx.x; c < kMaxChunks; c += kNumThreads)
        own->arrivals[(call + 1) % 2][c] = 0;
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < num_ranks) {
        __threadfence_system();
        st_release_sys_global(&control_of_rank(peer_bases, threadIdx.x)->started[rank], call);
    }
}

// The block that finishes a call (thread 0) waits until every peer has started it, so that the next
// call may write into any peer's other region at once (see the top of this file). Returns false,
// after recording the peer, on a timeout.
__device__ bool every_peer_started(const SenderControl* own, int num_ranks, uint64_t call, uint64_t deadline_ns,
                                   const Status& status) {
    for (int peer = 0; peer < num_ranks; ++peer) {
        if (!wait_at_least_until(&own->started[peer], call, deadline_ns)) {
            status.record_timeout(peer, kPhaseIntranodeStarted);
            return false;
        }
    }
    return true;
}

// Block 0 of each non-cached dispatch's stage kernel: the header receivers read, then its epoch.
// `staged`: offsets from the buffer's start.
__device__ void publish_meta(const SenderTokens& staged, const int32_t* num_tokens_per_expert, int num_experts,
                             uint64_t epoch) {
    auto* meta = reinterpret_cast<SenderMeta*>(staged.buffer);
    SenderControl* control = control_of(staged.buffer);
    if (threadIdx.x == 0) {
        meta->num_tokens = staged.num_tokens;
        meta->topk_idx_offset = staged.topk_idx_offset;
        meta->topk_weights_offset = staged.topk_weights_offset;
        meta->send_lists_offset = staged.send_lists_offset;
    }
    if (num_tokens_per_expert != nullptr) {
        auto* expert_counts = reinterpret_cast<int32_t*>(meta + 1);
        for (int e = threadIdx.x; e < num_experts; e += kNumThreads)
            expert_counts[e] = num_tokens_per_expert[e];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        st_release_sys_global(&control->meta_epoch, epoch);
    }
}

// One warp stages one token's top-k ids and weights (the rows are pushed later, not staged).
__device__ __forceinline__ void stage_token(const SenderTokens& staged, int token, int lane) {
    if (staged.topk_idx != nullptr && lane < staged.num_topk) {
        const int64_t slot = static_cast<int64_t>(token) * staged.num_topk + lane;
        reinterpret_cast<int64_t*>(staged.buffer + staged.topk_idx_offset)[slot] = staged.topk_idx[slot];
        if (staged.topk_weights != nullptr)
            reinterpret_cast<float*>(staged.buffer + staged.topk_weights_offset)[slot] = staged.topk_weights[slot];
    }
}

// One block scans destination `dst`: the send list (this rank's tokens for dst, in order), each
// token's position in it (send_pos, `[num_tokens][num_ranks]`), the positions at every multiple of
// kRoundUnitTokens and the total (send_prefix, see sent_before), and the count in the header.
__device__ void scan_destination(const bool* is_token_in_rank, int num_tokens, int num_ranks, int dst,
                                 int32_t* send_list, int32_t* send_pos, int32_t* send_prefix, SenderMeta* meta) {
    __shared__ int warp_totals[kWarpsPerBlock];
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    int base = 0;
    for (int first = 0; first < num_tokens; first += kNumThreads) {
        const int token = first + threadIdx.x;
        const bool sent = token < num_tokens && is_token_in_rank[static_cast<int64_t>(token) * num_ranks + dst];
        const uint32_t ballot = __ballot_sync(kFullWarpMask, sent);
        if (lane == 0)
            warp_totals[warp] = __popc(ballot);
        __syncthreads();
        int before = base + __popc(ballot & ((1u << lane) - 1));
        int chunk_total = 0;
        for (int w = 0; w < kWarpsPerBlock; ++w) {
            before += w < warp ? warp_totals[w] : 0;
            chunk_total += warp_totals[w];
        }
        if (token < num_tokens) {
            if (sent)
                send_list[before] = token;
            if (send_pos != nullptr)
                send_pos[static_cast<int64_t>(token) * num_ranks + dst] = sent ? before : -1;
            if (token % kRoundUnitTokens == 0)
                send_prefix[static_cast<int64_t>(token / kRoundUnitTokens) * num_ranks + dst] = before;
        }
        base += chunk_total;
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        meta->send_count[dst] = base;
        const int units = (num_tokens + kRoundUnitTokens - 1) / kRoundUnitTokens;
        send_prefix[static_cast<int64_t>(units) * num_ranks + dst] = base;
    }
}

// ---------------------------------------------------------------------------------------------
// Receiver side.

// Waits until every source has published this epoch's header, then reads where its arrays sit.
// Returns false (after recording the peer) on a timeout.
__device__ bool load_source_plans(SourcePlan* plans, const uint64_t* peer_bases, int rank, int num_ranks,
                                  uint64_t epoch, uint64_t deadline_ns, const Status& status) {
    return wait_for_every_peer(num_ranks, [&](int source) {
        auto* base = reinterpret_cast<uint8_t*>(peer_bases[source]);
        SenderControl* control = control_of(base);
        if (!wait_at_least_until(&control->meta_epoch, epoch, deadline_ns)) {
            status.record_timeout(source, kPhaseIntranodeStaged);
            return false;
        }
        const auto* meta = reinterpret_cast<const volatile SenderMeta*>(base);
        const int64_t num_tokens = meta->num_tokens;
        plans[source] = SourcePlan{reinterpret_cast<const int64_t*>(base + meta->topk_idx_offset),
                                   reinterpret_cast<const float*>(base + meta->topk_weights_offset),
                                   reinterpret_cast<const int32_t*>(base + meta->send_lists_offset) +
                                       rank * num_tokens};
        return true;
    });
}

// Top-k entries each lane of route_rows reads before it writes any: all of a top-8 run's entries at once.
constexpr int kRoutingBatch = 8;

// One warp writes the routing of received rows [first, first + kWarpSize) below num_recv: each row's
// source index, and its top-k ids as this rank's local expert ids (-1 where not local) with their weights
// (0 where not local). Lane l reads row first + l's source token from its source's send list; then the
// warp reads the rows' entries, consecutive lanes taking consecutive entries of a row, kRoutingBatch of
// them a lane in flight before any is written (the stores could alias the loads for all the compiler
// knows). That is two dependent reads across NVLink for 32 rows.
__device__ __forceinline__ void route_rows(const SourcePlan* plans, const int32_t* rank_prefix, int num_ranks,
                                           int first, int num_recv, int num_topk, const RecvRouting& recv,
                                           int64_t first_local, int experts_per_rank, int lane) {
    const int row = first + lane;
    int source = 0;
    int64_t token = 0;
    if (row < num_recv) {
        source = find_range(rank_prefix, num_ranks, row);
        token = plans[source].send_list[row - rank_prefix[source]];
        recv.src_idx[row] = static_cast<int32_t>(token);
    }
    if (recv.topk_idx == nullptr)
        return;
    const int num_entries = min(num_recv - first, kWarpSize) * num_topk;
    for (int batch = 0; batch < num_entries; batch += kRoutingBatch * kWarpSize) {
        int64_t expert[kRoutingBatch];
        float weight[kRoutingBatch];
#pragma unroll
        for (int i = 0; i < kRoutingBatch; ++i) {
            const int entry = batch + i * kWarpSize + lane;
            const int holder = (entry / num_topk) % kWarpSize;  // the lane that read the entry's row
            const int entry_source = __shfl_sync(kFullWarpMask, source, holder);
            const int64_t entry_token = __shfl_sync(kFullWarpMask, token, holder);
            expert[i] = -1;
            weight[i] = 0.0f;
            if (entry < num_entries) {
                const int64_t at = entry_token * num_topk + entry % num_topk;
                expert[i] = plans[entry_source].topk_idx[at];
                if (recv.topk_weights != nullptr)
                    weight[i] = plans[entry_source].topk_weights[at];
            }
        }
#pragma unroll
        for (int i = 0; i < kRoutingBatch; ++i) {
            const int entry = batch + i * kWarpSize + lane;
            if (entry >= num_entries)
                break;
            const bool local = expert[i] >= first_local && expert[i] < first_local + experts_per_rank;
            const int64_t at = static_cast<int64_t>(first) * num_topk + entry;
            recv.topk_idx[at] = local ? expert[i] - first_local : -1;
            if (recv.topk_weights != nullptr)
                recv.topk_weights[at] = local ? weight[i] : 0.0f;
        }
    }
}

// Whether the received arrays (num_rows rows) hold the num_recv rows this rank receives; if not (a
// dispatch whose num_worst_tokens was too small), block 0 records the overflow.
__device__ __forceinline__ bool received_rows_fit(int num_recv, int num_rows, const Status& status) {
    const bool fit = num_recv <= num_rows;
    if (!fit && blockIdx.x == 0 && threadIdx.x == 0)
        status.record(kStatusOverflow, num_recv);
    return fit;
}

// Called by every thread at the end of a dispatch or combine kernel: true only for thread 0 of the
// block that finishes last, after it has cleared the block count and the work counters
// (next_row[0, num_ranks]) for the next kernel. That thread then finishes the call.
__device__ bool last_block_finished(uint64_t* state, int32_t* next_row, int num_ranks) {
    if (!last_block_done(state, kStateBlocksDone))
        return false;
    state[kStateBlocksDone] = 0;
    for (int r = 0; r <= num_ranks; ++r)
        next_row[r] = 0;
    return true;
}

// ---------------------------------------------------------------------------------------------
// Rounds (see the top of this file).

// The rounds of a kernel that moves rows, worked out alike on every rank from the host's
// round_tokens and the largest token count of the dispatch (recv_info).
struct Rounds {
    int tokens;      // source tokens per round: round_tokens, or fewer when every rank has fewer
    int count;       // how many rounds (at least one, so that a call of no tokens is still a call)
    int chunk_rows;  // landing rows per arrival counter: a power of two that divides `tokens`
};

__device__ __forceinline__ Rounds plan_rounds(int round_tokens, int max_tokens, int num_ranks) {
    Rounds rounds;
    const int needed = (max_tokens + kRoundUnitTokens - 1) / kRoundUnitTokens * kRoundUnitTokens;
    rounds.tokens = min(round_tokens, max(kRoundUnitTokens, needed));
    rounds.count = max(1, (max_tokens + rounds.tokens - 1) / rounds.tokens);
    rounds.chunk_rows = kMinChunkRows;
    while (static_cast<int64_t>(num_ranks) * rounds.tokens > static_cast<int64_t>(rounds.chunk_rows) * kMaxChunks)
        rounds.chunk_rows *= 2;
    return rounds;
}

// This rank's tokens before `token` (a multiple of kRoundUnitTokens) that go to `dst`. send_prefix:
// `[units + 1][num_ranks]` with units = ceil(num_tokens / kRoundUnitTokens); its last row holds the
// totals, which also stand for every unit past the end.
__device__ __forceinline__ int sent_before(const int32_t* send_prefix, int num_tokens, int num_ranks, int64_t token,
                                           int dst) {
    const int64_t units = (num_tokens + kRoundUnitTokens - 1) / kRoundUnitTokens;
    return send_prefix[min(token / kRoundUnitTokens, units) * num_ranks + dst];
}

// Warp `warp` < num_ranks of a block: the rows this rank received from source `warp` whose source
// token is below `end_token`. Received rows come grouped by source (rank_prefix) in token order, and
// recv_src_idx holds each one's source token.
__device__ __forceinline__ int received_before(const int32_t* recv_src_idx, const int32_t* rank_prefix, int source,
                                               int64_t end_token, int max_tokens, int lane) {
    const int first = rank_prefix[source], last = rank_prefix[source + 1];
    if (end_token >= max_tokens)
        return last - first;
    return warp_lower_bound(recv_src_idx, first, last, end_token, lane) - first;
}

// Called by every thread of every block after its part of round `round`, unless that was the last:
// the block that finishes last clears the work counters, waits until every peer has started the
// round's call (so that the next round may write into every peer's other region) and tells the
// other blocks, which wait for it. A timeout is recorded by the wait that timed out.
__device__ void end_round(uint64_t* state, int32_t* next_row, const SenderControl* own, int num_ranks, uint64_t call,
                          int round, uint64_t deadline_ns, const Status& status) {
    if (last_block_finished(state, next_row, num_ranks)) {
        every_peer_started(own, num_ranks, call, deadline_ns, status);
        __threadfence();
        st_release_sys_global(state + kStateRoundsEnded, static_cast<uint64_t>(round + 1));
    }
    if (threadIdx.x == 0)
        wait_at_least_until(state + kStateRoundsEnded, static_cast<uint64_t>(round + 1), deadline_ns);
    __syncthreads();
}

// The thread that finishes a kernel's last round records the calls its rounds used.
__device__ __forceinline__ void finish_rounds(uint64_t* state, uint64_t last_call) {
    state[kStateRoundsEnded] = 0;
    state[kStateCalls] = last_call;
}

// The last block of a dispatch kernel waits until every peer has started `call` (its last), tells every
// source this rank is done with its dispatch, and records the epoch and the call as finished.
__device__ void finish_dispatch(const uint64_t* peer_bases, int rank, int num_ranks, uint64_t epoch, uint64_t call,
                                uint64_t* state, int32_t* next_row, uint64_t deadline_ns, const Status& status) {
    if (!last_block_finished(state, next_row, num_ranks))
        return;
    every_peer_started(control_of_rank(peer_bases, rank), num_ranks, call, deadline_ns, status);
    for (int source = 0; source < num_ranks; ++source)
        st_release_sys_global(&control_of_rank(peer_bases, source)->done[rank], epoch);
    state[kStateEpoch] = epoch;
    finish_rounds(state, call);
}

// A pusher warp of a dispatch, done with its rows of `call`: the last of the `num_pushers` warps to finish
// tells every receiver that this rank has pushed all its rows of the call there (SenderControl::pushed).
// Only a receiver that does not await its rows (one whose num_worst_tokens was too small) reads it: it
// must not clear the call's arrival counters while a peer may still count rows in them.
__device__ void count_pusher_done(uint64_t* state, const uint64_t* peer_bases, int rank, int num_ranks,
                                  uint64_t call, int num_pushers, int lane) {
    __syncwarp();
    unsigned long long done = 0;
    if (lane == 0) {
        __threadfence_system();  // this warp's rows and counts come before its share of the count
        done = atomicAdd(reinterpret_cast<unsigned long long*>(state + kStatePushersDone), 1ull) + 1;
    }
    if (__shfl_sync(kFullWarpMask, done, 0) != static_cast<unsigned long long>(num_pushers))
        return;
    if (lane == 0) {
        state[kStatePushersDone] = 0;  // every pusher of the round has counted; the next round counts anew
        __threadfence_system();        // what lane 0 saw of the other warps through the count comes first
    }
    __syncwarp();                      // ... for every lane's release below
    if (lane < num_ranks)
        st_release_sys_global(&control_of_rank(peer_bases, lane)->pushed[rank], call);
}

// A receiver that does not await its rows of `call` waits instead until every peer has pushed them all
// (count_pusher_done). Block-wide; false (after recording the peer) on a timeout.
__device__ bool every_peer_pushed(const SenderControl* own, int num_ranks, uint64_t call, uint64_t deadline_ns,
                                  const Status& status) {
    return wait_for_every_peer(num_ranks, [&](int peer) {
        if (wait_at_least_until(&own->pushed[peer], call, deadline_ns))
            return true;
        status.record_timeout(peer, kPhaseIntranodePushed);
        return false;
    });
}

}  // namespace cuep

// The entries take their argument struct's fields as scalar parameters, in the struct's order
// (parameter args_a_b is field args.a.b), and build the struct first: taken as one struct parameter,
// its reads are scheduled otherwise by NVRTC and every kernel's hot loops compile to other code.

namespace cuep::intranode {

// ---------------------------------------------------------------------------------------------
// Non-cached dispatch, step 1: stage. Blocks [0, num_ranks) scan one destination each; the rest
// copy top-k ids and weights. Block 0 also announces the call and publishes the header.
// is_token_in_rank: `[num_tokens, num_ranks]`; send_pos: `[num_tokens, num_ranks]` and send_prefix:
// `[ceil(num_tokens / kRoundUnitTokens) + 1, num_ranks]`, written (see scan_destination);
// num_tokens_per_expert: `[num_experts]` or null.
__global__ void __launch_bounds__(kNumThreads, 1)
stage(const int64_t* args_tokens_topk_idx, const float* args_tokens_topk_weights, int args_tokens_num_topk,
      int args_tokens_num_tokens, uint8_t* args_tokens_buffer, int64_t args_tokens_topk_idx_offset,
      int64_t args_tokens_topk_weights_offset, int64_t args_tokens_send_lists_offset,
      const bool* args_is_token_in_rank, const int32_t* args_num_tokens_per_expert,
      int args_num_experts, int args_num_ranks, int32_t* args_send_pos, int32_t* args_send_prefix,
      const uint64_t* args_peer_bases, int args_rank, int64_t args_region_bytes,
      const uint64_t* args_state, int32_t* args_status_device, int32_t* args_status_host,
      uint64_t args_timeout_ns) {
    const StageArgs args{{args_tokens_topk_idx, args_tokens_topk_weights, args_tokens_num_topk, args_tokens_num_tokens,
                          args_tokens_buffer, args_tokens_topk_idx_offset, args_tokens_topk_weights_offset,
                          args_tokens_send_lists_offset},
                         args_is_token_in_rank, args_num_tokens_per_expert, args_num_experts, args_num_ranks,
                         args_send_pos, args_send_prefix, args_peer_bases, args_rank, args_region_bytes, args_state,
                         {args_status_device, args_status_host}, args_timeout_ns};
    const Status status = args.status;
    const int num_ranks = args.num_ranks;
    const CallStart start = start_call(args.state, args.region_bytes);
    const SenderTokens& tokens = args.tokens;
    const int64_t region = start.region;
    const SenderTokens staged{tokens.topk_idx, tokens.topk_weights, tokens.num_topk, tokens.num_tokens,
                              tokens.buffer, region + tokens.topk_idx_offset, region + tokens.topk_weights_offset,
                              region + tokens.send_lists_offset};
    const uint64_t deadline_ns = globaltimer_ns() + args.timeout_ns;
    if (!wait_until_buffer_free(control_of(staged.buffer), num_ranks, start.epoch - 1, deadline_ns, status))
        return;
    if (blockIdx.x == 0) {
        announce_call(control_of(staged.buffer), args.peer_bases, args.rank, num_ranks, start.call);
        publish_meta(staged, args.num_tokens_per_expert, args.num_experts, start.epoch);
    }
    if (static_cast<int>(blockIdx.x) < num_ranks) {
        auto* send_list = reinterpret_cast<int32_t*>(staged.buffer + staged.send_lists_offset) +
                          static_cast<int64_t>(blockIdx.x) * staged.num_tokens;
        scan_destination(args.is_token_in_rank, staged.num_tokens, num_ranks, blockIdx.x, send_list, args.send_pos,
                         args.send_prefix, reinterpret_cast<SenderMeta*>(staged.buffer));
        return;
    }
    const int num_warps = (gridDim.x - num_ranks) * kWarpsPerBlock;
    const int lane = threadIdx.x % kWarpSize;
    for (int token = (blockIdx.x - num_ranks) * kWarpsPerBlock + threadIdx.x / kWarpSize; token < staged.num_tokens;
         token += num_warps)
        stage_token(staged, token, lane);  // the barrier after this kernel publishes them
}

// ---------------------------------------------------------------------------------------------
// Non-cached dispatch, step 3: notify (one block). Reads every sender's meta and writes this rank's plan:
//   recv_info = [num_recv_tokens, num_send_copies, max_tokens (of any rank), rank_prefix[num_ranks + 1],
//                num_recv_tokens_per_expert[num_local_experts] (aligned)] (kRecvInfo* above),
//   rank_prefix_matrix[num_ranks][num_ranks] (DeepEP's, the handle's first item: [s][d] is what
//   senders 0..s send to d).
__global__ void __launch_bounds__(kNumThreads)
notify(const uint64_t* args_peer_bases, int args_rank, int args_num_ranks, int args_num_experts,
       int args_expert_alignment, int32_t* args_recv_info, int32_t* args_rank_prefix_matrix) {
    const NotifyArgs args{args_peer_bases, args_rank, args_num_ranks, args_num_experts, args_expert_alignment,
                          args_recv_info, args_rank_prefix_matrix};
    const auto [peer_bases, rank, num_ranks, num_experts, expert_alignment, recv_info, rank_prefix_matrix] = args;
    __shared__ int32_t recv_from[kMaxRanks];
    __shared__ int32_t tokens_of[kMaxRanks];
    const int num_local_experts = num_experts / num_ranks;
    if (static_cast<int>(threadIdx.x) < num_ranks) {
        const int peer = threadIdx.x;
        const auto* meta = reinterpret_cast<const volatile SenderMeta*>(peer_bases[peer]);
        recv_from[peer] = meta->send_count[rank];
        tokens_of[peer] = static_cast<int32_t>(meta->num_tokens);
        int32_t total = 0;
        for (int s = 0; s < num_ranks; ++s) {
            total += reinterpret_cast<const volatile SenderMeta*>(peer_bases[s])->send_count[peer];
            rank_prefix_matrix[s * num_ranks + peer] = total;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const auto* own = reinterpret_cast<const SenderMeta*>(peer_bases[rank]);
        int32_t total = 0, copies = 0, max_tokens = 0;
        for (int r = 0; r < num_ranks; ++r) {
            recv_info[kRecvInfoRankPrefix + r] = total;
            total += recv_from[r];
            copies += own->send_count[r];
            max_tokens = max(max_tokens, tokens_of[r]);
        }
        recv_info[kRecvInfoRankPrefix + num_ranks] = total;
        recv_info[kRecvInfoRows] = total;
        recv_info[kRecvInfoCopies] = copies;
        recv_info[kRecvInfoMaxTokens] = max_tokens;
    }
    for (int e = threadIdx.x; e < num_local_experts; e += kNumThreads) {
        int32_t count = 0;
        for (int source = 0; source < num_ranks; ++source) {
            const auto* meta = reinterpret_cast<const volatile SenderMeta*>(peer_bases[source]);
            count += reinterpret_cast<const volatile int32_t*>(meta + 1)[rank * num_local_experts + e];
        }
        recv_info[kRecvInfoRankPrefix + num_ranks + 1 + e] =
            (count + expert_alignment - 1) / expert_alignment * expert_alignment;
    }
}

// ---------------------------------------------------------------------------------------------
// Non-cached dispatch, step 4: routing. One warp per run of 32 received rows (route_rows), source
// tokens from the sources' send lists; rows in order of (source rank, source token). recv_info: the notify kernel's;
// num_rows: the rows of the received arrays (the received count, or num_worst_tokens). The rows
// themselves follow in dispatch_push, which reads the source indices written here.
__global__ void __launch_bounds__(kNumThreads, 1)
receive_routing(int args_num_topk, const uint64_t* args_peer_bases, const int32_t* args_recv_info, int args_rank,
                int args_num_ranks, int args_num_experts, int args_num_rows, int64_t* args_recv_topk_idx,
                float* args_recv_topk_weights, int32_t* args_recv_src_idx, uint64_t* args_state,
                int32_t* args_status_device, int32_t* args_status_host, int32_t* args_next_row,
                uint64_t args_timeout_ns) {
    const RoutingArgs args{args_num_topk, args_peer_bases, args_recv_info, args_rank, args_num_ranks,
                           args_num_experts, args_num_rows,
                           {args_recv_topk_idx, args_recv_topk_weights, args_recv_src_idx},
                           args_state, {args_status_device, args_status_host}, args_next_row, args_timeout_ns};
    const Status status = args.status;
    const uint64_t* peer_bases = args.peer_bases;
    const int rank = args.rank, num_ranks = args.num_ranks, num_rows = args.num_rows, num_topk = args.num_topk;
    const RecvRouting recv = args.recv;
    __shared__ SourcePlan plans[kMaxRanks];
    __shared__ int32_t rank_prefix[kMaxRanks + 1];
    const CallStart start = start_call(args.state, 0);  // reads the staging of the stage kernel's call
    const uint64_t deadline_ns = globaltimer_ns() + args.timeout_ns;
    const int lane = threadIdx.x % kWarpSize, warp_in_block = threadIdx.x / kWarpSize;
    if (static_cast<int>(threadIdx.x) <= num_ranks)
        rank_prefix[threadIdx.x] = args.recv_info[kRecvInfoRankPrefix + threadIdx.x];
    const bool ok = load_source_plans(plans, peer_bases, rank, num_ranks, start.epoch, deadline_ns, status);

    const int num_recv = rank_prefix[num_ranks];
    const bool fits = received_rows_fit(num_recv, num_rows, status);
    // Padding rows up to num_worst_tokens: no expert, no source.
    const int num_warps = gridDim.x * kWarpsPerBlock;
    for (int row = num_recv + blockIdx.x * kWarpsPerBlock + warp_in_block; row < num_rows; row += num_warps) {
        if (recv.topk_idx != nullptr && lane < num_topk)
            recv.topk_idx[static_cast<int64_t>(row) * num_topk + lane] = -1;
        if (recv.topk_weights != nullptr && lane < num_topk)  // ids may come without weights
            recv.topk_weights[static_cast<int64_t>(row) * num_topk + lane] = 0.0f;
        if (lane == 0)
            recv.src_idx[row] = -1;
    }
    if (ok && fits) {
        const int experts_per_rank = args.num_experts / num_ranks;
        const int64_t first_local = static_cast<int64_t>(rank) * experts_per_rank;
        const int warp = blockIdx.x * kWarpsPerBlock + warp_in_block;
        for (int first = warp * kWarpSize; first < num_recv; first += num_warps * kWarpSize)
            route_rows(plans, rank_prefix, num_ranks, first, num_recv, num_topk, recv, first_local, experts_per_rank,
                       lane);
    }
    finish_dispatch(peer_bases, rank, num_ranks, start.epoch, start.call, args.state, args.next_row, deadline_ns,
                    status);
}

}  // namespace cuep::intranode

// ---------------------------------------------------------------------------------------------
// Cached dispatch, push form (cuep::intranode::dispatch_push), also the rows of a non-cached one.
// In each round, each receiver's region holds one section of round_tokens landing rows per source:
// the j-th row this rank sends it in the round lands at row j of this rank's section, followed by
// its scales. Pusher warps write each of this rank's tokens of the round, one read of it for every
// receiver, into the receivers' landing rows (rows for this rank itself go straight into recv_x) and
// count them in the receiver's per-chunk counters (SenderControl::arrivals); the other warps, and
// the pushers once done, copy each landed row into recv_x as soon as its chunk is complete.
// Pushing rather than pulling: on this fabric SM pushes move ~10% more than pulls
// (docs/performance-log.md, v0.4.3), and the sender's tokens need no staging copy.
namespace cuep {

// Consecutive tokens a pusher takes at a time; their rows to one receiver are consecutive landing rows.
// Measured at EP4: 1 token, 4 tokens and 2 are 506.6, 536.3 and 502.4 us (BF16, 128 SMs).
constexpr int kTokensPerRun = 2;
// The copy-out warps' pause between polls of a chunk counter, leaving issue slots and L2 to the
// pushers on the same SM (measured: 1-2 us per dispatch).
constexpr uint32_t kCopyOutPollSleepNs = 200;

// A block's plan of one round (shared memory), for the kernels that move rows in rounds: of the rows
// this rank received, those whose source token falls in the round, per source (what its dispatch
// copies out and its combine pushes back); of this rank's tokens in the round, those sent to each
// rank (what its dispatch pushes and its combine sums).
struct RoundPlan {
    int32_t rows_first[kMaxRanks];       // rows received from each source before this round
    int32_t rows_prefix[kMaxRanks + 1];  // prefix sums of this round's received rows per source
    int32_t sent_first[kMaxRanks];       // this rank's tokens sent to each rank before this round
    int32_t sent_count[kMaxRanks];       // ... and in this round
    int confirmed[kWarpsPerBlock][kMaxRanks];  // per warp, per rank: the newest chunk it saw complete, or -1
};

// Called by every thread of a block at the start of a round of source tokens [first_token,
// end_token). Warp s < num_ranks counts the rows received from source s (lane 0 of every such warp
// carries its count through the previous round in `received_through`); without `rows_known` (a
// dispatch whose num_worst_tokens was too small: recv_src_idx holds only some rows) there are none.
__device__ void plan_round(RoundPlan& plan, const int32_t* recv_src_idx, const int32_t* rank_prefix,
                           const int32_t* send_prefix, int num_tokens, int num_ranks, int max_tokens,
                           int64_t first_token, int64_t end_token, bool rows_known, int& received_through) {
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    __syncthreads();  // the previous round's plan is no longer read
    if (warp < num_ranks && rows_known) {
        const int through = received_before(recv_src_idx, rank_prefix, warp, end_token, max_tokens, lane);
        if (lane == 0) {
            plan.rows_first[warp] = received_through;
            // A round's rows from one source are at most its tokens: the clamp keeps a section within
            // its bounds even for a handle whose arrays do not fit together (they would time out instead).
            plan.rows_prefix[warp + 1] = min(through - received_through, static_cast<int>(end_token - first_token));
        }
        received_through = through;
    } else if (warp < num_ranks && lane == 0) {
        plan.rows_first[warp] = 0;
        plan.rows_prefix[warp + 1] = 0;
    }
    if (static_cast<int>(threadIdx.x) < num_ranks) {
        const int first = sent_before(send_prefix, num_tokens, num_ranks, first_token, threadIdx.x);
        plan.sent_first[threadIdx.x] = first;
        plan.sent_count[threadIdx.x] = sent_before(send_prefix, num_tokens, num_ranks, end_token, threadIdx.x) - first;
    }
    if (lane < num_ranks)
        plan.confirmed[warp][lane] = -1;
    __syncthreads();
    if (threadIdx.x == 0) {
        plan.rows_prefix[0] = 0;
        for (int s = 0; s < num_ranks; ++s)
            plan.rows_prefix[s + 1] += plan.rows_prefix[s];
    }
    __syncthreads();
}

// Rows of landing section `section` (of `section_rows` in the round) counted in the chunk that holds
// its row j: a chunk never spans two sections, and only the section's last chunk is short.
__device__ __forceinline__ uint32_t rows_in_chunk_of(int j, int section_rows, int chunk_rows) {
    return static_cast<uint32_t>(min(chunk_rows, section_rows - j / chunk_rows * chunk_rows));
}

// This rank's token rows, and the landing row they are pushed into: the hidden bytes, then the scales
// (FP8); rows start on a 128-byte line (LANDING_ROW_ALIGN in cuep/modes/intranode.py).
struct PushShape : TokenRows {
    int64_t row_bytes;  // push_row_bytes in cuep/modes/intranode.py
};

// What a pusher warp needs about the receivers in a round: where the round's region starts, where
// this rank's section starts in it, its tokens sent to each receiver before the round, and the
// rows per arrival counter.
struct PushTargets {
    const uint64_t* peer_bases;
    int64_t region;
    int section_first;
    const int32_t* sent_first;
    int chunk_rows;
};

// Lane d of a pusher warp counts the rows a run landed at receiver d: `rows` consecutive landing rows
// from `first`, at most kTokensPerRun, so they touch at most two of the receiver's chunks.
struct RunArrivals {
    int first = 0;
    int rows = 0;

    __device__ __forceinline__ void add(int slot) {
        if (rows++ == 0)
            first = slot;
    }

    // After the run's stores: each lane that landed rows releases its counts (every such lane in the
    // same instruction). A fence per receiver instead cost ~9 us per dispatch.
    __device__ __forceinline__ void publish(uint32_t* counters, int chunk_rows) {
        __syncwarp();
        if (rows == 0)
            return;
        const int first_chunk = first / chunk_rows, last_chunk = (first + rows - 1) / chunk_rows;
        const int in_first = first_chunk == last_chunk ? rows : (first_chunk + 1) * chunk_rows - first;
        red_release_sys_add(counters + first_chunk, static_cast<uint32_t>(in_first));
        if (in_first < rows)
            red_release_sys_add(counters + last_chunk, static_cast<uint32_t>(rows - in_first));
        rows = 0;
    }
};

// Pusher warp `pusher` of `num_pushers`, over this rank's tokens [first_token, last_token): runs of
// kTokensPerRun tokens, dealt in turn so that every receiver's landing rows fill front to back (see
// dispatch_push for how the pushers are numbered). Each run goes to its receivers in an order staggered
// by `stagger` (a number of its own per warp), so the links share the load.
__device__ void push_tokens(const PushShape& shape, const int32_t* send_pos, const PushTargets& targets, int rank,
                            int num_ranks, int first_token, int last_token, int pusher, int num_pushers, int stagger,
                            uint64_t call, uint8_t* recv_x, float* recv_scales, int own_first_row, int lane) {
    // recv_x == nullptr: this rank's own rows are not written (see the overflow check in the kernel).
    // Lane d < num_ranks: receiver d's arrival counters for this call.
    uint32_t* counters = lane < num_ranks ? control_of_rank(targets.peer_bases, lane)->arrivals[call % 2] : nullptr;
    RunArrivals arrivals;
    for (int first = first_token + pusher * kTokensPerRun; first < last_token; first += num_pushers * kTokensPerRun) {
        const int last = min(first + kTokensPerRun, last_token);
        for (int i = 0; i < num_ranks; ++i) {
            const int dst = (rank + 1 + stagger + i) % num_ranks;
            auto* base = reinterpret_cast<uint8_t*>(targets.peer_bases[dst]);
            for (int token = first; token < last; ++token) {
                const int pos = ld_nc_global(send_pos + static_cast<int64_t>(token) * num_ranks + dst);
                if (pos < 0)
                    continue;
                if (dst == rank) {
                    if (recv_x == nullptr)
                        continue;
                    const int64_t row = own_first_row + pos;
                    copy_token(shape, token, recv_x + row * shape.hidden_bytes, recv_scales + row * shape.num_scales,
                                lane);
                    continue;
                }
                const int slot = targets.section_first + pos - targets.sent_first[dst];
                uint8_t* landing = base + targets.region + static_cast<int64_t>(slot) * shape.row_bytes;
                copy_token(shape, token, landing, reinterpret_cast<float*>(landing + shape.hidden_bytes), lane);
                if (lane == dst)
                    arrivals.add(slot);
            }
        }
        arrivals.publish(counters, targets.chunk_rows);
    }
}

// One warp copies the row landed at `landed` into recv_x's row `row` (and its scales into recv_scales).
__device__ __forceinline__ void copy_out_row(const PushShape& shape, const uint8_t* landed, int64_t row,
                                             uint8_t* recv_x, float* recv_scales, int lane) {
    // An FP8 row is asked of L2 first, so that the copy's later steps find their bytes there (as the combine's
    // sum, reduce_token). A BF16 row's copy lost 1% to it on 24 SMs and more (docs/performance-log.md, session 54).
    if (shape.num_scales > 0 && lane == 0)
        bulk_prefetch_l2(landed, static_cast<uint32_t>(shape.hidden_bytes));
    warp_copy<false, kTokenCopyBatch>(recv_x + row * shape.hidden_bytes, landed, shape.hidden_bytes, lane);
    const auto* scales_in = reinterpret_cast<const int32_t*>(landed + shape.hidden_bytes);
    auto* scales_out = reinterpret_cast<int32_t*>(recv_scales) + row * shape.num_scales;
    for (int s = lane; s < shape.num_scales; s += kWarpSize)
        scales_out[s] = ld_volatile_global(scales_in + s);
}

}  // namespace cuep

namespace cuep::intranode {

// Cached dispatch, push form (see above). The first `push_warps` warps of each block push (at most
// kWarpsPerBlock - 1), the rest copy landed rows out from the start. send_pos: the handle's
// `[num_tokens, num_ranks]`; send_prefix, recv_src_idx: the handle's (see plan_round); recv_info: the
// notify kernel's; row_bytes: one landing row (push_row_bytes in cuep/modes/intranode.py);
// region_bytes: the size of each of the two regions (the same on every rank); round_tokens: the
// source tokens of a round (round_tokens in cuep/modes/intranode.py); num_rows: the rows of recv_x;
// deal_by_warp: number the pushers warp by warp across the blocks (pusher = warp * blocks + block)
// rather than block by block, so that the runs left over when a round's runs do not divide evenly spread
// evenly over the blocks instead of all falling to the first ones (the host sets it on few blocks:
// push_deal_by_warp in cuep/kernels/intranode.py).
__global__ void __launch_bounds__(kNumThreads, 1)
dispatch_push(const uint8_t* args_rows_x, int64_t args_rows_hidden_bytes, const float* args_rows_scales,
              int64_t args_rows_scale_token_stride, int64_t args_rows_scale_channel_stride,
              int args_rows_num_scales, const int32_t* args_send_pos, const int32_t* args_send_prefix,
              const int32_t* args_recv_src_idx, int args_num_tokens, int args_push_warps, int args_deal_by_warp,
              int64_t args_row_bytes, const uint64_t* args_peer_bases, const int32_t* args_recv_info, int args_rank,
              int args_num_ranks, int64_t args_region_bytes, int args_round_tokens, int args_num_rows,
              uint8_t* args_recv_x, float* args_recv_scales, uint64_t* args_state, int32_t* args_status_device,
              int32_t* args_status_host, int32_t* args_next_row, uint64_t args_timeout_ns) {
    const PushArgs args{{args_rows_x, args_rows_hidden_bytes, args_rows_scales, args_rows_scale_token_stride,
                         args_rows_scale_channel_stride, args_rows_num_scales},
                        args_send_pos, args_send_prefix, args_recv_src_idx, args_num_tokens, args_push_warps,
                        args_deal_by_warp, args_row_bytes, args_peer_bases, args_recv_info, args_rank,
                        args_num_ranks, args_region_bytes, args_round_tokens, args_num_rows, args_recv_x,
                        args_recv_scales, args_state, {args_status_device, args_status_host}, args_next_row,
                        args_timeout_ns};
    const Status status = args.status;
    const uint64_t* peer_bases = args.peer_bases;
    const int rank = args.rank, num_ranks = args.num_ranks;
    __shared__ int32_t rank_prefix[kMaxRanks + 1];
    __shared__ RoundPlan plan;
    const CallStart start = start_call(args.state, args.region_bytes);
    const uint64_t deadline_ns = globaltimer_ns() + args.timeout_ns;
    const int lane = threadIdx.x % kWarpSize, warp_in_block = threadIdx.x / kWarpSize;
    if (static_cast<int>(threadIdx.x) <= num_ranks)
        rank_prefix[threadIdx.x] = args.recv_info[kRecvInfoRankPrefix + threadIdx.x];
    const int max_tokens = args.recv_info[kRecvInfoMaxTokens];
    const Rounds rounds = plan_rounds(args.round_tokens, max_tokens, num_ranks);
    auto* own = reinterpret_cast<uint8_t*>(peer_bases[rank]);
    __syncthreads();

    const PushShape shape{args.rows, args.row_bytes};
    // A handle from a dispatch whose num_worst_tokens was too small: the peers still push (their rows
    // fit the landing sections) but this rank neither copies them out nor writes recv_x; it waits only
    // until every peer has pushed all of a round's rows (every_peer_pushed).
    const bool fits_recv_x = received_rows_fit(rank_prefix[num_ranks], args.num_rows, status);
    const int pushers_per_block = min(args.push_warps, kWarpsPerBlock - 1);
    const int block_major_pusher = blockIdx.x * pushers_per_block + warp_in_block;
    int* warp_confirmed = plan.confirmed[warp_in_block];
    int received_through = 0;
    for (int round = 0; round < rounds.count; ++round) {
        const uint64_t call = start.call + round;
        const int64_t region = region_offset(call, args.region_bytes);
        const int64_t first_token = static_cast<int64_t>(round) * rounds.tokens;
        plan_round(plan, args.recv_src_idx, rank_prefix, args.send_prefix, args.num_tokens, num_ranks, max_tokens,
                   first_token, first_token + rounds.tokens, fits_recv_x, received_through);
        if (blockIdx.x == 0)
            announce_call(control_of(own), peer_bases, rank, num_ranks, call);
        if (warp_in_block < pushers_per_block) {
            push_tokens(shape, args.send_pos,
                        PushTargets{peer_bases, region, rank * rounds.tokens, plan.sent_first, rounds.chunk_rows},
                        rank, num_ranks, static_cast<int>(min(first_token, static_cast<int64_t>(args.num_tokens))),
                        static_cast<int>(min(first_token + rounds.tokens, static_cast<int64_t>(args.num_tokens))),
                        args.deal_by_warp ? warp_in_block * gridDim.x + blockIdx.x : block_major_pusher,
                        gridDim.x * pushers_per_block, block_major_pusher, call,
                        fits_recv_x ? args.recv_x : nullptr, args.recv_scales, rank_prefix[rank], lane);
            count_pusher_done(args.state, peer_bases, rank, num_ranks, call, gridDim.x * pushers_per_block, lane);
        }
        const uint32_t* pushed = control_of(own)->arrivals[call % 2];
        const PushedCall pushed_call{control_of(own), call, num_ranks};
        for_each_row_spread_over_sources<kWarpsPerBlock>(args.next_row, plan.rows_prefix, rank, num_ranks,
                                                         [&](int source, int, int j, int lane) {
            const int slot = source * rounds.tokens + j;
            bool arrived = true;
            if (lane == 0)
                arrived = wait_chunk_count(pushed, slot / rounds.chunk_rows,
                                           rows_in_chunk_of(j, plan.rows_prefix[source + 1] - plan.rows_prefix[source],
                                                            rounds.chunk_rows),
                                           warp_confirmed[source], deadline_ns, status, pushed_call, source,
                                           kPhaseIntranodePushed, kCopyOutPollSleepNs);
            if (!__shfl_sync(kFullWarpMask, arrived, 0))
                return false;
            copy_out_row(shape, own + region + static_cast<int64_t>(slot) * shape.row_bytes,
                         rank_prefix[source] + plan.rows_first[source] + j, args.recv_x, args.recv_scales, lane);
            return true;
        }, rank);
        if (!fits_recv_x)  // its rows were not awaited: the next round clears the counters they land in
            every_peer_pushed(control_of(own), num_ranks, call, deadline_ns, status);
        if (round + 1 < rounds.count)
            end_round(args.state, args.next_row, control_of(own), num_ranks, call, round, deadline_ns, status);
    }
    finish_dispatch(peer_bases, rank, num_ranks, start.epoch, start.call + rounds.count - 1, args.state,
                    args.next_row, deadline_ns, status);
}

}  // namespace cuep::intranode

// ---------------------------------------------------------------------------------------------
// Combine: one kernel, in rounds of source tokens. In each round, each source's region holds one
// section of round_tokens landing rows per rank holding copies. Pusher warps write each received row
// of the round (its hidden vector, then its top-k weights) into the holder's section of the source's
// region, at the row's place among the holder's rows from that source in the round, and count it in
// the source's per-chunk arrival counters; reducer warps sum, in FP32,
// the copies of each of this rank's tokens as soon as they have landed. Pushers join the reduction
// when no row is left. A rank's own rows go through its landing region too: summed straight from x
// instead, they cost 6 us more at EP4 (docs/performance-log.md, v0.5.5), as the reducers then read them
// from HBM rather than from L2.
namespace cuep {

// Warps of each combine block that reduce from the start; the rest push first. The pushes are bound
// by NVLink and saturate it with far fewer warps than the eight left (the ceiling probe: 32 SMs), while
// a reduction that trails the arrivals is the combine's tail (measured at EP2: 4 reducers 226 us,
// 6 or 8 reducers 218-219 us; at EP4, with kTokenSlices = 4: 6 reducers 525.8 us, 8 512.2, 10 523.8).
constexpr int kReducerWarps = CUEP_COMBINE_REDUCER_WARPS;
constexpr int kPusherWarps = kWarpsPerBlock - kReducerWarps;

// Each token's reduction is split into this many slices of its hidden vector, claimed one by one,
// so the tokens whose copies arrive last are summed by several warps at once: the tail after the
// last arrival shrinks. Measured at EP4 with 8 reducers (graph replay): 1 slice 522.8 us, 2 516.7,
// 3 514.5, 4 512.2; 7 slices (one load step each) 540.7 with 6 reducers; again on v0.5.5: 4 slices
// 482.8-483.0 us, 6 484.8, 8 483.1. A launch of few blocks (bulk pushes, below) takes
// kBulkPushTokenSlices: measured at EP2, 24 SMs, 4 reducers, 2 slices 353.2 GB/s, 4 slices 327.0, 8 slices
// 275.7 (docs/performance-log.md, v0.17.0).
constexpr int kTokenSlices = 4;
constexpr int kBulkPushTokenSlices = 2;

// A launch of at most BULK_PUSH_MAX_BLOCKS blocks (cuep/kernels/intranode.py), on the Hopper path, pushes
// through the bulk-copy unit (the entry combine_bulk):
// lane 0 of each pusher warp drives its rows through kBulkPushStages chunks of dynamic shared memory
// (BulkRing; the host sizes it, combine_launch in cuep/kernels/intranode.py). On few SMs a
// warp's copy is bound by the bytes its registers keep in flight (2 KB), which the reducers' registers
// leave no room to raise; shared memory holds 16 KB a warp (4 stages: 6 were slower on 4 x H100 at 16-24 SMs,
// and fewer pushers with more stages slower still; docs/performance-log.md, session 54). On many SMs NVLink
// is the bound and the warps' copies are as fast (v0.17.0).
constexpr int kBulkPushStages = CUEP_BULK_PUSH_STAGES;
constexpr int kBulkPushChunkBytes = CUEP_BULK_PUSH_CHUNK_BYTES;
static_assert(kReducerWarps > 0 && kPusherWarps > 0 && kBulkPushStages >= 2 && kBulkPushStages <= kMaxBulkStages &&
              kBulkPushChunkBytes % 16 == 0, "the combine's warps and bulk stages");
// What the host launches combine_bulk with: each pusher warp's chunks, then their mbarriers.
static_assert(CUEP_BULK_PUSH_SHARED_BYTES ==
                  kPusherWarps * kBulkPushStages * (kBulkPushChunkBytes + static_cast<int>(sizeof(uint64_t))),
              "combine_launch (cuep/kernels/intranode.py) sizes combine_bulk's shared memory otherwise");

// Rows a pusher warp has landed but not yet counted: consecutive rows of one chunk of one source
// are counted together, in one release instead of one per row. Every lane holds the same state; the
// warp calls add() after a row's stores, and flush() as it claims more rows and when it stops pushing.
// (The release, red.release.sys instead of a system fence and an atomic, measured at EP4: combine
// 486.2-486.5 -> 482.4-483.2 us.)
struct PendingArrivals {
    uint32_t* counter = nullptr;
    uint32_t rows = 0;
    BulkRing<kBulkPushStages>* ring = nullptr;  // lane 0's bulk copies of the rows, when it makes them

    __device__ __forceinline__ void flush(int lane) {
        if (ring != nullptr && lane == 0)
            ring->complete();
        __syncwarp();
        if (lane == 0 && rows > 0)
            red_release_sys_add(counter, rows);
        counter = nullptr;
        rows = 0;
    }

    __device__ __forceinline__ void add(uint32_t* chunk_counter, int lane) {
        if (chunk_counter != counter)
            flush(lane);
        counter = chunk_counter;
        ++rows;
    }
};

struct CombineShape {
    int64_t hidden_bytes;
    int num_topk;
    int64_t landing_row_bytes;
};

// A reduction step loads kReduceUnroll vectors per lane from each of up to kCopiesPerLoad copies
// before adding any: one memory round trip per step instead of one per vector and copy, so the
// reduction keeps pace with the arrivals instead of trailing them (measured: it was the combine's
// tail). Four vectors of two copies fit in the 128 registers; four of four spill.
constexpr int kReduceUnroll = 4;
constexpr int kCopiesPerLoad = 2;

// The order in which a source sums its token's copies. Without top-k ids (DeepEP V1's combine): the
// holders in rank order, the biases last. With them (ElasticBuffer, DeepEP V2's bitwise contract): the
// biases first, then each holder's copy in increasing order of its representative top-k lane, the
// highest lane whose expert that holder holds; the FP32 sum is rounded once, so every rank's result is
// the one V2's reference computes. Each combined top-k weight is then the one its lane's holder sent back.
struct ContributionOrder {
    const int64_t* topk_idx;  // [num_tokens, num_topk] expert ids (-1: none), or null
    int num_topk, experts_per_rank;
};

// This rank's landing rows in this call's region and their per-chunk arrival counters.
struct LandedCopies {
    const uint8_t* rows;
    const uint32_t* arrivals;
    int section_rows, chunk_rows;  // landing rows per holder's section, rows per arrival counter
    const RoundPlan* plan;         // sent_first, sent_count: this rank's tokens sent to each holder
    PushedCall pushed;
};

// One warp sums slice `slice` (of `num_slices`) of the landed copies of `token` once each has
// arrived; slice 0 also sums the top-k weights. Lane r < num_ranks looks up rank r's copy and waits
// for its chunk (keeping the newest chunk it confirmed for rank r in `confirmed[r]`), so the checks
// of all copies take one round trip. Returns false on a timeout.
__device__ bool reduce_token(int token, int slice, int num_slices, const LandedCopies& landed, const int32_t* send_pos,
                             int num_ranks, const CombineShape& shape, const ContributionOrder& order,
                             const __nv_bfloat16* bias0, const __nv_bfloat16* bias1, __nv_bfloat16* combined_x,
                             float* combined_topk_weights, int* confirmed, uint64_t deadline_ns, const Status& status,
                             int lane) {
    const int pos = lane < num_ranks ? send_pos[static_cast<int64_t>(token) * num_ranks + lane] : -1;
    const int j = pos >= 0 ? pos - landed.plan->sent_first[lane] : 0;  // its row in holder lane's section
    const int slot = lane * landed.section_rows + j;
    bool ok = true;
    if (pos >= 0)
        ok = wait_chunk_count(landed.arrivals, slot / landed.chunk_rows,
                              rows_in_chunk_of(j, landed.plan->sent_count[lane], landed.chunk_rows), confirmed[lane],
                              deadline_ns, status, landed.pushed, lane, kPhaseIntranodeArrival);
    if (!__all_sync(kFullWarpMask, ok))
        return false;
    const uint8_t* rows[kMaxRanks];
    int num_copies = 0;
    const bool biases_first = order.topk_idx != nullptr;
    const uint8_t* holder_row = nullptr;  // V2's order: the copy of this lane's expert's holder
    if (!biases_first) {
        for (uint32_t holders = __ballot_sync(kFullWarpMask, pos >= 0); holders != 0; holders &= holders - 1) {
            const int copy_slot = __shfl_sync(kFullWarpMask, slot, __ffs(holders) - 1);
            rows[num_copies++] = landed.rows + static_cast<int64_t>(copy_slot) * shape.landing_row_bytes;
        }
    } else {
        // Lane k < num_topk: the holder of its expert; it represents that holder when no higher lane
        // names the same one. A holder the dispatch never sent to (ids changed since) adds nothing.
        int holder = -1;
        if (lane < order.num_topk) {
            const int64_t id = ld_nc_global(order.topk_idx + static_cast<int64_t>(token) * order.num_topk + lane);
            const int64_t rank_of_id = id >= 0 ? id / order.experts_per_rank : -1;
            holder = rank_of_id < num_ranks ? static_cast<int>(rank_of_id) : -1;  // past the experts: flagged, no rank
        }
        const uint32_t same_holder = __match_any_sync(kFullWarpMask, holder);  // every lane: a full-mask intrinsic
        const bool represents = holder >= 0 && ((same_holder >> lane) >> 1) == 0;
        for (uint32_t lanes = __ballot_sync(kFullWarpMask, represents); lanes != 0; lanes &= lanes - 1) {
            const int h = __shfl_sync(kFullWarpMask, holder, __ffs(lanes) - 1);
            const int copy_slot = __shfl_sync(kFullWarpMask, slot, h);
            if (__shfl_sync(kFullWarpMask, pos, h) >= 0)
                rows[num_copies++] = landed.rows + static_cast<int64_t>(copy_slot) * shape.landing_row_bytes;
        }
        const bool named = holder >= 0;
        const int holder_slot = __shfl_sync(kFullWarpMask, slot, named ? holder : 0);
        const int holder_pos = __shfl_sync(kFullWarpMask, pos, named ? holder : 0);
        if (named && holder_pos >= 0)
            holder_row = landed.rows + static_cast<int64_t>(holder_slot) * shape.landing_row_bytes;
    }
    const int num_vectors = static_cast<int>(shape.hidden_bytes / sizeof(int4));
    const int64_t token_vectors = static_cast<int64_t>(token) * num_vectors;
    auto* out = reinterpret_cast<int4*>(combined_x) + token_vectors;
    const int slice_vectors = (num_vectors + num_slices - 1) / num_slices;
    const uint64_t read_once = evict_first_policy();
    const int begin = slice * slice_vectors, end = min(num_vectors, begin + slice_vectors);
    // The loop below keeps only its registers' 4 KB a warp in flight; the slice of every copy is asked of
    // L2 at once, so that its later steps find their bytes there (docs/performance-log.md, session 54).
    if (lane == 0 && begin < end) {
#pragma unroll
        for (int c = 0; c < kMaxRanks; ++c)
            if (c < num_copies)
                bulk_prefetch_l2(rows[c] + static_cast<int64_t>(begin) * sizeof(int4),
                                 static_cast<uint32_t>((end - begin) * sizeof(int4)));
    }
    for (int first = begin + lane; first < end; first += kReduceUnroll * kWarpSize) {
        float acc[kReduceUnroll][kBf16PerVector] = {};
        const auto add_biases = [&]() {
#pragma unroll
            for (int u = 0; u < kReduceUnroll; ++u) {
                const int v = first + u * kWarpSize;
                if (v >= end)
                    continue;
                if (bias0 != nullptr)
                    accumulate_bf16x8(acc[u], ld_nc_global(reinterpret_cast<const int4*>(bias0) + token_vectors + v));
                if (bias1 != nullptr)
                    accumulate_bf16x8(acc[u], ld_nc_global(reinterpret_cast<const int4*>(bias1) + token_vectors + v));
            }
        };
        if (biases_first)
            add_biases();
#pragma unroll
        for (int group = 0; group < kMaxRanks; group += kCopiesPerLoad) {
            if (group >= num_copies)
                break;
            int4 raw[kCopiesPerLoad][kReduceUnroll];
#pragma unroll
            for (int c = 0; c < kCopiesPerLoad; ++c)
#pragma unroll
                for (int u = 0; u < kReduceUnroll; ++u)
                    if (group + c < num_copies && first + u * kWarpSize < end)
                        raw[c][u] = ld_relaxed_gpu_global(
                            reinterpret_cast<const int4*>(rows[group + c]) + first + u * kWarpSize, read_once);
#pragma unroll
            for (int c = 0; c < kCopiesPerLoad; ++c)
#pragma unroll
                for (int u = 0; u < kReduceUnroll; ++u)
                    if (group + c < num_copies && first + u * kWarpSize < end)
                        accumulate_bf16x8(acc[u], raw[c][u]);
        }
        if (!biases_first)
            add_biases();
#pragma unroll
        for (int u = 0; u < kReduceUnroll; ++u) {
            const int v = first + u * kWarpSize;
            if (v < end)
                st_global(out + v, floats_to_bf16x8(acc[u]), read_once);
        }
    }
    if (slice == 0 && combined_topk_weights != nullptr && lane < shape.num_topk) {
        // V1: each lane's weights summed over the copies. V2: the lane's weight as its expert's holder
        // sent it, 0 for a lane without an expert.
        float sum = 0.0f;
        if (biases_first) {
            if (holder_row != nullptr)
                sum = reinterpret_cast<const volatile float*>(holder_row + shape.hidden_bytes)[lane];
        } else {
            for (int c = 0; c < num_copies; ++c)
                sum += reinterpret_cast<const volatile float*>(rows[c] + shape.hidden_bytes)[lane];
        }
        combined_topk_weights[static_cast<int64_t>(token) * shape.num_topk + lane] = sum;
    }
    return true;
}

}  // namespace cuep

namespace cuep::intranode {

// The combine's rounds (the body of the entries combine and combine_bulk); kBulkPush: the pushers copy
// through the bulk-copy unit. Two entries, not a run-time switch in one: measured on 2 x H200, one
// kernel holding both lost a third of the bulk pushes' gain at 16-24 SMs and 2% above 32 SMs.
template <bool kBulkPush>
__device__ __forceinline__ void combine_rounds(const CombineArgs& args, int32_t* rank_prefix, RoundPlan& plan) {
    const Status status = args.status;
    const uint64_t* peer_bases = args.peer_bases;
    const int rank = args.rank, num_ranks = args.num_ranks, num_topk = args.num_topk;
    const int64_t hidden_bytes = args.hidden_bytes, landing_row_bytes = args.landing_row_bytes;
    extern __shared__ __align__(128) uint8_t bulk_push_chunks[];  // [kPusherWarps][stages][chunk], mbarriers
    const CallStart start = start_call(args.state, args.region_bytes);
    const uint64_t deadline_ns = globaltimer_ns() + args.timeout_ns;
    const int lane = threadIdx.x % kWarpSize, warp_in_block = threadIdx.x / kWarpSize;
    auto* own = reinterpret_cast<uint8_t*>(peer_bases[rank]);
    constexpr int token_slices = kBulkPush ? kBulkPushTokenSlices : kTokenSlices;
    const int pusher = max(warp_in_block - kReducerWarps, 0);
    constexpr int64_t kRingBytes = static_cast<int64_t>(kBulkPushStages) * kBulkPushChunkBytes;
    BulkRing<kBulkPushStages> ring{bulk_push_chunks + pusher * kRingBytes,
                  reinterpret_cast<uint64_t*>(bulk_push_chunks + kPusherWarps * kRingBytes) + pusher * kBulkPushStages,
                  kBulkPushChunkBytes, kBulkPushStages};
    if (kBulkPush && warp_in_block >= kReducerWarps && lane == 0)
        ring.init();
    if (static_cast<int>(threadIdx.x) <= num_ranks)
        rank_prefix[threadIdx.x] = args.recv_info[kRecvInfoRankPrefix + threadIdx.x];
    const int max_tokens = args.recv_info[kRecvInfoMaxTokens];
    const Rounds rounds = plan_rounds(args.round_tokens, max_tokens, num_ranks);
    __syncthreads();

    const CombineShape shape{hidden_bytes, num_topk, landing_row_bytes};
    const ContributionOrder order{args.order_topk_idx, args.order_num_topk, args.experts_per_rank};
    const int pushing_warps = static_cast<int>(gridDim.x) * (kWarpsPerBlock - kReducerWarps);
    // A handle from a dispatch whose num_worst_tokens was too small holds fewer rows (x, recv_src_idx) than
    // were sent: this rank pushes none back (its sources time out waiting for them) rather than read past them.
    const bool rows_known = received_rows_fit(rank_prefix[num_ranks], args.num_rows, status);
    int received_through = 0;
    uint64_t call = start.call;
    for (int round = 0; round < rounds.count; ++round, ++call) {
        const int64_t region = region_offset(call, args.region_bytes);
        const int64_t first_token = static_cast<int64_t>(round) * rounds.tokens;
        plan_round(plan, args.recv_src_idx, rank_prefix, args.send_prefix, args.num_tokens, num_ranks, max_tokens,
                   first_token, first_token + rounds.tokens, rows_known, received_through);
        if (blockIdx.x == 0)
            announce_call(control_of(own), peer_bases, rank, num_ranks, call);
        if (warp_in_block >= kReducerWarps) {
            PendingArrivals pending;
            if (kBulkPush)
                pending.ring = &ring;
            const auto publish_previous_claim = [&](int lane) { pending.flush(lane); };
            const int section_first = rank * rounds.tokens;
            for_each_row_spread_over_sources<kWarpsPerBlock>(args.next_row, plan.rows_prefix, rank, num_ranks,
                                                             [&](int source, int, int j, int lane) {
                const int64_t row = rank_prefix[source] + plan.rows_first[source] + j;
                const int slot = section_first + j;
                auto* base = reinterpret_cast<uint8_t*>(peer_bases[source]);
                uint8_t* landing = base + region + static_cast<int64_t>(slot) * landing_row_bytes;
                if constexpr (kBulkPush) {
                    if (lane == 0)
                        ring.copy_row(landing, args.x + row * hidden_bytes, hidden_bytes);
                } else {
                    warp_copy(landing, args.x + row * hidden_bytes, hidden_bytes, lane);
                }
                if (args.topk_weights != nullptr && lane < num_topk)
                    reinterpret_cast<float*>(landing + hidden_bytes)[lane] = args.topk_weights[row * num_topk + lane];
                pending.add(control_of(base)->arrivals[call % 2] + slot / rounds.chunk_rows, lane);
                return true;
            }, -1, pushing_warps, publish_previous_claim);
            pending.flush(lane);
        }
        const LandedCopies landed{own + region, control_of(own)->arrivals[call % 2], rounds.tokens, rounds.chunk_rows,
                                  &plan, PushedCall{control_of(own), call, num_ranks}};
        const int64_t round_tokens = max(int64_t{0}, min(first_token + rounds.tokens,
                                                         static_cast<int64_t>(args.num_tokens)) - first_token);
        while (true) {
            int item = 0;
            if (lane == 0)
                item = atomicAdd(args.next_row + num_ranks, 1);
            item = __shfl_sync(kFullWarpMask, item, 0);
            if (item / token_slices >= round_tokens)
                break;
            if (!reduce_token(static_cast<int>(first_token + item / token_slices), item % token_slices, token_slices,
                              landed, args.send_pos, num_ranks, shape, order, args.bias0, args.bias1,
                              args.combined_x, args.combined_topk_weights, plan.confirmed[warp_in_block], deadline_ns,
                              status, lane))
                break;
        }
        if (round + 1 < rounds.count)
            end_round(args.state, args.next_row, control_of(own), num_ranks, call, round, deadline_ns, status);
    }
    if (last_block_finished(args.state, args.next_row, num_ranks)) {
        every_peer_started(control_of(own), num_ranks, call - 1, deadline_ns, status);
        finish_rounds(args.state, call - 1);
    }
}

// next_row[0, num_ranks): the pushers' per-source row counters; next_row[num_ranks]: the reducers'
// counter of token slices (both per round). send_pos, send_prefix, recv_src_idx: the handle's; num_rows:
// the rows of x and recv_src_idx (the dispatch's received arrays); x: `[num_rows, hidden]` bf16;
// topk_weights: `[num_rows, num_topk]` or null;
// round_tokens: the source tokens of a round (round_tokens in cuep/modes/intranode.py);
// landing_row_bytes: one landing row (landing_row_bytes in cuep/modes/intranode.py); region_bytes:
// the size of each of the two regions; bias0, bias1: `[num_tokens, hidden]` or null; order_topk_idx:
// `[num_tokens, order_num_topk]` int64 ids of the dispatch (ContributionOrder) or null; combined_x:
// `[num_tokens, hidden]`; combined_topk_weights: `[num_tokens, num_topk]` or null.
__global__ void __launch_bounds__(kNumThreads, 1)
combine(const uint64_t* args_peer_bases, const int32_t* args_recv_info, const int32_t* args_send_pos,
        const int32_t* args_send_prefix, const int32_t* args_recv_src_idx, int args_rank, int args_num_ranks,
        int args_num_tokens, int args_round_tokens, int args_num_rows, const uint8_t* args_x,
        int64_t args_hidden_bytes,
        const float* args_topk_weights, int args_num_topk, int64_t args_landing_row_bytes,
        int64_t args_region_bytes, const __nv_bfloat16* args_bias0, const __nv_bfloat16* args_bias1,
        const int64_t* args_order_topk_idx, int args_order_num_topk, int args_experts_per_rank,
        __nv_bfloat16* args_combined_x, float* args_combined_topk_weights, uint64_t* args_state,
        int32_t* args_status_device, int32_t* args_status_host, int32_t* args_next_row,
        uint64_t args_timeout_ns) {
    const CombineArgs args{args_peer_bases, args_recv_info, args_send_pos, args_send_prefix, args_recv_src_idx,
                           args_rank, args_num_ranks, args_num_tokens, args_round_tokens, args_num_rows, args_x,
                           args_hidden_bytes,
                           args_topk_weights, args_num_topk, args_landing_row_bytes, args_region_bytes, args_bias0,
                           args_bias1, args_order_topk_idx, args_order_num_topk, args_experts_per_rank,
                           args_combined_x, args_combined_topk_weights, args_state,
                           {args_status_device, args_status_host}, args_next_row, args_timeout_ns};
    __shared__ int32_t rank_prefix[kMaxRanks + 1];
    __shared__ RoundPlan plan;
    combine_rounds<false>(args, rank_prefix, plan);
}

#if CUEP_ENABLE_SM90_FEATURES
// The same combine, its pushers copying through the bulk-copy unit (combine_rounds<true>), launched with
// combine_launch's dynamic shared memory (cuep/kernels/intranode.py) on at most BULK_PUSH_MAX_BLOCKS
// blocks. Hopper builds only.
__global__ void __launch_bounds__(kNumThreads, 1)
combine_bulk(const uint64_t* args_peer_bases, const int32_t* args_recv_info, const int32_t* args_send_pos,
        const int32_t* args_send_prefix, const int32_t* args_recv_src_idx, int args_rank, int args_num_ranks,
        int args_num_tokens, int args_round_tokens, int args_num_rows, const uint8_t* args_x,
        int64_t args_hidden_bytes,
        const float* args_topk_weights, int args_num_topk, int64_t args_landing_row_bytes,
        int64_t args_region_bytes, const __nv_bfloat16* args_bias0, const __nv_bfloat16* args_bias1,
        const int64_t* args_order_topk_idx, int args_order_num_topk, int args_experts_per_rank,
        __nv_bfloat16* args_combined_x, float* args_combined_topk_weights, uint64_t* args_state,
        int32_t* args_status_device, int32_t* args_status_host, int32_t* args_next_row,
        uint64_t args_timeout_ns) {
    const CombineArgs args{args_peer_bases, args_recv_info, args_send_pos, args_send_prefix, args_recv_src_idx,
                           args_rank, args_num_ranks, args_num_tokens, args_round_tokens, args_num_rows, args_x,
                           args_hidden_bytes,
                           args_topk_weights, args_num_topk, args_landing_row_bytes, args_region_bytes, args_bias0,
                           args_bias1, args_order_topk_idx, args_order_num_topk, args_experts_per_rank,
                           args_combined_x, args_combined_topk_weights, args_state,
                           {args_status_device, args_status_host}, args_next_row, args_timeout_ns};
    __shared__ int32_t rank_prefix[kMaxRanks + 1];
    __shared__ RoundPlan plan;
    combine_rounds<true>(args, rank_prefix, plan);
}
#endif

}  // namespace cuep::intranode
