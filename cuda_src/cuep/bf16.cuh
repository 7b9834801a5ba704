// Eight bf16 channels in one 16-byte vector, to and from float32 for sums kept in FP32.
#pragma once

#include <cuda_bf16.h>

#include <cuep/common.cuh>
#include <cuep/ptx.cuh>

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

// Nothing added to a sum besides its rows (warp_sum_bf16_rows's `before` or `after`).
struct NoAddend {
    __device__ __forceinline__ void operator()(float (&)[kBf16PerVector], int) const {}
};

// One warp sums, in FP32, `num_rows` BF16 rows of `num_vectors` 16-byte vectors and writes the sum, rounded
// once, to `out`. Vector v's sum starts from zero, takes `before(acc, v)`, then rows row_at(0), row_at(1),
// ... in that order, then `after(acc, v)`; so the order of the sums is the caller's. Every lane runs the same
// steps and calls row_at(c) alike, whatever num_vectors, so row_at may shuffle (before and after are called for
// the lane's own vectors only). Each lane loads kUnroll vectors of kRowsPerLoad rows before adding any: a loop
// that added each vector as it came would wait out one memory latency per vector, and a warp would keep only
// 1 KB in flight. The rows are read with volatile loads (their writers may be other GPUs).
template <int kUnroll, int kRowsPerLoad, typename RowAt, typename Before, typename After>
__device__ __forceinline__ void warp_sum_bf16_rows(int4* out, int num_vectors, int num_rows, const RowAt& row_at,
                                                   const Before& before, const After& after, int lane) {
    for (int step = 0; step < num_vectors; step += kUnroll * kWarpSize) {
        const int first = step + lane;
        float acc[kUnroll][kBf16PerVector] = {};
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (first + u * kWarpSize < num_vectors)
                before(acc[u], first + u * kWarpSize);
        for (int group = 0; group < num_rows; group += kRowsPerLoad) {
            int4 raw[kRowsPerLoad][kUnroll];
#pragma unroll
            for (int c = 0; c < kRowsPerLoad; ++c) {
                const int4* row = group + c < num_rows ? row_at(group + c) : nullptr;
#pragma unroll
                for (int u = 0; u < kUnroll; ++u)
                    if (row != nullptr && first + u * kWarpSize < num_vectors)
                        raw[c][u] = ld_volatile_global(row + first + u * kWarpSize);
            }
#pragma unroll
            for (int c = 0; c < kRowsPerLoad; ++c)
#pragma unroll
                for (int u = 0; u < kUnroll; ++u)
                    if (group + c < num_rows && first + u * kWarpSize < num_vectors)
                        accumulate_bf16x8(acc[u], raw[c][u]);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int v = first + u * kWarpSize;
            if (v < num_vectors) {
                after(acc[u], v);
                out[v] = floats_to_bf16x8(acc[u]);
            }
        }
    }
}

}  // namespace cuep
