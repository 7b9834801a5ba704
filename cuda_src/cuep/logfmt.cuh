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
// One half-warp codes one block: lane w holds channels 8w .. 8w + 7 (vector w), and every store is
// a whole 16-byte vector or the block's meta.
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
    int meta, overflow, encoded_bytes, message_bytes;

    __device__ explicit LogFmtLayout(int hidden) {
        const int blocks = hidden / kLogFmtBlock;
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

// Whole warps, each half-warp one block: code vector `v` (channels 8v .. 8v + 7, this lane's `f`) into
// `message`; `active`: the vector exists (a half-warp past the end computes but stores nothing).
// Every lane takes part in the shuffles whichever way its block goes. Returns whether this lane's
// block fell back to BF16.
__device__ __forceinline__ bool store_logfmt_vector(uint8_t* message, const LogFmtLayout& layout, int v,
                                                    const float (&f)[kBf16PerVector], bool active) {
    const int w = static_cast<int>(threadIdx.x) % kLogFmtLanes;
    float largest = 0.0f, smallest = __int_as_float(0x7f800000);  // +inf: no nonzero value yet
    bool finite = true;
#pragma unroll
    for (int k = 0; k < kBf16PerVector; ++k) {
        const float m = fabsf(f[k]);
        finite &= m <= 3.402823466e38f;  // false for inf and nan
        largest = fmaxf(largest, m);
        if (m > 0.0f)
            smallest = fminf(smallest, m);
    }
#pragma unroll
    for (int offset = kLogFmtLanes / 2; offset > 0; offset /= 2) {  // within the half-warp
        largest = fmaxf(largest, __shfl_xor_sync(kFullWarpMask, largest, offset));
        smallest = fminf(smallest, __shfl_xor_sync(kFullWarpMask, smallest, offset));
        finite &= __shfl_xor_sync(kFullWarpMask, finite, offset);
    }
    const float log_max = __log2f(largest), log_smallest = __log2f(smallest);
    const bool zero = largest == 0.0f;
    const bool too_wide = log_max - log_smallest > kLogFmtMaxOctaves || log_max >= kLogFmtMaxLog2;
    const bool fallback = !finite || (!zero && too_wide);
    const float log_min = zero ? 0.0f : log_smallest;
    const float step = zero ? 0.0f : (log_max - log_smallest) / static_cast<float>(kLogFmtMaxLevel - 1);
    const float inverse_step = step > 0.0f ? 1.0f / step : 0.0f;
    uint64_t low = 0;   // byte k: bits 0-7 of channel k's level
    uint32_t high = 0;  // bits 2k, 2k + 1: bit 8 of channel k's level, its sign
#pragma unroll
    for (int k = 0; k < kBf16PerVector; ++k) {
        const float m = fabsf(f[k]);
        int level = 0;
        if (m > 0.0f)
            level = min(kLogFmtMaxLevel, max(1, 1 + __float2int_rn((__log2f(m) - log_min) * inverse_step)));
        low |= static_cast<uint64_t>(level & 0xff) << (8 * k);
        high |= static_cast<uint32_t>((level >> 8) | (m > 0.0f && f[k] < 0.0f ? 2 : 0)) << (2 * k);
    }
    // Gather whole vectors: lane pairs' low bytes, then groups of 8 lanes' high bits.
    const uint64_t next_low = __shfl_down_sync(kFullWarpMask, low, 1);
    const uint32_t high2 = high | (__shfl_down_sync(kFullWarpMask, high, 1) << 16);
    const uint64_t high4 = high2 | (static_cast<uint64_t>(__shfl_down_sync(kFullWarpMask, high2, 2)) << 32);
    const uint64_t next_high4 = __shfl_down_sync(kFullWarpMask, high4, 4);
    if (!active)
        return false;
    const int block = v / kLogFmtLanes;
    uint8_t* compact = message + block * kLogFmtCompactBytes;
    if (fallback) {
        st_na_global(reinterpret_cast<int4*>(message + layout.bf16_vector(block, w)), floats_to_bf16x8(f));
    } else {
        if (w % 2 == 0)
            st_na_global(reinterpret_cast<int4*>(compact + w * 8),
                         make_int4(static_cast<int>(low), static_cast<int>(low >> 32), static_cast<int>(next_low),
                                   static_cast<int>(next_low >> 32)));
        if (w % 8 == 0)
            st_na_global(reinterpret_cast<int4*>(compact + kLogFmtBlock + w * 2),
                         make_int4(static_cast<int>(high4), static_cast<int>(high4 >> 32),
                                   static_cast<int>(next_high4), static_cast<int>(next_high4 >> 32)));
    }
    if (w == 0)
        *reinterpret_cast<float2*>(message + layout.meta_of(block)) =
            make_float2(fallback ? 0.0f : log_min, fallback ? kLogFmtFallbackStep : step);
    return fallback;
}

// acc[c] += weight * channel c of vector `v` of a LogFMT message a peer wrote (L2 loads).
__device__ __forceinline__ void accumulate_logfmt_vector(float (&acc)[kBf16PerVector], const uint8_t* message,
                                                         const LogFmtLayout& layout, int v, float weight) {
    const int block = v / kLogFmtLanes, w = v % kLogFmtLanes;
    const float2 meta = __ldcg(reinterpret_cast<const float2*>(message + layout.meta_of(block)));
    const uint8_t* compact = message + block * kLogFmtCompactBytes;
    if (meta.y == kLogFmtFallbackStep) {
        accumulate_bf16x8(acc, ld_cg_global(reinterpret_cast<const int4*>(message + layout.bf16_vector(block, w))),
                          weight);
        return;
    }
    const uint64_t low = __ldcg(reinterpret_cast<const unsigned long long*>(compact + w * 8));
    const uint32_t high = __ldcg(reinterpret_cast<const unsigned short*>(compact + kLogFmtBlock + w * 2));
#pragma unroll
    for (int k = 0; k < kBf16PerVector; ++k) {
        const int level = static_cast<int>((low >> (8 * k)) & 0xff) | static_cast<int>(((high >> (2 * k)) & 1) << 8);
        const float magnitude = level == 0 ? 0.0f : exp2f(fmaf(static_cast<float>(level - 1), meta.y, meta.x));
        acc[k] = fmaf(weight, (high >> (2 * k + 1)) & 1 ? -magnitude : magnitude, acc[k]);
    }
}

}  // namespace cuep
