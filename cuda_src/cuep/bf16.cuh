// Eight bf16 channels in one 16-byte vector, to and from float32 for sums kept in FP32.
#pragma once

#include <cuda_bf16.h>

#include <cuep/common.cuh>

namespace cuep {

constexpr int kBf16PerVector = 8;

// Exact: a bf16 is the high half of the float with the same value.
__device__ __forceinline__ void bf16x8_to_floats(const int4& v, float (&f)[kBf16PerVector]) {
    const uint32_t words[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                               static_cast<uint32_t>(v.w)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(words[i] << 16);
        f[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
}

// Rounded to nearest even, once per channel.
__device__ __forceinline__ int4 floats_to_bf16x8(const float (&f)[kBf16PerVector]) {
    uint32_t words[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __nv_bfloat162 pair = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
        words[i] = *reinterpret_cast<const uint32_t*>(&pair);
    }
    return make_int4(words[0], words[1], words[2], words[3]);
}

// acc[c] += channel c of `packed`.
__device__ __forceinline__ void accumulate_bf16x8(float (&acc)[kBf16PerVector], const int4& packed) {
    float f[kBf16PerVector];
    bf16x8_to_floats(packed, f);
#pragma unroll
    for (int c = 0; c < kBf16PerVector; ++c)
        acc[c] += f[c];
}

// acc[c] += weight * channel c of `packed`, with one rounding (fused multiply-add).
__device__ __forceinline__ void accumulate_bf16x8(float (&acc)[kBf16PerVector], const int4& packed, float weight) {
    float f[kBf16PerVector];
    bf16x8_to_floats(packed, f);
#pragma unroll
    for (int c = 0; c < kBf16PerVector; ++c)
        acc[c] = fmaf(weight, f[c], acc[c]);
}

}  // namespace cuep
