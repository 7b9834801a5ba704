// Dispatch layout: from each token's top-k expert ids to the counts that dispatch needs.
//
// Input:  topk_idx [num_tokens, num_topk], int32 or int64 (one entry kernel each); -1 means no
//         expert, and any id outside [0, num_experts) counts nowhere. An id outside [-1, num_experts)
//         is recorded in the status words (block 0 checks every entry), and a later host call raises
//         it (the next one once this kernel has finished): a check on the host would cost a sync per call.
// Output: num_tokens_per_expert [num_experts]   entries routed to each expert,
//         num_tokens_per_rank   [num_ranks]     tokens with at least one expert on each rank,
//         num_tokens_per_node   [num_nodes]     the same per node (only when num_nodes > 1),
//         is_token_in_rank      [num_tokens, num_ranks] (bool).
// Experts are split evenly and in order: rank r holds experts [r * E / R, (r + 1) * E / R), and
// node n holds ranks [n * R / N, (n + 1) * R / N).
//
// Grid: independent blocks, no communication. The first ceil(E / kExpertsPerBlock) blocks count
// experts, the next ceil(R / kGroupsPerBlock) decide is_token_in_rank and count ranks, and when
// there are several nodes the last ceil(N / kGroupsPerBlock) count nodes. Each block reads all of
// topk_idx (from L2 after the first); counts live in registers and are summed once per block.
#include <cuep/common.cuh>
#include <cuep/ptx.cuh>
#include <cuep/sync.cuh>

namespace cuep {

// From cuep/kernels/layout.py (its num_blocks() relies on the same counts).
constexpr int kNumThreads = CUEP_NUM_THREADS;
constexpr int kExpertsPerBlock = CUEP_EXPERTS_PER_BLOCK;  // counters per block live in registers
constexpr int kGroupsPerBlock = CUEP_GROUPS_PER_BLOCK;
static_assert(kNumThreads % kWarpSize == 0 && kNumThreads <= kWarpSize * kMaxWarpsPerBlock);
static_assert(kExpertsPerBlock <= kNumThreads && kGroupsPerBlock <= kNumThreads);

template <int kNumCounters>
__device__ void sum_over_block_and_store(int (&counts)[kNumCounters], int first, int limit, int* out) {
    __shared__ int per_warp[kNumThreads / kWarpSize][kNumCounters];
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
#pragma unroll
    for (int j = 0; j < kNumCounters; ++j) {
        int sum = counts[j];
#pragma unroll
        for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
            sum += __shfl_xor_sync(kFullWarpMask, sum, offset);
        if (lane == 0)
            per_warp[warp][j] = sum;
    }
    __syncthreads();
    if (threadIdx.x < kNumCounters && first + static_cast<int>(threadIdx.x) < limit) {
        int total = 0;
        for (int w = 0; w < kNumThreads / kWarpSize; ++w)
            total += per_warp[w][threadIdx.x];
        out[first + threadIdx.x] = total;
    }
}

// check_ids: also record the first id outside [-1, num_experts) in `status` (one block does).
template <typename TopkIdx>
__device__ void count_experts(const TopkIdx* topk_idx, int num_tokens, int num_topk, int num_experts,
                              int first_expert, int* num_tokens_per_expert, bool check_ids, const Status& status) {
    int counts[kExpertsPerBlock] = {};
    const int64_t num_entries = static_cast<int64_t>(num_tokens) * num_topk;
    for (int64_t i = threadIdx.x; i < num_entries; i += kNumThreads) {
        const int64_t id = static_cast<int64_t>(ld_nc_global(topk_idx + i));
        if (check_ids && (id < -1 || id >= num_experts))
            status.record_bad_expert_id(id, num_experts, kBadIdsLayout);
        const int64_t slot = id - first_expert;
#pragma unroll
        for (int j = 0; j < kExpertsPerBlock; ++j)
            counts[j] += slot == j;
    }
    sum_over_block_and_store(counts, first_expert, num_experts, num_tokens_per_expert);
}

// A "group" is a rank or a node: a contiguous range of experts_per_group experts.
// is_token_in_group may be null (nodes need only the counts).
template <typename TopkIdx>
__device__ void count_groups(const TopkIdx* topk_idx, int num_tokens, int num_topk, int num_experts,
                             int experts_per_group, int num_groups, int first_group,
                             bool* is_token_in_group, int* num_tokens_per_group) {
    int counts[kGroupsPerBlock] = {};
    for (int token = threadIdx.x; token < num_tokens; token += kNumThreads) {
        bool hit[kGroupsPerBlock] = {};
        for (int k = 0; k < num_topk; ++k) {
            const int64_t expert = ld_nc_global(topk_idx + static_cast<int64_t>(token) * num_topk + k);
            if (expert < 0 || expert >= num_experts)
                continue;
            const int64_t slot = expert / experts_per_group - first_group;
#pragma unroll
            for (int j = 0; j < kGroupsPerBlock; ++j)
                hit[j] |= slot == j;
        }
#pragma unroll
        for (int j = 0; j < kGroupsPerBlock; ++j) {
            counts[j] += hit[j];
            if (is_token_in_group != nullptr && first_group + j < num_groups)
                is_token_in_group[static_cast<int64_t>(token) * num_groups + first_group + j] = hit[j];
        }
    }
    sum_over_block_and_store(counts, first_group, num_groups, num_tokens_per_group);
}

template <typename TopkIdx>
__device__ void dispatch_layout(const TopkIdx* topk_idx, int num_tokens, int num_topk, int num_experts,
                                int num_ranks, int num_nodes, int* num_tokens_per_expert,
                                int* num_tokens_per_rank, int* num_tokens_per_node, bool* is_token_in_rank,
                                const Status& status) {
    const int num_expert_blocks = (num_experts + kExpertsPerBlock - 1) / kExpertsPerBlock;
    const int num_rank_blocks = (num_ranks + kGroupsPerBlock - 1) / kGroupsPerBlock;
    const int experts_per_rank = num_experts / num_ranks;
    int block = blockIdx.x;
    if (block < num_expert_blocks) {
        count_experts(topk_idx, num_tokens, num_topk, num_experts, block * kExpertsPerBlock, num_tokens_per_expert,
                      block == 0, status);
        return;
    }
    block -= num_expert_blocks;
    if (block < num_rank_blocks) {
        count_groups(topk_idx, num_tokens, num_topk, num_experts, experts_per_rank, num_ranks,
                     block * kGroupsPerBlock, is_token_in_rank, num_tokens_per_rank);
        return;
    }
    block -= num_rank_blocks;
    if (num_nodes > 1)
        count_groups(topk_idx, num_tokens, num_topk, num_experts, experts_per_rank * (num_ranks / num_nodes),
                     num_nodes, block * kGroupsPerBlock, static_cast<bool*>(nullptr), num_tokens_per_node);
}

// What both entries take (mirror: LayoutArgs in cuep/kernels/layout.py). The entries take its fields
// as scalar parameters, in order (parameter args_x is field args.x), and build it first: taken as one
// struct parameter, its fields are loads that NVRTC schedules otherwise, and the counting loops
// compile to other code.
struct LayoutArgs {
    const void* topk_idx;          // [num_tokens, num_topk], the entry's type
    int num_tokens, num_topk, num_experts, num_ranks, num_nodes;
    int* num_tokens_per_expert;    // [num_experts]
    int* num_tokens_per_rank;      // [num_ranks]
    int* num_tokens_per_node;      // [num_nodes], or nullptr with one node
    bool* is_token_in_rank;        // [num_tokens, num_ranks]
    int32_t* status_device;        // the Buffer's status words (a Status, as two fields)
    int32_t* status_host;
};

template <typename TopkIdx>
__device__ __forceinline__ void dispatch_layout(const LayoutArgs& a) {
    dispatch_layout(static_cast<const TopkIdx*>(a.topk_idx), a.num_tokens, a.num_topk, a.num_experts, a.num_ranks,
                    a.num_nodes, a.num_tokens_per_expert, a.num_tokens_per_rank, a.num_tokens_per_node,
                    a.is_token_in_rank, Status{a.status_device, a.status_host});
}

}  // namespace cuep

namespace cuep::layout {

// The entries, one per topk_idx type. (One __global__ template instantiated twice would name the
// same code, but NVRTC then gives the family's internal symbols a different name on every compile.)
__global__ void __launch_bounds__(kNumThreads)
get_dispatch_layout_i32(const int32_t* args_topk_idx, int args_num_tokens, int args_num_topk, int args_num_experts,
                        int args_num_ranks, int args_num_nodes, int* args_num_tokens_per_expert,
                        int* args_num_tokens_per_rank, int* args_num_tokens_per_node, bool* args_is_token_in_rank,
                        int32_t* args_status_device, int32_t* args_status_host) {
    dispatch_layout<int32_t>({args_topk_idx, args_num_tokens, args_num_topk, args_num_experts, args_num_ranks,
                              args_num_nodes, args_num_tokens_per_expert, args_num_tokens_per_rank,
                              args_num_tokens_per_node, args_is_token_in_rank, args_status_device,
                              args_status_host});
}

__global__ void __launch_bounds__(kNumThreads)
get_dispatch_layout_i64(const int64_t* args_topk_idx, int args_num_tokens, int args_num_topk, int args_num_experts,
                        int args_num_ranks, int args_num_nodes, int* args_num_tokens_per_expert,
                        int* args_num_tokens_per_rank, int* args_num_tokens_per_node, bool* args_is_token_in_rank,
                        int32_t* args_status_device, int32_t* args_status_host) {
    dispatch_layout<int64_t>({args_topk_idx, args_num_tokens, args_num_topk, args_num_experts, args_num_ranks,
                              args_num_nodes, args_num_tokens_per_expert, args_num_tokens_per_rank,
                              args_num_tokens_per_node, args_is_token_in_rank, args_status_device,
                              args_status_host});
}

}  // namespace cuep::layout
