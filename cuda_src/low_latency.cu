// Low-latency (decode) dispatch and combine through NVSHMEM, for any number of ranks.
//
// Each rank's low-latency region (NVSHMEM symmetric memory; cuep/modes/low_latency.py lays it out)
// holds kNumBuffers buffers. Calls are numbered on the device (1, 2, ... equal on every rank; see
// "Call order" below) and call `seq` uses buffer seq % kNumBuffers, so which buffer a call uses, and
// what it waits for, follow from device state: a CUDA graph that replays a call, a hook's receive
// replayed from another graph than its send, or eager calls between replays all keep counting. Every
// flag is a uint64 that only grows: call `seq` raises its flags to `seq`, so nothing is ever reset.
//
// Dispatch (rank s sends its T tokens; every rank holds L = E / R experts):
//   send: s lays out its own tokens (map_tokens): each choice's row among s's tokens of its expert,
//         and each expert's count. It publishes its routing table to every rank (T, the counts of
//         that rank's experts, and each choice as expert and row), each block the rows of its own
//         tokens, and writes each token once per destination *rank* (not per expert), FP8-quantised
//         or BF16, into slot (s, t) of that rank's buffer; a slot's flag rises once the token's data
//         and its rows are out.
//   recv: rank r reads every source's token count and its experts' counts, from which each local
//         expert's rows follow in (source rank, source token) order, and fans each arrived token out
//         into the rows its choices name.
// Combine (the reverse; rank r holds the expert outputs x[L, R * T_max, H]):
//   send: every source s publishes its top-k weights to every rank; r then sums, in FP32, the
//         weighted outputs of its local experts for each (s, t) it received and writes that one
//         BF16 partial into slot (r, t) of s's buffer, so each (token, rank) pair crosses once. The
//         send waits for no peer beyond a bounded look (combine_send says how long): a pair of
//         several rows whose weights have not arrived by then goes as its rows, unweighted, into
//         choice slots (t, k) of s (direct peers; a put peer's pair waits for the weights).
//   recv: s adds, in FP32, the partials of every rank that held one of its token's experts (or their
//         rows, weighted here).
// Peers reachable by load/store (nvshmem_ptr) get direct stores then a release store of the flag;
// other peers, or every peer when the put path is forced, get an NVSHMEM put then its signal
// (cuep/network.cuh) from a staging copy in this rank's buffer. Tables (routing, weights) need no
// flag on the direct path: each 64-bit word carries a tag of its call number beside the value, so it
// shows itself when it lands.
//
// The device helpers are static: this family is compiled relocatable (it links NVSHMEM), and there an
// external __device__ function is also compiled as a stand-alone copy that the link then drops.
// combine_token stays external: as a static function the combine kernel's code changes.
//
// Every wait is bounded (cuep/sync.cuh): a timed-out wait records the peer and phase in `status`
// (mirrored to pinned host memory, so no copy is enqueued per call) and every later wait of the
// launch gives up at once; the host raises PeerTimeoutError. In shrink mode (Buffer(enable_shrink=
// True)) it masks the peer instead (MaskedStatus): this rank sends it nothing and waits for it no
// more, the call completes without it, and the other ranks are told at once, so that every live rank
// skips it too.
//
// Options: a combine's partials may travel as LogFMT (cuep/logfmt.cuh) instead of BF16; a call given
// wait statistics adds, per peer, the nanoseconds its receive waited for that peer's messages.
//
// Values the host shares with these kernels (block size, top-k bound, phases, trace points, the
// sequence state's size) are defined once in cuep/kernels/low_latency.py and arrive as CUEP_* macros;
// the argument structs are mirrored there field for field (tests/test_kernel_args.py checks them).

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
#include <cuep/fp8.cuh>
#include <cuep/logfmt.cuh>
#include <cuep/network.cuh>
#include <cuep/ptx.cuh>
#include <cuep/sync.cuh>
#include <cuep/trace.cuh>

namespace cuep {

constexpr int kNumThreads = CUEP_NUM_THREADS;
// The hooks' build (cuep.kernels.low_latency.spec(receive_only=True)): the same two kernels, under the same
// names, with the receive alone. A hook's receive launched from the whole build ran its path among the
// send's code, whose lines a launch after other work (an expert's GEMM) fetches from memory one by one;
// a build of the receive alone keeps the path's instructions few and together. Profilers, DeepEP's test
// among them, see one dispatch and one combine kernel, as with DeepEP's. Its launches have the receive
// phase alone (cuep/modes/low_latency.py's Run is the one place that picks a build).
#ifndef CUEP_RECEIVE_ONLY
#define CUEP_RECEIVE_ONLY 0
#endif
constexpr bool kReceiveOnly = CUEP_RECEIVE_ONLY != 0;
constexpr int kMaxTopk = CUEP_MAX_TOPK;  // experts per token; a warp's lanes hold one each
constexpr int kMaxTokensPerRank = CUEP_MAX_TOKENS_PER_RANK;  // the largest num_max_dispatch_tokens_per_rank
static_assert(kMaxTopk <= kWarpSize, "ranks_holding_token gives each choice a lane");
constexpr int kBytesPerVector = 16;
// The FP8 send quantises a unit of two vectors (16 channels) per lane into one 16-byte store, so a
// warp covers four whole scale blocks and stores their scales as one 16-byte vector too: NVLink
// carries full vectors only, no 8- or 4-byte stragglers.
constexpr int kVectorsPerUnit = 2;
constexpr int kChannelsPerUnit = kVectorsPerUnit * kBf16PerVector;
constexpr int kLanesPerScaleBlock = kScaleBlock / kChannelsPerUnit;
constexpr int kScaleBlocksPerWarp = kWarpSize / kLanesPerScaleBlock;
static_assert(kScaleBlock % kChannelsPerUnit == 0 && kScaleBlocksPerWarp == 4,
              "a warp's scales go out as one 16-byte vector (store_fp8_unit)");
constexpr int kScalesPerUe8m0Word = CUEP_UE8M0_SCALES_PER_WORD;  // UE8M0 exponents packed in one int32
constexpr float kMinAmax = 1e-4f;        // keeps the scale finite for an all-zero block
// Routing table: [num_tokens, 0, 0, 0, expert counts, routed words] (count_words says more); even sections
// keep every token's words 16-byte aligned.
constexpr int kRoutingHeaderWords = CUEP_ROUTING_HEADER_WORDS;
static_assert(kRoutingHeaderWords % 2 == 0, "the sections of a routing table start 16-byte aligned");
constexpr int kIdsAtOnce = 8;            // the caller's top-k ids a sender loads before laying out any (map_tokens)
// Loads a thread issues before its first store (batched_copy in cuep/copy.cuh says why); sized to the
// 128 registers a thread has at 512 threads (more spills).
constexpr int kCopyBatch = 8;            // receive copy: 16-byte vectors per lane (FP8 7168: 14, two batches)
constexpr int kTableBatch = 16;          // routing / weight tables: words per thread (T=128, top-8: 9)
constexpr int kSendBatch = 4;            // dispatch send: 16-byte vectors of x per thread (7168: one round)
constexpr int kGroupThreads = 128;       // combine send: one warp group per (source, token) pair
constexpr int kGroupsPerBlock = kNumThreads / kGroupThreads;
constexpr int kPartialBatch = 7;         // combine send: vectors per thread summed at once (7168: 7)
// combine send, LogFMT: a warp group codes one stride of a partial (kPartialBatch vectors a thread) into its
// stage, then copies it out (LogFmtStage).
constexpr int kStageBlocks = kPartialBatch * kGroupThreads / kLogFmtLanes;
using PartialStage = LogFmtStage<kStageBlocks>;
static_assert(kPartialBatch * kGroupThreads % kLogFmtLanes == 0, "a stride of a partial holds whole LogFMT blocks");
static_assert(kGroupsPerBlock * sizeof(PartialStage) <= 40 * 1024,
              "the combine send's stages, with the kernel's other shared memory, stay within 48 KB of static shared memory");
constexpr int kSumBatch = 2;             // combine receive: block-wide strides summed at once (7168: 2)
constexpr int kPartialsAtOnce = 4;       // combine receive: partials loaded before adding
constexpr int kChoiceSlots = CUEP_CHOICE_SLOTS;  // combine: rows of a token sent one by one (its top-k bound)
// A weights-table word's value for a choice the combine's ids no longer route (-1 since the dispatch): a NaN of
// one bit pattern (all ones), so that a choice of weight 0 still counts as routed. A routed weight of those
// bits goes as another NaN (weight_word).
constexpr uint32_t kUnroutedWeight = 0xFFFFFFFFu;

// A launch's phases (a bit set): both for a whole call, one of them for a hook's send and receive.
constexpr int kSendPhase = CUEP_SEND_PHASE;
constexpr int kRecvPhase = CUEP_RECV_PHASE;
static_assert((kSendPhase & kRecvPhase) == 0, "the phases are separate bits");

// Trace points (trace.cuh): what each is, and what cuep.bench prints for it, is in
// cuep/kernels/low_latency.py (DISPATCH_TRACE, COMBINE_TRACE). Dispatch:
constexpr int kTraceStart = CUEP_TRACE_START;
constexpr int kTraceTokensMapped = CUEP_TRACE_TOKENS_MAPPED;      // this rank's tokens laid out (map_tokens)
constexpr int kTraceTablePublished = CUEP_TRACE_TABLE_PUBLISHED;  // routing rows (or weight tables) out
constexpr int kTraceTokensStored = CUEP_TRACE_TOKENS_STORED;      // token stores issued (before their flags)
constexpr int kTraceSendDone = CUEP_TRACE_SEND_DONE;
constexpr int kTraceTablesRead = CUEP_TRACE_TABLES_READ;          // every source's token count and expert counts
constexpr int kTraceLaidOut = CUEP_TRACE_LAID_OUT;                // the call laid out
constexpr int kTraceFlagsReleased = CUEP_TRACE_FLAGS_RELEASED;    // latest token flag release that returned
constexpr int kTraceLastRowFlag = CUEP_TRACE_LAST_ROW_FLAG;       // latest token flag a receive waited for
constexpr int kTraceRowsCopied = CUEP_TRACE_ROWS_COPIED;
constexpr int kTraceEnd = CUEP_TRACE_END;
constexpr int kTraceEntry = CUEP_TRACE_ENTRY;  // the block entered the kernel (both calls)
constexpr int kTraceExit = CUEP_TRACE_EXIT;    // thread 0 leaves, the block counted done (both calls; other
                                               // warps of the block may still run)
// Combine (kTraceStart, kTraceTablePublished, kTraceEnd as above):
constexpr int kTraceWeightsReady = CUEP_TRACE_WEIGHTS_READY;      // latest pair with rows and weights ready
constexpr int kTracePartialStored = CUEP_TRACE_PARTIAL_STORED;    // latest partial stored (before its flag)
constexpr int kTracePartialFlagged = CUEP_TRACE_PARTIAL_FLAGGED;
constexpr int kTracePartialsArrived = CUEP_TRACE_PARTIALS_ARRIVED;  // latest token whose partials all came
constexpr int kTraceTokensSummed = CUEP_TRACE_TOKENS_SUMMED;

// Named barriers of the fused dispatch's two teams (0 is the whole block's).
constexpr int kSenderBarrier = 1;
constexpr int kReceiverBarrier = 2;

// Words of the per-Buffer sequence state (device memory, not symmetric; the host allocates
// kSeqWords of them, zeroed).
constexpr int kNumBuffers = CUEP_NUM_BUFFERS;
constexpr int kSeqLatest = CUEP_SEQ_LATEST;      // number of the newest call sent
constexpr int kSeqReceived = CUEP_SEQ_RECEIVED;  // [kNumBuffers]: number of the newest call received on each buffer
static_assert(kSeqLatest == 0 && kSeqReceived == 1, "the words below follow these two");
constexpr int kSeqBlocksDone = kSeqReceived + kNumBuffers;  // [kNumBuffers]: blocks of the running launch that finished
constexpr int kSeqTablesDone = kSeqBlocksDone + kNumBuffers;  // [kNumBuffers]: routing tables the running send published
constexpr int kSeqTablesSent = kSeqTablesDone + kNumBuffers;  // newest dispatch whose routing tables all went out
constexpr int kSeqRowsPublished = kSeqTablesSent + 1;  // [kNumBuffers], shrink mode: blocks whose routing rows went out
constexpr int kSeqWords = CUEP_SEQ_WORDS;
static_assert(kSeqRowsPublished + kNumBuffers == kSeqWords, "SEQ_WORDS is the sequence state's size");

// Which rule of the call order a call broke (status word kStatusCallOrder; cuep/kernels/status.py names them).
constexpr int kCallOrderInFlight = CUEP_CALL_ORDER_IN_FLIGHT;
constexpr int kCallOrderUnsent = CUEP_CALL_ORDER_UNSENT;
constexpr int kCallOrderReceived = CUEP_CALL_ORDER_RECEIVED;
constexpr int kCallOrderOvertaken = CUEP_CALL_ORDER_OVERTAKEN;
constexpr int kCallOrderHandleBusy = CUEP_CALL_ORDER_HANDLE_BUSY;

// ---------------------------------------------------------------------------------------------
// Shrink mode

// Values of a mask entry (MaskedStatus::masked): 0 live, else masked, and whether this rank still has
// to tell the other ranks (masked by hand) or has told them (or was told).
constexpr int kMaskedToTell = CUEP_MASKED_TO_TELL;
constexpr int kMaskedTold = CUEP_MASKED_TOLD;

// The status's cold paths, out of line and with scalar arguments (so that no caller's state has to live
// in memory for the call). Inlined at every wait, their code, NVSHMEM's puts among it, lay between the
// hot paths' instructions: a launch that follows other work fetches its instructions from memory, and a
// receive then waited for lines it never ran. MaskedStatus's members below say what each does.
static __device__ __noinline__ void record_broken_call_order(int32_t* device, int32_t* host, int32_t rule, uint64_t seq,
                                                      int32_t peer) {
    if (atomicCAS(device + kStatusCallOrder, 0, rule) != 0)
        return;
    const auto call = static_cast<int32_t>(seq & 0x7fffffffu);
    device[kStatusCallOrderCall] = host[kStatusCallOrderCall] = call;
    device[kStatusCallOrderPeer] = host[kStatusCallOrderPeer] = peer;
    atomicExch(device + kStatusTimedOut, 1);
    __threadfence_system();
    *reinterpret_cast<volatile int32_t*>(host + kStatusCallOrder) = rule;
    __threadfence_system();
}

static __device__ __noinline__ void tell_peers_masked(int32_t* masked, int rank, int num_ranks, int peer) {
    const auto is_masked = [&](int pe) { return ld_volatile_global(masked + pe) != 0; };
    int alive = 0;
    for (int pe = 0; pe < num_ranks; ++pe)
        alive += !is_masked(pe);
    if (is_masked(rank) || 2 * alive < num_ranks)
        return;
    bool put = false;
    for (int pe = 0; pe < num_ranks; ++pe) {
        if (pe == rank || (pe != peer && is_masked(pe)))
            continue;
        if (auto* direct = static_cast<int32_t*>(nvshmem_ptr(masked + peer, pe))) {
            st_relaxed_sys_global(direct, kMaskedTold);
        } else if (pe != peer) {
            nvshmem_int_p(masked + peer, kMaskedTold, pe);
            put = true;
        }
    }
    if (put)
        nvshmem_quiet();  // delivered before the kernel ends, so before any clean of the masks
    masked[peer] = kMaskedTold;
}

// The family's status: Status's words and, in shrink mode (a Buffer made with enable_shrink), this
// rank's mask of its peers. There a wait that times out does not fail the call: it masks its peer and
// tells the other ranks at once; from then on every wait on that peer gives up at once while the
// waits on the others go on, and this rank sends the peer nothing more.
struct MaskedStatus {
    int32_t* device;
    int32_t* host;
    int32_t* masked;  // shrink mode: [num_ranks] (symmetric): 0, kMaskedToTell or kMaskedTold; else nullptr
    int rank, num_ranks;

    __device__ Status plain() const { return Status{device, host}; }
    __device__ void record(int word, int32_t value) const { plain().record(word, value); }
    __device__ void record_bad_expert_id(int64_t id, int num_experts) const {
        plain().record_bad_expert_id(id, num_experts, kBadIdsLowLatency);
    }

    __device__ bool is_masked(int peer) const { return masked != nullptr && ld_volatile_global(masked + peer) != 0; }

    __device__ bool broke_call_order() const { return ld_volatile_global(device + kStatusCallOrder) != 0; }

    // wait_until's policy (cuep/sync.cuh). A broken call order ends every wait at once, in shrink mode too.
    __device__ bool gives_up_on(int peer) const {
        return masked != nullptr ? is_masked(peer) || broke_call_order() : plain().timed_out();
    }

    // The call `seq` broke `rule` of the call order (seen from `peer`'s messages, or -1). The first record
    // wins; the device's timeout word is set too (not its mirror), so that every wait of the launch ends
    // at once, and the host raises CallOrderError, not a timeout.
    __device__ void break_call_order(int32_t rule, uint64_t seq, int32_t peer) const {
        record_broken_call_order(device, host, rule, seq, peer);
    }

    __device__ void time_out(int32_t peer, int32_t phase) const {
        if (masked == nullptr)
            plain().record_timeout(peer, phase);
        else if (atomicCAS(masked + peer, 0, kMaskedToTell) == 0)
            tell(peer);
    }

    // Tell every other live rank that `peer` is masked, so that they stop waiting for it now. The peer
    // is told too where this GPU stores to it, so that it learns it is out; one reached only by network
    // puts is not written (its process may be gone, and a put to it could break the connection for
    // everyone). A rank tells nothing when its peers masked it, or when it sees fewer than half the
    // ranks alive: then it may be the one that cannot hear the others.
    __device__ void tell(int peer) const { tell_peers_masked(masked, rank, num_ranks, peer); }

    // This status without the mask: its waits stop only at the deadline, and a timeout fails the call.
    __device__ MaskedStatus unmasked() const { return MaskedStatus{device, host, nullptr, rank, num_ranks}; }
};

// ---------------------------------------------------------------------------------------------
// Launch bookkeeping

// ---------------------------------------------------------------------------------------------
// Call order
//
// A launch with the send phase numbers a new call: the newest number sent, plus one. A receive-only
// launch (a hook) completes the call its send recorded in the call's own record (`call_record`, a
// word of the dispatch's allocation that the host keeps with the handle), so a hook finds its call
// whatever was captured or replayed in between.
//
// The rules (docs/low-latency.md, "Low-latency call order"): every rank makes the same low-latency calls in
// the same order, and a rank sends call n only once it has received every call up to n - 2 (at most
// two results in flight, DeepEP's rule). Under them no send ever waits for a peer, and kNumBuffers =
// 4 buffers are enough: this rank's send of n runs after its receive of n - 2 (stream order), which
// waited for every peer's send of n - 2 (a dispatch's routing table, a combine's weights flag), which
// each peer ran after its own receive of n - 4, the last call on n's buffer. Each rank checks its own
// rule when it sends (kCallOrderInFlight) and when it receives (kCallOrderUnsent, kCallOrderReceived),
// and a receiver that meets a flag or tag newer than its call reports the peer (kCallOrderOvertaken):
// each an error at once, never a wait that times out or data overwritten unseen.
__device__ __forceinline__ int buffer_of(uint64_t seq) { return static_cast<int>(seq % kNumBuffers); }

// The newest call received on each buffer (kSeqReceived), as one launch reads them.
struct ReceivedCalls {
    static_assert(kNumBuffers == 4, "one word a buffer below");
    uint64_t buffer0, buffer1, buffer2, buffer3;

    // The newest call received on call's buffer (selected: an indexed array would live in local memory).
    __device__ __forceinline__ uint64_t on_buffer_of(uint64_t call) const {
        const int b = buffer_of(call);
        return b < 2 ? (b == 0 ? buffer0 : buffer1) : (b == 2 ? buffer2 : buffer3);
    }
};

// Thread 0 of a block: the call this launch makes or completes, and the rule it breaks (0: none). Every
// word it may need is loaded at once, before the call's number is known (which buffer's word counts
// depends on it): a launch right after other work finds them cold, and each dependent read would wait
// in turn.
template <typename Args>
__device__ __forceinline__ int32_t check_call(const Args& a, uint64_t& seq) {
    const bool sends = a.phases & kSendPhase;
    // The record is the call's own allocation, unwritten until its send ran.
    const uint64_t recorded = ld_volatile_global(a.call_record);
    const uint64_t latest = ld_volatile_global(a.seq_state + kSeqLatest);
    const uint64_t* words = a.seq_state + kSeqReceived;
    const ReceivedCalls received{ld_volatile_global(words), ld_volatile_global(words + 1), ld_volatile_global(words + 2),
                                 ld_volatile_global(words + 3)};
    int32_t broken = 0;
    if (sends) {
        seq = latest + 1;
        // Every call up to seq - 2 received (the sends before this one checked the older ones).
        if ((seq > 2 && received.on_buffer_of(seq - 2) < seq - 2) ||
            (seq > 3 && received.on_buffer_of(seq - 3) < seq - 3))
            broken = kCallOrderInFlight;
        else if (handle_busy(a, recorded, received))  // a combine's own rule (by argument type: below the structs)
            broken = kCallOrderHandleBusy;
    } else {
        // A recorded number that is not one of the two newest sends (a pending receive's, under the
        // rules) is no call of this handle's.
        seq = recorded;
        if (seq == 0 || seq > latest || seq + 1 < latest)
            broken = kCallOrderUnsent;
        else if (received.on_buffer_of(seq) >= seq)
            broken = kCallOrderReceived;
    }
    return broken;
}

// The call this launch makes or completes, and whether it may go on: decided by each block's thread 0
// (blocks read the same words, which nothing in the launch writes) and shared with the block, so the
// block's threads take one branch; block 0 records a broken rule.
template <typename Args>
__device__ __forceinline__ bool start_call(const Args& a, uint64_t& seq) {
    __shared__ uint64_t block_seq;
    __shared__ int32_t block_broken;
    if (threadIdx.x == 0) {
        block_broken = check_call(a, block_seq);
        fence_acq_rel_gpu();  // the reads above, before this block counts itself done (finish_launch)
        if (block_broken != 0 && blockIdx.x == 0)
            a.status.break_call_order(block_broken, block_seq, -1);
    }
    __syncthreads();
    seq = block_seq;
    return block_broken == 0;
}

// The launch's arguments with the buffer pointers moved to call seq's buffer (the host passes buffer 0's).
template <typename Byte>
__device__ __forceinline__ Byte* in_buffer(Byte* pointer, int64_t offset) {
    return reinterpret_cast<Byte*>(reinterpret_cast<uintptr_t>(pointer) + offset);
}

// Shrink mode, by the last thread of a launch: tell the other ranks of each peer masked here but not
// told yet (Buffer.low_latency_update_mask_buffer; a wait that times out tells at once).
__device__ __forceinline__ void tell_pending_masks(const MaskedStatus& status) {
    if (status.masked == nullptr)
        return;
    for (int peer = 0; peer < status.num_ranks; ++peer)
        if (ld_volatile_global(status.masked + peer) == kMaskedToTell)
            status.tell(peer);
}

// The last block of a launch to count itself (last_block_counted: after every block's reads of the
// state, start_call; only this GPU reads it, in later launches) publishes a send's call number, in the
// sequence state and in the call's record, and a receive's, and, in shrink mode, tells the other ranks
// of masks set by hand. A send refused by the call order counts as made, so that the ranks' numbers
// stay equal, but records no call (record_call): its receive is refused at once instead of waiting for
// data this rank never sent.
template <typename Args>
__device__ __forceinline__ void finish_launch(const Args& a, uint64_t seq, bool in_order) {
    if (!last_block_counted(a.seq_state + kSeqBlocksDone, a.buffer))
        return;
    a.seq_state[kSeqBlocksDone + a.buffer] = 0;
    if (a.phases & kSendPhase) {
        a.seq_state[kSeqLatest] = seq;
        record_call(a, seq, in_order);
    }
    if ((a.phases & kRecvPhase) && in_order)  // a refused receive's number is no call it completed
        a.seq_state[kSeqReceived + a.buffer] = seq;
    tell_pending_masks(a.status);
}

// Shrink mode: whether the peers masked this rank, which then sits the call out and reports it, until
// every rank cleans the masks. Block-uniform: a mask may land while the block's threads read it.
template <typename Args>
__device__ __forceinline__ bool sits_out(const Args& a) {
    if (a.status.masked == nullptr || !__syncthreads_or(a.status.is_masked(a.rank)))
        return false;
    if (threadIdx.x == 0)
        a.status.record(kStatusSelfMasked, 1);
    return true;
}

// Adds the nanoseconds since `started` to peer's entry of a call's wait statistics (if it has them).
__device__ __forceinline__ void add_wait(int64_t* wait_stats, int peer, uint64_t started) {
    if (wait_stats != nullptr)
        atomicAdd(reinterpret_cast<unsigned long long*>(wait_stats + peer),
                  static_cast<unsigned long long>(globaltimer_ns() - started));
}

// When some peer takes puts, a dispatch's token data waits until the whole tables have gone out. Every
// receiver needs every table before it can lay out a single row, and a table stored once the tokens
// flood the links queues behind them (measured: tables landing ~10 us into a 21 us dispatch); sent
// first, they land in a few microseconds and the receivers' layout overlaps the flood. (Direct peers
// need no such wait: each block's routing rows lead its own tokens.) By a team's leader, after the
// team stored one table (or, on the put path, its put was issued).
__device__ __forceinline__ void count_table_sent(uint64_t* seq_state, int buffer, int num_ranks, uint64_t seq) {
    auto* done = reinterpret_cast<unsigned long long*>(seq_state + kSeqTablesDone + buffer);
    if (atomicAdd(done, 1ull) == static_cast<unsigned long long>(num_ranks) - 1) {
        *done = 0;
        atomicMax(reinterpret_cast<unsigned long long*>(seq_state + kSeqTablesSent), seq);
    }
}

// The tag of call `seq`: seq mod (2^32 - 1), plus 1, so never 0 and a word no call has written yet
// (zeroed memory) never passes for one. A word left unwritten for a multiple of 2^32 - 1 calls could;
// a receiver reads only the words its source wrote this call, so that would take a token slot idle
// for days and then read a few nanoseconds before its new value lands.
__device__ __forceinline__ uint32_t word_tag(uint64_t seq) {
    constexpr uint64_t kModulus = 0xffffffffull;
    uint64_t folded = (seq & kModulus) + (seq >> 32);  // 2^32 = 1 (mod 2^32 - 1)
    folded = (folded & kModulus) + (folded >> 32);
    if (folded >= kModulus)
        folded -= kModulus;
    return static_cast<uint32_t>(folded) + 1;
}

// A table word: the value in the low half, its call's tag in the high half. An aligned 64-bit store
// lands whole, so a receiver that sees the tag sees the value.
__device__ __forceinline__ uint64_t tagged_word(uint64_t seq, uint32_t value) {
    return (static_cast<uint64_t>(word_tag(seq)) << 32) | value;
}

__device__ __forceinline__ bool has_tag(uint64_t word, uint64_t seq) {
    return static_cast<uint32_t>(word >> 32) == word_tag(seq);
}

// Whether a table word carries the tag of a call after seq: the peer's next call on this buffer
// overtook the one awaited (a broken call order; tags wrap after 2^32 - 1 calls, beyond any run).
__device__ __forceinline__ bool has_newer_tag(uint64_t word, uint64_t seq) {
    const auto tag = static_cast<uint32_t>(word >> 32);
    return tag != 0 && static_cast<int32_t>(tag - word_tag(seq)) > 0;
}

// Table word `word` (already loaded once into `value`) once it carries seq's tag; false if the wait
// gave up (wait_until, as every wait of this family) or met a newer call's tag (reported).
__device__ __forceinline__ bool wait_for_word(const uint64_t* word, uint64_t seq, uint64_t deadline_ns,
                                              const MaskedStatus& status, int peer, int phase, uint64_t& value) {
    return wait_until([&] { return has_tag(value, seq); },
                      [&] {
                          if (has_newer_tag(value, seq))
                              status.break_call_order(kCallOrderOvertaken, seq, peer);
                          value = ld_volatile_global(word);
                      },
                      deadline_ns, status, peer, phase);
}

// Values of the flags of a wait_for_call_on already acquired before it (a receive reads them beside its
// other first loads); a flag not read early is loaded by the wait's first poll as any other.
struct FlagsRead {
    bool first_read = false, second_read = false;
    uint64_t first = 0, second = 0;
};

// Wait until `peer`'s flag `first`, or its flag `second` where given, reaches call seq (acquire): 1 or 2,
// which one did; 0 if the wait gave up, or if a flag went past seq: a newer call of the peer overtook
// this one (reported; its data may be overwritten). The first poll takes the values in `early`.
__device__ __forceinline__ int wait_for_call_on(const uint64_t* first, const uint64_t* second, uint64_t seq,
                                                uint64_t deadline_ns, const MaskedStatus& status, int peer, int phase,
                                                FlagsRead early = FlagsRead{}) {
    uint64_t first_seen = 0, second_seen = 0;
    const bool came = wait_until(
        [&] {
            first_seen = early.first_read ? early.first : ld_acquire_sys_global(first);
            // The second flag only where the first has not come: acquires do not overlap.
            second_seen = second == nullptr || first_seen >= seq ? 0
                          : early.second_read                    ? early.second
                                                                 : ld_acquire_sys_global(second);
            early = FlagsRead{};
            return first_seen >= seq || second_seen >= seq;
        },
        [] {}, deadline_ns, status, peer, phase);
    if (!came)
        return 0;
    if (first_seen > seq || second_seen > seq) {
        status.break_call_order(kCallOrderOvertaken, seq, peer);
        return 0;
    }
    return first_seen == seq ? 1 : 2;
}

// Wait until `peer`'s flag reaches call seq (wait_for_call_on, one flag); false if it did not.
__device__ __forceinline__ bool wait_for_call(const uint64_t* flag, uint64_t seq, uint64_t deadline_ns,
                                              const MaskedStatus& status, int peer, int phase) {
    return wait_for_call_on(flag, nullptr, seq, deadline_ns, status, peer, phase) != 0;
}

// Table word `word` (`value`, without its tag) once it lands; false if it never came (the call is void
// then). One load, and the spin only where the word is not there yet.
__device__ __forceinline__ bool read_word(const uint64_t* word, uint64_t seq, uint64_t deadline_ns,
                                          const MaskedStatus& status, int peer, int phase, uint32_t& value) {
    uint64_t loaded = ld_volatile_global(word);
    if (!has_tag(loaded, seq) && !wait_for_word(word, seq, deadline_ns, status, peer, phase, loaded))
        return false;
    value = static_cast<uint32_t>(loaded);
    return true;
}

// Split in two for loops that load several ids before checking any: a report between two loads would
// keep the second from being issued before it (they may alias).
__device__ __forceinline__ int64_t load_expert_id(const void* topk_idx, bool ids_are_int64, int64_t i) {
    return ids_are_int64 ? static_cast<const int64_t*>(topk_idx)[i] : static_cast<const int32_t*>(topk_idx)[i];
}
__device__ __forceinline__ int checked_expert_id(int64_t id, int num_experts, const MaskedStatus& status) {
    if (id < -1 || id >= num_experts) {
        status.record_bad_expert_id(id, num_experts);
        return -1;
    }
    return static_cast<int>(id);
}
__device__ __forceinline__ int read_expert_id(const void* topk_idx, bool ids_are_int64, int64_t i, int num_experts,
                                              const MaskedStatus& status) {
    return checked_expert_id(load_expert_id(topk_idx, ids_are_int64, i), num_experts, status);
}

// Where this GPU can store into `pe`'s copy of a symmetric address, or nullptr when it must put.
template <typename T>
__device__ __forceinline__ T* direct_address(T* symmetric, int pe, int rank, bool force_put) {
    if (pe == rank)
        return symmetric;
    return force_put ? nullptr : static_cast<T*>(nvshmem_ptr(symmetric, pe));
}

// Whole warps of a block that work together, with their own named barrier: the whole block (barrier
// 0, as __syncthreads), or, in a fused dispatch, the sending half and the receiving half, so that the
// receivers lay out rows while the senders' stores still wait for the links.
struct Team {
    int first, size, barrier;

    __device__ int thread() const { return static_cast<int>(threadIdx.x) - first; }
    __device__ bool leader() const { return thread() == 0; }
    __device__ void sync() const { asm volatile("bar.sync %0, %1;" ::"r"(barrier), "r"(size) : "memory"); }
    // A barrier that also returns whether any thread of the team passed true.
    __device__ bool sync_or(bool value) const {
        int any;
        asm volatile("{\n .reg .pred vote, all;\n setp.ne.s32 vote, %1, 0;\n bar.red.or.pred all, %2, %3, vote;\n"
                     " selp.s32 %0, 1, 0, all;\n}"
                     : "=r"(any) : "r"(static_cast<int>(value)), "r"(barrier), "r"(size) : "memory");
        return any != 0;
    }
};

__device__ __forceinline__ Team whole_block() { return Team{0, static_cast<int>(blockDim.x), 0}; }

// Shrink mode, team-wide: whether `pe` is masked, as the team's leader reads it, so that the whole team
// takes the same branch (threads reading the mask themselves could disagree while a mask lands, and
// the branches hold team barriers). Without shrink mode, false at no cost.
__device__ __forceinline__ bool team_sees_masked(const Team& team, const MaskedStatus& status, int pe) {
    if (status.masked == nullptr)
        return false;
    __shared__ int seen[kNumThreads / kWarpSize];  // one word per team, at its first warp
    int* word = seen + team.first / kWarpSize;
    if (team.leader())
        *word = status.is_masked(pe);
    team.sync();
    const bool masked = *word != 0;
    team.sync();  // every thread read it before the leader writes the next
    return masked;
}

// Team-wide: write `count` tagged words, word i = value(i), into `table` (this rank's slot, a
// symmetric address) on `pe`. A put peer gets them from `staging` (this rank's symmetric scratch) with
// `flag` raised to `seq`. A direct peer needs nothing more (the tags show the words), but its flag is
// raised too, by a plain strong store that waits for nothing: a receiver that takes this rank for a
// put peer (Buffers created with different put options) then still finds it. In the opposite mix a
// direct reader polls words a put wrote; NVSHMEM's copies over NVLink write aligned 8-byte words whole,
// though only the signal is promised.
template <typename Value>
static __device__ void publish_table(const Team& team, uint64_t* table, uint64_t* staging, int count, Value value,
                              uint64_t* flag, uint64_t seq, int pe, int rank, bool force_put) {
    uint64_t* direct = direct_address(table, pe, rank, force_put);
    uint64_t* target = direct != nullptr ? direct : staging;
    batched_copy<uint32_t, kTableBatch>(team.thread(), team.size, count, value, [&](int i, uint32_t word) {
        st_relaxed_sys_global(target + i, tagged_word(seq, word));
    });
    team.sync();
    if (direct != nullptr) {
        if (team.leader())
            st_relaxed_sys_global(direct_address(flag, pe, rank, false), seq);
    } else {
        if (team.thread() < kWarpSize)
            put_then_signal_warp(table, staging, static_cast<size_t>(count) * sizeof(uint64_t), flag, seq, pe);
        team.sync();
    }
}

// Before reading a table from `pe`: a put peer's words are complete once its signal came; a direct
// peer's words show themselves (read_word). False if the signal never came. `a`: the launch's arguments
// (DispatchArgs or CombineArgs), whose rank and ways to its peers (force_put, all_direct) say which `pe` is;
// all_direct (every peer direct) spares the peer's lookup, two dependent reads (NVSHMEM's state, then the
// peer's base) that a receive launched after other work finds cold, ahead of the table's own.
template <typename Args>
__device__ __forceinline__ bool table_signalled(const Args& a, const uint64_t* flag, uint64_t seq, uint64_t deadline_ns,
                                                const MaskedStatus& status, int pe, int phase) {
    if (a.all_direct || direct_address(flag, pe, a.rank, a.force_put) != nullptr)
        return true;
    return wait_for_call(flag, seq, deadline_ns, status, pe, phase);
}

// Slot of token t from `source` in a [num_ranks][max_tokens][slot_bytes] message region.
template <typename Byte>
__device__ __forceinline__ Byte* message_slot(Byte* slots, int source, int t, int max_tokens, int64_t slot_bytes) {
    return slots + (static_cast<int64_t>(source) * max_tokens + t) * slot_bytes;
}

// A message (a dispatched token, or a combined partial) of `bytes` bytes sits at `slot` (a symmetric
// address) on each destination; `direct[i]` is where this GPU stores for destination i, nullptr for
// the put path, which sends the staged copy instead. Call after the block wrote the message.
struct Destinations {
    int count;
    int pe[kMaxTopk];
    uint8_t* direct[kMaxTopk];
    bool any_put;
};

// A direct destination's flag is a release store from one lane of the team's last warp: a release
// waits until the message's stores have landed, and only that warp waits, while the rest of the team
// goes on (so callers alternate two `dst` buffers: the next message's lookup must not overwrite what
// that warp still reads). Put destinations get a put then its signal from the team's first warp.
// `trace`: stamps kTraceFlagsReleased once a release returned (on current GPUs a release waits, as a
// fence does, for the message's stores to land; put destinations are not stamped).
static __device__ void raise_message_flags(const Team& team, const Destinations& dst, uint8_t* slot, const uint8_t* staged,
                                    int64_t bytes, uint64_t* flag, uint64_t seq, int rank, uint64_t* trace) {
    team.sync();
    const int i = team.thread() - (team.size - kWarpSize);
    if (i >= 0 && i < dst.count && dst.direct[i] != nullptr) {
        st_release_sys_global(direct_address(flag, dst.pe[i], rank, false), seq);
        trace_latest(trace, kTraceFlagsReleased);
    }
    if (dst.any_put) {
        if (team.thread() < kWarpSize)
            for (int d = 0; d < dst.count; ++d)
                if (dst.direct[d] == nullptr)
                    put_then_signal_warp(slot, staged, bytes, flag, seq, dst.pe[d]);
        team.sync();  // every thread read `dst` before the buffer comes round again
    }
}

// Smallest power of two >= value (value positive and normal).
__device__ __forceinline__ float power_of_two_at_least(float value) {
    uint32_t bits = __float_as_uint(value);
    if (bits & 0x7fffffu)
        bits = (bits & 0x7f800000u) + 0x800000u;
    return __uint_as_float(bits);
}

// ---------------------------------------------------------------------------------------------
// Dispatch

// cuep::low_latency::dispatch's one argument, passed by value (mirror: DispatchArgs in cuep/kernels/low_latency.py).
struct DispatchArgs {
    int phases;
    int buffer;                    // the call's buffer: set on the device (in_buffer), 0 from the host
    int64_t buffer_bytes;          // from one buffer to the next
    uint64_t* call_record;         // the number of this call, written by its send, read by a receive-only launch
    const int4* x;                 // [num_tokens, hidden] bf16
    int num_tokens, hidden, use_fp8, round_scale, use_ue8m0;
    const void* topk_idx;          // [num_tokens, num_topk], int64 or int32
    int ids_are_int64, num_topk, num_experts, rank, num_ranks, max_tokens, force_put;
    int all_direct;                // the host found every peer reachable by load/store, force_put off: no
                                   // lookup tells a receive whether to wait for a put's signal
    // The call's buffer (symmetric addresses; the same offsets on every rank; buffer 0's from the host)
    uint64_t* routing_flags;       // [num_ranks]
    uint64_t* token_flags;         // [num_ranks][flag_stride]
    int flag_stride;
    uint64_t* routing;             // [num_ranks][routing_words] tagged
    int routing_words;
    uint8_t* slots;                // [num_ranks][max_tokens][slot_bytes]
    int64_t slot_bytes;
    uint64_t* routing_staging;     // [num_ranks][staging_words]: this call's tables, for the put path
    int staging_words;
    uint8_t* slot_staging;         // [max_tokens][slot_bytes]
    int staged_tokens;             // receiving warps per block that may stage their first token (dispatch_recv)
    int stage_bytes;               // shared bytes of one staged token: its message, rounded up to 16
    // Outputs
    uint8_t* recv_x;               // [L][num_ranks * max_tokens][hidden] e4m3, or bf16
    void* recv_scales;             // [L][scale columns][num_ranks * max_tokens]: float, or packed UE8M0 int32
    int32_t* recv_count;           // [L]
    int32_t* recv_src_info;        // [L][num_ranks * max_tokens]: source token of each row
    int64_t* layout_range;         // [L][num_ranks]: (first row << 32) | rows from that source
    int32_t* combine_rows;         // [num_ranks][max_tokens][num_topk]: flat row in x of combine, or -1
    int32_t* source_tokens;        // [num_ranks]: tokens each source sent
    int32_t* cumulative_stats;     // [L] or nullptr
    uint64_t* source_decisions;    // shrink mode: [kNumBuffers][num_ranks], see agree_on_source; else nullptr
    int64_t* wait_stats;           // [num_ranks] or nullptr: nanoseconds the receive waited for each source, added
    uint64_t* seq_state;
    uint64_t timeout_ns;
    MaskedStatus status;
    uint64_t* trace;               // [gridDim.x][kTracePoints] in CUEP_TRACE builds, else nullptr
};

// A source's routing table, as each rank holds it (tagged words): the header (kRoutingHeaderWords; word
// 0 the source's token count), then its counts of tokens for each of that rank's experts (count_words),
// then each token's routed words (ids_stride each). Both sections are padded to even, so that each token's
// words are 16-byte aligned.
__device__ __forceinline__ int count_words(const DispatchArgs& a) { return (a.num_experts / a.num_ranks + 1) & ~1; }
__device__ __forceinline__ int ids_stride(const DispatchArgs& a) { return (a.num_topk + 1) & ~1; }
__device__ __forceinline__ int ids_offset(const DispatchArgs& a) { return kRoutingHeaderWords + count_words(a); }
// Source s's routing table in this rank's buffer (the symmetric address of s's table everywhere).
__device__ __forceinline__ uint64_t* source_table(const DispatchArgs& a, int s) {
    return a.routing + static_cast<int64_t>(s) * a.routing_words;
}

// The dispatch's dynamic shared memory (dispatch_shared_bytes and dispatch_staging in
// cuep/kernels/low_latency.py size it): the receive's state, then the send's layout of this rank's tokens
// (map_tokens; a fused dispatch's two teams use their parts at once), then, 16-byte aligned,
// a.staged_tokens slots of a.stage_bytes for the tokens stage_first_token loads early.
struct DispatchShared {
    int32_t* source_tokens;  // [R]: tokens each source sent
    int32_t* source_first;   // [L][R + 1]: a local expert's first row from each source; entry R: its row count
    uint32_t* token_bits;    // [E][bit_words]: a bit per (expert, token of this rank)
    int4* staged;            // [staged_tokens][stage_bytes / 16]
};

__device__ __forceinline__ DispatchShared dispatch_shared(const DispatchArgs& a) {
    extern __shared__ __align__(16) int32_t shared[];
    const int R = a.num_ranks, L = a.num_experts / R;
    DispatchShared d;
    d.source_tokens = shared;
    d.source_first = shared + R;
    d.token_bits = reinterpret_cast<uint32_t*>(d.source_first + L * (R + 1));
    constexpr int kWordsPerVector = kBytesPerVector / sizeof(int32_t);
    const int words = R + L * (R + 1) + a.num_experts * ((a.max_tokens + kWarpSize - 1) / kWarpSize);
    d.staged = reinterpret_cast<int4*>(shared + (words + kWordsPerVector - 1) / kWordsPerVector * kWordsPerVector);
    return d;
}

// A routed word: one choice of a token as its sender laid it out, the expert id in the low kExpertIdBits
// bits and, above them, the token's row among the sender's tokens of that expert (in token order); or
// kNoExpert (no expert, and the pad).
constexpr int kExpertIdBits = CUEP_EXPERT_ID_BITS;
constexpr uint32_t kNoExpert = ~0u;
static_assert(kMaxTokensPerRank <= (1 << (32 - kExpertIdBits)) - 1, "a row fits above the expert id");
__device__ __forceinline__ int routed_expert(uint32_t word) {
    return word == kNoExpert ? -1 : static_cast<int>(word & ((1u << kExpertIdBits) - 1));
}
__device__ __forceinline__ int routed_row(uint32_t word) { return static_cast<int>(word >> kExpertIdBits); }

// The arguments of call seq: its buffer's pointers (start_call, "Call order").
__device__ __forceinline__ DispatchArgs in_buffer(DispatchArgs a, uint64_t seq) {
    a.buffer = buffer_of(seq);
    const int64_t offset = a.buffer * a.buffer_bytes;
    a.routing_flags = in_buffer(a.routing_flags, offset);
    a.token_flags = in_buffer(a.token_flags, offset);
    a.routing = in_buffer(a.routing, offset);
    a.slots = in_buffer(a.slots, offset);
    a.routing_staging = in_buffer(a.routing_staging, offset);
    a.slot_staging = in_buffer(a.slot_staging, offset);
    return a;
}

// A dispatch's send checks no more than every send (check_call). Its record is its own allocation's: it
// records its number, or 0 when refused (its hook is then refused, kCallOrderUnsent), and zeroes the
// handle's combine record (the word after its own), which each combine of the handle then sets.
__device__ __forceinline__ bool handle_busy(const DispatchArgs&, uint64_t, const ReceivedCalls&) { return false; }
__device__ __forceinline__ void record_call(const DispatchArgs& a, uint64_t seq, bool in_order) {
    a.call_record[0] = in_order ? seq : 0;
    a.call_record[1] = 0;
}

__device__ __forceinline__ int64_t message_bytes(const DispatchArgs& a) {
    return a.use_fp8 ? a.hidden + a.hidden / kScaleBlock * static_cast<int64_t>(sizeof(float))
                     : static_cast<int64_t>(a.hidden) * 2;
}

// A warp: the ranks holding token t's experts, each once, in choice order, written to `ranks`
// (kMaxTopk entries of shared memory); returns how many; masked ranks (shrink mode) hold none. The
// caller syncs before others read.
static __device__ int ranks_holding_token(const void* topk_idx, bool ids_are_int64, int t, int num_topk, int num_experts,
                                   int num_ranks, const MaskedStatus& status, int* ranks) {
    const int lane = threadIdx.x % kWarpSize;
    int r = -1;
    if (lane < num_topk) {
        const int id = read_expert_id(topk_idx, ids_are_int64, static_cast<int64_t>(t) * num_topk + lane, num_experts,
                                      status);
        r = id >= 0 ? id / (num_experts / num_ranks) : -1;
    }
    const uint32_t same_rank = __match_any_sync(kFullWarpMask, r);  // every lane: a full-mask intrinsic
    // Shrink mode: a masked rank's experts take no tokens. The first lane naming a rank decides for
    // all of them (a mask landing meanwhile must not split a rank's choices).
    const bool leads = r >= 0 && __ffs(same_rank) - 1 == lane;
    const bool first = leads && !status.is_masked(r);
    const uint32_t firsts = __ballot_sync(kFullWarpMask, first);
    if (first)
        ranks[__popc(firsts & ((1u << lane) - 1))] = r;
    return __popc(firsts);
}

// The ranks holding token t's experts (each once), and where to store for each. Ends with a team barrier.
static __device__ void find_destinations(const Team& team, const DispatchArgs& a, int t, Destinations& dst) {
    if (team.thread() < kWarpSize) {
        const int count = ranks_holding_token(a.topk_idx, a.ids_are_int64, t, a.num_topk, a.num_experts, a.num_ranks,
                                              a.status, dst.pe);
        __syncwarp();
        uint8_t* slot = message_slot(a.slots, a.rank, t, a.max_tokens, a.slot_bytes);
        const int lane = team.thread();
        const bool mine = lane < count;
        if (mine)
            dst.direct[lane] = direct_address(slot, dst.pe[lane], a.rank, a.force_put);
        const bool put = mine && dst.direct[lane] == nullptr;
        const uint32_t puts = __ballot_sync(kFullWarpMask, put);
        if (lane == 0) {
            dst.count = count;
            dst.any_put = puts != 0;
        }
    }
    team.sync();
}

// Vector i of this thread's round `round` of a token: kSendBatch block-wide strides of vectors (BF16),
// or kSendBatch / kVectorsPerUnit strides of units (FP8), each unit two neighbouring vectors.
__device__ __forceinline__ int send_vector(const Team& team, const DispatchArgs& a, int round, int i) {
    if (!a.use_fp8)
        return (round * kSendBatch + i) * team.size + team.thread();
    const int unit = (round * kSendBatch + i) / kVectorsPerUnit * team.size + team.thread();
    return unit * kVectorsPerUnit + i % kVectorsPerUnit;
}

// Team-wide: this thread's vectors of token t in round `round`, lanes past the end loading zeros so
// that every lane takes part in the scale shuffles.
__device__ __forceinline__ void load_token_round(const Team& team, const DispatchArgs& a, int t, int round,
                                                 int4 (&raw)[kSendBatch]) {
    const int num_vectors = a.hidden / kBf16PerVector;
    const int4* row = a.x + static_cast<int64_t>(t) * num_vectors;
#pragma unroll
    for (int i = 0; i < kSendBatch; ++i) {
        const int v = send_vector(team, a, round, i);
        raw[i] = v < num_vectors ? ld_nc_global(row + v) : make_int4(0, 0, 0, 0);
    }
}

// Four floats times `scale` as four e4m3 bytes, the first in the low byte.
__device__ __forceinline__ int e4m3x4(const float* f, float scale) {
    return static_cast<int>(e4m3x2_from_floats(__fmul_rn(f[0], scale), __fmul_rn(f[1], scale)) |
                            (e4m3x2_from_floats(__fmul_rn(f[2], scale), __fmul_rn(f[3], scale)) << 16));
}

// Whole warps: quantise unit u of a token (vectors `low`, `high`) to e4m3 with its block's scale and
// store it to every destination; lane 0 stores the scales of the warp's four blocks.
__device__ __forceinline__ void store_fp8_unit(const DispatchArgs& a, const Destinations& dst, uint8_t* staged, int u,
                                               const int4& low, const int4& high) {
    const int lane = threadIdx.x % kWarpSize;
    float f[kChannelsPerUnit];
    bf16x8_to_floats(low, *reinterpret_cast<float(*)[kBf16PerVector]>(f));
    bf16x8_to_floats(high, *reinterpret_cast<float(*)[kBf16PerVector]>(f + kBf16PerVector));
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kChannelsPerUnit; ++i)
        amax = fmaxf(amax, fabsf(f[i]));
#pragma unroll
    for (int offset = kLanesPerScaleBlock / 2; offset > 0; offset /= 2)
        amax = fmaxf(amax, __shfl_xor_sync(kFullWarpMask, amax, offset));
    amax = fmaxf(amax, kMinAmax);
    float scale_inv = __fdiv_rn(amax, kE4m3Max);
    float scale = __fdiv_rn(kE4m3Max, amax);
    if (a.round_scale) {
        scale_inv = power_of_two_at_least(scale_inv);
        scale = __frcp_rn(scale_inv);
    }
    const int4 packed = make_int4(e4m3x4(f, scale), e4m3x4(f + 4, scale), e4m3x4(f + 8, scale), e4m3x4(f + 12, scale));
    int4 warp_scales;
    warp_scales.x = __float_as_int(__shfl_sync(kFullWarpMask, scale_inv, 0 * kLanesPerScaleBlock));
    warp_scales.y = __float_as_int(__shfl_sync(kFullWarpMask, scale_inv, 1 * kLanesPerScaleBlock));
    warp_scales.z = __float_as_int(__shfl_sync(kFullWarpMask, scale_inv, 2 * kLanesPerScaleBlock));
    warp_scales.w = __float_as_int(__shfl_sync(kFullWarpMask, scale_inv, 3 * kLanesPerScaleBlock));
    const int num_blocks = a.hidden / kScaleBlock;
    const int first_block = (u - lane) / kLanesPerScaleBlock;
    const bool active = u < a.hidden / kChannelsPerUnit;
    const bool stores_warp_scales = lane == 0 && first_block + kScaleBlocksPerWarp <= num_blocks;
    const bool stores_own_scale =
        first_block + kScaleBlocksPerWarp > num_blocks && active && lane % kLanesPerScaleBlock == 0;
    auto store = [&](uint8_t* message) {
        if (active)
            st_na_global(reinterpret_cast<int4*>(message) + u, packed);
        if (stores_warp_scales)
            st_na_global(reinterpret_cast<int4*>(message + a.hidden) + first_block / kScaleBlocksPerWarp, warp_scales);
        if (stores_own_scale)  // a partial warp at the end of a hidden size not a multiple of 512
            reinterpret_cast<float*>(message + a.hidden)[u / kLanesPerScaleBlock] = scale_inv;
    };
    for (int i = 0; i < dst.count; ++i)
        if (dst.direct[i] != nullptr)
            store(dst.direct[i]);
    if (staged != nullptr)
        store(staged);
}

// Block-wide: write token t to every rank holding one of its experts (raise_token_flags publishes it).
// The first round of x is loaded before the destinations are looked up, so the two latencies overlap.
// `tables_of`: a call number whose routing tables must have gone out before the first store, or 0.
static __device__ void send_token(const Team& team, const DispatchArgs& a, int t, Destinations& dst, uint64_t tables_of,
                           uint64_t deadline_ns) {
    const int num_vectors = a.hidden / kBf16PerVector;
    const int round_vectors = kSendBatch * team.size;
    const int num_rounds = (num_vectors + round_vectors - 1) / round_vectors;
    const int lane = threadIdx.x % kWarpSize;
    int4 raw[kSendBatch];
    load_token_round(team, a, t, 0, raw);
    find_destinations(team, a, t, dst);
    if (tables_of != 0) {
        if (team.leader())
            wait_at_least(a.seq_state + kSeqTablesSent, tables_of, deadline_ns, a.status, a.rank,
                          kPhaseLowLatencyRouting);
        team.sync();
    }
    uint8_t* staged = dst.any_put ? a.slot_staging + static_cast<int64_t>(t) * a.slot_bytes : nullptr;
    for (int round = 0; round < num_rounds; ++round) {
        if (round > 0)
            load_token_round(team, a, t, round, raw);
        if (a.use_fp8) {
#pragma unroll
            for (int i = 0; i < kSendBatch; i += kVectorsPerUnit) {
                const int u = send_vector(team, a, round, i) / kVectorsPerUnit;
                if (u - lane < a.hidden / kChannelsPerUnit)  // warp-uniform: whole warps shuffle
                    store_fp8_unit(a, dst, staged, u, raw[i], raw[i + 1]);
            }
            continue;
        }
#pragma unroll
        for (int i = 0; i < kSendBatch; ++i) {
            const int v = send_vector(team, a, round, i);
            if (v >= num_vectors)
                continue;
            for (int d = 0; d < dst.count; ++d)
                if (dst.direct[d] != nullptr)
                    st_na_global(reinterpret_cast<int4*>(dst.direct[d]) + v, raw[i]);
            if (staged != nullptr)
                reinterpret_cast<int4*>(staged)[v] = raw[i];
        }
    }
}

// Raise token t's flag on every destination (after send_token wrote it there). Team-wide.
static __device__ void raise_token_flags(const Team& team, const DispatchArgs& a, int t, const Destinations& dst,
                                  uint64_t seq) {
    uint8_t* slot = message_slot(a.slots, a.rank, t, a.max_tokens, a.slot_bytes);
    raise_message_flags(team, dst, slot, a.slot_staging + static_cast<int64_t>(t) * a.slot_bytes, message_bytes(a),
                        a.token_flags + static_cast<int64_t>(a.rank) * a.flag_stride + t, seq, a.rank, a.trace);
}

// The send's layout of this rank's tokens (dynamic shared memory, after the receive's state): a bit per
// (expert, token) naming the expert, bit_words(a) words per expert.
__device__ __forceinline__ int bit_words(const DispatchArgs& a) { return (a.num_tokens + kWarpSize - 1) / kWarpSize; }

// Tokens before t (all of them for t = num_tokens) among those naming the expert of `bits`.
__device__ __forceinline__ int tokens_before(const uint32_t* bits, int t) {
    int count = t % kWarpSize != 0 ? __popc(bits[t / kWarpSize] & ((1u << (t % kWarpSize)) - 1)) : 0;
    for (int w = 0; w < t / kWarpSize; ++w)
        count += __popc(bits[w]);
    return count;
}

// Team-wide, before any routing word or flag goes out: the bitmap of this rank's tokens per expert (a
// token naming an expert twice counts once), from which routing_word takes each choice's row and each
// expert's count. `meanwhile` (team-wide work of the caller's) runs once the first batch of ids is on its
// way, so that its own waits and the ids' overlap. Ends with a team barrier.
template <typename Meanwhile>
static __device__ void map_tokens(const Team& team, const DispatchArgs& a, uint32_t* bits, const Meanwhile& meanwhile) {
    const int words = bit_words(a), count = a.num_tokens * a.num_topk;
    const auto load = [&](int i) { return load_expert_id(a.topk_idx, a.ids_are_int64, i); };
    const auto mark = [&](int i, int64_t loaded) {
        const int id = checked_expert_id(loaded, a.num_experts, a.status);
        const int t = i / a.num_topk;
        if (id >= 0)
            atomicOr(bits + id * words + t / kWarpSize, 1u << (t % kWarpSize));
    };
    int64_t first[kIdsAtOnce];
#pragma unroll
    for (int j = 0; j < kIdsAtOnce; ++j)
        if (const int i = team.thread() + j * team.size; i < count)
            first[j] = load(i);
    meanwhile();
    for (int i = team.thread(); i < a.num_experts * words; i += team.size)
        bits[i] = 0;
    team.sync();
#pragma unroll
    for (int j = 0; j < kIdsAtOnce; ++j)
        if (const int i = team.thread() + j * team.size; i < count)
            mark(i, first[j]);
    batched_copy<int64_t, kIdsAtOnce>(team.thread() + kIdsAtOnce * team.size, team.size, count, load, mark);
    team.sync();
}

// Word i of the routing table this rank sends to rank pe (count_words says how it is laid out), from
// the send's layout (map_tokens).
__device__ __forceinline__ uint32_t routing_word(const DispatchArgs& a, const uint32_t* bits, int pe, int i) {
    if (i < kRoutingHeaderWords)
        return i == 0 ? static_cast<uint32_t>(a.num_tokens) : 0u;
    const int L = a.num_experts / a.num_ranks, words = bit_words(a);
    if (i < ids_offset(a)) {  // pe's expert e: how many of this rank's tokens name it
        const int e = i - kRoutingHeaderWords;
        return e < L ? static_cast<uint32_t>(tokens_before(bits + (pe * L + e) * words, a.num_tokens)) : 0u;
    }
    const int stride = ids_stride(a);
    const int t = (i - ids_offset(a)) / stride, k = (i - ids_offset(a)) % stride;
    const int id = k < a.num_topk ? read_expert_id(a.topk_idx, a.ids_are_int64, static_cast<int64_t>(t) * a.num_topk + k,
                                                   a.num_experts, a.status)
                                  : -1;  // the pad
    return id < 0 ? kNoExpert
                  : static_cast<uint32_t>(tokens_before(bits + id * words, t)) << kExpertIdBits | static_cast<uint32_t>(id);
}

// Shrink mode, by each sending block's leader once its rows went out: the last one stores the header
// (the token count) to every direct peer. A receiver that sees a header then finds every word of the
// table, so the blocks of a receive agree on what a source sent even when the source is lost in the
// middle of its send (agree_on_source).
static __device__ void publish_header_last(const DispatchArgs& a, const uint32_t* bits, uint64_t seq) {
    __threadfence_system();  // this block's rows (the team's barrier ordered them before this thread)
    auto* published = reinterpret_cast<unsigned long long*>(a.seq_state + kSeqRowsPublished + a.buffer);
    if (atomicAdd(published, 1ull) != gridDim.x - 1)
        return;
    *published = 0;
    __threadfence_system();  // every block's rows before the header
    for (int pe = 0; pe < a.num_ranks; ++pe) {
        uint64_t* table = direct_address(source_table(a, a.rank), pe, a.rank, a.force_put);
        if (table != nullptr && !a.status.is_masked(pe))
            for (int w = 0; w < kRoutingHeaderWords; ++w)
                st_relaxed_sys_global(table + w, tagged_word(seq, routing_word(a, bits, pe, w)));
    }
}

// Team-wide: this block's tokens' rows of the routing table of every direct (NVLink) peer, and from
// block 0 the header, the peer's expert counts and the flag a receiver that takes this rank for a put
// peer waits for (it then polls the tagged words like everyone else). Each block stores its own tokens'
// rows, before their flags and beside their data (dispatch_send says in which order); tables stored
// whole by a few blocks queue behind every other block's flood (measured with the receive's former
// layout, which read every row: it waited ~5 us for them at EP4).
static __device__ void publish_own_routing_rows(const Team& team, const DispatchArgs& a, const uint32_t* bits,
                                                uint64_t seq) {
    const int stride = ids_stride(a);
    const int block = static_cast<int>(blockIdx.x), grid = static_cast<int>(gridDim.x);
    const int own_tokens = a.num_tokens > block ? (a.num_tokens - 1 - block) / grid + 1 : 0;
    const bool header_last = a.status.masked != nullptr;  // shrink mode: publish_header_last
    // Block 0's words before the tokens' rows: the header (unless it comes last) and the counts.
    const int first_word = header_last ? kRoutingHeaderWords : 0;
    const int lead_words = block == 0 ? ids_offset(a) - first_word : 0;
    const int per_peer = lead_words + own_tokens * stride;
    for (int i = team.thread(); i < a.num_ranks * per_peer; i += team.size) {
        const int pe = i / per_peer, w = i % per_peer;
        uint64_t* table = direct_address(source_table(a, a.rank), pe, a.rank, a.force_put);
        if (table == nullptr || a.status.is_masked(pe))
            continue;
        const int r = w - lead_words;
        const int index = r < 0 ? first_word + w : ids_offset(a) + (block + r / stride * grid) * stride + r % stride;
        st_relaxed_sys_global(table + index, tagged_word(seq, routing_word(a, bits, pe, index)));
    }
    if (block == 0)
        for (int pe = team.thread(); pe < a.num_ranks; pe += team.size)
            if (uint64_t* flag = direct_address(a.routing_flags + a.rank, pe, a.rank, a.force_put);
                flag != nullptr && !a.status.is_masked(pe))
                st_relaxed_sys_global(flag, seq);
    team.sync();
    if (header_last && team.leader())
        publish_header_last(a, bits, seq);
}

// Team-wide: whether any peer takes this rank's tables and tokens by put (NVSHMEM) rather than by direct
// stores. Each thread looks up its own share of the peers, so the lookups wait once, not once per peer.
// Ends with a team barrier.
__device__ __forceinline__ bool has_put_peer(const Team& team, const DispatchArgs& a) {
    bool put = false;
    for (int pe = team.thread(); !a.all_direct && pe < a.num_ranks; pe += team.size)
        put |= direct_address(a.routing_flags, pe, a.rank, a.force_put) == nullptr;
    return team.sync_or(put);
}

// Send this block's tokens, each token's flags after its routing rows. Where every peer takes direct
// stores (and outside shrink mode, whose masks a token's destinations and its rows must see alike), a
// block other than 0 stores its first token's data while its layout's ids load (the token's destinations
// wait for the same ids), and raises that token's flags once its rows are out: the data crosses the
// links beside the layout, not after it. Block 0 lays out first: every receiver's layout waits for the
// counts it publishes. When some peer takes puts, the whole tables for those peers go out first (from
// the last blocks, which have no token when the grid outnumbers the tokens; every receiver waits for all
// the tables), and every token after them. (In a data-first block the trace's "tokens mapped" includes
// the first token's stores, and that token's "tokens stored" comes after its rows.)
static __device__ void dispatch_send(const Team& team, const DispatchArgs& a, uint64_t seq, uint64_t deadline_ns) {
    __shared__ Destinations dst[2];  // alternating, see raise_message_flags
    uint32_t* bits = dispatch_shared(a).token_bits;
    const int first_token = static_cast<int>(blockIdx.x);
    bool gated = false, data_first = false;
    map_tokens(team, a, bits, [&] {
        gated = has_put_peer(team, a);
        data_first = !gated && a.status.masked == nullptr && first_token > 0 && first_token < a.num_tokens;
        if (data_first)
            send_token(team, a, first_token, dst[0], 0, deadline_ns);
    });
    if (team.leader())
        trace_mark(a.trace, kTraceTokensMapped);
    const int table_words = ids_offset(a) + a.num_tokens * ids_stride(a);
    for (int pe = gridDim.x - 1 - blockIdx.x; gated && pe < a.num_ranks; pe += gridDim.x) {
        if (direct_address(a.routing, pe, a.rank, a.force_put) == nullptr && !team_sees_masked(team, a.status, pe))
            publish_table(team, source_table(a, a.rank), a.routing_staging + static_cast<int64_t>(pe) * a.staging_words,
                          table_words, [&](int i) { return routing_word(a, bits, pe, i); }, a.routing_flags + a.rank,
                          seq, pe, a.rank, a.force_put);
        if (team.leader())
            count_table_sent(a.seq_state, a.buffer, a.num_ranks, seq);
    }
    publish_own_routing_rows(team, a, bits, seq);
    if (team.leader())
        trace_mark(a.trace, kTraceTablePublished);
    int parity = 0;
    for (int t = first_token; t < a.num_tokens; t += gridDim.x, parity ^= 1) {
        if (!(data_first && t == first_token))
            send_token(team, a, t, dst[parity], gated && t == first_token ? seq : 0, deadline_ns);
        if (team.leader())
            trace_mark(a.trace, kTraceTokensStored);
        raise_token_flags(team, a, t, dst[parity], seq);
    }
}

// Token t's routed words in source s's routing table (source_table).
__device__ __forceinline__ const uint64_t* routed_words(const DispatchArgs& a, int s, int t) {
    return source_table(a, s) + ids_offset(a) + static_cast<int64_t>(t) * ids_stride(a);
}

// Shrink mode: what every block of this call takes source s to have sent, given what this block saw
// (`sent`: its token count, or -1 when its table never came): the first block to decide decides for
// all (`decision`: this buffer's word of s, (call number << 12) | (count + 1)). A block that gave up on s
// while another saw its header then reads its table like the other (the header came last, so every
// word is there), and one that saw it while another gave up drops it: the blocks lay out the same rows.
__device__ __forceinline__ int agree_on_source(uint64_t* decision, uint64_t seq, int sent) {
    constexpr int kCountBits = 12;
    static_assert(kMaxTokensPerRank + 2 <= (1 << kCountBits), "a token count and 'none' fit the low bits");
    auto* word = reinterpret_cast<unsigned long long*>(decision);
    const unsigned long long mine = (seq << kCountBits) | static_cast<unsigned long long>(sent + 1);
    unsigned long long seen = ld_volatile_global(decision);
    while ((seen >> kCountBits) < seq) {  // nobody decided this call yet
        const unsigned long long before = atomicCAS(word, seen, mine);
        if (before == seen)
            return sent;
        seen = before;
    }
    return static_cast<int>(seen & ((1ull << kCountBits) - 1)) - 1;
}

// Word `index` of source s's routing table once it landed (after the put path's signal), or -1 if the
// wait gave up.
__device__ __forceinline__ int read_routing_word(const DispatchArgs& a, int s, int index, uint64_t seq,
                                                 uint64_t deadline_ns, const MaskedStatus& status) {
    uint32_t value = 0;
    const bool came =
        table_signalled(a, a.routing_flags + s, seq, deadline_ns, status, s, kPhaseLowLatencyRouting) &&
        read_word(source_table(a, s) + index, seq, deadline_ns, status, s, kPhaseLowLatencyRouting, value);
    return came ? static_cast<int>(value) : -1;
}

// Source s's count of tokens for this rank's local expert e, once it landed (0 if the wait gave up).
__device__ __forceinline__ int read_expert_count(const DispatchArgs& a, int s, int e, uint64_t seq, uint64_t deadline_ns,
                                                 const MaskedStatus& status) {
    return max(0, min(read_routing_word(a, s, kRoutingHeaderWords + e, seq, deadline_ns, status), a.max_tokens));
}

// Wait for every source's token count and its counts of this rank's experts (0 from a masked source,
// shrink mode, as every block of the call agrees): source s's count of expert e goes to entry s + 1 of
// e's first rows (lay_out_call sums them). Every word at once, except in shrink mode, where a source's
// header comes last: its counts are read once the blocks agreed that it sent. The team's first threads
// read the headers and its last the counts, away from the warps that stage a token first (whose reads
// would wait for that token's flag). Ends with a team barrier.
static __device__ void read_tables(const Team& team, const DispatchArgs& a, const DispatchShared& d, uint64_t seq,
                                   uint64_t deadline_ns) {
    const int R = a.num_ranks, L = a.num_experts / R;
    const bool shrink = a.source_decisions != nullptr;
    for (int s = team.thread(); s < R; s += team.size) {
        const uint64_t started = a.wait_stats != nullptr ? globaltimer_ns() : 0;
        int sent = read_routing_word(a, s, 0, seq, deadline_ns, a.status);  // the header's token count
        if (blockIdx.x == 0)  // every block waits for every table; one counts it
            add_wait(a.wait_stats, s, started);
        if (shrink)
            sent = agree_on_source(a.source_decisions + static_cast<int64_t>(a.buffer) * R + s, seq, sent);
        d.source_tokens[s] = max(0, min(sent, a.max_tokens));
        if (blockIdx.x == 0)
            a.source_tokens[s] = d.source_tokens[s];
    }
    for (int i = team.size - 1 - team.thread(); !shrink && i < R * L; i += team.size) {
        const int s = i / L, e = i % L;
        d.source_first[e * (R + 1) + s + 1] = read_expert_count(a, s, e, seq, deadline_ns, a.status);
    }
    team.sync();
    if (!shrink)
        return;
    // Unmasked: a source this call counts sent its whole table (agree_on_source), even if masked since.
    for (int i = team.thread(); i < R * L; i += team.size) {
        const int s = i / L, e = i % L;
        d.source_first[e * (R + 1) + s + 1] =
            d.source_tokens[s] > 0 ? read_expert_count(a, s, e, seq, deadline_ns, a.status.unmasked()) : 0;
    }
    team.sync();
}

// The call's layout, from the counts read_tables left: each local expert's first row from each source
// (an exclusive sum over the sources, so that its rows follow in (source, token) order) and its row
// count. Block b also writes the counts and per-source ranges of experts b, b + grid, ...
static __device__ void lay_out_call(const Team& team, const DispatchArgs& a, const DispatchShared& d) {
    const int R = a.num_ranks, L = a.num_experts / R;
    for (int e = team.thread(); e < L; e += team.size) {  // into first rows, then the total
        int32_t* first = d.source_first + e * (R + 1);
        int sum = 0;
        for (int s = 0; s <= R; ++s) {
            const int rows = s < R ? first[s + 1] : 0;
            first[s] = sum;
            sum += rows;
        }
    }
    team.sync();
    for (int e = blockIdx.x; e < L; e += gridDim.x) {
        const int32_t* first = d.source_first + e * (R + 1);
        for (int s = team.thread(); s < R; s += team.size)
            a.layout_range[static_cast<int64_t>(e) * R + s] =
                (static_cast<int64_t>(first[s]) << 32) | (first[s + 1] - first[s]);
        if (team.leader()) {
            a.recv_count[e] = first[R];
            if (a.cumulative_stats != nullptr)
                atomicAdd(a.cumulative_stats + e, first[R]);
        }
    }
}

// Pair i of the receive: token i % max_tokens of source i / max_tokens.
struct Pair {
    int s, t;
};
__device__ __forceinline__ Pair pair_of(const DispatchArgs& a, int i) { return Pair{i / a.max_tokens, i % a.max_tokens}; }

// A warp of the receive whose first pair (`first`) has already arrived when the receive starts loads
// its message into the warp's shared slot (`order` of a.staged_tokens) at once, so that the load
// overlaps the wait for the tables rather than following it: a hook's receive, launched after its data
// landed, then only stores. Returns the slot (receive_token's `staged`), or nullptr where the token has
// not arrived, or a flag is past the call (receive_token reports it), or the warp has no slot. Its
// copies are ordinary loads (cp_async_16): each lane's acquire of the flag orders the lane's own.
static __device__ const int4* stage_first_token(const DispatchArgs& a, const DispatchShared& d, int order, int first,
                                                uint64_t seq) {
    if (order >= a.staged_tokens || first >= a.num_ranks * a.max_tokens)
        return nullptr;
    const Pair p = pair_of(a, first);
    const uint64_t flag = ld_acquire_sys_global(a.token_flags + static_cast<int64_t>(p.s) * a.flag_stride + p.t);
    if (!__all_sync(kFullWarpMask, flag == seq))
        return nullptr;
    int4* slot = d.staged + static_cast<int64_t>(order) * (a.stage_bytes / kBytesPerVector);
    const auto* message = reinterpret_cast<const int4*>(message_slot(a.slots, p.s, p.t, a.max_tokens, a.slot_bytes));
    for (int v = threadIdx.x % kWarpSize; v < a.stage_bytes / kBytesPerVector; v += kWarpSize)
        cp_async_16(slot + v, message + v);
    return slot;
}

// A warp: values [0, count) loaded once (load(i), lane-strided as in batched_copy), each stored to every
// lane in `targets` as store(its expert, its row, i, value). Every lane calls it: the targets' (expert,
// row) are shuffled from them in warp-uniform code.
template <typename T, typename Load, typename Store>
__device__ __forceinline__ void copy_to_targets(int count, uint32_t targets, int e, int row, const Load& load,
                                                const Store& store) {
    const int lane = threadIdx.x % kWarpSize;
    for (int base = lane; base - lane < count; base += kCopyBatch * kWarpSize) {
        T values[kCopyBatch];
#pragma unroll
        for (int i = 0; i < kCopyBatch; ++i)
            if (base + i * kWarpSize < count)
                values[i] = load(base + i * kWarpSize);
        for (uint32_t left = targets; left != 0; left &= left - 1) {
            const int from = __ffs(left) - 1;
            const int to_e = __shfl_sync(kFullWarpMask, e, from), to_row = __shfl_sync(kFullWarpMask, row, from);
#pragma unroll
            for (int i = 0; i < kCopyBatch; ++i)
                if (base + i * kWarpSize < count)
                    store(to_e, to_row, base + i * kWarpSize, values[i]);
        }
    }
}

// A lane's routed word of pair `first` (receive_token's `early`), loaded at the receive's start, before
// its tables are read: where every source stores directly, a word shows its call by its tag, so one
// that carries this call's is its value, and the pair's own read of its words waits for none. 0 (no
// call's tag) past the pairs, on lanes past num_topk, or where some peer puts (its words are whole only
// once its signal came).
__device__ __forceinline__ uint64_t early_routed_word(const DispatchArgs& a, int first) {
    const int lane = threadIdx.x % kWarpSize;
    if (!a.all_direct || lane >= a.num_topk || first >= a.num_ranks * a.max_tokens)
        return 0;
    const Pair p = pair_of(a, first);
    return ld_volatile_global(routed_words(a, p.s, p.t) + lane);
}

// What a warp of the receive does for its pair: all of it, or one of two parts that two warps take at
// once (dispatch_recv says when): the rows with their combine_rows and source entries, or the FP8 scales.
enum class PairPart { kWhole, kRows, kScales };

// A warp: token t of source s, once it arrived, into the row of each local expert it names (read once,
// stored to each row), and its combine_rows entries: the flat row of each choice, -1 for another rank's
// expert (or none). Its routed words give each choice's expert and row within the expert's rows from s.
// `staged`: the token's message, already arrived and loaded into shared memory (stage_first_token), or
// nullptr; `early`: the lane's routed word if already loaded (early_routed_word), else 0. `part`: which
// of the pair's stores this warp makes (the two warps of a split pair read the same words and flag, so
// they find the same rows; in shrink mode, where a source masked during the call leaves its rows
// undefined, one may store while the other gives up).
static __device__ void receive_token(const DispatchArgs& a, const DispatchShared& d, int s, int t, uint64_t seq,
                                     uint64_t deadline_ns, const int4* staged, uint64_t early, PairPart part) {
    const bool stores_rows = part != PairPart::kScales, stores_scales = part != PairPart::kRows && a.use_fp8;
    const int lane = threadIdx.x % kWarpSize;
    const int R = a.num_ranks, L = a.num_experts / R;
    const int64_t rows_per_expert = static_cast<int64_t>(R) * a.max_tokens;
    int e = -1, row = 0;
    if (lane < a.num_topk) {
        uint32_t word = kNoExpert;  // kept where the wait gave up
        if (has_tag(early, seq))
            word = static_cast<uint32_t>(early);
        else
            read_word(routed_words(a, s, t) + lane, seq, deadline_ns, a.status, s, kPhaseLowLatencyRouting, word);
        e = routed_expert(word) - a.rank * L;
        e = e >= 0 && e < L ? e : -1;
        if (e >= 0) {
            // A row past the source's count (a table that does not match its counts) is dropped, not
            // stored over another token's row.
            const int32_t* first = d.source_first + e * (R + 1) + s;
            row = first[0] + routed_row(word);
            e = routed_row(word) < first[1] - first[0] ? e : -1;
        }
    }
    int32_t* choice_rows = a.combine_rows + (static_cast<int64_t>(s) * a.max_tokens + t) * a.num_topk;
    if (stores_rows && lane < a.num_topk && e < 0)
        choice_rows[lane] = -1;
    // One copy per local expert: the first lane naming it stores the token (a token may name one twice).
    const uint32_t same_expert = __match_any_sync(kFullWarpMask, e >= 0 ? e : -1 - lane);
    const uint32_t targets = __ballot_sync(kFullWarpMask, e >= 0 && __ffs(same_expert) - 1 == lane);
    if (targets == 0)
        return;
    const uint64_t started = a.wait_stats != nullptr ? globaltimer_ns() : 0;
    // Each lane acquires the flag itself; the warp then goes on only if every lane saw it (the copy below
    // shuffles across the warp).
    const bool arrived = staged != nullptr ||
                         __all_sync(kFullWarpMask, wait_for_call(a.token_flags + static_cast<int64_t>(s) * a.flag_stride
                                                                 + t, seq, deadline_ns, a.status, s,
                                                                 kPhaseLowLatencyToken));
    if (lane == 0 && stores_rows)  // counted once per pair
        add_wait(a.wait_stats, s, started);
    if (!arrived)  // the call is void, or (shrink mode) s was masked during it: the rows keep no data
        return;
    if (lane == 0)
        trace_latest(a.trace, kTraceLastRowFlag);
    if (staged != nullptr) {  // every lane's copies landed (each waits for its own; the warp then syncs)
        cp_async_wait_all();
        __syncwarp();
    }
    // The message from where it is: shared memory if staged, else this rank's buffer (L2, after the acquire).
    const uint8_t* message = staged != nullptr ? reinterpret_cast<const uint8_t*>(staged)
                                               : message_slot(a.slots, s, t, a.max_tokens, a.slot_bytes);
    const int64_t data_bytes = a.use_fp8 ? a.hidden : static_cast<int64_t>(a.hidden) * 2;
    const int4* src = reinterpret_cast<const int4*>(message);
    if (stores_rows) {
        copy_to_targets<int4>(static_cast<int>(data_bytes / kBytesPerVector), targets, e, row,
                              [&](int v) { return staged != nullptr ? src[v] : ld_cg_global(src + v); },
                              [&](int to_e, int to_row, int v, const int4& value) {
                                  st_na_global(reinterpret_cast<int4*>(
                                      a.recv_x + (to_e * rows_per_expert + to_row) * data_bytes) + v, value);
                              });
    }
    if (stores_scales) {
        const float* scales = reinterpret_cast<const float*>(message + a.hidden);
        const auto scale = [&](int g) { return staged != nullptr ? scales[g] : __ldcg(scales + g); };
        const int num_scales = a.hidden / kScaleBlock;
        if (a.use_ue8m0) {
            const int num_words = num_scales / kScalesPerUe8m0Word;
            auto packed_word = [&](int w) {
                uint32_t word = 0;
#pragma unroll
                for (int i = 0; i < kScalesPerUe8m0Word; ++i)
                    word |= ((__float_as_uint(scale(w * kScalesPerUe8m0Word + i)) >> 23) & 0xffu) << (8 * i);
                return static_cast<int32_t>(word);
            };
            copy_to_targets<int32_t>(num_words, targets, e, row, packed_word,
                                     [&](int to_e, int to_row, int w, int32_t word) {
                                         static_cast<int32_t*>(a.recv_scales)
                                             [(to_e * num_words + w) * rows_per_expert + to_row] = word;
                                     });
        } else {
            copy_to_targets<float>(num_scales, targets, e, row, scale,
                                   [&](int to_e, int to_row, int g, float scale) {
                                       static_cast<float*>(a.recv_scales)
                                           [(to_e * num_scales + g) * rows_per_expert + to_row] = scale;
                                   });
        }
    }
    if (stores_rows && e >= 0) {
        const int64_t flat_row = e * rows_per_expert + row;
        a.recv_src_info[flat_row] = t;  // a lane naming an expert twice writes the same value
        choice_rows[lane] = static_cast<int32_t>(flat_row);
    }
}

// Read the tables and lay out the call, then receive every (source, token) pair, a warp each: pair i
// goes to block i % grid, so that every SM takes a share of the copies (a decode call often has fewer
// pairs than the grid has warps, and given in order they would fill only the first blocks). The team's
// first warp reads the tables' headers (read_tables; its last warps read the counts), so it takes the
// last share of pairs, and the others stage their first token first where it has arrived.
// Where the team has two warps for every pair of an FP8 call, each pair is split: the first half of
// the warps in that rotated order store the rows (they stage), the second half the scales of the same
// pairs (the first warp among them: it takes the last share's scales). A token's scales go to its rows
// in scattered 4-byte stores (the column-major layout), which the one warp would otherwise make after
// its rows, at the end of the receive's longest path.
static_assert(kNumThreads / 2 / kWarpSize % 2 == 0, "a receiving team splits its warps into two halves");
static __device__ void dispatch_recv(const Team& team, const DispatchArgs& a, uint64_t seq, uint64_t deadline_ns) {
    const DispatchShared d = dispatch_shared(a);
    const int warps = team.size / kWarpSize;
    const int warp_order = (team.thread() / kWarpSize + warps - 1) % warps;
    const bool split = a.use_fp8 && a.num_ranks * a.max_tokens <= static_cast<int>(gridDim.x) * (warps / 2);
    const int warps_per_part = split ? warps / 2 : warps;
    const PairPart part = !split ? PairPart::kWhole : warp_order < warps_per_part ? PairPart::kRows : PairPart::kScales;
    const int order = warp_order % warps_per_part;
    const int first = order * gridDim.x + blockIdx.x;
    const uint64_t first_word = early_routed_word(a, first);  // issued before the staged token's flag is read
    const int4* staged = part != PairPart::kScales ? stage_first_token(a, d, order, first, seq) : nullptr;
    read_tables(team, a, d, seq, deadline_ns);
    if (team.leader())
        trace_mark(a.trace, kTraceTablesRead);
    lay_out_call(team, a, d);
    if (team.leader())
        trace_mark(a.trace, kTraceLaidOut);
    const int stride = static_cast<int>(gridDim.x) * warps_per_part;
    for (int i = first; i < a.num_ranks * a.max_tokens; i += stride) {
        const Pair p = pair_of(a, i);
        if (p.t < d.source_tokens[p.s])
            receive_token(a, d, p.s, p.t, seq, deadline_ns, i == first ? staged : nullptr, i == first ? first_word : 0,
                          part);
    }
    if (staged != nullptr)  // a staged token that was not received (shrink mode: its source counted none)
        cp_async_wait_all();
    if constexpr (kTrace) {
        team.sync();
        if (team.leader())
            trace_mark(a.trace, kTraceRowsCopied);
    }
}

// The dispatch launch. With both phases, the first half of the block sends and the second half
// receives: a sender warp waits for the links (stores, then the release of each token's flags), and
// the receivers would otherwise wait for it at every barrier.
static __device__ void dispatch(const DispatchArgs& a, uint64_t seq, uint64_t deadline_ns) {
    const bool sends = !kReceiveOnly && (a.phases & kSendPhase), receives = kReceiveOnly || (a.phases & kRecvPhase);
    const bool split = sends && receives;
    const int half = static_cast<int>(blockDim.x) / 2;
    const bool sender = !split || static_cast<int>(threadIdx.x) < half;
    if (sends && sender) {
        const Team team = split ? Team{0, half, kSenderBarrier} : whole_block();
        dispatch_send(team, a, seq, deadline_ns);
        if (team.leader())
            trace_mark(a.trace, kTraceSendDone);
    }
    if (receives && (!split || !sender))
        dispatch_recv(split ? Team{half, half, kReceiverBarrier} : whole_block(), a, seq, deadline_ns);
}

// ---------------------------------------------------------------------------------------------
// Combine

// cuep::low_latency::combine's one argument, passed by value (mirror: CombineArgs in cuep/kernels/low_latency.py).
struct CombineArgs {
    int phases;
    int buffer;                    // as DispatchArgs
    int64_t buffer_bytes;
    uint64_t* call_record;
    const int4* x;                 // [L * num_ranks * max_tokens][hidden] bf16: the expert outputs
    const void* topk_idx;          // [num_tokens, num_topk] of this rank's tokens, int64 or int32
    int ids_are_int64;
    const float* topk_weights;     // [num_tokens, num_topk]
    int num_tokens, num_topk, hidden, num_experts, rank, num_ranks, max_tokens, force_put;
    int all_direct;                // as DispatchArgs
    const int32_t* combine_rows;   // from the dispatch, see DispatchArgs
    const int32_t* source_tokens;
    // The call's buffer
    uint64_t* weight_flags;        // [num_ranks]
    uint64_t* token_flags;         // [num_ranks][flag_stride]
    int flag_stride;
    uint64_t* weights;             // [num_ranks][weight_words] tagged floats
    int weight_words;
    uint8_t* slots;                // [num_ranks][max_tokens][slot_bytes]: partials from each rank
    int64_t slot_bytes;            // a LogFMT message's (LogFmtLayout), which a BF16 partial fits in
    uint64_t* choice_flags;        // [kMaxTokensPerRank][kChoiceSlots]
    uint8_t* choice_slots;         // [max_tokens][kChoiceSlots][slot_bytes]: BF16 rows sent one by one (send_partial);
                                   // nullptr where num_topk > kChoiceSlots, and in shrink mode: such a pair waits
    uint64_t split_after_ns;       // how long a pair of several rows looks for its weights before it splits,
                                   // in a launch that also receives
    uint64_t hook_split_after_ns;  // the same in a hook's send (a launch of the send phase alone; set per launch
                                   // by the host); 0: one look
    uint64_t* weight_staging;      // [num_ranks][staging_words]: this call's tables, for the put path
    int staging_words;
    uint8_t* slot_staging;         // [num_ranks][max_tokens][slot_bytes]
    int4* combined_x;              // [num_tokens, hidden] bf16
    int use_logfmt;                // other ranks' partials travel as LogFMT (cuep/logfmt.cuh), else BF16 (this
                                   // rank's own partials and rows sent one by one: BF16 either way, see send_partial)
    int64_t* wait_stats;           // [num_ranks] or nullptr: nanoseconds the receive waited for each rank, added
    uint64_t* seq_state;
    uint64_t timeout_ns;
    MaskedStatus status;
    uint64_t* trace;               // [gridDim.x][kTracePoints] in CUEP_TRACE builds, else nullptr
};

// The weights-table word of this rank's choice i (t * num_topk + k): kUnroutedWeight where the combine's id is
// -1, else its weight's bits, but for a NaN of kUnroutedWeight's bits, which goes as the positive quiet NaN (it
// still spoils its token, and never reads as unrouted).
__device__ __forceinline__ uint32_t weight_word(const CombineArgs& a, int64_t i) {
    if (read_expert_id(a.topk_idx, a.ids_are_int64, i, a.num_experts, a.status) < 0)
        return kUnroutedWeight;
    const uint32_t word = __float_as_uint(a.topk_weights[i]);
    return word == kUnroutedWeight ? 0x7FFFFFFFu : word;
}

// Warp group `group` of the combine send, with named barrier group + 1 (0 is the whole block's).
__device__ __forceinline__ Team warp_group(int group) { return Team{group * kGroupThreads, kGroupThreads, group + 1}; }

// The arguments of call seq: its buffer's pointers (as the dispatch's).
__device__ __forceinline__ CombineArgs in_buffer(CombineArgs a, uint64_t seq) {
    a.buffer = buffer_of(seq);
    const int64_t offset = a.buffer * a.buffer_bytes;
    a.weight_flags = in_buffer(a.weight_flags, offset);
    a.token_flags = in_buffer(a.token_flags, offset);
    a.weights = in_buffer(a.weights, offset);
    a.slots = in_buffer(a.slots, offset);
    a.weight_staging = in_buffer(a.weight_staging, offset);
    a.slot_staging = in_buffer(a.slot_staging, offset);
    a.choice_flags = in_buffer(a.choice_flags, offset);
    a.choice_slots = a.choice_slots != nullptr ? in_buffer(a.choice_slots, offset) : nullptr;
    return a;
}

// A combine's send, besides: its handle's combine record (`recorded`) names no combine still in flight
// (each combine of a handle records its number there, where its hook finds it: two at once would share it).
__device__ __forceinline__ bool handle_busy(const CombineArgs&, uint64_t recorded, const ReceivedCalls& received) {
    return recorded != 0 && received.on_buffer_of(recorded) < recorded;
}
// A refused combine leaves the record to the combine it names, whose hook still finds it.
__device__ __forceinline__ void record_call(const CombineArgs& a, uint64_t seq, bool in_order) {
    if (in_order)
        *a.call_record = seq;
}

// What a warp group knows about its pair: this rank's rows holding the token's experts and their weights.
struct PairRows {
    int rows[kMaxTopk];
    int choices[kMaxTopk];  // top-k slot of each row
    float weights[kMaxTopk];
    int count;
    int first_row;  // rows[0] as gather_pair_rows found it (-1: none), the row whose loads send_partial starts
                    // early: gather_pair_weights may then drop rows, which the other warps must not race
    bool ready;  // the weights are here (or the pair needs none); false: they never came, or are not here yet
    bool fell_back;  // some LogFMT block of the partial went as BF16: the whole message travels
};

// Warp 0 of a group: this rank's rows for pair (s, t), in choice order.
static __device__ void gather_pair_rows(const CombineArgs& a, int s, int t, PairRows& pair) {
    const int lane = threadIdx.x % kWarpSize;
    const int64_t entry = (static_cast<int64_t>(s) * a.max_tokens + t) * a.num_topk;
    const int num_rows = a.num_experts / a.num_ranks * a.num_ranks * a.max_tokens;
    int row = lane < a.num_topk ? __ldg(a.combine_rows + entry + lane) : -1;
    if (row >= num_rows)  // never read outside x, whatever a dispatch that lost a rank midway left here
        row = -1;
    const uint32_t held = __ballot_sync(kFullWarpMask, row >= 0);
    if (row >= 0) {
        const int slot = __popc(held & ((1u << lane) - 1));
        pair.rows[slot] = row;
        pair.choices[slot] = lane;
    }
    const int first_row = held != 0 ? __shfl_sync(kFullWarpMask, row, __ffs(held) - 1) : -1;  // warp-uniform
    if (lane == 0) {
        pair.count = __popc(held);
        pair.first_row = first_row;
    }
}

// Warp 0 of a group, after gather_pair_rows and a group barrier: source s's weights of the pair's rows,
// waited for, or with `split_ns` (s a direct peer) looked for until the global timer passes it: a pair
// whose weights are not all here by then is not ready, and goes as its rows, unweighted (weights 1).
// This rank's own tokens (s the rank) take theirs from the launch's input: always ready. A ready pair
// then keeps only the rows whose choices the combine's ids still route (pair.count drops).
static __device__ void gather_pair_weights(const CombineArgs& a, int s, int t, uint64_t seq, uint64_t deadline_ns,
                                    PairRows& pair, uint64_t split_ns) {
    const int lane = threadIdx.x % kWarpSize;
    const int count = pair.count;
    // A pair of one row goes unweighted and its source applies the weight (gather_partials): such a
    // partial needs nothing from the source, so it leaves at once, before the weights can arrive.
    bool ready = count == 1;
    uint32_t weight = __float_as_uint(1.0f);  // this lane's row's weight word (lane < count)
    const uint64_t* token_weights =
        a.weights + static_cast<int64_t>(s) * a.weight_words + static_cast<int64_t>(t) * a.num_topk;
    if (count > 0 && s == a.rank) {  // warp-uniform
        // This rank's own token: its weights are this launch's input, the words it publishes (combine_send)
        // before they land. Read there, the pair never waits for its own table, nor splits in a hook's send;
        // and a row of one whose only choice is unrouted now is not sent.
        if (lane < count)
            weight = weight_word(a, static_cast<int64_t>(t) * a.num_topk + pair.choices[lane]);
        ready = true;
    } else if (count > 1 && split_ns != 0) {  // warp-uniform
        uint64_t word = 0;
        bool looking = true;
        do {
            word = lane < count ? ld_volatile_global(token_weights + pair.choices[lane]) : 0;
            ready = __all_sync(kFullWarpMask, lane >= count || has_tag(word, seq));
            // Lane 0's clock decides for the warp: lanes that read it apart must not leave apart.
            looking = __shfl_sync(kFullWarpMask, globaltimer_ns() < split_ns, 0);
        } while (!ready && looking);
        if (ready)
            weight = static_cast<uint32_t>(word);
    } else if (count > 1) {  // warp-uniform
        if (lane == 0)
            ready = table_signalled(a, a.weight_flags + s, seq, deadline_ns, a.status, s, kPhaseLowLatencyWeights);
        ready = __shfl_sync(kFullWarpMask, ready, 0);
        if (ready && lane < count)
            ready = read_word(token_weights + pair.choices[lane], seq, deadline_ns, a.status, s, kPhaseLowLatencyWeights,
                              weight);
        ready = __all_sync(kFullWarpMask, ready);
    }
    // A choice set to -1 since the dispatch takes no row: the pair keeps the rows still routed, as many as the
    // token's source counts on this rank (gather_partials), which weighs a partial of one row itself. So a pair
    // left with one row goes unweighted, and one left with none sends nothing. Rows of a pair not ready all go.
    const bool kept = lane < count && !(ready && weight == kUnroutedWeight);
    const uint32_t kept_lanes = __ballot_sync(kFullWarpMask, kept);
    const int kept_count = __popc(kept_lanes);
    const int row = kept ? pair.rows[lane] : 0, choice = kept ? pair.choices[lane] : 0;
    __syncwarp();  // every lane read its row before a lower slot is written
    if (kept) {
        const int slot = __popc(kept_lanes & ((1u << lane) - 1));
        pair.rows[slot] = row;
        pair.choices[slot] = choice;
        pair.weights[slot] = ready && kept_count > 1 ? __uint_as_float(weight) : 1.0f;
    }
    if (lane == 0) {
        pair.count = kept_count;
        pair.ready = ready;
    }
}

// This thread's vectors of one stride of expert-output row `row` (kPartialBatch, kGroupThreads apart from `first`).
__device__ __forceinline__ void load_row_stride(const CombineArgs& a, int row, int first, int4 (&raw)[kPartialBatch]) {
    const int num_vectors = a.hidden / kBf16PerVector;
    const int4* x = a.x + static_cast<int64_t>(row) * num_vectors;
#pragma unroll
    for (int i = 0; i < kPartialBatch; ++i)
        if (first + i * kGroupThreads < num_vectors)
            raw[i] = ld_nc_global(x + first + i * kGroupThreads);
}

// Warp group: the FP32 weighted sum of the pair's rows [first_row, first_row + count) (pair.weights), as
// LogFMT where `coded` (coded in the group's `stage`), else BF16, at `out_bytes` (this GPU's store address
// of the message), then the message's flag (`flag`, a symmetric address) raised to seq on s: a release
// store where `is_direct` (`out_bytes` is s's memory), else a put of `slot` from `out_bytes` (staged) then
// its signal. With `preloaded`, `raw` holds this thread's first stride of the first row.
static __device__ void store_message(const CombineArgs& a, int s, uint64_t seq, const Team& group, PairRows& pair,
                                     PartialStage& stage, int first_row, int count, bool coded,
                                     int4 (&raw)[kPartialBatch], bool preloaded, uint8_t* out_bytes, bool is_direct,
                                     uint8_t* slot, uint64_t* flag) {
    const int thread = group.thread();
    int4* out = reinterpret_cast<int4*>(out_bytes);
    const int num_vectors = a.hidden / kBf16PerVector;
    const LogFmtLayout logfmt(a.hidden);
    // The whole group runs each stride (LogFMT codes a block per half-warp, with shuffles, and the group
    // shares a stage); the loads and stores of lanes past the end are predicated off.
    for (int first = thread; first - thread < num_vectors; first += kPartialBatch * kGroupThreads) {
        float sum[kPartialBatch][kBf16PerVector] = {};
        for (int j = first_row; j < first_row + count; ++j) {
            if (!preloaded || j > first_row || first != thread)
                load_row_stride(a, pair.rows[j], first, raw);
            const float weight = pair.weights[j];
#pragma unroll
            for (int i = 0; i < kPartialBatch; ++i)
                accumulate_bf16x8(sum[i], raw[i], weight);
        }
        if (coded) {
            const int first_block = (first - thread) / kLogFmtLanes;
            if (first != thread)
                group.sync();  // the previous stride's copy has read the stage
#pragma unroll
            for (int i = 0; i < kPartialBatch; ++i) {
                const int v = first + i * kGroupThreads;
                if (stage_logfmt_vector(stage, first_block, out_bytes, logfmt, v, sum[i], v < num_vectors))
                    pair.fell_back = true;
            }
            group.sync();
            copy_logfmt_stage(stage, first_block, min(kStageBlocks, logfmt.blocks - first_block), out_bytes, logfmt,
                              thread, kGroupThreads);
        } else {
#pragma unroll
            for (int i = 0; i < kPartialBatch; ++i)
                if (first + i * kGroupThreads < num_vectors)
                    st_na_global(out + first + i * kGroupThreads, floats_to_bf16x8(sum[i]));
        }
    }
    group.sync();
    if (thread == 0)
        trace_latest(a.trace, kTracePartialStored);
    if (is_direct) {
        if (thread == 0)  // after the group barrier: the release covers the whole group's stores
            st_release_sys_global(direct_address(flag, s, a.rank, false), seq);
    } else if (thread < kWarpSize) {
        const int bytes = !coded           ? a.hidden * 2
                          : pair.fell_back ? logfmt.message_bytes
                                           : logfmt.encoded_bytes;
        put_then_signal_warp(slot, out_bytes, static_cast<size_t>(bytes), flag, seq, s);
    }
    if (thread == 0)
        trace_latest(a.trace, kTracePartialFlagged);
}

// Warp group: send pair (source s, token t): the FP32 weighted sum of this rank's rows for it into slot
// (this rank, t) of s, as one BF16 or LogFMT partial. A pair of several rows needs s's weights; to a
// direct peer that has not published them by `split_ns` (it is late, or still sending), the rows go one
// by one instead, unweighted, into choice slots (t, k) of s, which weighs them (combine_token): the send
// waits for no peer beyond that. (Ranks in step, as in a CUDA graph, find the weights within a few
// microseconds; splitting at once would double the bytes of such a combine.) Such rows travel as BF16
// with LogFMT too: they cross NVLink only, where coding each row costs the send more than its bytes. A
// put peer's pair waits for the weights (its rows would need staging of their own). The first row's
// loads are in flight meanwhile.
static __device__ void send_partial(const CombineArgs& a, int s, int t, uint64_t seq, uint64_t deadline_ns,
                                    uint64_t split_ns, const Team& group, PairRows& pair, PartialStage& stage) {
    const int thread = group.thread();
    if (thread < kWarpSize)
        gather_pair_rows(a, s, t, pair);
    if (thread == 0)
        pair.fell_back = false;
    group.sync();
    int4 raw[kPartialBatch];
    const int loaded_row = pair.first_row;
    if (loaded_row >= 0)
        load_row_stride(a, loaded_row, thread, raw);
    uint8_t* slot = message_slot(a.slots, a.rank, t, a.max_tokens, a.slot_bytes);
    uint8_t* direct = direct_address(slot, s, a.rank, a.force_put);
    const bool may_split = direct != nullptr && a.choice_slots != nullptr;
    if (thread < kWarpSize)
        gather_pair_weights(a, s, t, seq, deadline_ns, pair, may_split ? split_ns : 0);
    group.sync();
    if (thread == 0)
        trace_latest(a.trace, kTraceWeightsReady);
    // The pair's rows may have dropped one (gather_pair_weights): the row in flight is the first one only if kept.
    const bool preloaded = pair.count > 0 && pair.rows[0] == loaded_row;
    if (pair.ready && pair.count > 0) {
        uint8_t* out = direct != nullptr ? direct : message_slot(a.slot_staging, s, t, a.max_tokens, a.slot_bytes);
        // A partial for this rank itself stays on the GPU: coding it would cost the send and the receive for
        // no bytes saved, so it goes as BF16 with LogFMT too (gather_partials sorts it among the BF16 parts).
        const bool coded = a.use_logfmt && s != a.rank;
        store_message(a, s, seq, group, pair, stage, 0, pair.count, coded, raw, preloaded, out, direct != nullptr,
                      slot, a.token_flags + static_cast<int64_t>(a.rank) * a.flag_stride + t);
    } else if (!pair.ready && may_split && pair.count > 1) {
        for (int j = 0; j < pair.count; ++j) {
            const int64_t choice = static_cast<int64_t>(t) * kChoiceSlots + pair.choices[j];
            store_message(a, s, seq, group, pair, stage, j, 1, false, raw, preloaded && j == 0,
                          direct_address(a.choice_slots + choice * a.slot_bytes, s, a.rank, false), true, nullptr,
                          a.choice_flags + choice);
        }
    }
    group.sync();  // every thread read `pair` before the next pair overwrites it
}

static __device__ void combine_send(const CombineArgs& a, uint64_t seq, uint64_t deadline_ns) {
    __shared__ PairRows pairs[kGroupsPerBlock];
    __shared__ PartialStage stages[kGroupsPerBlock];
    // A pair that may split (send_partial) looks for its source's weights until split_ns, then splits. A
    // launch that receives too waits for its peers anyway, so its pairs look for split_after_ns, which keeps
    // ranks in step (graph replays) at one partial per pair. A hook's send (this launch does not receive)
    // looks for hook_split_after_ns: as long, where the host captured it into a CUDA graph, else
    // CUEP_COMBINE_HOOK_SPLIT_US (0 by default: one look, no wait for a peer). A pair that may not split (a
    // put peer, more than kChoiceSlots choices, shrink mode) waits for its weights in either launch; a pair
    // of this rank's own token neither looks nor waits (gather_pair_weights).
    const uint64_t split_ns =
        globaltimer_ns() + ((a.phases & kRecvPhase) ? a.split_after_ns : a.hook_split_after_ns);
    // This rank's weights (kUnroutedWeight where the id is -1) go to every rank first: the others look for them.
    // They go from the last blocks, which hold the fewest pairs.
    const int count = a.num_tokens * a.num_topk;
    for (int pe = gridDim.x - 1 - blockIdx.x; pe < a.num_ranks; pe += gridDim.x) {
        if (team_sees_masked(whole_block(), a.status, pe))
            continue;
        publish_table(whole_block(), a.weights + static_cast<int64_t>(a.rank) * a.weight_words,
                      a.weight_staging + static_cast<int64_t>(pe) * a.staging_words, count,
                      [&](int i) { return weight_word(a, i); }, a.weight_flags + a.rank, seq, pe, a.rank, a.force_put);
        trace_block(a.trace, kTraceTablePublished);
    }
    // One pair per warp group, first to group 0 of every block, so that when pairs are fewer than
    // groups (EP2) the remote partials leave from every SM rather than from the first blocks' four
    // groups each. Pairs interleave sources, so neighbouring blocks write to different ranks.
    const int group = threadIdx.x / kGroupThreads;
    const int num_groups = gridDim.x * kGroupsPerBlock;
    for (int i = group * gridDim.x + blockIdx.x; i < a.num_ranks * a.max_tokens; i += num_groups) {
        const int s = (i + a.rank) % a.num_ranks, t = i / a.num_ranks;
        if (t < __ldg(a.source_tokens + s) && !team_sees_masked(warp_group(group), a.status, s))
            send_partial(a, s, t, seq, deadline_ns, split_ns, warp_group(group), pairs[group], stages[group]);
    }
}

// Warp 0: what to add for token t, written to `parts` and `part_weights` (kMaxTopk entries of shared
// memory, nullptr where a message never came), the `num_coded` partials of other ranks first (LogFMT where
// the call is), then this rank's own partial and the rows sent one by one (BF16); returns how many in all.
// Each rank holding some of the token's experts sent one partial at slot (rank, t): weighted here when it
// holds one choice (of those the combine's ids still route), summed with the weights there when it holds
// several. Or, when it did not have the weights yet, each choice's row at choice slot (t, k), weighted here
// (send_partial; never this rank's own). Masked ranks (shrink mode) add nothing.
static __device__ int gather_partials(const CombineArgs& a, int t, uint64_t seq, uint64_t deadline_ns,
                                      const uint8_t** parts, float* part_weights, int& num_coded) {
    const int lane = threadIdx.x % kWarpSize;
    int r = -1;
    float weight = 0.0f;
    if (lane < a.num_topk) {
        const int64_t choice = static_cast<int64_t>(t) * a.num_topk + lane;
        const int id = read_expert_id(a.topk_idx, a.ids_are_int64, choice, a.num_experts, a.status);
        r = id >= 0 ? id / (a.num_experts / a.num_ranks) : -1;
        weight = a.topk_weights[choice];
    }
    // Every flag this token may wait for, read beside its choices rather than after them (a hook's
    // receive finds them all cold), one a lane: lane r < R rank r's partial flag, lane R + k choice k's
    // row flag where rows may come (and the warp has a lane for each). The waits below then start from
    // values in hand. A lane's acquire orders the whole block's later reads (the barrier after this).
    const bool rows_early = a.choice_slots != nullptr && a.num_ranks + a.num_topk <= kWarpSize;
    const uint64_t* early_word =
        lane < a.num_ranks ? a.token_flags + static_cast<int64_t>(lane) * a.flag_stride + t
        : rows_early && lane < a.num_ranks + a.num_topk
            ? a.choice_flags + static_cast<int64_t>(t) * kChoiceSlots + lane - a.num_ranks
            : nullptr;
    const uint64_t early_flag = early_word != nullptr ? ld_acquire_sys_global(early_word) : 0;
    const bool rank_known = r >= 0 && r < kWarpSize, choice_known = rows_early && lane < a.num_topk;
    const uint64_t rank_flag = __shfl_sync(kFullWarpMask, early_flag, rank_known ? r : 0);
    const uint64_t choice_flag = __shfl_sync(kFullWarpMask, early_flag, choice_known ? a.num_ranks + lane : 0);
    const uint32_t same_rank = __match_any_sync(kFullWarpMask, r);  // every lane: a full-mask intrinsic
    const int leader = __ffs(same_rank) - 1;
    const int choices = __popc(same_rank);
    // The first lane naming a rank decides for all of them (a mask landing meanwhile must not split a
    // rank's choices), and waits for its message.
    int form = 0;  // 0: nothing to add, 1: the rank's partial, 2: each choice's row
    if (lane == leader && r >= 0 && !a.status.is_masked(r)) {
        const uint64_t started = a.wait_stats != nullptr ? globaltimer_ns() : 0;
        // A rank of one choice may send its row too: one that held more at the dispatch, whose others were set
        // to -1 since, and could not weigh them (send_partial). This rank's own pairs never go as rows.
        const uint64_t* row_flag = a.choice_slots != nullptr && r != a.rank
                                       ? a.choice_flags + static_cast<int64_t>(t) * kChoiceSlots + lane
                                       : nullptr;
        // The rank's partial, or the first of its rows sent one by one, from the values read early where
        // there are.
        form = wait_for_call_on(a.token_flags + static_cast<int64_t>(r) * a.flag_stride + t, row_flag, seq,
                                deadline_ns, a.status, r, kPhaseLowLatencyPartial,
                                FlagsRead{rank_known, row_flag != nullptr && choice_known, rank_flag, choice_flag});
        add_wait(a.wait_stats, r, started);
    }
    form = __shfl_sync(kFullWarpMask, form, leader);
    const uint8_t* part = nullptr;
    bool adds = false;
    if (form == 1 && lane == leader) {
        adds = true;
        part = message_slot(a.slots, r, t, a.max_tokens, a.slot_bytes);
        weight = choices == 1 ? weight : 1.0f;
    } else if (form == 2) {
        adds = true;
        const int64_t choice = static_cast<int64_t>(t) * kChoiceSlots + lane;
        if (lane == leader || wait_for_call_on(a.choice_flags + choice, nullptr, seq, deadline_ns, a.status, r,
                                               kPhaseLowLatencyPartial, FlagsRead{choice_known, false, choice_flag}))
            part = a.choice_slots + choice * a.slot_bytes;
    }
    // Other ranks' partials first, then the rest: the two may differ in format (this rank's own partial and
    // rows travel as BF16).
    const bool coded = adds && form == 1 && r != a.rank;
    const uint32_t coded_lanes = __ballot_sync(kFullWarpMask, coded);
    const uint32_t bf16_lanes = __ballot_sync(kFullWarpMask, adds && !coded);
    if (adds) {
        const uint32_t below = (1u << lane) - 1;
        const int i = coded ? __popc(coded_lanes & below) : __popc(coded_lanes) + __popc(bf16_lanes & below);
        parts[i] = part;
        part_weights[i] = weight;
    }
    num_coded = __popc(coded_lanes);
    return __popc(coded_lanes | bf16_lanes);
}

// How combine_token reads a part's vector `v`: a BF16 partial's vector whole, or a LogFMT partial's codes.
struct Bf16Parts {
    using Loaded = int4;
    __device__ Loaded load(const uint8_t* part, int v) const { return ld_cg_global(reinterpret_cast<const int4*>(part) + v); }
    __device__ void add(float (&sum)[kBf16PerVector], const Loaded& raw, const uint8_t*, int, float weight) const {
        accumulate_bf16x8(sum, raw, weight);
    }
};
struct LogFmtParts {
    LogFmtLayout layout;
    using Loaded = LogFmtCodes;
    __device__ Loaded load(const uint8_t* part, int v) const { return load_logfmt_codes(part, layout, v); }
    __device__ void add(float (&sum)[kBf16PerVector], const Loaded& codes, const uint8_t* part, int v,
                        float weight) const {
        accumulate_logfmt_vector(sum, codes, part, layout, v, weight);
    }
};

// This thread's vectors [first, first + kSumBatch * blockDim.x) of token t: sum += parts [begin, end) (nullptr:
// a message that never came), in `format`, times their weights. The thread loads its vectors of
// kPartialsAtOnce parts before it adds any, so that a token waits for a few loads' latency, not one per part.
// A vector past the end, or of a message that never came, loads as zeros, which add nothing in either
// format: no branch per vector.
template <typename Parts>
__device__ __forceinline__ void add_parts(float (&sum)[kSumBatch][kBf16PerVector], int first, int num_vectors,
                                          const uint8_t* const* parts, const float* part_weights, int begin, int end,
                                          const Parts& format) {
    for (int base = begin; base < end; base += kPartialsAtOnce) {
        typename Parts::Loaded raw[kPartialsAtOnce][kSumBatch];
#pragma unroll
        for (int i = 0; i < kPartialsAtOnce; ++i) {
            const uint8_t* part = parts[min(base + i, end - 1)];
#pragma unroll
            for (int j = 0; j < kSumBatch; ++j) {
                const int v = first + j * blockDim.x;
                raw[i][j] = base + i < end && v < num_vectors && part != nullptr ? format.load(part, v)
                                                                                 : typename Parts::Loaded{};
            }
        }
#pragma unroll
        for (int i = 0; i < kPartialsAtOnce; ++i) {
            if (base + i >= end)  // block-uniform
                break;
            const uint8_t* part = parts[base + i];
            const float weight = part_weights[base + i];
#pragma unroll
            for (int j = 0; j < kSumBatch; ++j)
                format.add(sum[j], raw[i][j], part, first + j * blockDim.x, weight);
        }
    }
}

// Block-wide: sum, in FP32, what every rank holding one of token t's experts sent (gather_partials): its
// partials, BF16 or LogFMT (this rank's own, BF16), and rows sent one by one, BF16.
__device__ void combine_token(const CombineArgs& a, int t, uint64_t seq, uint64_t deadline_ns) {
    __shared__ const uint8_t* parts[kMaxTopk];
    __shared__ float part_weights[kMaxTopk];
    __shared__ int num_parts, num_coded;
    if (threadIdx.x < kWarpSize) {
        int partials_coded;
        const int count = gather_partials(a, t, seq, deadline_ns, parts, part_weights, partials_coded);
        if (threadIdx.x == 0) {
            num_parts = count;
            num_coded = partials_coded;
        }
    }
    __syncthreads();
    trace_block(a.trace, kTracePartialsArrived);
    const int num_vectors = a.hidden / kBf16PerVector;
    const int count = num_parts, coded = a.use_logfmt ? num_coded : 0;
    for (int first = threadIdx.x; first < num_vectors; first += kSumBatch * blockDim.x) {
        float sum[kSumBatch][kBf16PerVector] = {};
        if (coded > 0)
            add_parts(sum, first, num_vectors, parts, part_weights, 0, coded, LogFmtParts{LogFmtLayout(a.hidden)});
        add_parts(sum, first, num_vectors, parts, part_weights, coded, count, Bf16Parts{});
#pragma unroll
        for (int j = 0; j < kSumBatch; ++j)
            if (first + j * blockDim.x < num_vectors)
                a.combined_x[static_cast<int64_t>(t) * num_vectors + first + j * blockDim.x] = floats_to_bf16x8(sum[j]);
    }
    __syncthreads();
}

static __device__ void combine_recv(const CombineArgs& a, uint64_t seq, uint64_t deadline_ns) {
    for (int t = blockIdx.x; t < a.num_tokens; t += gridDim.x)
        combine_token(a, t, seq, deadline_ns);
    trace_block(a.trace, kTraceTokensSummed);
    // The receive completes only once every live peer has sent this call (its weights flag, raised first):
    // a partial-free peer too, so that the call order's bound on how far a peer runs ahead holds. Checked
    // after block 0's tokens, which do not read the peers' weights.
    if (blockIdx.x == 0)
        for (int s = threadIdx.x; s < a.num_ranks; s += blockDim.x)
            if (!a.status.is_masked(s))
                wait_for_call(a.weight_flags + s, seq, deadline_ns, a.status, s, kPhaseLowLatencyWeights);
}

}  // namespace cuep

namespace cuep::low_latency {

__global__ void __launch_bounds__(kNumThreads, 1) dispatch(const DispatchArgs launched) {
    cuep::trace_block(launched.trace, cuep::kTraceEntry);
    uint64_t seq;
    const bool in_order = cuep::start_call(launched, seq);
    const cuep::DispatchArgs args = cuep::in_buffer(launched, seq);
    const uint64_t deadline_ns = cuep::globaltimer_ns() + args.timeout_ns;
    cuep::trace_block(args.trace, cuep::kTraceStart);
    if (in_order && !cuep::sits_out(args))
        cuep::dispatch(args, seq, deadline_ns);
    if constexpr (cuep::kTrace)
        __syncthreads();  // the end is the last team's
    cuep::trace_block(args.trace, cuep::kTraceEnd);
    cuep::finish_launch(args, seq, in_order);
    cuep::trace_block(args.trace, cuep::kTraceExit);
}


__global__ void __launch_bounds__(kNumThreads, 1) combine(const CombineArgs launched) {
    cuep::trace_block(launched.trace, cuep::kTraceEntry);
    uint64_t seq;
    const bool in_order = cuep::start_call(launched, seq);
    const cuep::CombineArgs args = cuep::in_buffer(launched, seq);
    const uint64_t deadline_ns = cuep::globaltimer_ns() + args.timeout_ns;
    cuep::trace_block(args.trace, cuep::kTraceStart);
    const bool sits_out = !in_order || cuep::sits_out(args);
    // Shrink mode: the send's waits (a source's weights) end at half the timeout. A warp group that waits
    // for a lost source sends its next pairs only then, and their ranks' waits for them must not run
    // out first, or they would mask a live rank.
    const uint64_t send_deadline_ns =
        args.status.masked != nullptr ? deadline_ns - args.timeout_ns / 2 : deadline_ns;
    if (!cuep::kReceiveOnly && !sits_out && (args.phases & cuep::kSendPhase))
        cuep::combine_send(args, seq, send_deadline_ns);
    if (!sits_out && (args.phases & cuep::kRecvPhase))
        cuep::combine_recv(args, seq, deadline_ns);
    cuep::trace_block(args.trace, cuep::kTraceEnd);
    cuep::finish_launch(args, seq, in_order);
    cuep::trace_block(args.trace, cuep::kTraceExit);
}

}  // namespace cuep::low_latency
