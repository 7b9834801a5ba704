// FP8 e4m3 ("fn": no infinities, one NaN code, largest finite 448) from float, rounding to nearest
// even and saturating to +-448: in hardware from sm_89, in software where kSoftwareFp8 is set.
// cuep/fp8.py encodes with the same rules, so the host helpers and these kernels agree bit for bit.
#pragma once

#include <cuep/common.cuh>

namespace cuep {

constexpr float kE4m3Max = 448.0f;
constexpr uint32_t kE4m3MaxCode = 0x7e;
constexpr uint32_t kE4m3NanCode = 0x7f;
constexpr int kE4m3Bias = 7;
constexpr int kE4m3MantissaBits = 3;
constexpr float kE4m3MinNormal = 0.015625f;   // 2^-6
constexpr float kE4m3SubnormalSteps = 512.0f;  // subnormals are multiples of 2^-9

__device__ __forceinline__ uint32_t e4m3_from_float_software(float value) {
    const uint32_t bits = __float_as_uint(value);
    const uint32_t sign = (bits >> 31) << 7;
    const float magnitude = fabsf(value);
    if (isnan(magnitude))
        return sign | kE4m3NanCode;
    if (magnitude >= kE4m3Max)
        return sign | kE4m3MaxCode;
    if (magnitude < kE4m3MinNormal)  // code = the subnormal step count; 8 steps is the smallest normal
        return sign | static_cast<uint32_t>(__float2int_rn(magnitude * kE4m3SubnormalSteps));
    // Keep 3 of float's 23 mantissa bits, rounding to nearest even; a carry moves into the exponent.
    constexpr int kDropped = 23 - kE4m3MantissaBits;
    const int exponent = static_cast<int>((bits >> 23) & 0xff) - 127;
    const uint32_t mantissa = bits & 0x7fffff;
    uint32_t kept = mantissa >> kDropped;
    const uint32_t rest = mantissa & ((1u << kDropped) - 1);
    const uint32_t half = 1u << (kDropped - 1);
    kept += (rest > half || (rest == half && (kept & 1))) ? 1 : 0;
    const uint32_t code = (static_cast<uint32_t>(exponent + kE4m3Bias) << kE4m3MantissaBits) + kept;
    return sign | min(code, kE4m3MaxCode);
}

// Two values to two e4m3 bytes: `low` in the low byte.
__device__ __forceinline__ uint32_t e4m3x2_from_floats(float low, float high) {
    if constexpr (kSoftwareFp8) {
        return e4m3_from_float_software(low) | (e4m3_from_float_software(high) << 8);
    } else {
        uint16_t packed;
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(high), "f"(low));
        return packed;
    }
}

}  // namespace cuep
