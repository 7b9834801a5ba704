// LogFMT: the low-latency combine's optional 10-bit logarithmic message format (use_logfmt=True).
//
// A message is one token's FP32 partial sum, coded per block of kLogFmtBlock channels. A block whose
// nonzero magnitudes span at most kLogFmtMaxOctaves octaves travels as 10-bit codes: a sign and a
// 9-bit magnitude level m, 0 for zero, else |x| = 2^(log_min + (m - 1) * step) with the block's own
// log_min and step (its meta); any other block (a huge channel beside small ones, inf, nan, values
// near float32's top) travels as BF16. The layout, the rule and the error bound are cuep/logfmt.py's,
// which holds the NumPy reference and defines every constant here (CUEP_LOGFMT_*):
//
//   [compact: kLogFmtCompactBytes per block][meta: 2 floats per block, padded to 16 B][overflow per block]
//
// An encoded block fills its compact bytes (a low byte per channel, then 2 bits per channel: bit 8
// of m and the sign), so it needs no overflow; a BF16 block puts its first kLogFmtCompactBytes there
// and the rest in its overflow. So without a fallback only compact + meta travel.
//
// One half-warp codes one block: lane w holds channels 8w .. 8w + 7 (vector w). A sender codes into
// shared memory and copies the message out in whole 16-byte vectors (LogFmtStage).
#pragma once

#include <cuep/bf16.cuh>
#include <cuep/common.cuh>
#include <cuep/ptx.cuh>

namespace cuep {

constexpr int kLogFmtBlock = CUEP_LOGFMT_BLOCK;
constexpr int kLogFmtMaxLevel = CUEP_LOGFMT_MAX_LEVEL;        // magnitude levels 1 .. max, 0 for zero
constexpr float kLogFmtMaxOctaves = CUEP_LOGFMT_MAX_OCTAVES;  // widest nonzero range a block codes
constexpr int kLogFmtCompactBytes = CUEP_LOGFMT_COMPACT_BYTES;
constexpr int kLogFmtMetaBytes = CUEP_LOGFMT_META_BYTES;
constexpr int kLogFmtOverflowBytes = CUEP_LOGFMT_OVERFLOW_BYTES;
constexpr float kLogFmtFallbackStep = CUEP_LOGFMT_FALLBACK_STEP;  // a BF16 block's step
constexpr int kLogFmtMetaAlignment = CUEP_LOGFMT_META_ALIGNMENT;  // the overflow area starts on a vector
constexpr float kLogFmtMaxLog2 = CUEP_LOGFMT_MAX_LOG2;            // a block reaching 2^this falls back
constexpr int kLogFmtLanes = kLogFmtBlock / kBf16PerVector;       // lanes (vectors) per block
static_assert(kLogFmtLanes == kWarpSize / 2, "a half-warp codes one block");
static_assert(kLogFmtMaxLevel == 511, "magnitude levels fill 9 bits: a low byte and bit 8");
static_assert(kLogFmtCompactBytes == kLogFmtBlock + kLogFmtBlock * 2 / 8, "a byte and 2 bits per channel");
static_assert(kLogFmtCompactBytes + kLogFmtOverflowBytes == kLogFmtBlock * 2, "a BF16 block fills both");
static_assert(kLogFmtCompactBytes % 16 == 0 && kLogFmtOverflowBytes % 16 == 0 && kLogFmtMetaBytes == 8,
              "whole vectors, and a float pair of meta");

// Where a message's regions start, for `hidden` channels (a multiple of kLogFmtBlock).
struct LogFmtLayout {
    int blocks, meta, overflow, encoded_bytes, message_bytes;

    __device__ explicit LogFmtLayout(int hidden) {
        blocks = hidden / kLogFmtBlock;
        meta = blocks * kLogFmtCompactBytes;
        overflow = meta + (blocks * kLogFmtMetaBytes + kLogFmtMetaAlignment - 1) / kLogFmtMetaAlignment *
                              kLogFmtMetaAlignment;
        encoded_bytes = overflow;
        message_bytes = overflow + blocks * kLogFmtOverflowBytes;
    }

    // Byte offset of vector w (channels 8w .. 8w + 7) of a block sent as BF16: its compact bytes, then
    // its overflow.
    __device__ int bf16_vector(int block, int w) const {
        const int byte = w * 16;
        return byte < kLogFmtCompactBytes ? block * kLogFmtCompactBytes + byte
                                          : overflow + block * kLogFmtOverflowBytes + byte - kLogFmtCompactBytes;
    }

    __device__ int meta_of(int block) const { return meta + block * kLogFmtMetaBytes; }
};

// A sender's shared-memory copy of kBlocks consecutive blocks of a message: their compact bytes, then
// their meta, as the message lays them out. A half-warp's codes are a few bytes a lane, and a block's meta
// 8 bytes: stored straight to a peer they would cross NVLink as that many partial writes, where the
// stage goes out as whole 16-byte vectors of one contiguous run (copy_logfmt_stage).
template <int kBlocks>
struct LogFmtStage {
    static_assert(kBlocks % 2 == 0, "a stage's meta starts on a vector of the message (16 bytes: two blocks')");
    static constexpr int kMeta = kBlocks * kLogFmtCompactBytes;
    alignas(16) uint8_t bytes[kMeta + kBlocks * kLogFmtMetaBytes];
};

// Whole warps, each half-warp one block: code vector `v` (channels 8v .. 8v + 7, this lane's `f`) into
// `stage`, which holds the blocks from `first_block`, or, where its block travels as BF16 and the
// vector falls in the block's overflow, straight into `message`. `active`: the vector exists (a
// half-warp past the end computes but stores nothing). Every lane takes part in the shuffles whichever
// way its block goes. Returns whether this lane's block fell back to BF16.
template <int kBlocks>
__device__ __forceinline__ bool stage_logfmt_vector(LogFmtStage<kBlocks>& stage, int first_block, uint8_t* message,
                                                    const LogFmtLayout& layout, int v,
                                                    const float (&f)[kBf16PerVector], bool active) {
    const int w = static_cast<int>(threadIdx.x) % kLogFmtLanes;
    const float infinity = __int_as_float(0x7f800000);
    // An inf or a nan counts as an infinite magnitude: the block's largest, which makes it fall back.
    float largest = 0.0f, smallest = infinity;  // smallest nonzero magnitude; +inf: none yet
#pragma unroll
    for (int k = 0; k < kBf16PerVector; ++k) {
        const float m = fabsf(f[k]);
        largest = fmaxf(largest, m <= 3.402823466e38f ? m : infinity);  // the comparison is false for nan
        smallest = fminf(smallest, m > 0.0f ? m : infinity);
    }
#pragma unroll
    for (int offset = kLogFmtLanes / 2; offset > 0; offset /= 2) {  // within the half-warp
        largest = fmaxf(largest, __shfl_xor_sync(kFullWarpMask, largest, offset));
        smallest = fminf(smallest, __shfl_xor_sync(kFullWarpMask, smallest, offset));
    }
    if (!active)
        return false;
    const float log_max = __log2f(largest), log_smallest = __log2f(smallest);
    const bool zero = largest == 0.0f;
    const float span = log_max - log_smallest;
    const bool fallback = !zero && (span > kLogFmtMaxOctaves || log_max >= kLogFmtMaxLog2);
    const float log_min = zero ? 0.0f : log_smallest;
    // The reference divides; a product with the reciprocal is within an ulp, far inside the error bound.
    const float step = zero ? 0.0f : span * (1.0f / static_cast<float>(kLogFmtMaxLevel - 1));
    const int block = v / kLogFmtLanes;
    uint8_t* compact = stage.bytes + (block - first_block) * kLogFmtCompactBytes;
    if (fallback) {
        const int4 packed = floats_to_bf16x8(f);
        if (w * 16 < kLogFmtCompactBytes)
            *reinterpret_cast<int4*>(compact + w * 16) = packed;
        else
            st_na_global(reinterpret_cast<int4*>(message + layout.bf16_vector(block, w)), packed);
    } else {
        const float inverse_step = step > 0.0f ? __fdividef(static_cast<float>(kLogFmtMaxLevel - 1), span) : 0.0f;
        uint64_t low = 0;   // byte k: bits 0-7 of channel k's level
        uint32_t high = 0;  // bits 2k, 2k + 1: bit 8 of channel k's level, its sign
#pragma unroll
        for (int k = 0; k < kBf16PerVector; ++k) {
            // Computed for a zero too (its log is -inf, which converts to INT_MIN), then dropped: a branch
            // around it per channel costs more than the log (unconditional says why).
            const float m = fabsf(f[k]);
            const int any = unconditional(
                min(kLogFmtMaxLevel, max(1, 1 + __float2int_rn((__log2f(m) - log_min) * inverse_step))));
            const int level = m > 0.0f ? any : 0;
            low |= static_cast<uint64_t>(level & 0xff) << (8 * k);
            high |= static_cast<uint32_t>((level >> 8) | (f[k] < 0.0f ? 2 : 0)) << (2 * k);
        }
        *reinterpret_cast<uint64_t*>(compact + w * 8) = low;
        *reinterpret_cast<uint16_t*>(compact + kLogFmtBlock + w * 2) = static_cast<uint16_t>(high);
    }
    if (w == 0)
        *reinterpret_cast<float2*>(stage.bytes + LogFmtStage<kBlocks>::kMeta +
                                   (block - first_block) * kLogFmtMetaBytes) =
            make_float2(fallback ? 0.0f : log_min, fallback ? kLogFmtFallbackStep : step);
    return fallback;
}

// Thread `thread` of `threads`, after a barrier over the stage's writers: staged blocks [first_block,
// first_block + count) into `message` (with the one message's last blocks, count may be odd: its meta's
// last vector then carries 8 bytes of padding, which the layout reserves).
template <int kBlocks>
__device__ __forceinline__ void copy_logfmt_stage(const LogFmtStage<kBlocks>& stage, int first_block, int count,
                                                  uint8_t* message, const LogFmtLayout& layout, int thread,
                                                  int threads) {
    const int compact_vectors = count * kLogFmtCompactBytes / 16;
    const int meta_vectors = (count * kLogFmtMetaBytes + 15) / 16;
    const int4* compact = reinterpret_cast<const int4*>(stage.bytes);
    const int4* meta = reinterpret_cast<const int4*>(stage.bytes + LogFmtStage<kBlocks>::kMeta);
    int4* compact_out = reinterpret_cast<int4*>(message + first_block * kLogFmtCompactBytes);
    int4* meta_out = reinterpret_cast<int4*>(message + layout.meta_of(first_block));
    for (int i = thread; i < compact_vectors + meta_vectors; i += threads) {
        if (i < compact_vectors)
            st_na_global(compact_out + i, compact[i]);
        else
            st_na_global(meta_out + i - compact_vectors, meta[i - compact_vectors]);
    }
}

// Vector `v` of a LogFMT message as loaded: its block's meta and its codes. Loaded apart from decoding
// (accumulate_logfmt_vector), so that a receiver has every part's loads in flight before it waits on one.
struct LogFmtCodes {
    float2 meta;
    uint64_t low;
    uint32_t high;
};

// Vector `v`'s codes in a LogFMT message a peer wrote (L2 loads).
__device__ __forceinline__ LogFmtCodes load_logfmt_codes(const uint8_t* message, const LogFmtLayout& layout, int v) {
    const int block = v / kLogFmtLanes, w = v % kLogFmtLanes;
    const uint8_t* compact = message + block * kLogFmtCompactBytes;
    return LogFmtCodes{__ldcg(reinterpret_cast<const float2*>(message + layout.meta_of(block))),
                       __ldcg(reinterpret_cast<const unsigned long long*>(compact + w * 8)),
                       __ldcg(reinterpret_cast<const unsigned short*>(compact + kLogFmtBlock + w * 2))};
}

// acc[c] += weight * channel c of vector `v` of `message`, from its codes (load_logfmt_codes); a block
// that travels as BF16 loads the vector itself now. Zero codes (LogFmtCodes{}) add nothing.
__device__ __forceinline__ void accumulate_logfmt_vector(float (&acc)[kBf16PerVector], const LogFmtCodes& codes,
                                                         const uint8_t* message, const LogFmtLayout& layout, int v,
                                                         float weight) {
    if (codes.meta.y == kLogFmtFallbackStep) {
        const int block = v / kLogFmtLanes, w = v % kLogFmtLanes;
        accumulate_bf16x8(acc, ld_cg_global(reinterpret_cast<const int4*>(message + layout.bf16_vector(block, w))),
                          weight);
        return;
    }
#pragma unroll
    for (int k = 0; k < kBf16PerVector; ++k) {
        const int level =
            static_cast<int>((codes.low >> (8 * k)) & 0xff) | static_cast<int>(((codes.high >> (2 * k)) & 1) << 8);
        const float magnitude = level == 0 ? 0.0f : exp2f(fmaf(static_cast<float>(level - 1), codes.meta.y, codes.meta.x));
        acc[k] = fmaf(weight, (codes.high >> (2 * k + 1)) & 1 ? -magnitude : magnitude, acc[k]);
    }
}

}  // namespace cuep
