"""cuep.reference against layouts worked out by hand."""

import ml_dtypes
import numpy as np
import pytest

from cuep import fp8, reference


def test_two_ranks_three_tokens_four_experts():
    # Rank 0 holds experts 0-1, rank 1 holds experts 2-3.
    topk = np.array([[0, 1],    # both on rank 0
                     [1, 3],    # rank 0 and rank 1
                     [-1, 2]])  # rank 1 only; -1 routes nowhere
    layout = reference.get_dispatch_layout(topk, num_experts=4, num_ranks=2)
    np.testing.assert_array_equal(layout.num_tokens_per_expert, [1, 2, 1, 1])
    np.testing.assert_array_equal(layout.num_tokens_per_rank, [2, 2])
    np.testing.assert_array_equal(layout.is_token_in_rank, [[True, False], [True, True], [False, True]])
    assert layout.num_tokens_per_rdma_rank is None
    assert layout.num_tokens_per_rank.dtype == layout.num_tokens_per_expert.dtype == np.int32


def test_two_nodes_of_two_ranks():
    # 8 experts, 4 ranks (2 experts each), nodes {0, 1} and {2, 3}.
    topk = np.array([[0, 2, -1],   # ranks 0, 1 -> node 0 only
                     [1, 7, 6],    # ranks 0, 3 -> both nodes
                     [5, 4, -1],   # rank 2 -> node 1
                     [-1, -1, -1]])
    layout = reference.get_dispatch_layout(topk, num_experts=8, num_ranks=4, num_ranks_per_node=2)
    np.testing.assert_array_equal(layout.num_tokens_per_rank, [2, 1, 1, 1])
    np.testing.assert_array_equal(layout.num_tokens_per_rdma_rank, [2, 2])
    np.testing.assert_array_equal(layout.num_tokens_per_expert, [1, 1, 1, 0, 1, 1, 1, 1])
    assert not layout.is_token_in_rank[3].any()


def test_cross_node_copies_count_each_other_node_once_per_token():
    # 12 experts, 6 ranks (2 experts each), 3 nodes of 2 ranks: node n holds experts [4n, 4n + 4).
    topk = np.array([[0, 2, -1],    # node 0 only: nothing crosses
                     [5, 6, 4],     # node 1 three times (ranks 2 and 3): one copy
                     [9, 4, 11],    # nodes 2 and 1: two copies
                     [-1, -1, -1]])
    assert reference.cross_node_copies(topk, 12, 6, 2, rank=0) == 3
    assert reference.cross_node_copies(topk, 12, 6, 2, rank=1) == 3  # rank 1 shares rank 0's node
    # Seen from a rank of node 1, node 1 is home: token 0 crosses once, token 1 nowhere, token 2 once.
    assert reference.cross_node_copies(topk, 12, 6, 2, rank=3) == 2
    assert reference.cross_node_copies(topk, 12, 6, 6, rank=0) == 0  # one node: nothing crosses


def test_repeated_expert_counts_per_entry_but_rank_once():
    layout = reference.get_dispatch_layout(np.array([[3, 3]]), num_experts=4, num_ranks=2)
    np.testing.assert_array_equal(layout.num_tokens_per_expert, [0, 0, 0, 2])
    np.testing.assert_array_equal(layout.num_tokens_per_rank, [0, 1])


def test_zero_tokens():
    layout = reference.get_dispatch_layout(np.zeros((0, 8), dtype=np.int64), num_experts=16, num_ranks=4)
    assert layout.is_token_in_rank.shape == (0, 4)
    assert not layout.num_tokens_per_rank.any() and not layout.num_tokens_per_expert.any()


@pytest.mark.parametrize("topk, experts, ranks, message", [
    (np.array([[0, 4]]), 4, 2, r"in \[0, 4\)"),
    (np.array([[0, -2]]), 4, 2, r"in \[0, 4\)"),
    (np.array([[0, 1]]), 5, 2, "multiple of num_ranks"),
    (np.array([0, 1]), 4, 2, "num_tokens, num_topk"),
])
def test_rejects_bad_input(topk, experts, ranks, message):
    with pytest.raises(ValueError, match=message):
        reference.get_dispatch_layout(topk, experts, ranks)


def test_dispatch_and_combine_two_ranks_by_hand():
    # Rank 0 holds experts 0-1, rank 1 holds experts 2-3.
    xs = [np.arange(6, dtype=np.float32).reshape(3, 2), np.arange(6, 10, dtype=np.float32).reshape(2, 2)]
    topk = [np.array([[0, 3], [1, -1], [2, 3]]), np.array([[3, -1], [0, 2]])]
    rank0, rank1 = reference.dispatch(xs, topk, num_experts=4)
    assert rank0.recv_src.tolist() == [[0, 0], [0, 1], [1, 1]]
    assert rank0.recv_x.tolist() == [[0, 1], [2, 3], [8, 9]]
    assert rank0.recv_topk_idx.tolist() == [[0, -1], [1, -1], [0, -1]]
    assert rank0.num_recv_tokens_per_expert == [2, 1]
    assert rank1.recv_src.tolist() == [[0, 0], [0, 2], [1, 0], [1, 1]]
    assert rank1.recv_topk_idx.tolist() == [[-1, 1], [0, 1], [1, -1], [-1, 0]]
    assert rank1.num_recv_tokens_per_expert == [2, 3]
    aligned = reference.dispatch(xs, topk, num_experts=4, expert_alignment=4)
    assert aligned[1].num_recv_tokens_per_expert == [4, 4]
    combined, _ = reference.combine([rank0.recv_x, rank1.recv_x], [rank0.recv_src, rank1.recv_src], [3, 2])
    assert combined[0].tolist() == [[0, 2], [2, 3], [4, 5]]  # token 0 came back from both ranks
    assert combined[1].tolist() == [[6, 7], [16, 18]]


def test_dispatch_zeroes_weights_of_remote_experts():
    xs = [np.zeros((1, 2)), np.zeros((0, 2))]
    result = reference.dispatch(xs, [np.array([[0, 2]]), np.zeros((0, 2), int)], num_experts=4,
                                topk_weights=[np.array([[0.25, 0.75]], np.float32), np.zeros((0, 2), np.float32)])
    assert result[0].recv_topk_weights.tolist() == [[0.25, 0.0]]
    assert result[1].recv_topk_weights.tolist() == [[0.0, 0.75]]


def test_low_latency_dispatch_orders_rows_by_source_rank_then_token():
    xs = [np.arange(3 * 128, dtype=np.float32).reshape(3, 128) + 1000 * s for s in range(2)]
    xs = [x.astype(ml_dtypes.bfloat16) for x in xs]
    topk = [np.array([[0, 3], [1, -1], [0, 1]]), np.array([[3, 0], [-1, -1], [2, 3]])]
    results = reference.low_latency_dispatch(xs, topk, num_experts=4, max_tokens=4, use_fp8=False)
    rank0, rank1 = results
    assert rank0.recv_count.tolist() == [3, 2] and rank1.recv_count.tolist() == [1, 3]
    assert rank0.recv_src[0].tolist() == [[0, 0], [0, 2], [1, 0]]
    assert rank1.recv_src[1].tolist() == [[0, 0], [1, 0], [1, 2]]
    np.testing.assert_array_equal(rank0.recv_x[0, 2], xs[1][0])
    assert rank0.recv_x.shape == (2, 8, 128) and not rank0.recv_x[0, 3:].astype(np.float32).any()


def test_low_latency_dispatch_fp8_sends_each_token_quantised_once():
    x = np.random.default_rng(1).standard_normal((2, 256)).astype(ml_dtypes.bfloat16)
    topk = [np.array([[0, 1], [1, -1]])]
    (result,) = reference.low_latency_dispatch([x], topk, num_experts=2, max_tokens=2, round_scale=True)
    codes, scales = fp8.quantize(x, round_scale=True)
    np.testing.assert_array_equal(result.recv_x[1, :2], codes)
    np.testing.assert_array_equal(result.recv_scales[1, :2], scales)


def test_low_latency_combine_weights_each_choice():
    topk = [np.array([[0, 1], [1, -1]])]
    weights = [np.array([[0.5, 2.0], [3.0, 7.0]], np.float32)]
    outputs = [np.zeros((2, 2, 128), np.float32)]
    outputs[0][0, 0] = 1.0  # expert 0, its row for token 0
    outputs[0][1, 0] = 10.0  # expert 1: token 0 first, then token 1
    outputs[0][1, 1] = 100.0
    (combined,) = reference.low_latency_combine(outputs, topk, weights, num_experts=2)
    assert combined[:, 0].tolist() == [0.5 * 1 + 2 * 10, 3 * 100]


def test_low_latency_combine_skips_choices_set_to_minus_one_since_the_dispatch():
    """The rows stay where the dispatch put them; an entry the combine's ids set to -1 adds nothing."""
    dispatched = [np.array([[0, 1], [1, -1]])]
    combined_ids = [np.array([[0, -1], [1, -1]])]
    weights = [np.array([[0.5, 2.0], [3.0, 7.0]], np.float32)]
    outputs = [np.zeros((2, 2, 128), np.float32)]
    outputs[0][0, 0], outputs[0][1, 0], outputs[0][1, 1] = 1.0, 10.0, 100.0  # expert 1: token 0's row, then 1's
    (combined,) = reference.low_latency_combine(outputs, combined_ids, weights, num_experts=2,
                                                dispatch_topk_idxs=dispatched)
    assert combined[:, 0].tolist() == [0.5 * 1, 3 * 100]  # token 1's row is still expert 1's second
    with pytest.raises(ValueError, match="rank 0's combine ids differ"):
        reference.low_latency_combine(outputs, [np.array([[1, 1], [1, -1]])], weights, num_experts=2,
                                      dispatch_topk_idxs=dispatched)


def test_rank_prefix_matrix_by_hand():
    # 2 ranks, 4 experts (2 per rank). Rank 0: token 0 -> rank 0, token 1 -> ranks 0 and 1, token 2 -> none.
    # Rank 1: token 0 -> rank 1 (twice, counted once), token 1 -> rank 0.
    topk = [np.array([[0, 1], [1, 3], [-1, -1]]), np.array([[2, 3], [0, -1]])]
    assert reference.rank_prefix_matrix(topk, 4).tolist() == [[2, 1], [3, 2]]
    assert reference.rank_prefix_matrix(topk, 4).dtype == np.int32


def test_low_latency_handle_items_by_hand():
    # 2 ranks, 2 experts (1 per rank), 3 tokens per rank.
    topk = [np.array([[0], [1], [0]]), np.array([[0], [0], [1]])]
    xs = [np.zeros((3, 128), np.float32)] * 2
    results = reference.low_latency_dispatch(xs, topk, num_experts=2, max_tokens=3, use_fp8=False)
    src_info, layout_range = reference.low_latency_handle_items(results[0], num_ranks=2)
    # Expert 0 receives rank 0's tokens 0 and 2, then rank 1's tokens 0 and 1.
    assert src_info[0].tolist() == [0, 2, 0, 1]
    assert layout_range.tolist() == [[(0 << 32) | 2, (2 << 32) | 2]]
    src_info, layout_range = reference.low_latency_handle_items(results[1], num_ranks=2)
    assert src_info[0].tolist() == [1, 2] and layout_range.tolist() == [[(0 << 32) | 1, (1 << 32) | 1]]


def test_elastic_layout_groups_entries_by_expert_in_received_order():
    import ml_dtypes
    # rank 0 receives from two sources; 2 local experts; alignment 4
    recv_topk_idx = np.array([[1, -1, 0], [-1, 1, -1], [0, 1, -1]])
    result = reference.DispatchResult(np.zeros((3, 8), ml_dtypes.bfloat16), None, recv_topk_idx, None, [],
                                      np.array([[0, 5], [1, 2], [1, 7]]))
    layout = reference.elastic_layout(result, 100, 2, expert_alignment=4)
    # expert 0: entries (0, 2), (2, 0) -> rows 0, 1; expert 1 starts at 4: (0, 0), (1, 1), (2, 1) -> 4, 5, 6
    np.testing.assert_array_equal(layout.expanded_row, [[4, -1, 0], [-1, 5, -1], [1, 6, -1]])
    np.testing.assert_array_equal(layout.psum_per_expert, [2, 7])
    np.testing.assert_array_equal(layout.psum_per_expert_compact, [4, 8])
    np.testing.assert_array_equal(layout.src_global, [5, 102, 107])
    assert layout.num_expanded_rows == 8


def test_elastic_combine_adds_biases_first_then_holders_by_their_highest_lane():
    import ml_dtypes
    bf16 = ml_dtypes.bfloat16
    # One token of rank 0, lanes on ranks 1 and 0 (2 experts per rank): rank 1's highest lane is 0, rank 0's is 1,
    # so the order is bias, rank 1, rank 0: 2^24 - 2^24 + 1 = 1. In rank order FP32 loses the 1: 2^24 + 1 - 2^24 = 0.
    topk = [np.array([[2, 0]]), np.zeros((0, 2), np.int64)]
    rows = np.zeros((1, 2, 1), bf16)
    rows[0, 0, 0], rows[0, 1, 0] = 1.0, -(2.0 ** 24)
    got = reference.elastic_combine([rows, np.zeros((0, 2, 1), bf16)], topk, 4,
                                    [(np.full((1, 1), 2.0 ** 24, bf16),), None])
    assert got[0][0, 0] == bf16(1.0)
    # On the expert's rank, a token's rows in lane order: 2^24 + 1 - 2^24 = 0 in FP32.
    summed = reference.lane_order_sum(np.array([[[2.0 ** 24], [1.0], [-(2.0 ** 24)]]], bf16))
    assert summed[0, 0] == bf16(0.0)
    # From a start (V2's biases, allow_multiple_reduction=False): 2^24 + 1 + 1 - 2^24 = 0 in FP32; the start last, 2.
    start = np.full((1, 1), 2.0 ** 24, np.float32)
    assert reference.lane_order_sum(np.array([[[1.0], [1.0], [-(2.0 ** 24)]]], bf16), start)[0, 0] == bf16(0.0)
    assert start[0, 0] == 2.0 ** 24  # not summed in place


def test_elastic_combine_across_nodes_rounds_each_node_partial_once():
    import ml_dtypes
    bf16 = ml_dtypes.bfloat16
    # Four ranks, two a node, one expert each; one token of rank 0 with lanes on ranks 1, 0, 3 (highest lanes 0, 1,
    # 2): node 0 sums ranks 1 then 0, node 1 has rank 3; the source adds node 0's partial, then node 1's.
    topk = [np.array([[1, 0, 3]])] + [np.zeros((0, 3), np.int64)] * 3
    rows = np.zeros((1, 4, 1), bf16)
    rows[0, 1, 0], rows[0, 0, 0], rows[0, 3, 0] = 256.0, 1.0, -256.0
    empty = [np.zeros((0, 4, 1), bf16)] * 3
    hybrid = reference.elastic_combine([rows] + empty, topk, 4, ranks_per_node=2)
    # Node 0's partial 257 rounds to 256 in BF16 (8 significant bits), so the result is 0; summed flat it is 1.
    assert hybrid[0][0, 0] == bf16(0.0)
    assert reference.elastic_combine([rows] + empty, topk, 4)[0][0, 0] == bf16(1.0)
    # The order between nodes follows each node's highest lane: node 1's rank 3 holds lane 0 here.
    topk = [np.array([[3, 0, 1]])] + [np.zeros((0, 3), np.int64)] * 3
    rows[0, 3, 0], rows[0, 0, 0], rows[0, 1, 0] = -(2.0 ** 24), 1.0, 0.0
    bias = (np.full((1, 1), 2.0 ** 24, bf16),)
    got = reference.elastic_combine([rows] + empty, topk, 4, [bias, None, None, None], ranks_per_node=2)
    # The bias, node 1 (lane 0), node 0 (lanes 1, 2): 2^24 - 2^24 + 1 = 1; node 0 first would lose the 1 in FP32.
    assert got[0][0, 0] == bf16(1.0)
