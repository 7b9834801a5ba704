"""The internode mode's buffer layouts, row sizes, plan layout and size hints (no GPU needed)."""

import pytest

from cuep import Config
from cuep.kernels import internode as kernels
from cuep.modes import internode
from cuep.modes.resources import check_internode_sizes
from cuep.runtime.topology import plan_topology


def test_rows_hold_their_parts_in_whole_vectors():
    # BF16 7168, top-8, 8 ranks per node: 14336 + 8 * 8 + 4 + 8 * 4 = 14436 -> 14448
    assert internode.dispatch_row_bytes(14336, 0, 8, 8) == 14448
    # FP8 7168 with 56 scales, top-8, 2 ranks per node: 7168 + 224 + 64 + 4 + 8 = 7468 -> 7472
    assert internode.dispatch_row_bytes(7168, 56, 8, 2) == 7472
    assert internode.combine_row_bytes(7168, 8) == 14368
    assert internode.combine_row_bytes(7168, 0) == 14336
    for size in (internode.dispatch_row_bytes(2 * 384, 0, 3, 3), internode.combine_row_bytes(384, 3)):
        assert size % internode.ROW_ALIGN == 0


@pytest.mark.parametrize("num_ranks,num_nodes", [(4, 2), (4, 4), (6, 3), (16, 2), (256, 32)])
def test_rdma_layout_parts_do_not_overlap_and_fit(num_ranks, num_nodes):
    total = 300 << 20
    layout = internode.RdmaLayout.carve(total, num_ranks, num_nodes)
    parts = [(layout.count_signals, 8 * num_ranks), (layout.chunk_signals, 8 * num_nodes * kernels.MAX_CHUNKS),
             (layout.counts, 4 * num_ranks * kernels.COUNT_WORDS),
             (layout.count_staging, 4 * num_ranks * kernels.COUNT_WORDS),
             (layout.send, num_nodes * layout.partition_bytes), (layout.recv, num_nodes * layout.partition_bytes)]
    for (start, size), (next_start, _) in zip(parts, parts[1:]):
        assert start + size <= next_start
    assert layout.recv + num_nodes * layout.partition_bytes <= total
    assert layout.partition_bytes > 0 and layout.partition_bytes % 4096 == 0
    # rdma_bytes_for is the inverse: the smallest buffer whose partitions hold that many bytes
    need = internode.rdma_bytes_for(layout.partition_bytes, num_ranks, num_nodes)
    assert internode.RdmaLayout.carve(need, num_ranks, num_nodes).partition_bytes == layout.partition_bytes


def test_plan_layout_parts_follow_each_other():
    plan = internode.PlanLayout.create(num_ranks=6, num_nodes=3, ranks_per_node=2, num_local_experts=16)
    assert (plan.recv_prefix, plan.per_expert, plan.forward_prefix, plan.part_rows, plan.push_offsets,
            plan.forward_offsets, plan.landing_rows, plan.words) == (2, 9, 25, 29, 35, 41, 47, 49)


def test_chunk_rows_respect_the_signal_table():
    assert internode.chunk_rows(6, 4096) == 6
    assert internode.chunk_rows(6, 10 * kernels.MAX_CHUNKS) == 10
    assert internode.chunk_rows(1, 0) == 1


def test_rdma_hint_holds_a_batch_per_partition():
    hint = Config().get_rdma_buffer_size_hint(14336, 16)  # 2 nodes of 8 (DeepEP's default node)
    layout = internode.RdmaLayout.carve(hint, 16, 2)
    assert layout.partition_bytes >= 4096 * internode.dispatch_row_bytes(14336, 0, 8, 8)
    assert Config().get_rdma_buffer_size_hint(14336, 8) == 0  # one node
    assert Config().get_rdma_buffer_size_hint(14336, 4, num_ranks_per_node=2) > 0
    with pytest.raises(ValueError, match="num_ranks_per_node"):
        Config().get_rdma_buffer_size_hint(14336, 6, num_ranks_per_node=4)


def test_nvl_hint_across_nodes_holds_the_combine_landing_rows():
    hint = Config().get_nvl_buffer_size_hint(14336, 16)
    rows = 2 * 4096 * 8  # nodes * tokens * min(ranks per node, top-k)
    assert hint == internode.NVL_CONTROL_BYTES + rows * internode.combine_row_bytes(7168, 8)


def test_hints_follow_cuep_ranks_per_node(monkeypatch):
    monkeypatch.setenv("CUEP_RANKS_PER_NODE", "2")
    assert Config().get_rdma_buffer_size_hint(4096, 4) == Config().get_rdma_buffer_size_hint(
        4096, 4, num_ranks_per_node=2) > 0


def topology(num_ranks, ranks_per_node):
    return plan_topology(0, [0] * num_ranks, ranks_per_node)


def test_buffer_sizes_that_cannot_serve_the_nodes_raise_at_construction():
    with pytest.raises(ValueError, match="num_rdma_bytes"):
        check_internode_sizes(topology(4, 2), 1 << 20, 0)
    with pytest.raises(ValueError, match="num_nvl_bytes"):
        check_internode_sizes(topology(4, 2), 1024, 64 << 20)
    with pytest.raises(ValueError, match="at most 8 ranks per node"):
        check_internode_sizes(topology(32, 16), 1 << 20, 1 << 30)
    check_internode_sizes(topology(4, 2), 1 << 20, 64 << 20)


def test_every_shape_of_cluster_fits_the_kernels_bounds():
    # The notify block gives each source a thread, the kernels' shared tables hold one entry per rank.
    assert kernels.NUM_THREADS >= kernels.MAX_RANKS
    assert kernels.MAX_RANKS_PER_NODE <= 32
    assert kernels.COUNT_WORDS >= kernels.COUNT_HEADER_WORDS + kernels.MAX_LOCAL_EXPERTS


def test_handle_round_trips_through_its_flat_tuple():
    import numpy as np
    handle = internode.Handle(
        num_tokens=5, num_rows=7, num_recv_tokens=6, num_local_experts=4, plan=np.zeros(40, np.int32),
        plan_host=np.zeros(40, np.int32), send_pos=np.zeros((5, 4), np.int32), node_pos=np.zeros((5, 2), np.int32),
        node_list=np.zeros((2, 5), np.int32), counts=np.zeros(6, np.int32), forward_pos=np.zeros((3, 2), np.int32),
        recv_gbl_rank_prefix_sum=np.arange(1, 5, dtype=np.int32), recv_src_idx=np.zeros(7, np.int32),
        is_token_in_rank=np.zeros((5, 4), np.bool_))
    items = list(handle)
    assert len(items) == len(handle) == len(internode.HANDLE_ARRAYS)
    assert items[-4] is handle.recv_gbl_rank_prefix_sum  # where DeepEP's users read it
    restored = internode.Handle.from_arrays(dict(zip(internode.HANDLE_ARRAYS, items)))
    assert (restored.num_tokens, restored.num_rows, restored.num_recv_tokens, restored.num_local_experts,
            restored.num_ranks) == (5, 7, 6, 4, 4)
    assert restored.plan_host is None  # a restored handle's combine checks its landing rows on the device
    items[1] = np.zeros((5, 4), np.int64)
    with pytest.raises(ValueError, match="send_pos must be int32"):
        internode.Handle.from_arrays(dict(zip(internode.HANDLE_ARRAYS, items)))
