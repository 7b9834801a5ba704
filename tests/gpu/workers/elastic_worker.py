"""GPU worker for ``cuep.ElasticBuffer`` (DeepEP V2's API) against cuep.reference, under mpirun: on one node,
or across nodes (``CUEP_RANKS_PER_NODE`` makes virtual ones on one host).

Every rank rebuilds every rank's inputs from one seed (``common.SeededInputs``), so it knows what it must
receive and what its tokens must combine to. Moved data, metadata and prefix sums are compared exactly;
combined sums bit for bit against ``reference.elastic_combine`` (V2's summation order; across nodes, its
hybrid order).
"""

from __future__ import annotations

import functools

import cupy
import numpy as np
from common import BF16, SeededInputs, bits, expect_error, run_cases, selected_cases
from mpi4py import MPI

import cuep
from cuep import reference

comm = MPI.COMM_WORLD
rank, num_ranks = comm.Get_rank(), comm.Get_size()
SEED = 11
EXPERTS = 16 * num_ranks
LOCAL_EXPERTS = EXPERTS // num_ranks
MAX_TOKENS = 600
all_inputs = SeededInputs(SEED, num_ranks)
RANKS_PER_NODE = num_ranks  # set in main() from the buffer's topology


def odd_tokens(s: int) -> int:
    return MAX_TOKENS - 37 * s


def expert_rows(key: int, rows: int, hidden: int, on_rank: int) -> np.ndarray:
    """What rank ``on_rank``'s experts return for its ``rows`` received rows: BF16 normals, known to every rank."""
    return np.random.default_rng([SEED, key, on_rank]).standard_normal((rows, hidden)).astype(BF16)


def dispatch(buffer, inputs, expand: bool, alignment: int = 1, handle=None, **options):
    mine = inputs[rank].on_gpu()
    x = (mine.x, mine.scales) if mine.scales is not None else mine.x
    return buffer.dispatch(x, topk_idx=None if handle is not None else mine.topk_idx,
                           topk_weights=mine.topk_weights, num_experts=EXPERTS if handle is None else None,
                           expert_alignment=alignment if handle is None else None, handle=handle, do_expand=expand,
                           **options)


def check_layouts(inputs, alignment: int, compact, expanded, exact: bool = True):
    """The compact and expanded dispatches of ``inputs`` against the reference (``exact``: the outputs have
    the received rows, as after a CPU sync); returns the reference's compact result and layout for this rank."""
    want = reference.dispatch(inputs.xs, inputs.topk_idxs, EXPERTS, inputs.topk_weights, inputs.scales,
                              alignment)[rank]
    layout = reference.elastic_layout(want, MAX_TOKENS, LOCAL_EXPERTS, alignment)
    n = len(want.recv_x)
    recv_x, recv_idx, recv_w, handle, _ = compact
    rows = recv_x[0] if isinstance(recv_x, tuple) else recv_x
    assert not exact or rows.shape[0] == n, (rows.shape, n)
    np.testing.assert_array_equal(bits(rows.get()[:n]), bits(want.recv_x))
    if isinstance(recv_x, tuple):
        np.testing.assert_array_equal(recv_x[1].get()[:n], want.recv_scales)
    np.testing.assert_array_equal(recv_idx.get()[:n], want.recv_topk_idx)
    np.testing.assert_array_equal(recv_w.get()[:n], want.recv_topk_weights)
    metadata = handle.recv_src_metadata.get()[:n]
    np.testing.assert_array_equal(metadata[:, 0], layout.src_global)
    np.testing.assert_array_equal(metadata[:, 2:], -1)
    # Rows from the ranks of each local index (on every node), prefix-summed.
    from_rank = np.bincount(want.recv_src[:, 0], minlength=num_ranks).reshape(-1, RANKS_PER_NODE)
    np.testing.assert_array_equal(handle.psum_num_recv_tokens_per_scaleup_rank.get(), np.cumsum(from_rank.sum(0)))
    np.testing.assert_array_equal(handle.psum_num_recv_tokens_per_expert.get(), layout.psum_per_expert_compact)
    if exact:
        assert handle.num_recv_tokens_per_expert_list == want.num_recv_tokens_per_expert
    ex_x, ex_idx, ex_w, ex_handle, _ = expanded
    assert ex_idx is None
    slots = ex_handle.recv_src_metadata.get()[:n, 2:]
    np.testing.assert_array_equal(slots, layout.expanded_row)
    np.testing.assert_array_equal(ex_handle.psum_num_recv_tokens_per_expert.get(), layout.psum_per_expert)
    np.testing.assert_array_equal(ex_handle.num_unaligned_recv_tokens_per_expert.get(), layout.num_unaligned_per_expert)
    ex_rows = (ex_x[0] if isinstance(ex_x, tuple) else ex_x).get()
    compact_rows = rows.get()
    i, k = np.nonzero(slots >= 0)
    np.testing.assert_array_equal(bits(ex_rows[slots[i, k]]), bits(compact_rows[i]))
    np.testing.assert_array_equal(ex_w.get()[slots[i, k]], want.recv_topk_weights[i, k])
    if isinstance(ex_x, tuple):
        np.testing.assert_array_equal(ex_x[1].get()[slots[i, k]], recv_x[1].get()[i])
    return want, layout


def holder_sums(expanded_row, rows):
    """On the expert's rank, each compact row's sum of its lanes' expanded rows (``rows[expanded_row[i, k]]``, none
    where -1) in lane order, as the default expanded combine sends it."""
    lanes = np.where(expanded_row[..., None] >= 0, rows[np.maximum(expanded_row, 0)], np.zeros((), BF16))
    return reference.lane_order_sum(lanes)


def combine_and_check(buffer, inputs, want, layout, handle, ex_handle, key: int, biases=None):
    """Compact and expanded combines of known expert rows, bit for bit against V2's order; each lane's top-k
    weight comes back from its expert's holder."""
    hidden = inputs.xs[0].shape[1]
    everyone = comm.allgather((want.recv_src, layout.expanded_row, ex_handle.num_rows))
    compact_from = [np.zeros((n, num_ranks, hidden), BF16) for n in inputs.num_tokens]
    expand_from = [np.zeros((n, num_ranks, hidden), BF16) for n in inputs.num_tokens]
    mine = inputs[rank]
    topk = mine.topk_idx
    want_weights = np.zeros(topk.shape, np.float32)
    for r, (sources, expanded, num_expanded) in enumerate(everyone):
        compact_rows = expert_rows(key, len(sources), hidden, r)
        expanded_rows = expert_rows(key + 1, num_expanded, hidden, r)
        expanded_weights = np.random.default_rng([SEED, key, r]).random(num_expanded, dtype=np.float32)
        summed = holder_sums(expanded, expanded_rows)
        for i, (s, t) in enumerate(sources):
            compact_from[s][t, r], expand_from[s][t, r] = compact_rows[i], summed[i]
            if s == rank:
                held = expanded[i] >= 0
                want_weights[t, held] = expanded_weights[expanded[i, held]]
    own_biases = [biases if s == rank else None for s in range(num_ranks)]
    bias = None if biases is None else tuple(cupy.asarray(b) for b in biases) if len(biases) == 2 \
        else cupy.asarray(biases[0])
    n = len(want.recv_x)
    y = np.zeros((handle.num_rows, hidden), BF16)
    y[:n] = expert_rows(key, n, hidden, rank)
    recv_w = cupy.asarray(np.pad(want.recv_topk_weights, ((0, handle.num_rows - n), (0, 0))))
    combined, weights, _ = buffer.combine(cupy.asarray(y), handle, topk_weights=recv_w, bias=bias)
    want_compact = reference.elastic_combine(compact_from, inputs.topk_idxs, EXPERTS, own_biases, RANKS_PER_NODE)[rank]
    np.testing.assert_array_equal(bits(combined.get()), bits(want_compact))
    np.testing.assert_array_equal(weights.get(), np.where(topk >= 0, mine.topk_weights, 0))
    ey = expert_rows(key + 1, ex_handle.num_rows, hidden, rank)
    ex_w = np.random.default_rng([SEED, key, rank]).random(ex_handle.num_rows, dtype=np.float32)
    combined, weights, _ = buffer.combine(cupy.asarray(ey), ex_handle, topk_weights=cupy.asarray(ex_w), bias=bias)
    want_expand = reference.elastic_combine(expand_from, inputs.topk_idxs, EXPERTS, own_biases, RANKS_PER_NODE)[rank]
    np.testing.assert_array_equal(bits(combined.get()), bits(want_expand))
    np.testing.assert_array_equal(weights.get(), want_weights)


def bf16_layouts_and_combines(buffer):
    for key, alignment, biases in ((1, 1, 0), (3, 8, 1), (5, 128, 2)):
        inputs = all_inputs(odd_tokens, 2048, EXPERTS, 8, masked=0.15)
        compact = dispatch(buffer, inputs, False, alignment)
        expanded = dispatch(buffer, inputs, True, alignment)
        want, layout = check_layouts(inputs, alignment, compact, expanded)
        rng = np.random.default_rng([SEED, key, rank, 99])
        own = [rng.standard_normal((inputs.num_tokens[rank], 2048)).astype(BF16) for _ in range(biases)]
        combine_and_check(buffer, inputs, want, layout, compact[3], expanded[3], key, own or None)


def fp8_column_major_scales_cached_with_zero_padding(buffer):
    inputs = all_inputs(odd_tokens, 7168, EXPERTS, 6, fp8=True)
    compact = dispatch(buffer, inputs, False, 16)
    expanded = dispatch(buffer, inputs, True, 16, use_tma_aligned_col_major_sf=True)
    scales = expanded[0][1]
    assert scales.strides == (4, 4 * ((scales.shape[0] + 3) // 4 * 4)), scales.strides
    want, layout = check_layouts(inputs, 16, compact, expanded)
    cached_x, _, cached_w, cached_handle, _ = dispatch(buffer, inputs, True, handle=expanded[3], do_zero_padding=True,
                                                       use_tma_aligned_col_major_sf=True)
    assert cached_handle is expanded[3]
    for got, ref in ((cached_x[0], expanded[0][0]), (cached_x[1], expanded[0][1]), (cached_w, expanded[2])):
        slots = layout.expanded_row[layout.expanded_row >= 0]
        np.testing.assert_array_equal(got.get()[slots], ref.get()[slots])
    psum = layout.psum_per_expert
    for e in range(LOCAL_EXPERTS):
        end = -(-int(psum[e]) // 16) * 16
        assert not cached_x[0].get()[psum[e]:end].any() and not cached_w.get()[psum[e]:end].any()
    cached = dispatch(buffer, inputs, False, handle=compact[3])
    np.testing.assert_array_equal(cached[0][0].get(), compact[0][0].get())
    np.testing.assert_array_equal(cached[1].get(), compact[1].get())
    # The compact layout's scales column-major too, as V2's TMA takes them.
    column_major = dispatch(buffer, inputs, False, 16, use_tma_aligned_col_major_sf=True)[0][1]
    assert column_major.strides == (4, 4 * ((column_major.shape[0] + 3) // 4 * 4)), column_major.strides
    np.testing.assert_array_equal(column_major.get(), want.recv_scales)


def without_cpu_sync_and_stats(buffer):
    inputs = all_inputs(odd_tokens, 2048, EXPERTS, 8, masked=0.1)
    stats = cupy.full(LOCAL_EXPERTS, 5, dtype=cupy.int32)
    compact = dispatch(buffer, inputs, False, 4, do_cpu_sync=False, cumulative_local_expert_recv_stats=stats)
    expanded = dispatch(buffer, inputs, True, 4, do_cpu_sync=False)
    assert compact[3].num_rows == num_ranks * MAX_TOKENS and compact[3].num_recv_tokens_per_expert_list == []
    want, layout = check_layouts(inputs, 4, compact, expanded, exact=False)
    np.testing.assert_array_equal(stats.get(), 5 + layout.num_unaligned_per_expert)
    combine_and_check(buffer, inputs, want, layout, compact[3], expanded[3], 7)


def rounds_without_cpu_sync(buffer):
    """A buffer of one 128-token round for hidden 2048 (V1's hints for rounds of 128): batches of up to
    600 tokens move in rounds without any CPU wait, across nodes too (the rounds of num_max_tokens_per_rank)."""
    hidden, unit = 2048, 128
    configs = (cuep.Buffer.get_dispatch_config(num_ranks), cuep.Buffer.get_combine_config(num_ranks))
    num_bytes = max(c.get_nvl_buffer_size_hint(2 * hidden, num_ranks, unit) for c in configs) + max(
        c.get_rdma_buffer_size_hint(2 * hidden, num_ranks, unit) for c in configs)
    small = cuep.ElasticBuffer(comm, num_bytes, num_max_tokens_per_rank=MAX_TOKENS, hidden=hidden,
                               explicitly_destroy=True)
    try:
        inputs = all_inputs(odd_tokens, hidden, EXPERTS, 8, masked=0.1)
        compact = dispatch(small, inputs, False, 2, do_cpu_sync=False)
        expanded = dispatch(small, inputs, True, 2, do_cpu_sync=False)
        want, layout = check_layouts(inputs, 2, compact, expanded, exact=False)
        combine_and_check(small, inputs, want, layout, compact[3], expanded[3], 9, None)
        if RANKS_PER_NODE < num_ranks:  # the forwarders' record, round by round
            handle = dispatch(small, inputs, False)[3]
            assert handle._dispatch.num_rounds > 1, handle._dispatch.num_rounds
            forwarded_rows_name_their_places(handle, inputs, reference.dispatch(inputs.xs, inputs.topk_idxs, EXPERTS))
    finally:
        small.destroy()


def dst_buffer_slots_name_the_rows_received(buffer):
    inputs = all_inputs(odd_tokens, 512, EXPERTS, 8, masked=0.2)
    _, _, _, handle, _ = dispatch(buffer, inputs, False)
    everyone = reference.dispatch(inputs.xs, inputs.topk_idxs, EXPERTS)
    if RANKS_PER_NODE < num_ranks:
        forwarded_rows_name_their_places(handle, inputs, everyone)
        return
    slots = handle.dst_buffer_slot_idx.get()
    topk = inputs[rank].topk_idx
    for t, k in zip(*np.nonzero(topk >= 0)):
        holder = topk[t, k] // LOCAL_EXPERTS
        source_rows = everyone[holder].recv_src
        row = np.nonzero((source_rows[:, 0] == rank) & (source_rows[:, 1] == t))[0]
        assert slots[t, k] == row[0], (t, k, slots[t, k], row)
    assert (slots[topk < 0] == -1).all()


def forwarded_rows_name_their_places(handle, inputs, everyone):
    """Across nodes (V2's hybrid mode) dst_buffer_slot_idx is the forwarders' record: for each row this rank
    forwarded to its node (by source node, then token; every source on this rank's rail), the row's place
    among the rows of its round each local rank received from its source, -1 where it received none."""
    round_tokens = handle._dispatch.round_tokens  # the rounds the dispatch ran in (cuep's, not V2's, notion)
    node, local = divmod(rank, RANKS_PER_NODE)
    node_ranks = range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE)
    want_src, want_places = [], []
    for source in range(local, num_ranks, RANKS_PER_NODE):
        received = [everyone[q].recv_src for q in node_ranks]
        sent = [r[r[:, 0] == source, 1] for r in received]  # the tokens each local rank got from this source
        for t in np.unique(np.concatenate(sent)).tolist():
            first = t // round_tokens * round_tokens
            want_src.append(t)
            want_places.append([int(np.searchsorted(tokens, t) - np.searchsorted(tokens, first)) if t in tokens
                                else -1 for tokens in sent])
    np.testing.assert_array_equal(handle.token_metadata_at_forward.get(), want_src)
    np.testing.assert_array_equal(handle.dst_buffer_slot_idx.get(), np.array(want_places).reshape(-1, RANKS_PER_NODE))


def expanded_combine_without_multiple_reduction(buffer):
    """A Buffer made with allow_multiple_reduction=False: each expanded row goes back alone and its token's rank adds
    the biases and every lane's row in top-k lane order, rounded once, bit for bit; with and without a CPU sync,
    with 0, 1 and 2 biases. Between ranks the result must differ from the default's (a rank's lanes rounded first),
    which shows the rows did not come back summed. Across nodes the constructor refuses it."""
    make = functools.partial(cuep.ElasticBuffer, comm, num_max_tokens_per_rank=MAX_TOKENS, hidden=7168,
                             allow_multiple_reduction=False, explicitly_destroy=True)
    if RANKS_PER_NODE < num_ranks:  # across nodes only V2's hybrid order is built
        expect_error(NotImplementedError, make, "allow_multiple_reduction=False across nodes",
                     "allow_multiple_reduction=False")
        return
    single = make()
    hidden = 2048
    try:
        for key, alignment, num_biases, cpu_sync in ((21, 1, 0, True), (23, 128, 2, False), (25, 8, 1, True)):
            inputs = all_inputs(odd_tokens, hidden, EXPERTS, 8, masked=0.15)
            handle = dispatch(single, inputs, True, alignment, do_cpu_sync=cpu_sync)[3]
            want = reference.dispatch(inputs.xs, inputs.topk_idxs, EXPERTS, inputs.topk_weights, inputs.scales,
                                      alignment)[rank]
            layout = reference.elastic_layout(want, MAX_TOKENS, LOCAL_EXPERTS, alignment)
            everyone = comm.allgather((want.recv_src, layout.expanded_row, handle.num_rows))
            topk = inputs[rank].topk_idx
            lanes = np.zeros((*topk.shape, hidden), BF16)  # the expanded row each lane's holder returns
            summed_by_holder = np.zeros((topk.shape[0], num_ranks, hidden), BF16)
            for r, (sources, expanded, num_expanded) in enumerate(everyone):
                rows = expert_rows(key, num_expanded, hidden, r)
                mine = sources[:, 0] == rank
                i, k = np.nonzero(mine[:, None] & (expanded >= 0))
                lanes[sources[i, 1], k] = rows[expanded[i, k]]
                summed_by_holder[sources[mine, 1], r] = holder_sums(expanded[mine], rows)
            rng = np.random.default_rng([SEED, key, rank, 98])
            biases = [rng.standard_normal((len(topk), hidden)).astype(BF16) for _ in range(num_biases)]
            start = functools.reduce(np.add, (b.astype(np.float32) for b in biases)) if biases else None  # V2's
            bias = tuple(cupy.asarray(b) for b in biases) if num_biases == 2 else \
                cupy.asarray(biases[0]) if biases else None
            y = cupy.asarray(expert_rows(key, handle.num_rows, hidden, rank))
            combined, weights, _ = single.combine(y, handle, bias=bias)
            assert weights is None
            got = bits(combined.get())
            np.testing.assert_array_equal(got, bits(reference.lane_order_sum(lanes, start)))
            if num_ranks > 1:  # only this rank's tokens: the others' come as none
                others = [np.zeros((0, num_ranks, hidden), BF16), np.zeros((0, topk.shape[1]), np.int64)]
                summed_first = reference.elastic_combine(
                    [summed_by_holder if s == rank else others[0] for s in range(num_ranks)],
                    [topk if s == rank else others[1] for s in range(num_ranks)], EXPERTS,
                    [biases or None if s == rank else None for s in range(num_ranks)])[rank]
                assert (got != bits(summed_first)).any(), "the same as a combine that sums each rank's lanes first"
        expect_error(ValueError, lambda: single.combine(y, handle, topk_weights=cupy.ones(handle.num_rows, cupy.float32)),
                     "weights with allow_multiple_reduction=False", "topk_weights must be None")
    finally:
        single.destroy()


def bad_arguments_raise_before_any_kernel(buffer):
    inputs = all_inputs(odd_tokens, 512, EXPERTS, 8)
    mine = inputs[rank].on_gpu()
    expect_error(TypeError, lambda: buffer.dispatch(mine.x, topk_idx=mine.topk_idx.astype(cupy.int32),
                                                    num_experts=EXPERTS), "int32 topk_idx", "topk_idx must be int64")
    expect_error(ValueError, lambda: buffer.dispatch(mine.x, topk_idx=mine.topk_idx, num_experts=EXPERTS,
                                                     num_max_tokens_per_rank=10), "too many tokens",
                 "num_max_tokens_per_rank")
    expect_error(ValueError, lambda: buffer.dispatch(mine.x, topk_idx=mine.topk_idx, num_experts=EXPERTS,
                                                     do_zero_padding=True), "zero padding, compact", "do_zero_padding")
    expect_error(NotImplementedError, lambda: buffer.engram_write(None), "engram", "out of scope")


def main() -> None:
    global RANKS_PER_NODE
    buffer = cuep.ElasticBuffer(comm, num_max_tokens_per_rank=MAX_TOKENS, hidden=7168, explicitly_destroy=True)
    assert buffer.num_bytes == cuep.ElasticBuffer.get_buffer_size_hint(comm, MAX_TOKENS, 7168)
    RANKS_PER_NODE = buffer.num_scaleup_ranks
    assert buffer.get_logical_domain_size() == (num_ranks // RANKS_PER_NODE, RANKS_PER_NODE)
    cases = [
        ("BF16 compact and expanded layouts, combines bit for bit with 0, 1 and 2 biases", bf16_layouts_and_combines),
        ("FP8, column-major scales, cached dispatches, zero padding",
         fp8_column_major_scales_cached_with_zero_padding),
        ("no CPU sync, cumulative stats", without_cpu_sync_and_stats),
        ("no CPU sync, batches of several rounds", rounds_without_cpu_sync),
        ("dst_buffer_slot_idx names the rows received", dst_buffer_slots_name_the_rows_received),
        ("allow_multiple_reduction=False: each expanded row back alone, summed by lane",
         expanded_combine_without_multiple_reduction),
        ("bad arguments raise before any kernel", bad_arguments_raise_before_any_kernel),
    ]
    run_cases(comm, selected_cases([(name, functools.partial(case, buffer)) for name, case in cases],
                                   lambda named: named[1].func.__name__))
    buffer.destroy()
    if rank == 0:
        nodes = "one node" if RANKS_PER_NODE == num_ranks else f"{num_ranks // RANKS_PER_NODE} nodes"
        print(f"elastic worker passed on {num_ranks} ranks ({nodes})", flush=True)


if __name__ == "__main__":
    main()
