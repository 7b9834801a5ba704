// Low-latency (decode) dispatch and combine through NVSHMEM, for any number of ranks.
//
// Each rank's low-latency buffer (NVSHMEM symmetric memory; cuep/kernels/low_latency.py lays it out)
// has two halves that calls alternate between, so one call's data can still be in flight while the
// next is sent. Every flag is a uint64 that only grows: a call numbered `seq` (counted on the device,
// equal on every rank) raises flags to `seq`, so nothing is ever reset between calls and a CUDA graph
// that replays a call keeps counting.
//
// Dispatch (rank s sends its T tokens; every rank holds L = E / R experts):
//   send: s publishes its routing table (T and its top-k ids) to every rank, then writes each token
//         once per destination *rank* (not per expert), FP8-quantised or BF16, into slot (s, t) of
//         that rank's buffer and raises the slot's flag.
//   recv: rank r reads every routing table, lays out each local expert's rows by (source rank,
//         source token), and fans each arrived token out into the rows of its local experts.
// Combine (the reverse; rank r holds the expert outputs x[L, R * T_max, H]):
//   send: every source s publishes its top-k weights to every rank; r then sums, in FP32, the
//         weighted outputs of its local experts for each (s, t) it received and writes that one
//         BF16 partial into slot (r, t) of s's buffer, so each (token, rank) pair crosses once.
//   recv: s adds, in FP32, the partials of every rank that held one of its token's experts.
// Peers reachable by load/store (nvshmem_ptr) get direct stores then a release store of the flag;
// other peers, or every peer when the put path is forced, get an NVSHMEM put-with-signal from a
// staging copy in this rank's buffer.
//
// Every wait is bounded: a timed-out wait records the peer and phase in `status` (mirrored to
// pinned host memory, so no copy is enqueued per call) and every later wait of the launch gives up
// at once; the host raises PeerTimeoutError.

// libnvshmem_device.a (3.8) does not export nvshmemi_transfer_put_signal_dispatch<scope>, which the
// put-with-signal calls reach; with this switch the headers compile the transfer code in here
// (network puts then go through NVSHMEM's proxy under NVRTC, which has no IBGDA).
#define NVSHMEM_ENABLE_ALL_DEVICE_INLINING
#include <nvshmem.h>
#include <nvshmemx.h>
#include <cuda_bf16.h>

#include <cuep/common.cuh>
#include <cuep/fp8.cuh>
#include <cuep/ptx.cuh>
#include <cuep/sync.cuh>

namespace cuep {

constexpr int kNumThreads = 512;
constexpr int kMaxTopk = 32;             // mirrors MAX_TOPK in cuep/kernels/low_latency.py
constexpr int kBf16PerVector = 8;        // one 16-byte vector of bf16
constexpr int kBytesPerVector = 16;
constexpr int kScaleBlock = 128;         // channels per FP8 scale
constexpr int kLanesPerScaleBlock = kScaleBlock / kBf16PerVector;
constexpr int kScalesPerUe8m0Word = 4;   // UE8M0 exponents packed in one int32
constexpr float kMinAmax = 1e-4f;        // keeps the scale finite for an all-zero block
constexpr int kRoutingHeaderWords = 4;   // routing table: [num_tokens, 0, 0, 0, ids[T_max][K]]
// Loads a thread issues before its first store. Every loop below that moves data loads a batch, then
// stores it: stores are ordered after earlier loads, so a loop that alternated them would wait out
// one memory latency per element. Sized to the 128 registers a thread has at 512 threads (more spills).
constexpr int kCopyBatch = 8;            // receive copy: 16-byte vectors per lane (FP8 7168: 14, two batches)
constexpr int kSendBatch = 4;            // dispatch send: block-wide strides of a token (BF16 7168: 2)
constexpr int kGroupThreads = 128;       // combine send: one warp group per (source, token) pair
constexpr int kGroupsPerBlock = kNumThreads / kGroupThreads;
constexpr int kPartialBatch = 7;         // combine send: vectors per thread summed at once (7168: 7)
constexpr int kSumBatch = 2;             // combine receive: block-wide strides summed at once (7168: 2)
constexpr int kPartialsAtOnce = 4;       // combine receive: partials loaded before adding

constexpr int kSendPhase = 1;            // mirrors SEND_PHASE / RECV_PHASE in the launch module
constexpr int kRecvPhase = 2;

// Words of the per-Buffer sequence state (device memory, not symmetric).
constexpr int kSeqLatest = 0;            // number of the newest call sent
constexpr int kSeqOfHalf = 1;            // [2]: number of the newest call sent on each half
constexpr int kSeqBlocksDone = 3;        // [2]: blocks of the running send launch that finished

// ---------------------------------------------------------------------------------------------
// Launch bookkeeping

// A launch with the send phase numbers a new call; a receive-only launch (a hook) completes the
// newest call sent on its half.
__device__ __forceinline__ uint64_t call_number(uint64_t* seq_state, int phases, int half) {
    return (phases & kSendPhase) ? ld_volatile_global(seq_state + kSeqLatest) + 1
                                 : ld_volatile_global(seq_state + kSeqOfHalf + half);
}

// The last block of a send launch publishes its call number (every block has read the old one).
__device__ __forceinline__ void finish_send_launch(uint64_t* seq_state, int phases, int half, uint64_t seq) {
    if (!(phases & kSendPhase))
        return;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(reinterpret_cast<unsigned long long*>(seq_state + kSeqBlocksDone + half), 1ull) ==
            gridDim.x - 1) {
            seq_state[kSeqBlocksDone + half] = 0;
            seq_state[kSeqLatest] = seq;
            seq_state[kSeqOfHalf + half] = seq;
        }
    }
}

struct Status {
    int32_t* device;  // the words a launch updates atomically
    int32_t* host;    // pinned host mirror (device-visible), read by the host without a copy

    __device__ bool timed_out() const { return ld_volatile_global(device + kStatusTimedOut) != 0; }

    __device__ void record_timeout(int32_t peer, int32_t phase) const {
        if (cuep::record_timeout(device, peer, phase)) {  // the first timeout is mirrored for the host
            host[kStatusPeer] = peer;
            host[kStatusPhase] = phase;
            __threadfence_system();
            *reinterpret_cast<volatile int32_t*>(host + kStatusTimedOut) = 1;
        }
    }

    __device__ void record_bad_expert_id() const {
        device[kStatusBadExpertIds] = 1;
        *reinterpret_cast<volatile int32_t*>(host + kStatusBadExpertIds) = 1;
    }
};

// Wait until *flag >= seq. Gives up at the deadline (recording who never came) or at once when
// another wait of this launch already timed out: the call's result is void then, and one dead peer
// must cost one timeout, not one per token.
__device__ __forceinline__ bool wait_for_flag(const uint64_t* flag, uint64_t seq, uint64_t deadline_ns,
                                              const Status& status, int peer, int phase) {
    while (ld_acquire_sys_global(flag) < seq) {
        if (status.timed_out())
            return false;
        if (globaltimer_ns() > deadline_ns) {
            status.record_timeout(peer, phase);
            return false;
        }
    }
    return true;
}

// An expert id from the caller's top-k array; ids outside [-1, num_experts) count as -1 and are reported.
__device__ __forceinline__ int read_expert_id(const void* topk_idx, bool ids_are_int64, int64_t i, int num_experts,
                                              const Status& status) {
    const int64_t id = ids_are_int64 ? static_cast<const int64_t*>(topk_idx)[i] : static_cast<const int32_t*>(topk_idx)[i];
    if (id < -1 || id >= num_experts) {
        status.record_bad_expert_id();
        return -1;
    }
    return static_cast<int>(id);
}

// Where this GPU can store into `pe`'s copy of a symmetric address, or nullptr when it must put.
template <typename T>
__device__ __forceinline__ T* direct_address(T* symmetric, int pe, int rank, bool force_put) {
    if (pe == rank)
        return symmetric;
    return force_put ? nullptr : static_cast<T*>(nvshmem_ptr(symmetric, pe));
}

// Block-wide: write `count` words, word i = value(i), into `table` (this rank's slot, a symmetric
// address) on `pe`, then raise `flag` on `pe` to `seq`. `staging`: this rank's symmetric scratch
// for the put path.
template <typename Value>
__device__ void publish_table(uint32_t* table, uint32_t* staging, int count, Value value, uint64_t* flag,
                              uint64_t seq, int pe, int rank, bool force_put) {
    uint32_t* direct = direct_address(table, pe, rank, force_put);
    uint32_t* target = direct != nullptr ? direct : staging;
    for (int i = threadIdx.x; i < count; i += blockDim.x)
        target[i] = value(i);
    __syncthreads();
    if (direct != nullptr) {
        // A release after the barrier covers every thread's stores (release is cumulative).
        if (threadIdx.x == 0)
            st_release_sys_global(direct_address(flag, pe, rank, false), seq);
    } else {
        nvshmemx_putmem_signal_nbi_block(table, staging, static_cast<size_t>(count) * sizeof(uint32_t), flag, seq,
                                         NVSHMEM_SIGNAL_SET, pe);
    }
    __syncthreads();
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

__device__ void raise_message_flags(const Destinations& dst, uint8_t* slot, const uint8_t* staged, int64_t bytes,
                                    uint64_t* flag, uint64_t seq, int rank) {
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < dst.count && dst.direct[threadIdx.x] != nullptr)
        st_release_sys_global(direct_address(flag, dst.pe[threadIdx.x], rank, false), seq);
    if (dst.any_put) {
        for (int i = 0; i < dst.count; ++i)
            if (dst.direct[i] == nullptr)
                nvshmemx_putmem_signal_nbi_block(slot, staged, bytes, flag, seq, NVSHMEM_SIGNAL_SET, dst.pe[i]);
    }
    __syncthreads();
}

__device__ __forceinline__ void bf16x8_to_floats(const int4& v, float (&f)[kBf16PerVector]) {
    const uint32_t words[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                               static_cast<uint32_t>(v.w)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(words[i] << 16);
        f[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ int4 floats_to_bf16x8(const float (&f)[kBf16PerVector]) {
    uint32_t words[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __nv_bfloat162 pair = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
        words[i] = *reinterpret_cast<const uint32_t*>(&pair);
    }
    return make_int4(words[0], words[1], words[2], words[3]);
}

// Smallest power of two >= value (value positive and normal).
__device__ __forceinline__ float power_of_two_at_least(float value) {
    uint32_t bits = __float_as_uint(value);
    if (bits & 0x7fffffu)
        bits = (bits & 0x7f800000u) + 0x800000u;
    return __uint_as_float(bits);
}

// Elements [0, count) moved by `store(i, load(i))`, this thread taking first, first + step, ...: it
// loads kCopyBatch of them before storing any (see kCopyBatch).
template <typename T, typename Load, typename Store>
__device__ __forceinline__ void batched_copy(int first, int step, int count, const Load& load, const Store& store) {
    for (int base = first; base < count; base += kCopyBatch * step) {
        T values[kCopyBatch];
#pragma unroll
        for (int i = 0; i < kCopyBatch; ++i)
            if (base + i * step < count)
                values[i] = load(base + i * step);
#pragma unroll
        for (int i = 0; i < kCopyBatch; ++i)
            if (base + i * step < count)
                store(base + i * step, values[i]);
    }
}

// ---------------------------------------------------------------------------------------------
// Dispatch

struct DispatchArgs {
    int phases, half;
    const int4* x;                 // [num_tokens, hidden] bf16
    int num_tokens, hidden, use_fp8, round_scale, use_ue8m0;
    const void* topk_idx;          // [num_tokens, num_topk], int64 or int32
    int ids_are_int64, num_topk, num_experts, rank, num_ranks, max_tokens, force_put;
    // This half of the buffer (symmetric addresses; the same offsets on every rank)
    uint64_t* routing_flags;       // [num_ranks]
    uint64_t* token_flags;         // [num_ranks][flag_stride]
    int flag_stride;
    uint32_t* routing;             // [num_ranks][routing_words]
    int routing_words;
    uint8_t* slots;                // [num_ranks][max_tokens][slot_bytes]
    int64_t slot_bytes;
    uint32_t* routing_staging;     // [num_ranks][routing_words]
    uint8_t* slot_staging;         // [max_tokens][slot_bytes]
    // Outputs
    uint8_t* recv_x;               // [L][num_ranks * max_tokens][hidden] e4m3, or bf16
    void* recv_scales;             // [L][scale columns][num_ranks * max_tokens]: float, or packed UE8M0 int32
    int32_t* recv_count;           // [L]
    int32_t* recv_src_info;        // [L][num_ranks * max_tokens]: source token of each row
    int64_t* layout_range;         // [L][num_ranks]: (first row << 32) | rows from that source
    int32_t* combine_rows;         // [num_ranks][max_tokens][num_topk]: flat row in x of combine, or -1
    int32_t* source_tokens;        // [num_ranks]: tokens each source sent
    int32_t* cumulative_stats;     // [L] or nullptr
    int num_parts;                 // blocks that share one local expert's rows
    uint64_t* seq_state;
    uint64_t timeout_ns;
    Status status;
};

__device__ __forceinline__ int64_t message_bytes(const DispatchArgs& a) {
    return a.use_fp8 ? a.hidden + a.hidden / kScaleBlock * static_cast<int64_t>(sizeof(float))
                     : static_cast<int64_t>(a.hidden) * 2;
}

// Warp 0: the ranks holding token t's experts, each once, in choice order, written to `ranks`
// (kMaxTopk entries of shared memory); returns how many (to warp 0). The caller syncs before others read.
__device__ int ranks_holding_token(const void* topk_idx, bool ids_are_int64, int t, int num_topk, int num_experts,
                                   int num_ranks, const Status& status, int* ranks) {
    const int lane = threadIdx.x % kWarpSize;
    int r = -1;
    if (lane < num_topk) {
        const int id = read_expert_id(topk_idx, ids_are_int64, static_cast<int64_t>(t) * num_topk + lane, num_experts,
                                      status);
        r = id >= 0 ? id / (num_experts / num_ranks) : -1;
    }
    const uint32_t same_rank = __match_any_sync(kFullWarpMask, r);  // every lane: a full-mask intrinsic
    const bool first = r >= 0 && __ffs(same_rank) - 1 == lane;
    const uint32_t firsts = __ballot_sync(kFullWarpMask, first);
    if (first)
        ranks[__popc(firsts & ((1u << lane) - 1))] = r;
    return __popc(firsts);
}

// The ranks holding token t's experts (each once), and where to store for each. Ends with a barrier.
__device__ void find_destinations(const DispatchArgs& a, int t, Destinations& dst) {
    if (threadIdx.x < kWarpSize) {
        const int count = ranks_holding_token(a.topk_idx, a.ids_are_int64, t, a.num_topk, a.num_experts, a.num_ranks,
                                              a.status, dst.pe);
        __syncwarp();
        uint8_t* slot = message_slot(a.slots, a.rank, t, a.max_tokens, a.slot_bytes);
        const bool mine = static_cast<int>(threadIdx.x) < count;
        if (mine)
            dst.direct[threadIdx.x] = direct_address(slot, dst.pe[threadIdx.x], a.rank, a.force_put);
        const bool put = mine && dst.direct[threadIdx.x] == nullptr;
        const uint32_t puts = __ballot_sync(kFullWarpMask, put);
        if (threadIdx.x == 0) {
            dst.count = count;
            dst.any_put = puts != 0;
        }
    }
    __syncthreads();
}

// Block-wide: this thread's vectors of token t in round `round` (kSendBatch block-wide strides),
// lanes past the end loading zeros so that every lane takes part in the scale shuffles.
__device__ __forceinline__ void load_token_round(const DispatchArgs& a, int t, int round, int4 (&raw)[kSendBatch]) {
    const int num_vectors = a.hidden / kBf16PerVector;
    const int4* row = a.x + static_cast<int64_t>(t) * num_vectors;
#pragma unroll
    for (int i = 0; i < kSendBatch; ++i) {
        const int v = (round * kSendBatch + i) * blockDim.x + threadIdx.x;
        raw[i] = v < num_vectors ? ld_nc_global(row + v) : make_int4(0, 0, 0, 0);
    }
}

// Store one vector of token t (loaded as `raw`, vector index v) to every destination, FP8-quantised or as is.
__device__ __forceinline__ void store_token_vector(const DispatchArgs& a, const Destinations& dst, uint8_t* staged,
                                                   int v, const int4& raw) {
    const int lane = threadIdx.x % kWarpSize;
    const bool active = v < a.hidden / kBf16PerVector;
    if (!a.use_fp8) {
        if (!active)
            return;
        for (int i = 0; i < dst.count; ++i)
            if (dst.direct[i] != nullptr)
                st_na_global(reinterpret_cast<int4*>(dst.direct[i]) + v, raw);
        if (staged != nullptr)
            reinterpret_cast<int4*>(staged)[v] = raw;
        return;
    }
    float f[kBf16PerVector];
    bf16x8_to_floats(raw, f);
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kBf16PerVector; ++i)
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
    uint2 packed;
    packed.x = e4m3x2_from_floats(__fmul_rn(f[0], scale), __fmul_rn(f[1], scale)) |
               (e4m3x2_from_floats(__fmul_rn(f[2], scale), __fmul_rn(f[3], scale)) << 16);
    packed.y = e4m3x2_from_floats(__fmul_rn(f[4], scale), __fmul_rn(f[5], scale)) |
               (e4m3x2_from_floats(__fmul_rn(f[6], scale), __fmul_rn(f[7], scale)) << 16);
    if (!active)
        return;
    const bool writes_scale = lane % kLanesPerScaleBlock == 0;
    const int64_t scale_offset = a.hidden + static_cast<int64_t>(v / kLanesPerScaleBlock) * sizeof(float);
    for (int i = 0; i < dst.count; ++i) {
        if (dst.direct[i] == nullptr)
            continue;
        st_na_global(reinterpret_cast<uint2*>(dst.direct[i]) + v, packed);
        if (writes_scale)
            *reinterpret_cast<float*>(dst.direct[i] + scale_offset) = scale_inv;
    }
    if (staged != nullptr) {
        reinterpret_cast<uint2*>(staged)[v] = packed;
        if (writes_scale)
            *reinterpret_cast<float*>(staged + scale_offset) = scale_inv;
    }
}

// Block-wide: write token t to every rank holding one of its experts (raise_token_flags publishes it).
// The first round of x is loaded before the destinations are looked up, so the two latencies overlap.
__device__ void send_token(const DispatchArgs& a, int t, Destinations& dst) {
    const int num_vectors = a.hidden / kBf16PerVector;
    const int round_vectors = kSendBatch * blockDim.x;
    const int num_rounds = (num_vectors + round_vectors - 1) / round_vectors;
    int4 raw[kSendBatch];
    load_token_round(a, t, 0, raw);
    find_destinations(a, t, dst);
    uint8_t* staged = dst.any_put ? a.slot_staging + static_cast<int64_t>(t) * a.slot_bytes : nullptr;
    for (int round = 0; round < num_rounds; ++round) {
        if (round > 0)
            load_token_round(a, t, round, raw);
#pragma unroll
        for (int i = 0; i < kSendBatch; ++i) {
            const int v = (round * kSendBatch + i) * blockDim.x + threadIdx.x;
            if (v - static_cast<int>(threadIdx.x % kWarpSize) < num_vectors)  // warp-uniform: whole warps shuffle
                store_token_vector(a, dst, staged, v, raw[i]);
        }
    }
}

// Raise token t's flag on every destination (after send_token wrote it there). Block-wide.
__device__ void raise_token_flags(const DispatchArgs& a, int t, const Destinations& dst, uint64_t seq) {
    uint8_t* slot = message_slot(a.slots, a.rank, t, a.max_tokens, a.slot_bytes);
    raise_message_flags(dst, slot, a.slot_staging + static_cast<int64_t>(t) * a.slot_bytes, message_bytes(a),
                        a.token_flags + static_cast<int64_t>(a.rank) * a.flag_stride + t, seq, a.rank);
}

// Send this block's tokens; the flags of token `deferred` (-1: none) are left to the caller.
__device__ void dispatch_send(const DispatchArgs& a, uint64_t seq, Destinations& dst, int deferred) {
    // Routing tables first (every receiver waits for all of them), from the last blocks, which have
    // no token when the grid outnumbers the tokens.
    const int table_words = kRoutingHeaderWords + a.num_tokens * a.num_topk;
    for (int pe = gridDim.x - 1 - blockIdx.x; pe < a.num_ranks; pe += gridDim.x) {
        auto word = [&](int i) -> uint32_t {
            if (i >= kRoutingHeaderWords)
                return static_cast<uint32_t>(read_expert_id(a.topk_idx, a.ids_are_int64, i - kRoutingHeaderWords,
                                                            a.num_experts, a.status));
            return i == 0 ? static_cast<uint32_t>(a.num_tokens) : 0u;
        };
        publish_table(a.routing + static_cast<int64_t>(a.rank) * a.routing_words,
                      a.routing_staging + static_cast<int64_t>(pe) * a.routing_words, table_words, word,
                      a.routing_flags + a.rank, seq, pe, a.rank, a.force_put);
    }
    for (int t = blockIdx.x; t < a.num_tokens; t += gridDim.x) {
        send_token(a, t, dst);
        if (t != deferred)
            raise_token_flags(a, t, dst, seq);
    }
}

// Choice k of token t in source s's routing table (read after the table's flag was acquired; plain
// loads: this launch had not read those lines before).
__device__ __forceinline__ int routed_id(const DispatchArgs& a, int s, int t, int k) {
    return static_cast<int>(a.routing[static_cast<int64_t>(s) * a.routing_words + kRoutingHeaderWords +
                                      static_cast<int64_t>(t) * a.num_topk + k]);
}

// Copy the arrived token (s, t) into row `row` of local expert e (global id `expert`).
__device__ void receive_row(const DispatchArgs& a, int e, int expert, int row, int s, int t, uint64_t seq,
                            uint64_t deadline_ns) {
    const int lane = threadIdx.x % kWarpSize;
    const int64_t rows_per_expert = static_cast<int64_t>(a.num_ranks) * a.max_tokens;
    const int64_t flat_row = e * rows_per_expert + row;
    const bool chooses_expert = lane < a.num_topk && routed_id(a, s, t, lane) == expert;  // loaded before the copy
    if (!wait_for_flag(a.token_flags + static_cast<int64_t>(s) * a.flag_stride + t, seq, deadline_ns, a.status, s,
                       kPhaseLowLatencyToken))
        return;
    const uint8_t* message = message_slot(a.slots, s, t, a.max_tokens, a.slot_bytes);
    const int64_t data_bytes = a.use_fp8 ? a.hidden : static_cast<int64_t>(a.hidden) * 2;
    const int num_vectors = static_cast<int>(data_bytes / kBytesPerVector);
    const int4* src = reinterpret_cast<const int4*>(message);
    int4* dst = reinterpret_cast<int4*>(a.recv_x + flat_row * data_bytes);
    batched_copy<int4>(lane, kWarpSize, num_vectors, [&](int v) { return ld_cg_global(src + v); },
                       [&](int v, const int4& value) { st_na_global(dst + v, value); });
    if (a.use_fp8) {
        const float* scales = reinterpret_cast<const float*>(message + a.hidden);
        const int num_scales = a.hidden / kScaleBlock;
        if (a.use_ue8m0) {
            const int num_words = num_scales / kScalesPerUe8m0Word;
            int32_t* out = static_cast<int32_t*>(a.recv_scales) + e * num_words * rows_per_expert + row;
            auto packed_word = [&](int w) {
                uint32_t word = 0;
#pragma unroll
                for (int i = 0; i < kScalesPerUe8m0Word; ++i)
                    word |= ((__float_as_uint(__ldcg(scales + w * kScalesPerUe8m0Word + i)) >> 23) & 0xffu) << (8 * i);
                return static_cast<int32_t>(word);
            };
            batched_copy<int32_t>(lane, kWarpSize, num_words, packed_word,
                                  [&](int w, int32_t word) { out[w * rows_per_expert] = word; });
        } else {
            float* out = static_cast<float*>(a.recv_scales) + e * num_scales * rows_per_expert + row;
            batched_copy<float>(lane, kWarpSize, num_scales, [&](int g) { return __ldcg(scales + g); },
                                [&](int g, float scale) { out[g * rows_per_expert] = scale; });
        }
    }
    if (lane == 0)
        a.recv_src_info[flat_row] = t;
    if (chooses_expert)
        a.combine_rows[(static_cast<int64_t>(s) * a.max_tokens + t) * a.num_topk + lane] = static_cast<int32_t>(flat_row);
}

// The receive's shared state (dynamic shared memory): each source's token count, and one unit's
// layout: a bit per (source, token) naming the unit's expert, and the first row of each bitmap word.
struct ReceiveState {
    int32_t* source_tokens;  // [R]
    uint32_t* bits;          // [R][words_per_source]
    int32_t* word_base;      // [R][words_per_source]
    int words_per_source, num_words;
};

__device__ ReceiveState receive_state(const DispatchArgs& a) {
    extern __shared__ int32_t shared[];
    ReceiveState r;
    r.words_per_source = (a.max_tokens + kWarpSize - 1) / kWarpSize;
    r.num_words = a.num_ranks * r.words_per_source;
    r.source_tokens = shared;
    r.bits = reinterpret_cast<uint32_t*>(shared + a.num_ranks);
    r.word_base = shared + a.num_ranks + r.num_words;
    return r;
}

// Wait for every source's routing table and keep its token count. Ends with a barrier.
__device__ void read_source_tokens(const DispatchArgs& a, const ReceiveState& r, uint64_t seq, uint64_t deadline_ns) {
    for (int s = threadIdx.x; s < a.num_ranks; s += blockDim.x) {
        const bool arrived = wait_for_flag(a.routing_flags + s, seq, deadline_ns, a.status, s, kPhaseLowLatencyRouting);
        const int sent = arrived ? static_cast<int>(a.routing[static_cast<int64_t>(s) * a.routing_words]) : 0;
        r.source_tokens[s] = max(0, min(sent, a.max_tokens));
        if (blockIdx.x == 0)
            a.source_tokens[s] = r.source_tokens[s];
    }
    __syncthreads();
}

// Rows of local expert e: which (source, token) pairs name it, one bit each, then rows in (source,
// token) order. Writes the expert's count and per-source ranges (part 0 only). Ends with a barrier.
__device__ void lay_out_unit(const DispatchArgs& a, const ReceiveState& r, int e, int part) {
    __shared__ int32_t total_rows;
    const int R = a.num_ranks, expert = a.rank * (a.num_experts / R) + e;
    const int lane = threadIdx.x % kWarpSize;
    for (int i = threadIdx.x; i < r.num_words; i += blockDim.x)
        r.bits[i] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < R * a.max_tokens; i += blockDim.x) {
        const int s = i / a.max_tokens, t = i % a.max_tokens;
        if (t >= r.source_tokens[s])
            continue;
        bool chosen = false;
#pragma unroll 8
        for (int k = 0; k < a.num_topk; ++k)
            chosen |= routed_id(a, s, t, k) == expert;
        if (chosen)
            atomicOr(r.bits + s * r.words_per_source + t / kWarpSize, 1u << (t % kWarpSize));
    }
    __syncthreads();
    if (threadIdx.x < kWarpSize) {
        int carry = 0;
        for (int first = 0; first < r.num_words; first += kWarpSize) {
            const int i = first + lane;
            const int count = i < r.num_words ? __popc(r.bits[i]) : 0;
            int inclusive = count;
#pragma unroll
            for (int d = 1; d < kWarpSize; d *= 2) {
                const int below = __shfl_up_sync(kFullWarpMask, inclusive, d);
                if (lane >= d)
                    inclusive += below;
            }
            if (i < r.num_words)
                r.word_base[i] = carry + inclusive - count;
            carry += __shfl_sync(kFullWarpMask, inclusive, kWarpSize - 1);
        }
        if (lane == 0)
            total_rows = carry;
    }
    __syncthreads();
    if (part == 0) {
        for (int s = threadIdx.x; s < R; s += blockDim.x) {
            const int first = r.word_base[s * r.words_per_source];
            const int end = s + 1 < R ? r.word_base[(s + 1) * r.words_per_source] : total_rows;
            a.layout_range[static_cast<int64_t>(e) * R + s] = (static_cast<int64_t>(first) << 32) | (end - first);
        }
        if (threadIdx.x == 0) {
            a.recv_count[e] = total_rows;
            if (a.cumulative_stats != nullptr)
                atomicAdd(a.cumulative_stats + e, total_rows);
        }
    }
}

// Copy the unit's rows (those with row % num_parts == part) as their tokens arrive. Ends with a barrier.
__device__ void copy_unit_rows(const DispatchArgs& a, const ReceiveState& r, int e, int part, uint64_t seq,
                               uint64_t deadline_ns) {
    const int expert = a.rank * (a.num_experts / a.num_ranks) + e;
    const int warp = threadIdx.x / kWarpSize, num_warps = blockDim.x / kWarpSize;
    for (int i = warp; i < r.num_words; i += num_warps) {
        const uint32_t word = r.bits[i];
        for (uint32_t left = word; left != 0; left &= left - 1) {
            const int bit = __ffs(left) - 1;
            const int row = r.word_base[i] + __popc(word & ((1u << bit) - 1));
            if (row % a.num_parts == part)
                receive_row(a, e, expert, row, i / r.words_per_source, (i % r.words_per_source) * kWarpSize + bit,
                            seq, deadline_ns);
        }
    }
    __syncthreads();
}

// combine_rows entries naming another rank's expert (or none) have no row here: -1.
__device__ void mark_foreign_choices(const DispatchArgs& a, const ReceiveState& r) {
    const int L = a.num_experts / a.num_ranks;
    const int entries_per_source = a.max_tokens * a.num_topk;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
         i < static_cast<int64_t>(a.num_ranks) * entries_per_source; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int s = static_cast<int>(i / entries_per_source), within = static_cast<int>(i % entries_per_source);
        if (within / a.num_topk >= r.source_tokens[s])
            continue;
        const int id = routed_id(a, s, within / a.num_topk, within % a.num_topk);
        if (id < a.rank * L || id >= (a.rank + 1) * L)
            a.combine_rows[i] = -1;
    }
}

// The last token this block sends, or -1.
__device__ __forceinline__ int last_token_of_block(int num_tokens) {
    const int first = blockIdx.x;
    return first < num_tokens ? first + (num_tokens - 1 - first) / static_cast<int>(gridDim.x) * gridDim.x : -1;
}

// The dispatch launch. With both phases, a block raises its last token's flags only after it laid out
// its first unit: the release waits for the token's stores to land anyway, so the layout's chain of
// loads runs while they drain instead of after.
__device__ void dispatch(const DispatchArgs& a, uint64_t seq, uint64_t deadline_ns) {
    __shared__ Destinations dst;
    const bool sends = a.phases & kSendPhase, receives = a.phases & kRecvPhase;
    int deferred = sends && receives ? last_token_of_block(a.num_tokens) : -1;
    if (sends)
        dispatch_send(a, seq, dst, deferred);
    if (!receives)
        return;
    const ReceiveState r = receive_state(a);
    read_source_tokens(a, r, seq, deadline_ns);
    const int num_units = a.num_experts / a.num_ranks * a.num_parts;
    for (int unit = blockIdx.x; unit < num_units; unit += gridDim.x) {
        lay_out_unit(a, r, unit / a.num_parts, unit % a.num_parts);
        if (deferred >= 0) {
            raise_token_flags(a, deferred, dst, seq);
            deferred = -1;
        }
        copy_unit_rows(a, r, unit / a.num_parts, unit % a.num_parts, seq, deadline_ns);
    }
    if (deferred >= 0)  // a block without a unit
        raise_token_flags(a, deferred, dst, seq);
    mark_foreign_choices(a, r);
}

// ---------------------------------------------------------------------------------------------
// Combine

struct CombineArgs {
    int phases, half;
    const int4* x;                 // [L * num_ranks * max_tokens][hidden] bf16: the expert outputs
    const void* topk_idx;          // [num_tokens, num_topk] of this rank's tokens, int64 or int32
    int ids_are_int64;
    const float* topk_weights;     // [num_tokens, num_topk]
    int num_tokens, num_topk, hidden, num_experts, rank, num_ranks, max_tokens, force_put;
    const int32_t* combine_rows;   // from the dispatch, see DispatchArgs
    const int32_t* source_tokens;
    // This half of the buffer
    uint64_t* weight_flags;        // [num_ranks]
    uint64_t* token_flags;         // [num_ranks][flag_stride]
    int flag_stride;
    uint32_t* weights;             // [num_ranks][weight_words] floats
    int weight_words;
    uint8_t* slots;                // [num_ranks][max_tokens][slot_bytes]: partials from each rank
    int64_t slot_bytes;
    uint32_t* weight_staging;      // [num_ranks][weight_words]
    uint8_t* slot_staging;         // [num_ranks][max_tokens][slot_bytes]
    int4* combined_x;              // [num_tokens, hidden] bf16
    uint64_t* seq_state;
    uint64_t timeout_ns;
    Status status;
};

// Barrier of one warp group (named barriers 1..kGroupsPerBlock; 0 is __syncthreads).
__device__ __forceinline__ void sync_group(int group) {
    asm volatile("bar.sync %0, %1;" ::"r"(group + 1), "r"(kGroupThreads) : "memory");
}

// What a warp group knows about its pair: this rank's rows holding the token's experts and their weights.
struct PairRows {
    int rows[kMaxTopk];
    int choices[kMaxTopk];  // top-k slot of each row
    float weights[kMaxTopk];
    int count;
    bool ready;  // false: nothing to send, or the source's weights never came
};

// Warp 0 of a group: this rank's rows for pair (s, t), in choice order.
__device__ void gather_pair_rows(const CombineArgs& a, int s, int t, PairRows& pair) {
    const int lane = threadIdx.x % kWarpSize;
    const int64_t entry = (static_cast<int64_t>(s) * a.max_tokens + t) * a.num_topk;
    const int row = lane < a.num_topk ? __ldg(a.combine_rows + entry + lane) : -1;
    const uint32_t held = __ballot_sync(kFullWarpMask, row >= 0);
    if (row >= 0) {
        const int slot = __popc(held & ((1u << lane) - 1));
        pair.rows[slot] = row;
        pair.choices[slot] = lane;
    }
    if (lane == 0)
        pair.count = __popc(held);
}

// Warp 0 of a group, after gather_pair_rows and a group barrier: wait for source s's weights, then
// read those of the pair's rows.
__device__ void gather_pair_weights(const CombineArgs& a, int s, int t, uint64_t seq, uint64_t deadline_ns,
                                    PairRows& pair) {
    const int lane = threadIdx.x % kWarpSize;
    const int count = pair.count;
    bool ready = false;
    if (lane == 0)
        ready = count > 0 && wait_for_flag(a.weight_flags + s, seq, deadline_ns, a.status, s, kPhaseLowLatencyWeights);
    __syncwarp();  // orders lane 0's acquire before the other lanes' weight loads
    ready = __shfl_sync(kFullWarpMask, ready, 0);
    if (ready && lane < count)
        pair.weights[lane] = __ldcg(reinterpret_cast<const float*>(a.weights + static_cast<int64_t>(s) * a.weight_words) +
                                    static_cast<int64_t>(t) * a.num_topk + pair.choices[lane]);
    if (lane == 0)
        pair.ready = ready;
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

// Warp group: send the partial of pair (source s, token t), the FP32 weighted sum of this rank's rows
// for it, as BF16 into slot (this rank, t) of s, then raise the slot's flag. The first row's loads
// are in flight while the weights are awaited.
__device__ void send_partial(const CombineArgs& a, int s, int t, uint64_t seq, uint64_t deadline_ns, int group,
                             PairRows& pair) {
    const int thread = threadIdx.x % kGroupThreads;
    if (thread < kWarpSize)
        gather_pair_rows(a, s, t, pair);
    sync_group(group);
    int4 raw[kPartialBatch];
    if (pair.count > 0)
        load_row_stride(a, pair.rows[0], thread, raw);
    if (thread < kWarpSize)
        gather_pair_weights(a, s, t, seq, deadline_ns, pair);
    sync_group(group);
    if (!pair.ready) {
        sync_group(group);  // every thread read `pair` before the next pair overwrites it
        return;
    }
    uint8_t* slot = message_slot(a.slots, a.rank, t, a.max_tokens, a.slot_bytes);
    uint8_t* staged = message_slot(a.slot_staging, s, t, a.max_tokens, a.slot_bytes);
    uint8_t* direct = direct_address(slot, s, a.rank, a.force_put);
    int4* out = reinterpret_cast<int4*>(direct != nullptr ? direct : staged);
    const int num_vectors = a.hidden / kBf16PerVector;
    for (int first = thread; first < num_vectors; first += kPartialBatch * kGroupThreads) {
        float sum[kPartialBatch][kBf16PerVector] = {};
        for (int j = 0; j < pair.count; ++j) {
            if (j > 0 || first != thread)
                load_row_stride(a, pair.rows[j], first, raw);
            const float weight = pair.weights[j];
#pragma unroll
            for (int i = 0; i < kPartialBatch; ++i) {
                float f[kBf16PerVector];
                bf16x8_to_floats(raw[i], f);
#pragma unroll
                for (int c = 0; c < kBf16PerVector; ++c)
                    sum[i][c] = fmaf(weight, f[c], sum[i][c]);
            }
        }
#pragma unroll
        for (int i = 0; i < kPartialBatch; ++i)
            if (first + i * kGroupThreads < num_vectors)
                st_na_global(out + first + i * kGroupThreads, floats_to_bf16x8(sum[i]));
    }
    sync_group(group);
    uint64_t* flag = a.token_flags + static_cast<int64_t>(a.rank) * a.flag_stride + t;
    if (direct != nullptr) {
        if (thread == 0)  // after the group barrier: the release covers the whole group's stores
            st_release_sys_global(direct_address(flag, s, a.rank, false), seq);
    } else if (thread < kWarpSize) {
        nvshmemx_putmem_signal_nbi_warp(slot, staged, static_cast<size_t>(a.hidden) * 2, flag, seq,
                                        NVSHMEM_SIGNAL_SET, s);
    }
}

__device__ void combine_send(const CombineArgs& a, uint64_t seq, uint64_t deadline_ns) {
    __shared__ PairRows pairs[kGroupsPerBlock];
    // This rank's weights (zero where the id is -1) go to every rank first: the others wait on them.
    // They go from the last blocks, which have no pair when the groups outnumber the pairs.
    const int count = a.num_tokens * a.num_topk;
    for (int pe = gridDim.x - 1 - blockIdx.x; pe < a.num_ranks; pe += gridDim.x) {
        auto word = [&](int i) -> uint32_t {
            const bool routed = read_expert_id(a.topk_idx, a.ids_are_int64, i, a.num_experts, a.status) >= 0;
            return __float_as_uint(routed ? a.topk_weights[i] : 0.0f);
        };
        publish_table(a.weights + static_cast<int64_t>(a.rank) * a.weight_words,
                      a.weight_staging + static_cast<int64_t>(pe) * a.weight_words, count, word,
                      a.weight_flags + a.rank, seq, pe, a.rank, a.force_put);
    }
    // One pair per warp group; pairs interleave sources, so neighbouring groups write to different ranks.
    const int group = threadIdx.x / kGroupThreads;
    const int num_groups = gridDim.x * kGroupsPerBlock;
    for (int i = blockIdx.x * kGroupsPerBlock + group; i < a.num_ranks * a.max_tokens; i += num_groups) {
        const int s = (i + a.rank) % a.num_ranks, t = i / a.num_ranks;
        if (t < __ldg(a.source_tokens + s))
            send_partial(a, s, t, seq, deadline_ns, group, pairs[group]);
    }
}

// Block-wide: sum, in FP32, the partials of every rank holding one of token t's experts.
__device__ void combine_token(const CombineArgs& a, int t, uint64_t seq, uint64_t deadline_ns) {
    __shared__ int ranks[kMaxTopk];
    __shared__ int num_ranks_holding;
    if (threadIdx.x < kWarpSize) {
        const int count = ranks_holding_token(a.topk_idx, a.ids_are_int64, t, a.num_topk, a.num_experts,
                                              a.num_ranks, a.status, ranks);
        __syncwarp();
        if (static_cast<int>(threadIdx.x) < count)
            wait_for_flag(a.token_flags + static_cast<int64_t>(ranks[threadIdx.x]) * a.flag_stride + t, seq,
                          deadline_ns, a.status, ranks[threadIdx.x], kPhaseLowLatencyPartial);
        if (threadIdx.x == 0)
            num_ranks_holding = count;
    }
    __syncthreads();
    const int num_vectors = a.hidden / kBf16PerVector;
    const int count = num_ranks_holding;
    for (int first = threadIdx.x; first < num_vectors; first += kSumBatch * blockDim.x) {
        float sum[kSumBatch][kBf16PerVector] = {};
        for (int base = 0; base < count; base += kPartialsAtOnce) {
            int4 raw[kPartialsAtOnce][kSumBatch];
#pragma unroll
            for (int i = 0; i < kPartialsAtOnce; ++i) {
                const int4* partial = reinterpret_cast<const int4*>(
                    message_slot(a.slots, ranks[min(base + i, count - 1)], t, a.max_tokens, a.slot_bytes));
#pragma unroll
                for (int j = 0; j < kSumBatch; ++j) {
                    const int v = first + j * blockDim.x;
                    raw[i][j] = base + i < count && v < num_vectors ? ld_cg_global(partial + v) : make_int4(0, 0, 0, 0);
                }
            }
#pragma unroll
            for (int i = 0; i < kPartialsAtOnce; ++i)
#pragma unroll
                for (int j = 0; j < kSumBatch; ++j) {
                    float f[kBf16PerVector];
                    bf16x8_to_floats(raw[i][j], f);
#pragma unroll
                    for (int c = 0; c < kBf16PerVector; ++c)
                        sum[j][c] += f[c];
                }
        }
#pragma unroll
        for (int j = 0; j < kSumBatch; ++j)
            if (first + j * blockDim.x < num_vectors)
                a.combined_x[static_cast<int64_t>(t) * num_vectors + first + j * blockDim.x] = floats_to_bf16x8(sum[j]);
    }
    __syncthreads();
}

__device__ void combine_recv(const CombineArgs& a, uint64_t seq, uint64_t deadline_ns) {
    for (int t = blockIdx.x; t < a.num_tokens; t += gridDim.x)
        combine_token(a, t, seq, deadline_ns);
}

}  // namespace cuep

extern "C" __global__ void __launch_bounds__(cuep::kNumThreads, 1) cuep_ll_dispatch(const cuep::DispatchArgs args) {
    const uint64_t seq = cuep::call_number(args.seq_state, args.phases, args.half);
    const uint64_t deadline_ns = cuep::globaltimer_ns() + args.timeout_ns;
    cuep::dispatch(args, seq, deadline_ns);
    cuep::finish_send_launch(args.seq_state, args.phases, args.half, seq);
}

extern "C" __global__ void __launch_bounds__(cuep::kNumThreads, 1) cuep_ll_combine(const cuep::CombineArgs args) {
    const uint64_t seq = cuep::call_number(args.seq_state, args.phases, args.half);
    const uint64_t deadline_ns = cuep::globaltimer_ns() + args.timeout_ns;
    if (args.phases & cuep::kSendPhase)
        cuep::combine_send(args, seq, deadline_ns);
    if (args.phases & cuep::kRecvPhase)
        cuep::combine_recv(args, seq, deadline_ns);
    cuep::finish_send_launch(args.seq_state, args.phases, args.half, seq);
}
