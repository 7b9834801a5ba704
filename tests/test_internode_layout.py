"""The internode mode's buffer layouts, row sizes, plan layout and size hints (no GPU needed)."""

import pytest

from cuep import Config
from cuep.kernels import internode as kernels
from cuep.modes import internode
from cuep.modes.resources import check_internode_sizes
from cuep.runtime.topology import plan_topology


def test_rows_hold_their_parts_in_whole_vectors():
    # BF16 7168, top-8, 8 ranks per node: 14336 + 8 * 8 + 4 + 2 * 8 * 4 = 14468 -> 14480
    assert internode.dispatch_row_bytes(14336, 0, 8, 8) == 14480
    # FP8 7168 with 56 scales, top-8, 2 ranks per node: 7168 + 224 + 64 + 4 + 2 * 8 = 7476 -> 7488
    assert internode.dispatch_row_bytes(7168, 56, 8, 2) == 7488
    assert internode.combine_row_bytes(7168, 8) == 14384
    assert internode.combine_row_bytes(7168, 0) == 14352
    for size in (internode.dispatch_row_bytes(2 * 384, 0, 3, 3), internode.combine_row_bytes(384, 3)):
        assert size % internode.ROW_ALIGN == 0


@pytest.mark.parametrize("num_ranks,num_nodes", [(4, 2), (4, 4), (6, 3), (16, 2), (256, 32)])
def test_rdma_layout_parts_do_not_overlap_and_fit(num_ranks, num_nodes):
    total = 300 << 20
    layout = internode.RdmaLayout.carve(total, num_ranks, num_nodes)
    parts = [(layout.count_signals, 8 * num_ranks), (layout.chunk_signals, 8 * num_nodes * kernels.MAX_CHUNKS),
             (layout.round_signals, 8 * num_nodes), (layout.rows_released, 8 * num_ranks),
             (layout.partials_released, 8 * num_nodes), (layout.headers, 8 * num_nodes),
             (layout.header_staging, 8 * num_nodes), (layout.counts, 4 * num_ranks * kernels.COUNT_WORDS),
             (layout.count_staging, 4 * num_ranks * kernels.COUNT_WORDS),
             (layout.send, (num_nodes - 1) * layout.partition_bytes),  # none for the own node's rows
             (layout.recv, num_nodes * layout.partition_bytes)]
    for (start, size), (next_start, _) in zip(parts, parts[1:]):
        assert start + size <= next_start
    assert layout.recv + num_nodes * layout.partition_bytes <= total
    assert layout.partition_bytes > 0 and layout.partition_bytes % 4096 == 0
    # rdma_bytes_for is the inverse: the smallest buffer whose partitions hold that many bytes
    need = internode.rdma_bytes_for(layout.partition_bytes, num_ranks, num_nodes)
    assert internode.RdmaLayout.carve(need, num_ranks, num_nodes).partition_bytes == layout.partition_bytes


def test_plan_layout_parts_follow_each_other():
    plan = internode.PlanLayout.create(num_ranks=6, num_nodes=3, num_local_experts=16)
    # words 0, 1, 2: received rows, forwarded rows, the largest token count
    assert (plan.recv_prefix, plan.per_expert, plan.forward_prefix, plan.words) == (3, 10, 26, 30)
    assert internode.PlanLayout.MAX_TOKENS == 2


def test_chunk_rows_respect_the_signal_table():
    assert internode.chunk_rows(6, 4096) == 6
    assert internode.chunk_rows(6, 10 * kernels.MAX_CHUNKS) == 10
    assert internode.chunk_rows(1, 0) == 1


@pytest.mark.parametrize("chunk_tokens, round_rows, parts, grid", [
    (6, 4096, 4, 24), (6, 1280, 4, 24), (6, 4096, 2, 24), (6, 1280, 2, 24), (6, 1280, 2, 128), (6, 4096, 4, 16),
    (48, 4096, 4, 24), (6, 333, 3, 7), (1, 1, 1, 1)])
def test_balanced_chunks_give_every_warp_at_most_one_chunk_a_wave(chunk_tokens, round_rows, parts, grid):
    warps = grid * internode.WARPS_PER_BLOCK
    rows = internode.balanced_chunk_rows(chunk_tokens, round_rows, parts, grid)
    chunks = parts * -(-round_rows // rows)
    waves = -(-chunks // warps)
    assert chunk_tokens <= rows and (rows <= internode.MOST_CHUNK_ROWS or rows == chunk_tokens)
    # The fewest waves that chunks of at most MOST_CHUNK_ROWS rows (or the Config's) allow, and no smaller chunk
    # keeps that many.
    assert waves == max(1, -(-parts * -(-round_rows // max(chunk_tokens, internode.MOST_CHUNK_ROWS)) // warps))
    assert rows == chunk_tokens or parts * -(-round_rows // (rows - 1)) > waves * warps


def test_balanced_chunks_at_the_measured_sizes():
    # 2 nodes of 2 ranks, 24 SMs (384 warps): a dispatch's pull (4 partitions) and a combine's forward (2)
    assert internode.balanced_chunk_rows(6, 4096, 4, 24) == 22   # one round of 4096 tokens: 748 chunks, 2 waves
    assert internode.balanced_chunk_rows(6, 2048, 4, 24) == 22   # the hints' buffers, 2 even rounds: 376 chunks
    assert internode.balanced_chunk_rows(6, 2048, 2, 24) == 11   # the forward there: 374 chunks, 1 wave
    assert internode.balanced_chunk_rows(6, 1280, 4, 24) == 14   # rounds of 1280 tokens: 368 chunks, 1 wave
    assert internode.balanced_chunk_rows(6, 1280, 2, 24) == 7    # the forward there: 366 chunks, not 427 of 6
    # 2 nodes of 8, the hints' rounds of 1408 tokens: the pull's 16 partitions in 2 waves, the forward's 2 in 1
    assert internode.balanced_chunk_rows(6, 1408, 16, 24) == 30  # 752 chunks
    assert internode.balanced_chunk_rows(6, 1408, 2, 24) == 8    # 352 chunks
    assert internode.balanced_chunk_rows(6, 64 * kernels.MAX_CHUNKS, 4, 24) == 64  # the signal table's floor
    assert internode.balanced_chunk_rows(6, 0, 4, 24) == 6


def test_rdma_hint_holds_a_round_per_partition_with_no_token_count():
    # 2 nodes of 8 (DeepEP's default node), its defaults: the NVL rings (20 SMs / 2 channels of 256 tokens for each
    # of 8 local ranks) over 7 x 2 landing sections bind: 1462 tokens, 1408 in whole units of 128
    hint = Config().get_rdma_buffer_size_hint(14336, 16)
    layout = internode.RdmaLayout.carve(hint, 16, 2)
    assert layout.partition_bytes >= 1408 * internode.dispatch_row_bytes(14336, 0, 8, 8)
    assert hint == Config().get_rdma_buffer_size_hint(14336, 16, num_tokens=1300)  # whole units of 128
    assert Config(num_sms=40).get_rdma_buffer_size_hint(14336, 16) > hint
    assert Config().get_rdma_buffer_size_hint(14336, 8) == 0  # one node
    assert Config().get_rdma_buffer_size_hint(14336, 4, num_ranks_per_node=2) > 0
    with pytest.raises(ValueError, match="num_ranks_per_node"):
        Config().get_rdma_buffer_size_hint(14336, 6, num_ranks_per_node=4)


def test_nvl_hint_across_nodes_holds_a_rounds_landing_rows():
    hint = Config().get_nvl_buffer_size_hint(14336, 16)
    rows = 7 * 2 * 1408  # a section of a round per (other local rank, source node)
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
    # Nodes of one rank land no copies: the NVL buffer holds the combine's flags, in the least any Buffer takes.
    nvl_hint = Config().get_nvl_buffer_size_hint(14336, 4, num_ranks_per_node=1)
    assert nvl_hint == internode.nvl_bytes_for(0, 16) == internode.MIN_NVL_BYTES > internode.NVL_CONTROL_BYTES
    check_internode_sizes(topology(4, 1), nvl_hint, 64 << 20)


def test_every_shape_of_cluster_fits_the_kernels_bounds():
    # The notify block gives each source a thread, the kernels' shared tables hold one entry per rank.
    assert kernels.NUM_THREADS >= kernels.MAX_RANKS
    assert kernels.MAX_RANKS_PER_NODE <= 32
    assert kernels.COUNT_WORDS >= kernels.COUNT_HEADER_WORDS + kernels.MAX_LOCAL_EXPERTS


def test_handle_round_trips_through_its_flat_tuple():
    import numpy as np
    handle = internode.Handle(
        num_tokens=5, num_rows=7, num_recv_tokens=6, num_local_experts=4, round_tokens=128, num_rounds=1,
        plan=np.zeros(40, np.int32), plan_host=np.zeros(40, np.int32), send_pos=np.zeros((5, 4), np.int32),
        node_pos=np.zeros((5, 2), np.int32), node_list=np.zeros((2, 5), np.int32), counts=np.zeros(6, np.int32),
        unit_prefix=np.zeros((2, 6), np.int32), forward_pos=np.zeros((3, 2), np.int32),
        forward_src=np.zeros(3, np.int32), recv_gbl_rank_prefix_sum=np.arange(1, 5, dtype=np.int32),
        recv_src_idx=np.zeros(7, np.int32), is_token_in_rank=np.zeros((5, 4), np.bool_))
    items = list(handle)
    assert len(items) == len(handle) == len(internode.HANDLE_ARRAYS)
    assert items[-4] is handle.recv_gbl_rank_prefix_sum  # where DeepEP's users read it
    restored = internode.Handle.from_arrays(dict(zip(internode.HANDLE_ARRAYS, items)))
    assert (restored.num_tokens, restored.num_rows, restored.num_recv_tokens, restored.num_local_experts,
            restored.num_ranks, restored.round_tokens, restored.num_rounds) == (5, 7, 6, 4, 4, 128, 1)
    assert restored.plan_host is None
    unfit = dict(zip(internode.HANDLE_ARRAYS, items), unit_prefix=np.zeros((3, 6), np.int32))
    with pytest.raises(ValueError, match="do not fit together"):
        internode.Handle.from_arrays(unfit)
    items[1] = np.zeros((5, 4), np.int64)
    with pytest.raises(ValueError, match="send_pos must be int32"):
        internode.Handle.from_arrays(dict(zip(internode.HANDLE_ARRAYS, items)))


def _context_of(num_ranks: int, ranks_per_node: int, nvl_bytes: int, rdma_bytes: int):
    """What round_tokens_for reads of a Buffer's internode context."""
    import types
    rdma = internode.RdmaLayout.carve(rdma_bytes, num_ranks, num_ranks // ranks_per_node)
    return types.SimpleNamespace(topology=topology(num_ranks, ranks_per_node), rdma_layout=rdma,
                                 nvl_layout=internode.NvlLayout.carve(nvl_bytes),
                                 partition_rows=lambda row_bytes: rdma.partition_bytes // row_bytes)


@pytest.mark.parametrize("num_ranks,ranks_per_node,round_tokens", [(16, 8, 1408), (4, 2, 2560), (8, 2, 1280),
                                                                   (64, 8, 256), (4, 1, 2816)])
def test_buffers_sized_by_the_hints_take_rounds_of_their_tokens(num_ranks, ranks_per_node, round_tokens):
    config = Config()
    nvl = config.get_nvl_buffer_size_hint(14336, num_ranks, num_ranks_per_node=ranks_per_node)
    rdma = config.get_rdma_buffer_size_hint(14336, num_ranks, num_ranks_per_node=ranks_per_node)
    ctx = _context_of(num_ranks, ranks_per_node, nvl, rdma)
    assert internode.round_tokens_for(ctx, 7168, 8) == round_tokens
    assert internode.round_tokens_for(ctx, 7168, 4) == round_tokens  # fewer choices: smaller rows, same units
    small = _context_of(num_ranks, ranks_per_node, nvl, config.get_rdma_buffer_size_hint(
        14336, num_ranks, num_tokens=128, num_ranks_per_node=ranks_per_node))
    assert internode.round_tokens_for(small, 7168, 8) == 128
    assert internode.round_tokens_for(small, 2 * 7168, 8) == 0  # not one unit of rows twice as long


def deepep_internode_hints(config: Config, hidden_bytes: int, num_ranks: int) -> tuple[int, int]:
    """DeepEP V1's NVL and RDMA hints across nodes of 8 (csrc/config.hpp, as arithmetic): num_sms / 2 channels;
    on NVLink a ring of num_max_nvl_chunked_recv_tokens slots per local rank, on the network a send and a
    receive ring of num_max_rdma_chunked_recv_tokens slots per node; a slot holds a row, an 8-byte source
    record, 8 top-k ids (int64) and weights (float32) and 128 scales (float32), plus a few int32 counters."""
    channels, nodes, local = config.num_sms // 2, num_ranks // 8, 8
    slot = hidden_bytes + 8 + 8 * (8 + 4) + 128 * 4
    nvl = channels * local * (2 * nodes + 3) * 4 + channels * local * config.num_max_nvl_chunked_recv_tokens * slot
    rdma = channels * nodes * (8 * 2 + 2) * 2 * 4 + channels * nodes * config.num_max_rdma_chunked_recv_tokens * slot * 2
    return -(-nvl // 128) * 128, -(-rdma // 128) * 128


@pytest.mark.parametrize("num_sms", [8, 20, 24, 64])
@pytest.mark.parametrize("num_ranks", [16, 32, 64, 128])
def test_internode_hints_with_no_token_count_are_no_larger_than_deepeps(num_sms, num_ranks):
    """Frameworks size the Buffer from the hints with no token count, then send any batch (in rounds). Where
    DeepEP's NVL rings hold less than one unit of 128 tokens from each node (16 nodes at 8 SMs), the NVL hint
    is the one-unit round's instead, the least that works."""
    config = Config(num_sms=num_sms)
    nodes = num_ranks // 8
    for hidden in (2048, 4096, 7168):
        nvl, rdma = deepep_internode_hints(config, 2 * hidden, num_ranks)
        assert config.get_rdma_buffer_size_hint(2 * hidden, num_ranks) <= rdma
        if num_sms // 2 * config.num_max_nvl_chunked_recv_tokens >= internode.ROUND_UNIT_TOKENS * nodes:
            assert config.get_nvl_buffer_size_hint(2 * hidden, num_ranks) <= nvl
        else:
            assert config.get_nvl_buffer_size_hint(2 * hidden, num_ranks) == config.get_nvl_buffer_size_hint(
                2 * hidden, num_ranks, num_tokens=internode.ROUND_UNIT_TOKENS)
