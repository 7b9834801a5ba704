// Intranode (NVLink) high-throughput dispatch and combine between the ranks of one node.
//
// Every rank owns one symmetric buffer (NVSHMEM symmetric memory; `peer_bases[r]` is rank r's
// buffer as this GPU addresses it over NVLink). It starts with a fixed-size meta region, so the
// regions after it sit at the same offset on every rank:
//
//   [0, kMetaBytes)      SenderMeta: the sender's token count, where its staged arrays start,
//                        send_count[dst] and the per-expert counts from its layout; at its end,
//                        SenderControl: the flags of the protocol below
//   two regions of region_bytes each, used in turn: intranode call k (dispatches and combines
//   counted together, from 1, equal on every rank) uses region k % 2 (region_offset below) for
//                        non-cached dispatch: staged x rows, scales, top-k ids, weights, send lists
//                        cached dispatch: landing rows, one per received row (push form, below)
//                        combine:  landing rows, one per (token, rank that holds a copy)
//
// Why two regions: a call may write into a peer's region the moment it starts, with no handshake.
// Call k ends on each rank only once every peer has started call k (SenderControl::started), so
// when call k + 1 starts here every peer has finished call k - 1, the last user of the region that
// call k + 1 uses. Each call also clears, before it announces itself, the arrival counters of the
// other region, which the next call counts in.
//
// Dispatches are also numbered on their own (epochs 1, 2, ...). A non-cached dispatch's header (in
// the meta region, not in a region) is rewritten only once every receiver has finished the previous
// dispatch (SenderControl::done).
//
// Non-cached dispatch: (1) stage (cuep::intranode::stage): copy tokens, scan is_token_in_rank into
// per-destination send lists; (2) barrier; (3) notify: each receiver reads every sender's meta and
// builds its receive plan (rank prefix, per-expert counts, landing offsets); the host may wait for
// the count here to size the outputs; (4) pull (cuep::intranode::dispatch). Every byte crosses
// NVLink once.
//
// Cached dispatch (one kernel, cuep::intranode::dispatch_push): the senders push each token into its
// receivers' landing rows and the receivers copy them out as they complete; see that kernel.
//
// Combine (push, one kernel, cuep::intranode::combine): each rank writes the rows it received back
// into the landing region of their source, at the slot the dispatch plan assigned, counting every
// row in the source's per-chunk arrival counters; meanwhile the source sums, in FP32, the copies of
// each of its tokens as soon as they have landed, adds the optional biases, and writes the result.
// No barrier: the counters order everything.
//
// Each entry has an argument struct (StageArgs, NotifyArgs, DispatchArgs, PushArgs, CombineArgs
// below), mirrored field for field in cuep/kernels/intranode.py, which also defines the sizes both
// sides use (CUEP_* macros, read once below); it takes the struct's fields as its parameters (see
// the entries). The call sequences that launch them are in cuep/modes/intranode.py.
#include <cuep/bf16.cuh>
#include <cuep/common.cuh>
#include <cuep/copy.cuh>
#include <cuep/ptx.cuh>
#include <cuep/rows.cuh>
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
    int64_t x_offset, scales_offset, topk_idx_offset, topk_weights_offset, send_lists_offset;
    int32_t send_count[kMaxRanks];
    // followed by int32_t num_tokens_per_expert[num_experts], at most kMaxExperts
};
constexpr int64_t kMetaBytes = CUEP_META_BYTES;
constexpr int kMaxExperts = CUEP_MAX_EXPERTS;

// Arrivals (cached dispatch and combine) are counted per chunk of consecutive rows, at least
// kMinChunkRows long, so that at most kMaxChunks counters serve any row count.
constexpr int kMaxChunks = 1024;
constexpr int kMinChunkRows = 16;

// The protocol's flags, at the end of the meta region (zeroed when the Buffer is made).
struct SenderControl {
    uint64_t meta_epoch;               // newest epoch whose SenderMeta header this sender has published
    uint64_t done[kMaxRanks];          // done[r]: newest dispatch epoch receiver r has finished here
    uint64_t started[kMaxRanks];       // started[r]: newest intranode call rank r has started
    uint32_t arrivals[2][kMaxChunks];  // rows pushed here per chunk (cached dispatch, combine), per region
};
constexpr int64_t kControlBytes = CUEP_CONTROL_BYTES;
constexpr int64_t kControlOffset = kMetaBytes - kControlBytes;
static_assert(sizeof(SenderControl) <= kControlBytes, "SenderControl outgrew its share of the meta region");
static_assert(sizeof(SenderMeta) + kMaxExperts * sizeof(int32_t) <= kControlOffset,
              "the per-expert counts of the largest expert count overrun the protocol's flags");

// Per-rank state on the device (kStateWords uint64 words): the last finished dispatch and combine
// epochs (their sum is the number of finished intranode calls), and the blocks of the running
// dispatch or combine kernel that are done (the last one finishes the epoch).
constexpr int kStateEpoch = 0;
constexpr int kStateBlocksDone = 1;
constexpr int kStateCombineEpoch = 2;
constexpr int kStateWords = CUEP_STATE_WORDS;
static_assert(kStateCombineEpoch < kStateWords, "the host allocates too few state words");

__device__ __forceinline__ SenderControl* control_of(uint8_t* buffer) {
    return reinterpret_cast<SenderControl*>(buffer + kControlOffset);
}

// Rank r's SenderControl, as this GPU addresses it.
__device__ __forceinline__ SenderControl* control_of_rank(const uint64_t* peer_bases, int r) {
    return control_of(reinterpret_cast<uint8_t*>(peer_bases[r]));
}

// This rank's next intranode call: the one a dispatch or combine kernel runs.
__device__ __forceinline__ uint64_t next_call(const uint64_t* state) {
    return ld_volatile_global(state + kStateEpoch) + ld_volatile_global(state + kStateCombineEpoch) + 1;
}

// Where intranode call `call`'s region starts in a buffer (the same offset on every rank).
__device__ __forceinline__ int64_t region_offset(uint64_t call, int64_t region_bytes) {
    return kMetaBytes + static_cast<int64_t>(call % 2) * region_bytes;
}

__device__ __forceinline__ int rows_per_chunk(int64_t num_rows) {
    return max(kMinChunkRows, static_cast<int>((num_rows + kMaxChunks - 1) / kMaxChunks));
}

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

// What a receiver needs of one sender, read from the sender's meta at the start of a pull.
struct SourcePlan {
    const uint8_t* x;
    const float* scales;
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

// A sender's tokens and where this rank stages them (offsets from the buffer's start).
struct Staging : TokenRows {
    const int64_t* topk_idx;
    const float* topk_weights;
    int num_topk;
    int num_tokens;
    uint8_t* buffer;
    int64_t x_offset, scales_offset, topk_idx_offset, topk_weights_offset, send_lists_offset;
};

// Where a non-cached dispatch writes what this rank receives (`[num_rows, ...]` each; the optional
// arrays are null when not asked for).
struct RecvArrays {
    uint8_t* x;
    float* scales;
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

// This rank's tokens in a non-cached dispatch, and where its stage kernel puts them: offsets relative
// to the call's region (the kernel adds the region's start).
struct SenderTokens {
    TokenRows rows;
    const int64_t* topk_idx;
    const float* topk_weights;
    int num_topk;
    int num_tokens;
    uint8_t* buffer;
    int64_t scales_offset, topk_idx_offset, topk_weights_offset, send_lists_offset;
};

struct StageArgs {
    SenderTokens tokens;
    const bool* is_token_in_rank;
    const int32_t* num_tokens_per_expert;
    int num_experts, num_ranks;
    int32_t* send_pos;
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
    int32_t* combine_offsets;
    int32_t* send_offsets;
    int32_t* push_offsets;
    int32_t* rank_prefix_matrix;
};

struct DispatchArgs {
    SenderTokens tokens;  // only the row shape is read: the sources' headers say where their arrays sit
    const uint64_t* peer_bases;
    const int32_t* recv_info;
    int rank, num_ranks, num_experts, num_rows;
    RecvArrays recv;
    uint64_t* state;
    Status status;
    int32_t* next_row;
    uint64_t timeout_ns;
};

struct PushArgs {
    TokenRows rows;
    const int32_t* send_pos;
    const int32_t* push_offsets;
    int num_tokens;
    int push_warps;
    int64_t row_bytes;
    const uint64_t* peer_bases;
    const int32_t* recv_info;
    int rank, num_ranks;
    int64_t region_bytes;
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
    const int32_t* combine_offsets;
    const int32_t* send_pos;
    const int32_t* send_offsets;
    int rank, num_ranks, num_tokens;
    const uint8_t* x;
    int64_t hidden_bytes;
    const float* topk_weights;
    int num_topk;
    int64_t landing_row_bytes, region_bytes;
    const __nv_bfloat16* bias0;
    const __nv_bfloat16* bias1;
    __nv_bfloat16* combined_x;
    float* combined_topk_weights;
    uint64_t* state;
    Status status;
    int32_t* next_row;
    uint64_t timeout_ns;
};

// What a dispatch or combine kernel knows of its call before anything else (see the top of this file).
struct CallStart {
    uint64_t epoch;  // the dispatch or combine epoch this kernel finishes
    uint64_t call;   // the intranode call it runs
    int64_t region;  // where that call's region starts in every buffer
};

// The first thing every dispatch and combine kernel reads: its epoch (from state word `epoch_word`,
// kStateEpoch or kStateCombineEpoch), its call and that call's region. (Each kernel then reads the
// clock for its deadline; where it does so decides how the compiler schedules these loads.)
__device__ __forceinline__ CallStart start_call(const uint64_t* state, int epoch_word, int64_t region_bytes) {
    CallStart start;
    start.epoch = ld_volatile_global(state + epoch_word) + 1;
    start.call = next_call(state);
    start.region = region_offset(start.call, region_bytes);
    return start;
}

// One warp writes `token`'s hidden vector to `dst_x` and its scales (if any) to `dst_scales`.
__device__ __forceinline__ void copy_token(const TokenRows& rows, int token, uint8_t* dst_x, float* dst_scales,
                                           int lane) {
    warp_copy(dst_x, rows.x + token * rows.hidden_bytes, rows.hidden_bytes, lane);
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

// Whether every rank's landing rows in this call (rows_per_rank[r], `row_bytes` each) fit one region;
// if not, records the largest count. Every rank reads the same counts and has the same buffer size,
// so either all of them run the call or none does, and no one waits for a peer that will not come.
__device__ bool every_landing_fits(const int32_t* rows_per_rank, int num_ranks, int64_t row_bytes,
                                   int64_t region_bytes, const Status& status) {
    int most_rows = 0;
    for (int r = 0; r < num_ranks; ++r)
        most_rows = max(most_rows, rows_per_rank[r]);
    if (most_rows * row_bytes <= region_bytes)
        return true;
    if (blockIdx.x == 0 && threadIdx.x == 0)
        status.record(kStatusLandingRows, most_rows);
    return false;
}

// The start of every block of a kernel that pushes rows (cached dispatch, combine), before it moves
// any: fills this block's shared plan, then synchronises the block. rank_prefix[num_ranks + 1]: the
// rows received from each source (recv_info[2...]); chunk_rows[r]: receiver r's rows per arrival
// counter and, with kFirstRows, first_row[r]: this rank's first landing row at receiver r, both from
// `landing` = [first landing row at each receiver, landing rows at each receiver] (push_offsets or
// combine_offsets); confirmed[warp][r] = -1: no chunk of rank r confirmed yet. (kFirstRows is a
// template parameter: a null test of a shared array's address is not folded, and costs the cached
// dispatch 8 instructions.)
template <bool kFirstRows>
__device__ __forceinline__ void load_push_plan(const int32_t* recv_info, const int32_t* landing, int num_ranks,
                                               int32_t* rank_prefix, int32_t* first_row, int* chunk_rows,
                                               int (*confirmed)[kMaxRanks]) {
    const int lane = threadIdx.x % kWarpSize, warp_in_block = threadIdx.x / kWarpSize;
    if (static_cast<int>(threadIdx.x) <= num_ranks)
        rank_prefix[threadIdx.x] = recv_info[2 + threadIdx.x];
    if (static_cast<int>(threadIdx.x) < num_ranks) {
        if constexpr (kFirstRows)
            first_row[threadIdx.x] = landing[threadIdx.x];
        chunk_rows[threadIdx.x] = rows_per_chunk(landing[num_ranks + threadIdx.x]);
    }
    if (lane < num_ranks)
        confirmed[warp_in_block][lane] = -1;
    __syncthreads();
}

// Block 0 of each non-cached dispatch's stage kernel: the header receivers read, then its epoch.
__device__ void publish_meta(const Staging& args, const int32_t* num_tokens_per_expert, int num_experts,
                             uint64_t epoch) {
    auto* meta = reinterpret_cast<SenderMeta*>(args.buffer);
    SenderControl* control = control_of(args.buffer);
    if (threadIdx.x == 0) {
        meta->num_tokens = args.num_tokens;
        meta->x_offset = args.x_offset;
        meta->scales_offset = args.scales_offset;
        meta->topk_idx_offset = args.topk_idx_offset;
        meta->topk_weights_offset = args.topk_weights_offset;
        meta->send_lists_offset = args.send_lists_offset;
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

// One warp stages one token: its row, scales, top-k ids and weights.
__device__ __forceinline__ void stage_token(const Staging& args, int token, int lane) {
    auto* scales_out = reinterpret_cast<float*>(args.buffer + args.scales_offset);
    copy_token(args, token, args.buffer + args.x_offset + token * args.hidden_bytes,
               scales_out + static_cast<int64_t>(token) * args.num_scales, lane);
    if (args.topk_idx != nullptr && lane < args.num_topk) {
        const int64_t slot = static_cast<int64_t>(token) * args.num_topk + lane;
        reinterpret_cast<int64_t*>(args.buffer + args.topk_idx_offset)[slot] = args.topk_idx[slot];
        if (args.topk_weights != nullptr)
            reinterpret_cast<float*>(args.buffer + args.topk_weights_offset)[slot] = args.topk_weights[slot];
    }
}

__device__ void scan_destination(const bool* is_token_in_rank, int num_tokens, int num_ranks, int dst,
                                 int32_t* send_list, int32_t* send_pos, SenderMeta* meta) {
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
        }
        base += chunk_total;
        __syncthreads();
    }
    if (threadIdx.x == 0)
        meta->send_count[dst] = base;
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
        plans[source] = SourcePlan{base + meta->x_offset, reinterpret_cast<const float*>(base + meta->scales_offset),
                                   reinterpret_cast<const int64_t*>(base + meta->topk_idx_offset),
                                   reinterpret_cast<const float*>(base + meta->topk_weights_offset),
                                   reinterpret_cast<const int32_t*>(base + meta->send_lists_offset) +
                                       rank * num_tokens};
        return true;
    });
}

// One warp copies received row `row` (source token `token`) from its source's staging area.
__device__ __forceinline__ void pull_row(const SourcePlan& plan, int64_t token, int row, const Staging& shape,
                                         const RecvArrays& recv, int64_t first_local, int experts_per_rank, int lane) {
    // A row's scales (up to kWarpSize vectors, hidden <= 16384) are loaded before its data, so both
    // round trips overlap.
    const bool vector_scales = recv.scales != nullptr && shape.num_scales % kFloatsPerVector == 0 &&
                               shape.num_scales / kFloatsPerVector <= kWarpSize;  // rows start 16-byte aligned
    const bool has_scale_vector = vector_scales && lane < shape.num_scales / kFloatsPerVector;
    const int4* scales_in = reinterpret_cast<const int4*>(plan.scales + token * shape.num_scales);
    const int4 scale_vector = has_scale_vector ? ld_volatile_global(scales_in + lane) : int4{};
    warp_copy(recv.x + row * shape.hidden_bytes, plan.x + token * shape.hidden_bytes, shape.hidden_bytes, lane);
    if (has_scale_vector)
        reinterpret_cast<int4*>(recv.scales + static_cast<int64_t>(row) * shape.num_scales)[lane] = scale_vector;
    if (recv.scales != nullptr && !vector_scales) {
        for (int s = lane; s < shape.num_scales; s += kWarpSize)
            recv.scales[static_cast<int64_t>(row) * shape.num_scales + s] = plan.scales[token * shape.num_scales + s];
    }
    if (recv.topk_idx != nullptr && lane < shape.num_topk) {
        const int64_t expert = plan.topk_idx[token * shape.num_topk + lane];
        const bool local = expert >= first_local && expert < first_local + experts_per_rank;
        recv.topk_idx[static_cast<int64_t>(row) * shape.num_topk + lane] = local ? expert - first_local : -1;
        if (recv.topk_weights != nullptr)
            recv.topk_weights[static_cast<int64_t>(row) * shape.num_topk + lane] =
                local ? plan.topk_weights[token * shape.num_topk + lane] : 0.0f;
    }
}

// Called by every thread at the end of a dispatch or combine kernel: true only for thread 0 of the
// block that finishes last, after it has cleared the block count and the work counters
// (next_row[0, num_ranks]) for the next kernel. That thread then finishes the call.
__device__ bool last_block_finished(uint64_t* state, int32_t* next_row, int num_ranks) {
    if (!last_block_done<Scope::kSystem>(state, kStateBlocksDone))
        return false;
    state[kStateBlocksDone] = 0;
    for (int r = 0; r <= num_ranks; ++r)
        next_row[r] = 0;
    return true;
}

// The last block of a dispatch kernel waits until every peer has started this call, tells every
// source this rank is done with its dispatch, and records the epoch as finished.
__device__ void finish_dispatch(const uint64_t* peer_bases, int rank, int num_ranks, uint64_t epoch, uint64_t call,
                                uint64_t* state, int32_t* next_row, uint64_t deadline_ns, const Status& status) {
    if (!last_block_finished(state, next_row, num_ranks))
        return;
    every_peer_started(control_of_rank(peer_bases, rank), num_ranks, call, deadline_ns, status);
    for (int source = 0; source < num_ranks; ++source)
        st_release_sys_global(&control_of_rank(peer_bases, source)->done[rank], epoch);
    state[kStateEpoch] = epoch;
}

}  // namespace cuep

// The entries take their argument struct's fields as scalar parameters, in the struct's order
// (parameter args_a_b is field args.a.b), and build the struct first: taken as one struct parameter,
// its reads are scheduled otherwise by NVRTC and every kernel's hot loops compile to other code.

namespace cuep::intranode {

// ---------------------------------------------------------------------------------------------
// Non-cached dispatch, step 1: stage. Blocks [0, num_ranks) scan one destination each; the rest
// copy rows. Block 0 also announces the call and publishes the header. is_token_in_rank:
// `[num_tokens, num_ranks]`; send_pos: `[num_tokens, num_ranks]`, written (see scan_destination);
// num_tokens_per_expert: `[num_experts]` or null.
__global__ void __launch_bounds__(kNumThreads, 1)
stage(const uint8_t* args_tokens_rows_x, int64_t args_tokens_rows_hidden_bytes,
      const float* args_tokens_rows_scales, int64_t args_tokens_rows_scale_token_stride,
      int64_t args_tokens_rows_scale_channel_stride, int args_tokens_rows_num_scales,
      const int64_t* args_tokens_topk_idx, const float* args_tokens_topk_weights,
      int args_tokens_num_topk, int args_tokens_num_tokens, uint8_t* args_tokens_buffer,
      int64_t args_tokens_scales_offset, int64_t args_tokens_topk_idx_offset,
      int64_t args_tokens_topk_weights_offset, int64_t args_tokens_send_lists_offset,
      const bool* args_is_token_in_rank, const int32_t* args_num_tokens_per_expert,
      int args_num_experts, int args_num_ranks, int32_t* args_send_pos,
      const uint64_t* args_peer_bases, int args_rank, int64_t args_region_bytes,
      const uint64_t* args_state, int32_t* args_status_device, int32_t* args_status_host,
      uint64_t args_timeout_ns) {
    const StageArgs args{{{args_tokens_rows_x, args_tokens_rows_hidden_bytes, args_tokens_rows_scales,
                           args_tokens_rows_scale_token_stride, args_tokens_rows_scale_channel_stride,
                           args_tokens_rows_num_scales},
                          args_tokens_topk_idx, args_tokens_topk_weights, args_tokens_num_topk, args_tokens_num_tokens,
                          args_tokens_buffer, args_tokens_scales_offset, args_tokens_topk_idx_offset,
                          args_tokens_topk_weights_offset, args_tokens_send_lists_offset},
                         args_is_token_in_rank, args_num_tokens_per_expert, args_num_experts, args_num_ranks,
                         args_send_pos, args_peer_bases, args_rank, args_region_bytes, args_state,
                         {args_status_device, args_status_host}, args_timeout_ns};
    const Status status = args.status;
    const int num_ranks = args.num_ranks;
    const CallStart start = start_call(args.state, kStateEpoch, args.region_bytes);
    const SenderTokens& tokens = args.tokens;
    const int64_t region = start.region;
    const Staging staged{tokens.rows, tokens.topk_idx, tokens.topk_weights, tokens.num_topk, tokens.num_tokens,
                         tokens.buffer, region, region + tokens.scales_offset, region + tokens.topk_idx_offset,
                         region + tokens.topk_weights_offset, region + tokens.send_lists_offset};
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
                         reinterpret_cast<SenderMeta*>(staged.buffer));
        return;
    }
    const int num_warps = (gridDim.x - num_ranks) * kWarpsPerBlock;
    const int lane = threadIdx.x % kWarpSize;
    for (int token = (blockIdx.x - num_ranks) * kWarpsPerBlock + threadIdx.x / kWarpSize; token < staged.num_tokens;
         token += num_warps)
        stage_token(staged, token, lane);  // the barrier after this kernel publishes the rows
}

// ---------------------------------------------------------------------------------------------
// Non-cached dispatch, step 3: notify (one block). Reads every sender's meta and writes this rank's plan:
//   recv_info = [num_recv_tokens, num_send_copies, rank_prefix[num_ranks + 1],
//                num_recv_tokens_per_expert[num_local_experts] (aligned)]
//   combine_offsets[2 * num_ranks] (this rank's first landing row in each source, then each source's
//   landing row count: the copies of its tokens that the dispatch sent),
//   send_offsets[num_ranks] (each destination's first landing row in this rank's buffer),
//   push_offsets[2 * num_ranks] (for cached push dispatches: this rank's first row among each
//   destination's received rows, then each destination's received row count),
//   rank_prefix_matrix[num_ranks][num_ranks] (DeepEP's, the handle's first item: [s][d] is what
//   senders 0..s send to d).
__global__ void __launch_bounds__(kNumThreads)
notify(const uint64_t* args_peer_bases, int args_rank, int args_num_ranks, int args_num_experts,
       int args_expert_alignment, int32_t* args_recv_info, int32_t* args_combine_offsets,
       int32_t* args_send_offsets, int32_t* args_push_offsets, int32_t* args_rank_prefix_matrix) {
    const NotifyArgs args{args_peer_bases, args_rank, args_num_ranks, args_num_experts, args_expert_alignment,
                          args_recv_info, args_combine_offsets, args_send_offsets, args_push_offsets,
                          args_rank_prefix_matrix};
    const auto [peer_bases, rank, num_ranks, num_experts, expert_alignment, recv_info, combine_offsets, send_offsets,
                push_offsets, rank_prefix_matrix] = args;
    __shared__ int32_t recv_from[kMaxRanks];
    const int num_local_experts = num_experts / num_ranks;
    if (static_cast<int>(threadIdx.x) < num_ranks) {
        const int source = threadIdx.x;
        const auto* meta = reinterpret_cast<const volatile SenderMeta*>(peer_bases[source]);
        recv_from[source] = meta->send_count[rank];
        int32_t before = 0, copies = 0;
        for (int r = 0; r < num_ranks; ++r) {
            before += r < rank ? meta->send_count[r] : 0;
            copies += meta->send_count[r];
        }
        combine_offsets[source] = before;
        combine_offsets[num_ranks + source] = copies;

        const int dst = threadIdx.x;
        int32_t before_this_rank = 0, total = 0;
        for (int s = 0; s < num_ranks; ++s) {
            const int32_t count = reinterpret_cast<const volatile SenderMeta*>(peer_bases[s])->send_count[dst];
            before_this_rank += s < rank ? count : 0;
            total += count;
            rank_prefix_matrix[s * num_ranks + dst] = total;
        }
        push_offsets[dst] = before_this_rank;
        push_offsets[num_ranks + dst] = total;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const auto* own = reinterpret_cast<const SenderMeta*>(peer_bases[rank]);
        int32_t total = 0, copies = 0;
        for (int r = 0; r < num_ranks; ++r) {
            recv_info[2 + r] = total;
            total += recv_from[r];
            send_offsets[r] = copies;
            copies += own->send_count[r];
        }
        recv_info[2 + num_ranks] = total;
        recv_info[0] = total;
        recv_info[1] = copies;
    }
    for (int e = threadIdx.x; e < num_local_experts; e += kNumThreads) {
        int32_t count = 0;
        for (int source = 0; source < num_ranks; ++source) {
            const auto* meta = reinterpret_cast<const volatile SenderMeta*>(peer_bases[source]);
            count += reinterpret_cast<const volatile int32_t*>(meta + 1)[rank * num_local_experts + e];
        }
        recv_info[3 + num_ranks + e] = (count + expert_alignment - 1) / expert_alignment * expert_alignment;
    }
}

// ---------------------------------------------------------------------------------------------
// Non-cached dispatch, step 4: pull. One warp per received row, source tokens from the sources'
// send lists; rows land in order of (source rank, source token). recv_info: the notify kernel's;
// num_rows: the rows of the received arrays (the received count, or num_worst_tokens).
__global__ void __launch_bounds__(kNumThreads, 1)
dispatch(const uint8_t* args_tokens_rows_x, int64_t args_tokens_rows_hidden_bytes,
         const float* args_tokens_rows_scales, int64_t args_tokens_rows_scale_token_stride,
         int64_t args_tokens_rows_scale_channel_stride, int args_tokens_rows_num_scales,
         const int64_t* args_tokens_topk_idx, const float* args_tokens_topk_weights,
         int args_tokens_num_topk, int args_tokens_num_tokens, uint8_t* args_tokens_buffer,
         int64_t args_tokens_scales_offset, int64_t args_tokens_topk_idx_offset,
         int64_t args_tokens_topk_weights_offset, int64_t args_tokens_send_lists_offset,
         const uint64_t* args_peer_bases, const int32_t* args_recv_info, int args_rank,
         int args_num_ranks, int args_num_experts, int args_num_rows, uint8_t* args_recv_x,
         float* args_recv_scales, int64_t* args_recv_topk_idx, float* args_recv_topk_weights,
         int32_t* args_recv_src_idx, uint64_t* args_state, int32_t* args_status_device,
         int32_t* args_status_host, int32_t* args_next_row, uint64_t args_timeout_ns) {
    const DispatchArgs args{{{args_tokens_rows_x, args_tokens_rows_hidden_bytes, args_tokens_rows_scales,
                              args_tokens_rows_scale_token_stride, args_tokens_rows_scale_channel_stride,
                              args_tokens_rows_num_scales},
                             args_tokens_topk_idx, args_tokens_topk_weights, args_tokens_num_topk,
                             args_tokens_num_tokens, args_tokens_buffer, args_tokens_scales_offset,
                             args_tokens_topk_idx_offset, args_tokens_topk_weights_offset,
                             args_tokens_send_lists_offset},
                            args_peer_bases, args_recv_info, args_rank, args_num_ranks, args_num_experts,
                            args_num_rows,
                            {args_recv_x, args_recv_scales, args_recv_topk_idx, args_recv_topk_weights,
                             args_recv_src_idx},
                            args_state, {args_status_device, args_status_host}, args_next_row, args_timeout_ns};
    const Status status = args.status;
    const uint64_t* peer_bases = args.peer_bases;
    const int rank = args.rank, num_ranks = args.num_ranks, num_rows = args.num_rows;
    const SenderTokens& tokens = args.tokens;
    const Staging shape{tokens.rows, tokens.topk_idx, tokens.topk_weights, tokens.num_topk, tokens.num_tokens,
                        tokens.buffer, 0, tokens.scales_offset, tokens.topk_idx_offset, tokens.topk_weights_offset,
                        tokens.send_lists_offset};
    const RecvArrays recv = args.recv;
    __shared__ SourcePlan plans[kMaxRanks];
    __shared__ int32_t rank_prefix[kMaxRanks + 1];
    const CallStart start = start_call(args.state, kStateEpoch, 0);  // a pull has no region
    const uint64_t deadline_ns = globaltimer_ns() + args.timeout_ns;
    const int lane = threadIdx.x % kWarpSize, warp_in_block = threadIdx.x / kWarpSize;
    if (static_cast<int>(threadIdx.x) <= num_ranks)
        rank_prefix[threadIdx.x] = args.recv_info[2 + threadIdx.x];
    const bool ok = load_source_plans(plans, peer_bases, rank, num_ranks, start.epoch, deadline_ns, status);

    const int num_recv = rank_prefix[num_ranks];
    if (num_recv > num_rows && blockIdx.x == 0 && threadIdx.x == 0)  // num_worst_tokens was too small
        status.record(kStatusOverflow, num_recv);
    // Padding rows up to num_worst_tokens: no expert, no source.
    const int num_warps = gridDim.x * kWarpsPerBlock;
    for (int row = num_recv + blockIdx.x * kWarpsPerBlock + warp_in_block; row < num_rows; row += num_warps) {
        if (recv.topk_idx != nullptr && lane < shape.num_topk) {
            recv.topk_idx[static_cast<int64_t>(row) * shape.num_topk + lane] = -1;
            recv.topk_weights[static_cast<int64_t>(row) * shape.num_topk + lane] = 0.0f;
        }
        if (lane == 0)
            recv.src_idx[row] = -1;
    }
    if (ok && num_recv <= num_rows) {
        const int experts_per_rank = args.num_experts / num_ranks;
        const int64_t first_local = static_cast<int64_t>(rank) * experts_per_rank;
        for_each_row_spread_over_sources<kWarpsPerBlock>(args.next_row, rank_prefix, rank, num_ranks,
                                                         [&](int source, int row, int j, int lane) {
            const SourcePlan& plan = plans[source];
            const int64_t token = plan.send_list[j];
            pull_row(plan, token, row, shape, recv, first_local, experts_per_rank, lane);
            if (lane == 0)
                recv.src_idx[row] = static_cast<int32_t>(token);
            return true;
        });
    }
    finish_dispatch(peer_bases, rank, num_ranks, start.epoch, start.call, args.state, args.next_row, deadline_ns,
                    status);
}

}  // namespace cuep::intranode

// ---------------------------------------------------------------------------------------------
// Cached dispatch, push form (cuep::intranode::dispatch_push). Each receiver's buffer holds a landing
// region laid out like its received rows: row i of recv_x lands at row i, followed by its scales.
// Pusher warps write each of this rank's tokens, one read of it for every receiver, into the
// receivers' landing rows in this call's region (rows for this rank itself go straight into recv_x)
// and count them in the receiver's per-chunk counters (SenderControl::arrivals); the other
// warps, and the pushers once done, copy each landed row into recv_x as soon as its chunk is
// complete. Pushing rather than pulling: on this fabric SM pushes move ~10% more than pulls
// (docs/performance.md, v0.4.3), and the sender's tokens need no staging copy.
namespace cuep {

// Consecutive tokens a pusher takes at a time; their rows to one receiver are consecutive landing rows.
// Measured at EP4: 1 token, 4 tokens and 2 are 506.6, 536.3 and 502.4 us (BF16, 128 SMs).
constexpr int kTokensPerRun = 2;
// The copy-out warps' pause between polls of a chunk counter, leaving issue slots and L2 to the
// pushers on the same SM (measured: 1-2 us per dispatch).
constexpr uint32_t kCopyOutPollSleepNs = 200;

// This rank's token rows, and the landing row they are pushed into: the hidden bytes, then the scales
// (FP8); rows start on a 128-byte line (LANDING_ROW_ALIGN in cuep/modes/intranode.py).
struct PushShape : TokenRows {
    int64_t row_bytes;  // push_row_bytes in cuep/modes/intranode.py
};

// Landing rows of `chunk` that peers push: the chunk's rows less those this rank writes itself
// ([self_first, self_last), straight into recv_x).
__device__ __forceinline__ uint32_t pushed_rows_in_chunk(int chunk, int chunk_rows, int num_rows, int self_first,
                                                         int self_last) {
    const int first = chunk * chunk_rows, last = min(first + chunk_rows, num_rows);
    const int own = max(0, min(last, self_last) - max(first, self_first));
    return static_cast<uint32_t>(last - first - own);
}

// What a pusher warp needs about the receivers: where this call's region starts, this rank's first
// landing row at each and each one's rows per arrival counter.
struct PushTargets {
    const uint64_t* peer_bases;
    int64_t region;
    const int32_t* first_row;
    const int* chunk_rows;
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

// Pusher warp `pusher` of `num_pushers`: runs of kTokensPerRun tokens, dealt in turn so that every
// receiver's landing rows fill front to back; each run goes to its receivers in an order staggered
// by warp, so the links share the load.
__device__ void push_tokens(const PushShape& shape, const int32_t* send_pos, const PushTargets& targets, int rank,
                            int num_ranks, int num_tokens, int pusher, int num_pushers, uint64_t call,
                            uint8_t* recv_x, float* recv_scales, int own_first_row, int lane) {
    // recv_x == nullptr: this rank's own rows are not written (see the overflow check in the kernel).
    // Lane d < num_ranks: receiver d's arrival counters for this call and its rows per counter.
    uint32_t* counters = nullptr;
    int chunk_rows = 1;
    if (lane < num_ranks) {
        counters = control_of_rank(targets.peer_bases, lane)->arrivals[call % 2];
        chunk_rows = targets.chunk_rows[lane];
    }
    RunArrivals arrivals;
    for (int first = pusher * kTokensPerRun; first < num_tokens; first += num_pushers * kTokensPerRun) {
        const int last = min(first + kTokensPerRun, num_tokens);
        for (int i = 0; i < num_ranks; ++i) {
            const int dst = (rank + 1 + pusher + i) % num_ranks;
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
                const int slot = targets.first_row[dst] + pos;
                uint8_t* landing = base + targets.region + static_cast<int64_t>(slot) * shape.row_bytes;
                copy_token(shape, token, landing, reinterpret_cast<float*>(landing + shape.hidden_bytes), lane);
                if (lane == dst)
                    arrivals.add(slot);
            }
        }
        arrivals.publish(counters, chunk_rows);
    }
}

// One warp copies landed row `row` into recv_x (and its scales into recv_scales).
__device__ __forceinline__ void copy_out_row(const PushShape& shape, const uint8_t* landing, int64_t row,
                                             uint8_t* recv_x, float* recv_scales, int lane) {
    const uint8_t* src = landing + row * shape.row_bytes;
    warp_copy<false>(recv_x + row * shape.hidden_bytes, src, shape.hidden_bytes, lane);
    const auto* scales_in = reinterpret_cast<const int32_t*>(src + shape.hidden_bytes);
    auto* scales_out = reinterpret_cast<int32_t*>(recv_scales) + row * shape.num_scales;
    for (int s = lane; s < shape.num_scales; s += kWarpSize)
        scales_out[s] = ld_volatile_global(scales_in + s);
}

}  // namespace cuep

namespace cuep::intranode {

// Cached dispatch, push form (see above). The first `push_warps` warps of each block push (at most
// kWarpsPerBlock - 1), the rest copy landed rows out from the start. send_pos: the handle's
// `[num_tokens, num_ranks]`; push_offsets, recv_info: the notify kernel's; row_bytes: one landing row
// (push_row_bytes in cuep/modes/intranode.py); region_bytes: the size of each of the two regions (the
// same on every rank); num_rows: the rows of recv_x.
__global__ void __launch_bounds__(kNumThreads, 1)
dispatch_push(const uint8_t* args_rows_x, int64_t args_rows_hidden_bytes, const float* args_rows_scales,
              int64_t args_rows_scale_token_stride, int64_t args_rows_scale_channel_stride,
              int args_rows_num_scales, const int32_t* args_send_pos, const int32_t* args_push_offsets,
              int args_num_tokens, int args_push_warps, int64_t args_row_bytes,
              const uint64_t* args_peer_bases, const int32_t* args_recv_info, int args_rank,
              int args_num_ranks, int64_t args_region_bytes, int args_num_rows, uint8_t* args_recv_x,
              float* args_recv_scales, uint64_t* args_state, int32_t* args_status_device,
              int32_t* args_status_host, int32_t* args_next_row, uint64_t args_timeout_ns) {
    const PushArgs args{{args_rows_x, args_rows_hidden_bytes, args_rows_scales, args_rows_scale_token_stride,
                         args_rows_scale_channel_stride, args_rows_num_scales},
                        args_send_pos, args_push_offsets, args_num_tokens, args_push_warps, args_row_bytes,
                        args_peer_bases, args_recv_info, args_rank, args_num_ranks, args_region_bytes, args_num_rows,
                        args_recv_x, args_recv_scales, args_state, {args_status_device, args_status_host},
                        args_next_row, args_timeout_ns};
    const Status status = args.status;
    const uint64_t* peer_bases = args.peer_bases;
    const int rank = args.rank, num_ranks = args.num_ranks;
    __shared__ int32_t rank_prefix[kMaxRanks + 1];
    __shared__ int32_t first_row[kMaxRanks];
    __shared__ int chunk_rows[kMaxRanks];
    __shared__ int confirmed[kWarpsPerBlock][kMaxRanks];
    const CallStart start = start_call(args.state, kStateEpoch, args.region_bytes);
    const uint64_t deadline_ns = globaltimer_ns() + args.timeout_ns;
    const int lane = threadIdx.x % kWarpSize, warp_in_block = threadIdx.x / kWarpSize;
    load_push_plan<true>(args.recv_info, args.push_offsets, num_ranks, rank_prefix, first_row, chunk_rows, confirmed);
    auto* own = reinterpret_cast<uint8_t*>(peer_bases[rank]);
    if (!every_landing_fits(args.push_offsets + num_ranks, num_ranks, args.row_bytes, args.region_bytes, status))
        return;
    if (blockIdx.x == 0)
        announce_call(control_of(own), peer_bases, rank, num_ranks, start.call);

    const PushShape shape{args.rows, args.row_bytes};
    // A handle from a dispatch whose num_worst_tokens was too small: the peers still push (their rows
    // fit the landing region) and this rank still awaits them, but nothing is written to recv_x.
    const int num_recv = rank_prefix[num_ranks];
    const bool fits_recv_x = num_recv <= args.num_rows;
    if (!fits_recv_x && blockIdx.x == 0 && threadIdx.x == 0)
        status.record(kStatusOverflow, num_recv);
    const int pushers_per_block = min(args.push_warps, kWarpsPerBlock - 1);
    if (warp_in_block < pushers_per_block)
        push_tokens(shape, args.send_pos, PushTargets{peer_bases, start.region, first_row, chunk_rows}, rank,
                    num_ranks, args.num_tokens, blockIdx.x * pushers_per_block + warp_in_block,
                    gridDim.x * pushers_per_block, start.call, fits_recv_x ? args.recv_x : nullptr, args.recv_scales,
                    rank_prefix[rank], lane);
    const int own_chunk = rows_per_chunk(num_recv);
    const uint32_t* pushed = control_of(own)->arrivals[start.call % 2];
    const PushedCall pushed_call{control_of(own), start.call, num_ranks};
    int* warp_confirmed = confirmed[warp_in_block];
    for_each_row_spread_over_sources<kWarpsPerBlock>(args.next_row, rank_prefix, rank, num_ranks,
                                                     [&](int source, int row, int, int lane) {
        const int chunk = row / own_chunk;
        bool arrived = true;
        if (lane == 0)
            arrived = wait_chunk_count(pushed, chunk,
                                       pushed_rows_in_chunk(chunk, own_chunk, num_recv, rank_prefix[rank],
                                                            rank_prefix[rank + 1]),
                                       warp_confirmed[source], deadline_ns, status, pushed_call, source,
                                       kPhaseIntranodePushed, kCopyOutPollSleepNs);
        if (!__shfl_sync(kFullWarpMask, arrived, 0))
            return false;
        if (fits_recv_x)
            copy_out_row(shape, own + start.region, row, args.recv_x, args.recv_scales, lane);
        return true;
    }, rank);
    finish_dispatch(peer_bases, rank, num_ranks, start.epoch, start.call, args.state, args.next_row, deadline_ns,
                    status);
}

}  // namespace cuep::intranode

// ---------------------------------------------------------------------------------------------
// Combine: one kernel. Pusher warps write each received row (its hidden vector, then its top-k
// weights) into its source's landing row combine_offsets[source] + (row - rank_prefix[source]) in this
// call's region and count it in the source's per-chunk arrival counters; reducer warps sum, in FP32,
// the copies of each of this rank's tokens as soon as they have landed. Pushers join the reduction
// when no row is left. A rank's own rows go through its landing region too: summed straight from x
// instead, they cost 6 us more at EP4 (docs/performance.md, v0.5.5), as the reducers then read them
// from HBM rather than from L2.
namespace cuep {

// Warps of each combine block that reduce from the start; the rest push first. The pushes are bound
// by NVLink and saturate it with far fewer warps than the eight left (the ceiling probe: 32 SMs), while
// a reduction that trails the arrivals is the combine's tail (measured at EP2: 4 reducers 226 us,
// 6 or 8 reducers 218-219 us; at EP4, with kTokenSlices = 4: 6 reducers 525.8 us, 8 512.2, 10 523.8).
constexpr int kReducerWarps = 8;

// Each token's reduction is split into this many slices of its hidden vector, claimed one by one,
// so the tokens whose copies arrive last are summed by several warps at once: the tail after the
// last arrival shrinks. Measured at EP4 with 8 reducers (graph replay): 1 slice 522.8 us, 2 516.7,
// 3 514.5, 4 512.2; 7 slices (one load step each) 540.7 with 6 reducers; again on v0.5.5: 4 slices
// 482.8-483.0 us, 6 484.8, 8 483.1.
constexpr int kTokenSlices = 4;

// Rows a pusher warp has landed but not yet counted: consecutive rows of one chunk of one source
// are counted together, in one release instead of one per row. Every lane holds the same state; the
// warp calls add() after a row's stores, and flush() as it claims more rows and when it stops pushing.
// (The release, red.release.sys instead of a system fence and an atomic, measured at EP4: combine
// 486.2-486.5 -> 482.4-483.2 us.)
struct PendingArrivals {
    uint32_t* counter = nullptr;
    uint32_t rows = 0;

    __device__ __forceinline__ void flush(int lane) {
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

// This rank's landing rows in this call's region and their per-chunk arrival counters.
struct LandedCopies {
    const uint8_t* rows;
    const uint32_t* arrivals;
    int chunk_rows, num_rows;
    PushedCall pushed;
};

// One warp sums slice `slice` (of kTokenSlices) of the landed copies of `token` once each has
// arrived; slice 0 also sums the top-k weights. Lane r < num_ranks looks up rank r's copy and waits
// for its chunk (keeping the newest chunk it confirmed for rank r in `confirmed[r]`), so the checks
// of all copies take one round trip. Returns false on a timeout.
__device__ bool reduce_token(int token, int slice, const LandedCopies& landed, const int32_t* send_pos,
                             const int32_t* send_offsets, int num_ranks, const CombineShape& shape,
                             const __nv_bfloat16* bias0, const __nv_bfloat16* bias1, __nv_bfloat16* combined_x,
                             float* combined_topk_weights, int* confirmed, uint64_t deadline_ns, const Status& status,
                             int lane) {
    const int pos = lane < num_ranks ? send_pos[static_cast<int64_t>(token) * num_ranks + lane] : -1;
    const int slot = pos >= 0 ? send_offsets[lane] + pos : 0;
    bool ok = true;
    if (pos >= 0) {
        const int chunk = slot / landed.chunk_rows;
        const int rows_in_chunk = min(landed.chunk_rows, landed.num_rows - chunk * landed.chunk_rows);
        ok = wait_chunk_count(landed.arrivals, chunk, static_cast<uint32_t>(rows_in_chunk), confirmed[lane],
                              deadline_ns, status, landed.pushed, lane, kPhaseIntranodeArrival);
    }
    if (!__all_sync(kFullWarpMask, ok))
        return false;
    const uint8_t* rows[kMaxRanks];
    int num_copies = 0;
    for (uint32_t holders = __ballot_sync(kFullWarpMask, pos >= 0); holders != 0; holders &= holders - 1) {
        const int copy_slot = __shfl_sync(kFullWarpMask, slot, __ffs(holders) - 1);
        rows[num_copies++] = landed.rows + static_cast<int64_t>(copy_slot) * shape.landing_row_bytes;
    }
    const int num_vectors = static_cast<int>(shape.hidden_bytes / sizeof(int4));
    const int64_t token_vectors = static_cast<int64_t>(token) * num_vectors;
    auto* out = reinterpret_cast<int4*>(combined_x) + token_vectors;
    const int slice_vectors = (num_vectors + kTokenSlices - 1) / kTokenSlices;
    const uint64_t read_once = evict_first_policy();
    const int begin = slice * slice_vectors, end = min(num_vectors, begin + slice_vectors);
    for (int first = begin + lane; first < end; first += kReduceUnroll * kWarpSize) {
        float acc[kReduceUnroll][kBf16PerVector] = {};
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
#pragma unroll
        for (int u = 0; u < kReduceUnroll; ++u) {
            const int v = first + u * kWarpSize;
            if (v >= end)
                continue;
            if (bias0 != nullptr)
                accumulate_bf16x8(acc[u], ld_nc_global(reinterpret_cast<const int4*>(bias0) + token_vectors + v));
            if (bias1 != nullptr)
                accumulate_bf16x8(acc[u], ld_nc_global(reinterpret_cast<const int4*>(bias1) + token_vectors + v));
            st_global(out + v, floats_to_bf16x8(acc[u]), read_once);
        }
    }
    if (slice == 0 && combined_topk_weights != nullptr && lane < shape.num_topk) {
        float sum = 0.0f;
        for (int c = 0; c < num_copies; ++c)
            sum += reinterpret_cast<const volatile float*>(rows[c] + shape.hidden_bytes)[lane];
        combined_topk_weights[static_cast<int64_t>(token) * shape.num_topk + lane] = sum;
    }
    return true;
}

}  // namespace cuep

namespace cuep::intranode {

// next_row[0, num_ranks): the pushers' per-source row counters; next_row[num_ranks]: the reducers'
// counter of token slices. recv_info[1] is this rank's landing row count (copies of its tokens).
// combine_offsets, send_offsets: see the notify kernel; send_pos: the handle's; x: `[num received
// rows, hidden]` bf16; topk_weights: `[num received rows, num_topk]` or null; landing_row_bytes: one
// landing row (landing_row_bytes in cuep/modes/intranode.py); region_bytes: the size of each of the
// two regions; bias0, bias1: `[num_tokens, hidden]` or null; combined_x: `[num_tokens, hidden]`;
// combined_topk_weights: `[num_tokens, num_topk]` or null.
__global__ void __launch_bounds__(kNumThreads, 1)
combine(const uint64_t* args_peer_bases, const int32_t* args_recv_info,
        const int32_t* args_combine_offsets, const int32_t* args_send_pos,
        const int32_t* args_send_offsets, int args_rank, int args_num_ranks, int args_num_tokens,
        const uint8_t* args_x, int64_t args_hidden_bytes, const float* args_topk_weights,
        int args_num_topk, int64_t args_landing_row_bytes, int64_t args_region_bytes,
        const __nv_bfloat16* args_bias0, const __nv_bfloat16* args_bias1,
        __nv_bfloat16* args_combined_x, float* args_combined_topk_weights, uint64_t* args_state,
        int32_t* args_status_device, int32_t* args_status_host, int32_t* args_next_row,
        uint64_t args_timeout_ns) {
    const CombineArgs args{args_peer_bases, args_recv_info, args_combine_offsets, args_send_pos, args_send_offsets,
                           args_rank, args_num_ranks, args_num_tokens, args_x, args_hidden_bytes, args_topk_weights,
                           args_num_topk, args_landing_row_bytes, args_region_bytes, args_bias0, args_bias1,
                           args_combined_x, args_combined_topk_weights, args_state,
                           {args_status_device, args_status_host}, args_next_row, args_timeout_ns};
    const Status status = args.status;
    const uint64_t* peer_bases = args.peer_bases;
    const int32_t* combine_offsets = args.combine_offsets;
    const int rank = args.rank, num_ranks = args.num_ranks, num_topk = args.num_topk;
    const int64_t hidden_bytes = args.hidden_bytes, landing_row_bytes = args.landing_row_bytes;
    __shared__ int32_t rank_prefix[kMaxRanks + 1];
    __shared__ int landing_chunks[kMaxRanks];
    __shared__ int confirmed[kWarpsPerBlock][kMaxRanks];
    const CallStart start = start_call(args.state, kStateCombineEpoch, args.region_bytes);
    const uint64_t call = start.call;
    const int64_t region = start.region;
    const uint64_t deadline_ns = globaltimer_ns() + args.timeout_ns;
    const int lane = threadIdx.x % kWarpSize, warp_in_block = threadIdx.x / kWarpSize;
    auto* own = reinterpret_cast<uint8_t*>(peer_bases[rank]);
    load_push_plan<false>(args.recv_info, combine_offsets, num_ranks, rank_prefix, nullptr, landing_chunks, confirmed);
    if (!every_landing_fits(combine_offsets + num_ranks, num_ranks, landing_row_bytes, args.region_bytes, status))
        return;
    if (blockIdx.x == 0)
        announce_call(control_of(own), peer_bases, rank, num_ranks, call);

    const CombineShape shape{hidden_bytes, num_topk, landing_row_bytes};
    if (warp_in_block >= kReducerWarps) {
        PendingArrivals pending;
        const int pushing_warps = static_cast<int>(gridDim.x) * (kWarpsPerBlock - kReducerWarps);
        const auto publish_previous_claim = [&](int lane) { pending.flush(lane); };
        for_each_row_spread_over_sources<kWarpsPerBlock>(args.next_row, rank_prefix, rank, num_ranks,
                                                         [&](int source, int row, int j, int lane) {
            const int slot = combine_offsets[source] + j;
            auto* base = reinterpret_cast<uint8_t*>(peer_bases[source]);
            uint8_t* landing = base + region + static_cast<int64_t>(slot) * landing_row_bytes;
            warp_copy(landing, args.x + row * hidden_bytes, hidden_bytes, lane);
            if (args.topk_weights != nullptr && lane < num_topk)
                reinterpret_cast<float*>(landing + hidden_bytes)[lane] =
                    args.topk_weights[static_cast<int64_t>(row) * num_topk + lane];
            pending.add(control_of(base)->arrivals[call % 2] + slot / landing_chunks[source], lane);
            return true;
        }, -1, pushing_warps, publish_previous_claim);
        pending.flush(lane);
    }
    const int num_copies_total = args.recv_info[1];
    const LandedCopies landed{own + region, control_of(own)->arrivals[call % 2], rows_per_chunk(num_copies_total),
                              num_copies_total, PushedCall{control_of(own), call, num_ranks}};
    while (true) {
        int item = 0;
        if (lane == 0)
            item = atomicAdd(args.next_row + num_ranks, 1);
        item = __shfl_sync(kFullWarpMask, item, 0);
        const int token = item / kTokenSlices;
        if (token >= args.num_tokens)
            break;
        if (!reduce_token(token, item % kTokenSlices, landed, args.send_pos, args.send_offsets, num_ranks, shape,
                          args.bias0, args.bias1, args.combined_x, args.combined_topk_weights, confirmed[warp_in_block],
                          deadline_ns, status, lane))
            break;
    }
    if (last_block_finished(args.state, args.next_row, num_ranks)) {
        every_peer_started(control_of(own), num_ranks, call, deadline_ns, status);
        args.state[kStateCombineEpoch] = start.epoch;
    }
}

}  // namespace cuep::intranode
