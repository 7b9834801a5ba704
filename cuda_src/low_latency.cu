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
        if (atomicCAS(device + kStatusTimedOut, 0, 1) == 0) {
            device[kStatusPeer] = peer;
            device[kStatusPhase] = phase;
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
        if (threadIdx.x == 0) {
            __threadfence_system();
            st_release_sys_global(direct_address(flag, pe, rank, false), seq);
        }
    } else {
        nvshmemx_putmem_signal_nbi_block(table, staging, static_cast<size_t>(count) * sizeof(uint32_t), flag, seq,
                                         NVSHMEM_SIGNAL_SET, pe);
    }
    __syncthreads();
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
    if (static_cast<int>(threadIdx.x) < dst.count && dst.direct[threadIdx.x] != nullptr) {
        __threadfence_system();
        st_release_sys_global(direct_address(flag, dst.pe[threadIdx.x], rank, false), seq);
    }
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

// Block-wide: the ranks holding token t's experts, each once, in choice order, written to `ranks`
// (kMaxTopk entries of shared memory); returns how many. Ends with a barrier.
__device__ int ranks_holding_token(const void* topk_idx, bool ids_are_int64, int t, int num_topk, int num_experts,
                                   int num_ranks, const Status& status, int* ranks) {
    __shared__ int rank_of_choice[kMaxTopk];
    __shared__ int count;
    const int experts_per_rank = num_experts / num_ranks;
    if (static_cast<int>(threadIdx.x) < num_topk) {
        const int id = read_expert_id(topk_idx, ids_are_int64, static_cast<int64_t>(t) * num_topk + threadIdx.x,
                                      num_experts, status);
        rank_of_choice[threadIdx.x] = id >= 0 ? id / experts_per_rank : -1;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        count = 0;
        for (int k = 0; k < num_topk; ++k) {
            const int r = rank_of_choice[k];
            bool seen = r < 0;
            for (int i = 0; i < count && !seen; ++i)
                seen = ranks[i] == r;
            if (!seen)
                ranks[count++] = r;
        }
    }
    __syncthreads();
    return count;
}

// The ranks holding token t's experts (each once), and where to store for each.
__device__ void find_destinations(const DispatchArgs& a, int t, Destinations& dst) {
    if (threadIdx.x == 0)
        dst.any_put = false;  // ordered before the writers below by the helper's barriers
    const int count = ranks_holding_token(a.topk_idx, a.ids_are_int64, t, a.num_topk, a.num_experts, a.num_ranks,
                                          a.status, dst.pe);
    uint8_t* slot = a.slots + (static_cast<int64_t>(a.rank) * a.max_tokens + t) * a.slot_bytes;
    if (static_cast<int>(threadIdx.x) < count) {
        dst.direct[threadIdx.x] = direct_address(slot, dst.pe[threadIdx.x], a.rank, a.force_put);
        if (dst.direct[threadIdx.x] == nullptr)
            dst.any_put = true;  // benign race: every writer stores true
    }
    if (threadIdx.x == 0)
        dst.count = count;
    __syncthreads();
}

// Block-wide: quantise (or copy) token t once and store it to every destination.
__device__ void send_token(const DispatchArgs& a, int t, const Destinations& dst) {
    const int lane = threadIdx.x % kWarpSize;
    const int num_vectors = a.hidden / kBf16PerVector;
    const int4* row = a.x + static_cast<int64_t>(t) * num_vectors;
    uint8_t* staged = dst.any_put ? a.slot_staging + static_cast<int64_t>(t) * a.slot_bytes : nullptr;
    // Warps step through whole warps of vectors so that every lane takes part in the shuffles.
    for (int base = threadIdx.x - lane; base < num_vectors; base += blockDim.x) {
        const int v = base + lane;
        const bool active = v < num_vectors;
        const int4 raw = active ? ld_nc_global(row + v) : make_int4(0, 0, 0, 0);
        if (!a.use_fp8) {
            if (active) {
                for (int i = 0; i < dst.count; ++i)
                    if (dst.direct[i] != nullptr)
                        st_na_global(reinterpret_cast<int4*>(dst.direct[i]) + v, raw);
                if (staged != nullptr)
                    reinterpret_cast<int4*>(staged)[v] = raw;
            }
            continue;
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
            continue;
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
}

__device__ void dispatch_send(const DispatchArgs& a, uint64_t seq) {
    __shared__ Destinations dst;
    const int table_words = kRoutingHeaderWords + a.num_tokens * a.num_topk;
    for (int pe = blockIdx.x; pe < a.num_ranks; pe += gridDim.x) {
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
        find_destinations(a, t, dst);
        send_token(a, t, dst);
        uint8_t* slot = a.slots + (static_cast<int64_t>(a.rank) * a.max_tokens + t) * a.slot_bytes;
        raise_message_flags(dst, slot, a.slot_staging + static_cast<int64_t>(t) * a.slot_bytes, message_bytes(a),
                            a.token_flags + static_cast<int64_t>(a.rank) * a.flag_stride + t, seq, a.rank);
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
    if (!wait_for_flag(a.token_flags + static_cast<int64_t>(s) * a.flag_stride + t, seq, deadline_ns, a.status, s,
                       kPhaseLowLatencyToken))
        return;
    const uint8_t* message = a.slots + (static_cast<int64_t>(s) * a.max_tokens + t) * a.slot_bytes;
    const int64_t data_bytes = a.use_fp8 ? a.hidden : static_cast<int64_t>(a.hidden) * 2;
    const int num_vectors = static_cast<int>(data_bytes / kBytesPerVector);
    const int4* src = reinterpret_cast<const int4*>(message);
    int4* dst = reinterpret_cast<int4*>(a.recv_x + flat_row * data_bytes);
    for (int v = lane; v < num_vectors; v += kWarpSize)
        st_na_global(dst + v, ld_cg_global(src + v));
    if (a.use_fp8) {
        const float* scales = reinterpret_cast<const float*>(message + a.hidden);
        const int num_scales = a.hidden / kScaleBlock;
        if (a.use_ue8m0) {
            const int num_words = num_scales / kScalesPerUe8m0Word;
            int32_t* out = static_cast<int32_t*>(a.recv_scales) + e * num_words * rows_per_expert + row;
            for (int w = lane; w < num_words; w += kWarpSize) {
                uint32_t word = 0;
                for (int i = 0; i < kScalesPerUe8m0Word; ++i)
                    word |= ((__float_as_uint(__ldcg(scales + w * kScalesPerUe8m0Word + i)) >> 23) & 0xffu) << (8 * i);
                out[w * rows_per_expert] = static_cast<int32_t>(word);
            }
        } else {
            float* out = static_cast<float*>(a.recv_scales) + e * num_scales * rows_per_expert + row;
            for (int g = lane; g < num_scales; g += kWarpSize)
                out[g * rows_per_expert] = __ldcg(scales + g);
        }
    }
    if (lane == 0)
        a.recv_src_info[flat_row] = t;
    if (lane < a.num_topk && routed_id(a, s, t, lane) == expert)
        a.combine_rows[(static_cast<int64_t>(s) * a.max_tokens + t) * a.num_topk + lane] = static_cast<int32_t>(flat_row);
}

__device__ void dispatch_recv(const DispatchArgs& a, uint64_t seq, uint64_t deadline_ns) {
    extern __shared__ int32_t shared[];
    const int R = a.num_ranks, L = a.num_experts / R;
    const int words_per_source = (a.max_tokens + kWarpSize - 1) / kWarpSize;
    const int num_words = R * words_per_source;
    int32_t* source_tokens = shared;                                                   // [R]
    uint32_t* bits = reinterpret_cast<uint32_t*>(shared + R);                          // [R][words]
    int32_t* word_base = shared + R + num_words;                                       // [R][words]
    __shared__ int32_t total_rows;
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    const int num_warps = blockDim.x / kWarpSize;

    for (int s = threadIdx.x; s < R; s += blockDim.x) {
        const bool arrived = wait_for_flag(a.routing_flags + s, seq, deadline_ns, a.status, s, kPhaseLowLatencyRouting);
        const int sent = arrived ? static_cast<int>(a.routing[static_cast<int64_t>(s) * a.routing_words]) : 0;
        source_tokens[s] = max(0, min(sent, a.max_tokens));
        if (blockIdx.x == 0)
            a.source_tokens[s] = source_tokens[s];
    }
    __syncthreads();

    // Entries naming another rank's expert (or none) have no row here.
    const int entries_per_source = a.max_tokens * a.num_topk;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
         i < static_cast<int64_t>(R) * entries_per_source; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int s = static_cast<int>(i / entries_per_source), within = static_cast<int>(i % entries_per_source);
        if (within / a.num_topk >= source_tokens[s])
            continue;
        const int id = routed_id(a, s, within / a.num_topk, within % a.num_topk);
        if (id < a.rank * L || id >= (a.rank + 1) * L)
            a.combine_rows[i] = -1;
    }

    for (int unit = blockIdx.x; unit < L * a.num_parts; unit += gridDim.x) {
        const int e = unit / a.num_parts, part = unit % a.num_parts, expert = a.rank * L + e;
        // Which (source, token) pairs name this expert: one bit each, then rows in (source, token) order.
        for (int i = threadIdx.x; i < num_words; i += blockDim.x)
            bits[i] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < R * a.max_tokens; i += blockDim.x) {
            const int s = i / a.max_tokens, t = i % a.max_tokens;
            if (t >= source_tokens[s])
                continue;
            bool chosen = false;
            for (int k = 0; k < a.num_topk; ++k)
                chosen |= routed_id(a, s, t, k) == expert;
            if (chosen)
                atomicOr(bits + s * words_per_source + t / kWarpSize, 1u << (t % kWarpSize));
        }
        __syncthreads();
        if (warp == 0) {
            int carry = 0;
            for (int first = 0; first < num_words; first += kWarpSize) {
                const int i = first + lane;
                const int count = i < num_words ? __popc(bits[i]) : 0;
                int inclusive = count;
#pragma unroll
                for (int d = 1; d < kWarpSize; d *= 2) {
                    const int below = __shfl_up_sync(kFullWarpMask, inclusive, d);
                    if (lane >= d)
                        inclusive += below;
                }
                if (i < num_words)
                    word_base[i] = carry + inclusive - count;
                carry += __shfl_sync(kFullWarpMask, inclusive, kWarpSize - 1);
            }
            if (lane == 0)
                total_rows = carry;
        }
        __syncthreads();
        if (part == 0) {
            for (int s = threadIdx.x; s < R; s += blockDim.x) {
                const int first = word_base[s * words_per_source];
                const int end = s + 1 < R ? word_base[(s + 1) * words_per_source] : total_rows;
                a.layout_range[static_cast<int64_t>(e) * R + s] = (static_cast<int64_t>(first) << 32) | (end - first);
            }
            if (threadIdx.x == 0) {
                a.recv_count[e] = total_rows;
                if (a.cumulative_stats != nullptr)
                    atomicAdd(a.cumulative_stats + e, total_rows);
            }
        }
        for (int i = warp; i < num_words; i += num_warps) {
            const uint32_t word = bits[i];
            for (uint32_t left = word; left != 0; left &= left - 1) {
                const int bit = __ffs(left) - 1;
                const int row = word_base[i] + __popc(word & ((1u << bit) - 1));
                if (row % a.num_parts == part)
                    receive_row(a, e, expert, row, i / words_per_source, (i % words_per_source) * kWarpSize + bit, seq,
                                deadline_ns);
            }
        }
        __syncthreads();
    }
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

// Partial of pair (source s, token t): the weighted sum of this rank's experts' rows for it.
__device__ void send_partial(const CombineArgs& a, int s, int t, uint64_t seq, uint64_t deadline_ns) {
    __shared__ int rows[kMaxTopk];
    __shared__ float weights[kMaxTopk];
    __shared__ int num_rows;
    __shared__ bool weights_arrived;
    __shared__ int row_of_choice[kMaxTopk];
    __shared__ Destinations dst;
    const int64_t entry = (static_cast<int64_t>(s) * a.max_tokens + t) * a.num_topk;
    __syncthreads();  // the previous pair may have returned early: its readers must be done with the shared state
    if (static_cast<int>(threadIdx.x) < a.num_topk)
        row_of_choice[threadIdx.x] = a.combine_rows[entry + threadIdx.x];
    __syncthreads();
    if (threadIdx.x == 0) {
        num_rows = 0;
        for (int k = 0; k < a.num_topk; ++k)
            if (row_of_choice[k] >= 0)
                rows[num_rows++] = k;  // the choice for now; its row replaces it below
        weights_arrived = num_rows > 0 && wait_for_flag(a.weight_flags + s, seq, deadline_ns, a.status, s,
                                                        kPhaseLowLatencyWeights);
        uint8_t* slot = a.slots + (static_cast<int64_t>(a.rank) * a.max_tokens + t) * a.slot_bytes;
        dst.count = 1;
        dst.pe[0] = s;
        dst.direct[0] = direct_address(slot, s, a.rank, a.force_put);
        dst.any_put = dst.direct[0] == nullptr;
    }
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < num_rows && weights_arrived) {
        const int k = rows[threadIdx.x];
        weights[threadIdx.x] = __ldcg(reinterpret_cast<const float*>(a.weights + static_cast<int64_t>(s) * a.weight_words) +
                                      static_cast<int64_t>(t) * a.num_topk + k);
        rows[threadIdx.x] = row_of_choice[k];
    }
    __syncthreads();
    if (!weights_arrived)
        return;
    const int num_vectors = a.hidden / kBf16PerVector;
    int4* out = reinterpret_cast<int4*>(dst.direct[0] != nullptr
                                            ? dst.direct[0]
                                            : a.slot_staging + (static_cast<int64_t>(s) * a.max_tokens + t) * a.slot_bytes);
    for (int v = threadIdx.x; v < num_vectors; v += blockDim.x) {
        float sum[kBf16PerVector] = {};
        for (int j = 0; j < num_rows; ++j) {
            float f[kBf16PerVector];
            bf16x8_to_floats(ld_nc_global(a.x + static_cast<int64_t>(rows[j]) * num_vectors + v), f);
#pragma unroll
            for (int i = 0; i < kBf16PerVector; ++i)
                sum[i] = fmaf(weights[j], f[i], sum[i]);
        }
        st_na_global(out + v, floats_to_bf16x8(sum));
    }
    raise_message_flags(dst, a.slots + (static_cast<int64_t>(a.rank) * a.max_tokens + t) * a.slot_bytes,
                        a.slot_staging + (static_cast<int64_t>(s) * a.max_tokens + t) * a.slot_bytes,
                        static_cast<int64_t>(a.hidden) * 2,
                        a.token_flags + static_cast<int64_t>(a.rank) * a.flag_stride + t, seq, a.rank);
}

__device__ void combine_send(const CombineArgs& a, uint64_t seq, uint64_t deadline_ns) {
    // Publish this rank's weights (zero where the id is -1) to every rank first: they wait on them.
    const int count = a.num_tokens * a.num_topk;
    for (int pe = blockIdx.x; pe < a.num_ranks; pe += gridDim.x) {
        auto word = [&](int i) -> uint32_t {
            const bool routed = read_expert_id(a.topk_idx, a.ids_are_int64, i, a.num_experts, a.status) >= 0;
            return __float_as_uint(routed ? a.topk_weights[i] : 0.0f);
        };
        publish_table(a.weights + static_cast<int64_t>(a.rank) * a.weight_words,
                      a.weight_staging + static_cast<int64_t>(pe) * a.weight_words, count, word,
                      a.weight_flags + a.rank, seq, pe, a.rank, a.force_put);
    }
    // Pairs interleave sources, so neighbouring blocks write to different ranks.
    for (int i = blockIdx.x; i < a.num_ranks * a.max_tokens; i += gridDim.x) {
        const int s = (i + a.rank) % a.num_ranks, t = i / a.num_ranks;
        if (t < a.source_tokens[s])
            send_partial(a, s, t, seq, deadline_ns);
    }
}

__device__ void combine_recv(const CombineArgs& a, uint64_t seq, uint64_t deadline_ns) {
    __shared__ int ranks[kMaxTopk];
    const int num_vectors = a.hidden / kBf16PerVector;
    for (int t = blockIdx.x; t < a.num_tokens; t += gridDim.x) {
        const int num_ranks_holding = ranks_holding_token(a.topk_idx, a.ids_are_int64, t, a.num_topk, a.num_experts,
                                                          a.num_ranks, a.status, ranks);
        if (static_cast<int>(threadIdx.x) < num_ranks_holding) {
            const int r = ranks[threadIdx.x];
            wait_for_flag(a.token_flags + static_cast<int64_t>(r) * a.flag_stride + t, seq, deadline_ns, a.status, r,
                          kPhaseLowLatencyPartial);
        }
        __syncthreads();
        for (int v = threadIdx.x; v < num_vectors; v += blockDim.x) {
            float sum[kBf16PerVector] = {};
            for (int i = 0; i < num_ranks_holding; ++i) {
                const int4* partial = reinterpret_cast<const int4*>(
                    a.slots + (static_cast<int64_t>(ranks[i]) * a.max_tokens + t) * a.slot_bytes);
                float f[kBf16PerVector];
                bf16x8_to_floats(ld_cg_global(partial + v), f);
#pragma unroll
                for (int j = 0; j < kBf16PerVector; ++j)
                    sum[j] += f[j];
            }
            a.combined_x[static_cast<int64_t>(t) * num_vectors + v] = floats_to_bf16x8(sum);
        }
        __syncthreads();
    }
}

}  // namespace cuep

extern "C" __global__ void __launch_bounds__(cuep::kNumThreads, 1) cuep_ll_dispatch(const cuep::DispatchArgs args) {
    const uint64_t seq = cuep::call_number(args.seq_state, args.phases, args.half);
    const uint64_t deadline_ns = cuep::globaltimer_ns() + args.timeout_ns;
    if (args.phases & cuep::kSendPhase)
        cuep::dispatch_send(args, seq);
    if (args.phases & cuep::kRecvPhase)
        cuep::dispatch_recv(args, seq, deadline_ns);
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
