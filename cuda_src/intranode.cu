// Intranode (NVLink) high-throughput dispatch and combine between the ranks of one node.
//
// Every rank owns one symmetric buffer (NVSHMEM symmetric memory; `peer_bases[r]` is rank r's
// buffer as this GPU addresses it over NVLink). It starts with a fixed-size meta region, so the
// regions after it sit at the same offset on every rank:
//
//   [0, kMetaBytes)      SenderMeta: the sender's token count, where its staged arrays start,
//                        send_count[dst] and the per-expert counts from its layout
//   [kMetaBytes, ...)    dispatch: staged x rows, scales, top-k ids, weights, send lists
//                        combine:  landing rows, one per (token, rank that holds a copy)
//
// Dispatch (pull): (1) stage: each sender copies its tokens into its own buffer and scans
// is_token_in_rank into per-destination send lists; (2) barrier; (3) notify: each receiver reads
// every sender's meta and builds its receive plan (rank prefix, per-expert counts, where to read);
// (4) pull: each receiver copies exactly its rows from the senders' buffers into fresh arrays;
// (5) barrier, after which senders may reuse their buffers. Every byte crosses NVLink once.
//
// Combine (push): (1) barrier, so every source's buffer is free; (2) push: each rank writes the
// rows it received back into the landing region of the source rank, at the slot the dispatch
// plan assigned; (3) barrier; (4) reduce: each source sums, in FP32, the copies of each of its
// tokens, adds the optional biases, and writes the result. Barriers are barrier.cu's kernel.
#include <cuda_bf16.h>

#include <cuep/common.cuh>
#include <cuep/ptx.cuh>

namespace cuep {

constexpr int kNumThreads = 512;
constexpr int kWarpsPerBlock = kNumThreads / kWarpSize;
constexpr int kMaxRanks = 8;          // one NVLink domain; the notify block maps one thread per rank
constexpr int kCopyUnroll = 4;        // 16-byte vectors each lane has in flight per copy step
constexpr int kBf16PerVector = 8;     // 16 bytes of bf16

// Written by a sender's stage kernel at the start of its buffer, read remotely by receivers.
// Offsets are in bytes from the buffer's start; the host computes them (cuep/kernels/intranode.py).
struct SenderMeta {
    int64_t num_tokens;
    int64_t x_offset, scales_offset, topk_idx_offset, topk_weights_offset, send_lists_offset;
    int32_t send_count[kMaxRanks];
    // followed by int32_t num_tokens_per_expert[num_experts]
};
constexpr int64_t kMetaBytes = 64 * 1024;  // mirrors META_BYTES in cuep/kernels/intranode.py

// Receive plan of one source rank, built by notify, used by pull.
struct SourcePlan {
    const uint8_t* x;
    const float* scales;
    const int64_t* topk_idx;
    const float* topk_weights;
    const int32_t* send_list;  // the source's list of token indices for this rank
};

// Received rows come grouped by source rank. Walking them in order would send every warp of every
// rank to the same source at once, leaving the other links idle; instead each warp starts on a
// different source (staggered by rank and warp) and claims kRowsPerClaim rows at a time from
// per-source counters, moving on to the next source when one is exhausted.
constexpr int kRowsPerClaim = 2;

template <typename CopyRow>
__device__ __forceinline__ void for_each_row_spread_over_sources(int32_t* next_row, const int32_t* rank_prefix,
                                                                 int rank, int num_ranks, CopyRow copy_row) {
    const int lane = threadIdx.x % kWarpSize;
    const int warp = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize;
    int source = (rank + 1 + warp) % num_ranks;
    for (int exhausted = 0; exhausted < num_ranks;) {
        int first = 0;
        if (lane == 0)
            first = atomicAdd(next_row + source, kRowsPerClaim);
        first = __shfl_sync(kFullWarpMask, first, 0);
        const int segment = rank_prefix[source + 1] - rank_prefix[source];
        if (first >= segment) {
            source = (source + 1) % num_ranks;
            ++exhausted;
            continue;
        }
        const int last = min(first + kRowsPerClaim, segment);
        for (int j = first; j < last; ++j)
            copy_row(source, rank_prefix[source] + j, j, lane);
    }
}

// One warp copies `num_bytes` (a multiple of 16) from src to dst, kCopyUnroll vectors per lane in flight.
__device__ __forceinline__ void warp_copy(void* dst, const void* src, int64_t num_bytes, int lane) {
    auto* out = static_cast<int4*>(dst);
    const auto* in = static_cast<const int4*>(src);
    const int num_vectors = static_cast<int>(num_bytes / sizeof(int4));
    int i = lane;
    for (; i + (kCopyUnroll - 1) * kWarpSize < num_vectors; i += kCopyUnroll * kWarpSize) {
        int4 v[kCopyUnroll];
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u)
            v[u] = ld_nc_global(in + i + u * kWarpSize);
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u)
            st_na_global(out + i + u * kWarpSize, v[u]);
    }
    for (; i < num_vectors; i += kWarpSize)
        st_na_global(out + i, ld_nc_global(in + i));
}

// ---------------------------------------------------------------------------------------------
// Dispatch, step 1: stage. Blocks [0, num_ranks) scan one destination each; the rest copy rows.
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

__device__ void stage_rows(const uint8_t* x, int64_t hidden_bytes, const float* scales, int64_t scale_token_stride,
                           int64_t scale_channel_stride, int num_scales, const int64_t* topk_idx,
                           const float* topk_weights, int num_topk, int num_tokens, uint8_t* buffer,
                           int64_t scales_offset, int64_t topk_idx_offset, int64_t topk_weights_offset, int block,
                           int num_blocks) {
    const int lane = threadIdx.x % kWarpSize;
    const int warp = block * kWarpsPerBlock + threadIdx.x / kWarpSize;
    const int num_warps = num_blocks * kWarpsPerBlock;
    for (int token = warp; token < num_tokens; token += num_warps) {
        warp_copy(buffer + kMetaBytes + token * hidden_bytes, x + token * hidden_bytes, hidden_bytes, lane);
        if (scales != nullptr) {
            auto* staged = reinterpret_cast<float*>(buffer + scales_offset) + static_cast<int64_t>(token) * num_scales;
            for (int s = lane; s < num_scales; s += kWarpSize)
                staged[s] = scales[token * scale_token_stride + s * scale_channel_stride];
        }
        if (topk_idx != nullptr && lane < num_topk) {
            const int64_t slot = static_cast<int64_t>(token) * num_topk + lane;
            reinterpret_cast<int64_t*>(buffer + topk_idx_offset)[slot] = topk_idx[slot];
            if (topk_weights != nullptr)
                reinterpret_cast<float*>(buffer + topk_weights_offset)[slot] = topk_weights[slot];
        }
    }
}

}  // namespace cuep

using namespace cuep;

extern "C" __global__ void __launch_bounds__(kNumThreads)
cuep_intranode_stage(const uint8_t* x, int64_t hidden_bytes, const float* scales, int64_t scale_token_stride,
                     int64_t scale_channel_stride, int num_scales, const int64_t* topk_idx, const float* topk_weights,
                     int num_topk, const bool* is_token_in_rank, const int32_t* num_tokens_per_expert, int num_experts,
                     int num_tokens, int num_ranks, uint8_t* buffer, int64_t scales_offset, int64_t topk_idx_offset,
                     int64_t topk_weights_offset, int64_t send_lists_offset, int32_t* send_pos, int cached) {
    auto* meta = reinterpret_cast<SenderMeta*>(buffer);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        meta->num_tokens = num_tokens;
        meta->x_offset = kMetaBytes;
        meta->scales_offset = scales_offset;
        meta->topk_idx_offset = topk_idx_offset;
        meta->topk_weights_offset = topk_weights_offset;
        meta->send_lists_offset = send_lists_offset;
    }
    if (blockIdx.x == 0 && num_tokens_per_expert != nullptr) {
        auto* expert_counts = reinterpret_cast<int32_t*>(meta + 1);
        for (int e = threadIdx.x; e < num_experts; e += kNumThreads)
            expert_counts[e] = num_tokens_per_expert[e];
    }
    // Cached dispatch: the receivers already know which rows they need, so there is nothing to scan.
    // (A flag, not a null is_token_in_rank: an empty array's pointer is null too.)
    const int num_scan_blocks = cached ? 0 : num_ranks;
    if (static_cast<int>(blockIdx.x) < num_scan_blocks) {
        auto* send_list = reinterpret_cast<int32_t*>(buffer + send_lists_offset) + static_cast<int64_t>(blockIdx.x) * num_tokens;
        scan_destination(is_token_in_rank, num_tokens, num_ranks, blockIdx.x, send_list, send_pos, meta);
        return;
    }
    stage_rows(x, hidden_bytes, scales, scale_token_stride, scale_channel_stride, num_scales, topk_idx, topk_weights,
               num_topk, num_tokens, buffer, scales_offset, topk_idx_offset, topk_weights_offset,
               blockIdx.x - num_scan_blocks, gridDim.x - num_scan_blocks);
}

// ---------------------------------------------------------------------------------------------
// Dispatch, step 3: notify (one block). Reads every sender's meta and writes this rank's plan:
//   recv_info = [num_recv_tokens, num_send_copies, rank_prefix[num_ranks + 1],
//                num_recv_tokens_per_expert[num_local_experts] (aligned)]
//   plans[num_ranks], combine_offsets[num_ranks] (this rank's first landing row in each source),
//   send_offsets[num_ranks] (each destination's first landing row in this rank's buffer).
extern "C" __global__ void __launch_bounds__(kNumThreads)
cuep_intranode_notify(const uint64_t* peer_bases, int rank, int num_ranks, int num_experts, int expert_alignment,
                      int32_t* recv_info, SourcePlan* plans, int32_t* combine_offsets, int32_t* send_offsets) {
    __shared__ int32_t recv_from[kMaxRanks];
    const int num_local_experts = num_experts / num_ranks;
    if (static_cast<int>(threadIdx.x) < num_ranks) {
        const int source = threadIdx.x;
        const auto* base = reinterpret_cast<const uint8_t*>(peer_bases[source]);
        const auto* meta = reinterpret_cast<const volatile SenderMeta*>(base);
        recv_from[source] = meta->send_count[rank];
        int32_t before = 0;
        for (int r = 0; r < rank; ++r)
            before += meta->send_count[r];
        combine_offsets[source] = before;
        const int64_t num_tokens = meta->num_tokens;
        plans[source] = SourcePlan{base + meta->x_offset, reinterpret_cast<const float*>(base + meta->scales_offset),
                                   reinterpret_cast<const int64_t*>(base + meta->topk_idx_offset),
                                   reinterpret_cast<const float*>(base + meta->topk_weights_offset),
                                   reinterpret_cast<const int32_t*>(base + meta->send_lists_offset) + rank * num_tokens};
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
// Dispatch, step 4: pull. One warp per received row; rows land in order of (source rank, source token).
extern "C" __global__ void __launch_bounds__(kNumThreads)
cuep_intranode_pull(const SourcePlan* plans, const int32_t* recv_info, int rank, int num_ranks, int num_experts,
                    int num_rows, int64_t hidden_bytes, int num_scales, int num_topk, uint8_t* recv_x,
                    float* recv_scales, int64_t* recv_topk_idx, float* recv_topk_weights, int32_t* recv_src_idx,
                    int cached, int32_t* status, int32_t* next_row) {
    __shared__ int32_t rank_prefix[kMaxRanks + 1];
    if (static_cast<int>(threadIdx.x) <= num_ranks)
        rank_prefix[threadIdx.x] = recv_info[2 + threadIdx.x];
    __syncthreads();
    const int num_recv = recv_info[0];
    if (num_recv > num_rows && blockIdx.x == 0 && threadIdx.x == 0) {  // num_worst_tokens was too small
        status[kStatusOverflow] = num_recv;
        __threadfence_system();
    }
    const int lane = threadIdx.x % kWarpSize;
    const int num_warps = gridDim.x * kWarpsPerBlock;
    // Padding rows up to num_worst_tokens: no expert, no source.
    for (int row = num_recv + blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize; row < num_rows; row += num_warps) {
        if (recv_topk_idx != nullptr && lane < num_topk) {
            recv_topk_idx[static_cast<int64_t>(row) * num_topk + lane] = -1;
            recv_topk_weights[static_cast<int64_t>(row) * num_topk + lane] = 0.0f;
        }
        if (lane == 0 && !cached)
            recv_src_idx[row] = -1;
    }
    if (num_recv > num_rows)
        return;
    const int experts_per_rank = num_experts / num_ranks;
    const int64_t first_local = static_cast<int64_t>(rank) * experts_per_rank;
    for_each_row_spread_over_sources(next_row, rank_prefix, rank, num_ranks, [&](int source, int row, int j, int lane) {
        const SourcePlan& plan = plans[source];
        const int64_t token = cached ? recv_src_idx[row] : plan.send_list[j];
        warp_copy(recv_x + row * hidden_bytes, plan.x + token * hidden_bytes, hidden_bytes, lane);
        if (recv_scales != nullptr)
            for (int s = lane; s < num_scales; s += kWarpSize)
                recv_scales[static_cast<int64_t>(row) * num_scales + s] = plan.scales[token * num_scales + s];
        if (recv_topk_idx != nullptr && lane < num_topk) {
            const int64_t expert = plan.topk_idx[token * num_topk + lane];
            const bool local = expert >= first_local && expert < first_local + experts_per_rank;
            recv_topk_idx[static_cast<int64_t>(row) * num_topk + lane] = local ? expert - first_local : -1;
            if (recv_topk_weights != nullptr)
                recv_topk_weights[static_cast<int64_t>(row) * num_topk + lane] =
                    local ? plan.topk_weights[token * num_topk + lane] : 0.0f;
        }
        if (!cached && lane == 0)
            recv_src_idx[row] = static_cast<int32_t>(token);
    });
}

// ---------------------------------------------------------------------------------------------
// Combine, step 2: push. One warp per received row: its hidden vector, then its top-k weights,
// into the source's landing row combine_offsets[source] + (row - rank_prefix[source]).
extern "C" __global__ void __launch_bounds__(kNumThreads)
cuep_intranode_push(const uint64_t* peer_bases, const int32_t* recv_info, const int32_t* combine_offsets,
                    int rank, int num_ranks, const uint8_t* x, int64_t hidden_bytes, const float* topk_weights,
                    int num_topk, int64_t landing_row_bytes, int32_t* next_row) {
    __shared__ int32_t rank_prefix[kMaxRanks + 1];
    if (static_cast<int>(threadIdx.x) <= num_ranks)
        rank_prefix[threadIdx.x] = recv_info[2 + threadIdx.x];
    __syncthreads();
    for_each_row_spread_over_sources(next_row, rank_prefix, rank, num_ranks, [&](int source, int row, int j, int lane) {
        const int64_t slot = combine_offsets[source] + j;
        auto* landing = reinterpret_cast<uint8_t*>(peer_bases[source]) + kMetaBytes + slot * landing_row_bytes;
        warp_copy(landing, x + row * hidden_bytes, hidden_bytes, lane);
        if (topk_weights != nullptr && lane < num_topk)
            reinterpret_cast<float*>(landing + hidden_bytes)[lane] = topk_weights[static_cast<int64_t>(row) * num_topk + lane];
    });
    __threadfence_system();
}

// ---------------------------------------------------------------------------------------------
// Combine, step 4: reduce. One warp per source token: FP32 sum of its copies plus biases.
namespace cuep {

__device__ __forceinline__ void accumulate_bf16x8(float (&acc)[kBf16PerVector], const int4& packed) {
    const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
    for (int i = 0; i < kBf16PerVector / 2; ++i) {
        const float2 f = __bfloat1622float2(pairs[i]);
        acc[2 * i] += f.x;
        acc[2 * i + 1] += f.y;
    }
}

__device__ __forceinline__ int4 pack_bf16x8(const float (&acc)[kBf16PerVector]) {
    int4 packed;
    auto* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
    for (int i = 0; i < kBf16PerVector / 2; ++i)
        pairs[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    return packed;
}

}  // namespace cuep

extern "C" __global__ void __launch_bounds__(kNumThreads)
cuep_intranode_reduce(const uint8_t* buffer, const int32_t* send_pos, const int32_t* send_offsets, int num_ranks,
                      int num_tokens, int hidden, int num_topk, int64_t landing_row_bytes, const __nv_bfloat16* bias0,
                      const __nv_bfloat16* bias1, int has_weights, __nv_bfloat16* combined_x,
                      float* combined_topk_weights) {
    const int lane = threadIdx.x % kWarpSize;
    const int num_warps = gridDim.x * kWarpsPerBlock;
    const int num_vectors = hidden / kBf16PerVector;
    const uint8_t* landing = buffer + kMetaBytes;
    for (int token = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize; token < num_tokens; token += num_warps) {
        const uint8_t* rows[kMaxRanks];
        int num_copies = 0;
        for (int r = 0; r < num_ranks; ++r) {
            const int pos = send_pos[static_cast<int64_t>(token) * num_ranks + r];
            if (pos >= 0)
                rows[num_copies++] = landing + (static_cast<int64_t>(send_offsets[r]) + pos) * landing_row_bytes;
        }
        for (int v = lane; v < num_vectors; v += kWarpSize) {
            float acc[kBf16PerVector] = {};
            for (int c = 0; c < num_copies; ++c)
                accumulate_bf16x8(acc, ld_nc_global(reinterpret_cast<const int4*>(rows[c]) + v));
            const int64_t offset = static_cast<int64_t>(token) * num_vectors + v;
            if (bias0 != nullptr)
                accumulate_bf16x8(acc, ld_nc_global(reinterpret_cast<const int4*>(bias0) + offset));
            if (bias1 != nullptr)
                accumulate_bf16x8(acc, ld_nc_global(reinterpret_cast<const int4*>(bias1) + offset));
            st_na_global(reinterpret_cast<int4*>(combined_x) + offset, pack_bf16x8(acc));
        }
        if (has_weights && lane < num_topk) {
            float sum = 0.0f;
            for (int c = 0; c < num_copies; ++c)
                sum += reinterpret_cast<const float*>(rows[c] + static_cast<int64_t>(hidden) * 2)[lane];
            combined_topk_weights[static_cast<int64_t>(token) * num_topk + lane] = sum;
        }
    }
}
