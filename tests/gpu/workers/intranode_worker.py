"""GPU worker for normal-mode dispatch/combine against cuep.reference (run under mpirun): the intranode
mode, or the internode mode when ``CUEP_RANKS_PER_NODE`` splits the ranks into several (virtual) nodes.

Every rank rebuilds every rank's inputs from one seed, so it can compute what it must receive and
what its tokens must combine to. Moved data is compared bit for bit; combined sums within FP32-
accumulation tolerance of the reference. Each case below checks one behaviour; ``main`` runs them in
order (the order fixes each case's inputs, see ``common.SeededInputs``).
"""

from __future__ import annotations

import functools
import os

import cupy
import numpy as np
from common import (
    BF16,
    AllInputs,
    SeededInputs,
    assert_no_memory_growth,
    assert_sum_close,
    bits,
    environment,
    expect_error,
    rejoin,
    run_cases,
    selected_cases,
    times_out_without_rank_0,
)
from mpi4py import MPI

import cuep
from cuep import reference
from cuep.kernels.intranode import BULK_PUSH_MAX_BLOCKS
from cuep.modes import internode, intranode

comm = MPI.COMM_WORLD
rank, num_ranks = comm.Get_rank(), comm.Get_size()
SEED = 7
EXPERTS = 16 * num_ranks
all_inputs = SeededInputs(SEED, num_ranks)
RANKS_PER_NODE = int(os.environ.get("CUEP_RANKS_PER_NODE") or num_ranks)
ACROSS_NODES = RANKS_PER_NODE < num_ranks
# Across nodes, the hint with no token count (as frameworks size it): on 2 nodes of 2, rounds of 2560 tokens of
# hidden 4096, and of 1408 at hidden 7168, so the case of 1500-1731 tokens there takes two rounds (fewer tokens a
# round on more nodes; any_batch_through_a_buffer_of_a_few_rounds takes rounds of 128).
RDMA_BYTES = cuep.Config().get_rdma_buffer_size_hint(2 * 4096, num_ranks)


def make_buffer(num_nvl_bytes: int, **sizes) -> cuep.Buffer:
    """A Buffer with this NVL buffer and, across nodes, the RDMA buffer the cases need."""
    sizes.setdefault("num_rdma_bytes", RDMA_BYTES if ACROSS_NODES else 0)
    return cuep.Buffer(comm, num_nvl_bytes=num_nvl_bytes, **sizes)


# ------------------------------------------------------------------------------------------------------
# Checks against the reference


def dispatch_and_check(buffer, inputs: AllInputs, num_experts, with_topk=True, alignment=1, num_worst_tokens=0,
                       column_major_scales=False, **options):
    """Layout and dispatch of this rank's inputs; the rows, scales, top-k and per-expert counts must
    equal the reference's. Returns ``(recv_x, recv_topk_weights, handle)``."""
    mine = inputs[rank]
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(cupy.asarray(mine.topk_idx), num_experts)
    x_in = cupy.asarray(mine.x)
    if mine.scales is not None:
        scales_in = cupy.asarray(mine.scales)
        x_in = (x_in, cupy.asfortranarray(scales_in) if column_major_scales else scales_in)
    recv_x, recv_topk, recv_weights, per_expert_list, handle, event = buffer.dispatch(
        x_in, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=cupy.asarray(mine.topk_idx) if with_topk else None,
        topk_weights=cupy.asarray(mine.topk_weights) if with_topk else None, expert_alignment=alignment,
        num_worst_tokens=num_worst_tokens, **options)
    if options.get("async_finish"):
        event.current_stream_wait()
    expected = reference.dispatch(inputs.xs, inputs.topk_idxs, num_experts, inputs.topk_weights, inputs.scales,
                                  alignment)[rank]
    received = len(expected.recv_x)
    recv_data, recv_scales = recv_x if mine.scales is not None else (recv_x, None)
    rows = recv_data.shape[0]
    assert rows == (num_worst_tokens or received), (rows, received, num_worst_tokens)
    np.testing.assert_array_equal(bits(recv_data.get()[:received]), bits(expected.recv_x))
    if mine.scales is not None:
        np.testing.assert_array_equal(recv_scales.get()[:received], expected.recv_scales)
    if with_topk:
        np.testing.assert_array_equal(recv_topk.get()[:received], expected.recv_topk_idx)
        np.testing.assert_array_equal(recv_weights.get()[:received], expected.recv_topk_weights)
        assert (recv_topk.get()[received:] == -1).all() and (recv_weights.get()[received:] == 0).all()
    else:
        assert recv_topk is None and recv_weights is None
    assert per_expert_list == ([] if num_worst_tokens else expected.num_recv_tokens_per_expert), per_expert_list
    return recv_x, recv_weights, handle


def combine_and_check(buffer, inputs: AllInputs, num_experts, recv_x, recv_weights, handle, biases=None,
                      config=None):
    """Each rank scales what it received by (rank + 1) and sends it back; the sums (and the combined
    weights) must match the reference's. ``biases``: one or two lists of every rank's bias; ``config``:
    the combine's (its SM count), or the default."""
    all_recv = reference.dispatch(inputs.xs, inputs.topk_idxs, num_experts, inputs.topk_weights)
    scaled = [(r.recv_x.astype(np.float32) * (k + 1)).astype(BF16) for k, r in enumerate(all_recv)]
    mine = cupy.asarray(scaled[rank])
    rows = recv_x.shape[0]
    if rows > len(mine):  # num_worst_tokens padding rows are ignored by combine
        mine = cupy.concatenate([mine, cupy.zeros((rows - len(mine), mine.shape[1]), dtype=BF16)])
    bias_arg = None
    if biases is not None:
        bias_arg = tuple(cupy.asarray(b[rank]) for b in biases)
        bias_arg = bias_arg[0] if len(bias_arg) == 1 else bias_arg
    combined, combined_weights, _ = buffer.combine(mine, handle, topk_weights=recv_weights, bias=bias_arg,
                                                   config=config)
    want_x, want_w = reference.combine(scaled, [r.recv_src for r in all_recv], inputs.num_tokens,
                                       [r.recv_topk_weights for r in all_recv],
                                       [[b[s] for b in biases] for s in range(num_ranks)] if biases else None)
    magnitude, _ = reference.combine([np.abs(s.astype(np.float32)) for s in scaled], [r.recv_src for r in all_recv],
                                     inputs.num_tokens, None,
                                     [[np.abs(b[s].astype(np.float32)) for b in biases] for s in range(num_ranks)]
                                     if biases else None)
    got = combined.get().astype(np.float32)
    assert_sum_close(got, want_x[rank].astype(BF16).astype(np.float32), magnitude[rank], ACROSS_NODES)
    error = np.linalg.norm(got - want_x[rank]) / max(np.linalg.norm(want_x[rank]), 1e-6)
    assert error < 5e-3, error
    if recv_weights is not None:
        np.testing.assert_allclose(combined_weights.get(), want_w[rank], rtol=1e-6, atol=1e-6)


def check_moved_and_combined(recv_x, combined, new_inputs: AllInputs, tokens: int, padded: bool = False):
    """A dispatch of ``new_inputs`` landed ``recv_x`` here, and those rows, combined back unscaled with
    the received weights, gave ``combined``. ``padded``: ``recv_x`` has ``num_worst_tokens`` rows, of
    which the first ones received are compared (else every row, so the row count must match too).
    Returns every rank's expected combined weights."""
    expected = reference.dispatch(new_inputs.xs, new_inputs.topk_idxs, EXPERTS, new_inputs.topk_weights)
    got = recv_x.get()
    if padded:
        got = got[:len(expected[rank].recv_x)]
    np.testing.assert_array_equal(bits(got), bits(expected[rank].recv_x))
    want_x, want_w = reference.combine([r.recv_x for r in expected], [r.recv_src for r in expected],
                                       [tokens] * num_ranks, [r.recv_topk_weights for r in expected])
    magnitude, _ = reference.combine([np.abs(r.recv_x.astype(np.float32)) for r in expected],
                                     [r.recv_src for r in expected], [tokens] * num_ranks)
    assert_sum_close(combined.get().astype(np.float32), want_x[rank], magnitude[rank], ACROSS_NODES)
    return want_w


def bf16_normals(key: int, rows: int, hidden: int, source: int) -> np.ndarray:
    """Rank ``source``'s new BF16 tokens for a cached dispatch, the same on every rank."""
    return np.random.default_rng([SEED, key, source]).standard_normal((rows, hidden)).astype(BF16)


# ------------------------------------------------------------------------------------------------------
# Cases on the shared Buffer


def bf16_topk8_masked_odd_tokens(buffer):
    inputs = all_inputs(lambda s: 1001 + 3 * s, 2048, EXPERTS, 8)
    recv_x, recv_w, handle = dispatch_and_check(buffer, inputs, EXPERTS)
    combine_and_check(buffer, inputs, EXPERTS, recv_x, recv_w, handle)


def fp8_column_major_scales_hidden_7168(buffer):
    inputs = all_inputs(513, 7168, EXPERTS, 8, fp8=True)
    dispatch_and_check(buffer, inputs, EXPERTS, column_major_scales=True)


def combine_on_few_and_many_sms(buffer):
    """The combine pushes through the bulk-copy unit on at most BULK_PUSH_MAX_BLOCKS SMs (Hopper) and with
    the warps' copies above: both must give the reference's sums, with two biases and weights."""
    inputs = all_inputs(lambda s: 1500 + 77 * s, 7168, EXPERTS, 8)
    biases = [[bf16_normals(key, inputs.num_tokens[s], 7168, s) for s in range(num_ranks)] for key in (5, 6)]
    recv_x, recv_w, handle = dispatch_and_check(buffer, inputs, EXPERTS)
    for sms in (1, 8, BULK_PUSH_MAX_BLOCKS, BULK_PUSH_MAX_BLOCKS + 1, 96):
        combine_and_check(buffer, inputs, EXPERTS, recv_x, recv_w, handle, biases, config=cuep.Config(sms))


def without_topk(buffer):
    inputs = all_inputs(300, 1024, EXPERTS, 4)
    recv_x, _, handle = dispatch_and_check(buffer, inputs, EXPERTS, with_topk=False)
    combine_and_check(buffer, inputs, EXPERTS, recv_x, None, handle)


def wide_topk_17_and_32(buffer):
    """More top-k entries a row than one batch of the routing's loads takes (8 a lane of a warp's 32 rows):
    17 and 32 (the normal mode's most) columns, each row's ids and weights and each sum checked."""
    for num_topk in (17, 32):
        inputs = all_inputs(lambda s: 450 + 9 * s, 1024, EXPERTS, num_topk)
        recv_x, recv_w, handle = dispatch_and_check(buffer, inputs, EXPERTS)
        combine_and_check(buffer, inputs, EXPERTS, recv_x, recv_w, handle)


def cached_dispatch_new_x(buffer):
    inputs = all_inputs(700, 2048, EXPERTS, 8)
    _, _, handle = dispatch_and_check(buffer, inputs, EXPERTS)
    new_x = [bf16_normals(999, 700, 2048, s) for s in range(num_ranks)]
    recv_x, recv_topk, recv_w, per_expert, same_handle, _ = buffer.dispatch(cupy.asarray(new_x[rank]), handle=handle)
    expected = reference.dispatch(new_x, inputs.topk_idxs, EXPERTS)[rank]
    np.testing.assert_array_equal(bits(recv_x.get()), bits(expected.recv_x))
    assert recv_topk is None and recv_w is None and per_expert == [] and same_handle is handle


def fp8_packed_ue8m0_scales_then_cached(buffer):
    """DeepGEMM's packed UE8M0 scales (int32 [num_tokens, hidden / 512], as SGLang passes them) move as given,
    word for word, in the dispatch with a layout and in a cached one, and come back as int32."""
    inputs = all_inputs(lambda s: 300 + 7 * s, 7168, EXPERTS, 8, fp8=True)
    words = [np.random.default_rng([SEED, 512, s]).integers(-2**31, 2**31, (len(i.x), 7168 // 512), dtype=np.int32)
             for s, i in enumerate(inputs)]
    inputs = AllInputs(i._replace(scales=w) for i, w in zip(inputs, words, strict=True))
    (_, recv_scales), _, handle = dispatch_and_check(buffer, inputs, EXPERTS, column_major_scales=True)
    assert recv_scales.dtype == np.int32, recv_scales.dtype
    mine = inputs[rank]
    (_, cached_scales), *_ = buffer.dispatch((cupy.asarray(mine.x), cupy.asarray(mine.scales)), handle=handle)
    np.testing.assert_array_equal(cached_scales.get(), recv_scales.get()[:len(cached_scales)])


def cached_dispatches_back_to_back_fp8_then_combine(buffer):
    inputs = all_inputs(lambda s: 600 + 40 * s, 7168, EXPERTS, 8, fp8=True)
    _, recv_w, handle = dispatch_and_check(buffer, inputs, EXPERTS)
    calls = []
    for step in range(3):  # back to back: each call's landing region is reused by the next
        rngs = [np.random.default_rng([SEED, 1000 + step, s]) for s in range(num_ranks)]
        new = [(rng.integers(0, 256, (len(i.x), 7168), dtype=np.uint8),
                rng.random((len(i.x), 56), dtype=np.float32)) for rng, i in zip(rngs, inputs)]
        x_in = (cupy.asarray(new[rank][0]), cupy.asfortranarray(cupy.asarray(new[rank][1])))
        (recv_x, recv_scales), _, _, _, _, _ = buffer.dispatch(x_in, handle=handle)
        calls.append((new, recv_x, recv_scales))
    # Every call's outputs, read after the last one ran: a reuse of a landing region too early corrupts
    # the earlier calls' rows, not the last one's.
    for step, (new, recv_x, recv_scales) in enumerate(calls):
        expected = reference.dispatch([n[0] for n in new], inputs.topk_idxs, EXPERTS, None,
                                      [n[1] for n in new])[rank]
        np.testing.assert_array_equal(recv_x.get(), expected.recv_x, err_msg=f"rows of call {step}")
        np.testing.assert_array_equal(recv_scales.get(), expected.recv_scales, err_msg=f"scales of call {step}")
    x_bf16 = [bf16_normals(2000, len(i.x), 7168, s) for s, i in enumerate(inputs)]
    recv_bf16, _, _, _, _, _ = buffer.dispatch(cupy.asarray(x_bf16[rank]), handle=handle)
    expected = reference.dispatch(x_bf16, inputs.topk_idxs, EXPERTS)[rank]
    np.testing.assert_array_equal(bits(recv_bf16.get()), bits(expected.recv_x))
    combine_and_check(buffer, inputs.with_tokens(x_bf16), EXPERTS, recv_bf16, recv_w, handle)


def spin_kernel():
    """One thread that spins for ``ns`` nanoseconds: starts the calls queued after it late."""
    return cupy.RawKernel(r"""
    extern "C" __global__ void spin(unsigned long long ns) {
        unsigned long long start, now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
        do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < ns);
    }""", "spin")


def skewed_ranks_run_calls_back_to_back(buffer):
    """Cached dispatches and combines, one after another with no host sync, each call started up to
    2 ms late on some ranks (a spin kernel before it): peers push into a late rank's buffer while it
    still runs its previous call, which uses the other region."""
    spin = spin_kernel()
    inputs = all_inputs(700, 2048, EXPERTS, 8)
    _, recv_w, handle = dispatch_and_check(buffer, inputs, EXPERTS)
    delays = np.random.default_rng([SEED, 4000]).integers(0, 2_000_000, size=(8, num_ranks))
    delays[:, ::2] = 0  # even ranks always on time, so they get ahead of the others
    outputs = []
    for step in range(4):
        new_x = [bf16_normals(4001 + step, 700, 2048, s) for s in range(num_ranks)]
        spin((1,), (1,), (np.uint64(delays[2 * step, rank]),))
        recv_x, _, _, _, _, _ = buffer.dispatch(cupy.asarray(new_x[rank]), handle=handle)
        spin((1,), (1,), (np.uint64(delays[2 * step + 1, rank]),))
        combined, _, _ = buffer.combine(recv_x, handle, topk_weights=recv_w)
        outputs.append((new_x, recv_x, combined))
    for new_x, recv_x, combined in outputs:
        check_moved_and_combined(recv_x, combined, inputs.with_tokens(new_x), 700)


def alignment_and_two_biases(buffer):
    inputs = all_inputs(257, 1024, EXPERTS, 6)
    recv_x, recv_w, handle = dispatch_and_check(buffer, inputs, EXPERTS, alignment=4)
    biases = [[np.random.default_rng([SEED, 5, k, s]).standard_normal((257, 1024)).astype(BF16)
               for s in range(num_ranks)] for k in range(2)]
    combine_and_check(buffer, inputs, EXPERTS, recv_x, recv_w, handle, biases=biases)
    combine_and_check(buffer, inputs, EXPERTS, recv_x, recv_w, handle, biases=biases[:1])


def zero_tokens_on_rank_1(buffer):
    inputs = all_inputs(lambda s: 0 if s == 1 else 400, 1024, EXPERTS, 8)
    recv_x, recv_w, handle = dispatch_and_check(buffer, inputs, EXPERTS)
    combine_and_check(buffer, inputs, EXPERTS, recv_x, recv_w, handle)


def every_token_to_rank_0(buffer):
    inputs = all_inputs(300, 1024, EXPERTS, 4, masked=0.0, route=lambda t: t % (EXPERTS // num_ranks))
    recv_x, recv_w, handle = dispatch_and_check(buffer, inputs, EXPERTS)
    combine_and_check(buffer, inputs, EXPERTS, recv_x, recv_w, handle)


def unusual_hidden_sizes(buffer):
    # 128 and 1152 leave some lanes of a warp with one 4-vector step fewer than the others (hidden / 8 vectors,
    # 4 x 32 a step), which a warp-wide sum must still run in step.
    for hidden in (128, 384, 1152, 7168):
        inputs = all_inputs(200, hidden, EXPERTS, 8)
        recv_x, recv_w, handle = dispatch_and_check(buffer, inputs, EXPERTS)
        combine_and_check(buffer, inputs, EXPERTS, recv_x, recv_w, handle)


def async_previous_event_comm_stream_allocation(buffer):
    inputs = all_inputs(500, 2048, EXPERTS, 8)
    recv_x, recv_w, handle = dispatch_and_check(buffer, inputs, EXPERTS, previous_event=buffer.capture(),
                                                async_finish=True, allocate_on_comm_stream=True)
    combine_and_check(buffer, inputs, EXPERTS, recv_x, recv_w, handle)


def num_worst_tokens_no_cpu_wait(buffer):
    inputs = all_inputs(lambda s: 100 + 50 * s, 1024, EXPERTS, 8)
    worst = sum(100 + 50 * s for s in range(num_ranks))
    recv_x, recv_w, handle = dispatch_and_check(buffer, inputs, EXPERTS, num_worst_tokens=worst)
    combine_and_check(buffer, inputs, EXPERTS, recv_x, recv_w, handle)


def cuda_graph_capture_then_replay_with_new_inputs(buffer):
    tokens, hidden, num_topk = 256, 1024, 8
    worst = tokens * num_ranks
    x, _, topk, weights = all_inputs(tokens, hidden, EXPERTS, num_topk)[rank].on_gpu()
    cupy.cuda.get_current_stream().synchronize()  # the copies in are on this stream, the calls on `stream`
    stream = cupy.cuda.Stream(non_blocking=True)

    def moe_step():
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, EXPERTS)
        recv_x, _, recv_w, _, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk, topk_weights=weights, num_worst_tokens=worst)
        combined, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w)
        return recv_x, combined, combined_w, handle

    with stream:
        moe_step()  # warm the memory pool outside the capture
        stream.synchronize()
        stream.begin_capture()
        captured = moe_step()
        graph = stream.end_capture()
    recv_x, combined, combined_w, _ = captured
    for _ in range(5):
        inputs = all_inputs(tokens, hidden, EXPERTS, num_topk)
        with stream:
            x[...] = cupy.asarray(inputs[rank].x)
            topk[...] = cupy.asarray(inputs[rank].topk_idx)
            weights[...] = cupy.asarray(inputs[rank].topk_weights)
            graph.launch(stream)
        stream.synchronize()
        want_w = check_moved_and_combined(recv_x, combined, inputs, tokens, padded=True)
        np.testing.assert_allclose(combined_w.get(), want_w[rank], rtol=1e-6, atol=1e-6)


def async_inputs_outlive_the_callers_references(buffer):
    inputs = all_inputs(2048, 4096, EXPERTS, 8)
    x, topk = inputs[rank].x, inputs[rank].topk_idx
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(cupy.asarray(topk), EXPERTS)
    recv_x, _, _, _, _, event = buffer.dispatch(
        cupy.asarray(x), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, previous_event=buffer.capture(), async_finish=True)
    # The caller dropped x; fresh allocations on this stream must not take its memory while the
    # communication still reads it.
    garbage = [cupy.full(x.shape, 7, dtype=cupy.uint16) for _ in range(4)]
    event.current_stream_wait()
    expected = reference.dispatch(inputs.xs, inputs.topk_idxs, EXPERTS)[rank]
    np.testing.assert_array_equal(bits(recv_x.get()), bits(expected.recv_x))
    del garbage


def calls_on_two_streams_are_ordered(buffer):
    # Calls that the current stream waits for run on it, not on the comm stream; two of them on
    # different streams with no sync between must still run one after the other on the buffer.
    inputs = all_inputs(1500, 4096, EXPERTS, 8)
    _, recv_w, handle = dispatch_and_check(buffer, inputs, EXPERTS)
    new_x = [[bf16_normals(3000 + k, 1500, 4096, s) for s in range(num_ranks)] for k in range(2)]
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    received = []
    for k, stream in enumerate(streams):
        with stream:
            recv_x, _, _, _, _, _ = buffer.dispatch(cupy.asarray(new_x[k][rank]), handle=handle)
            received.append(recv_x)
    with streams[0]:
        combine_and_check(buffer, inputs.with_tokens(new_x[1]), EXPERTS, received[1], recv_w, handle)
    expected = [reference.dispatch(new_x[k], inputs.topk_idxs, EXPERTS)[rank].recv_x for k in range(2)]
    for k, recv_x in enumerate(received):
        np.testing.assert_array_equal(bits(recv_x.get(stream=streams[k])), bits(expected[k]))
    # Such a call's event is recorded when first used: a stream that waits on it sees the call's output.
    with streams[0]:
        recv_x, _, _, _, _, event = buffer.dispatch(cupy.asarray(new_x[0][rank]), handle=handle)
    with streams[1]:
        event.current_stream_wait()
        copied = recv_x.copy()
    np.testing.assert_array_equal(bits(copied.get(stream=streams[1])), bits(expected[0]))


def thousand_calls_hold_no_memory(buffer):
    x, _, topk, weights = all_inputs(64, 256, EXPERTS, 8)[rank].on_gpu()

    def step():
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, EXPERTS)
        recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                          num_tokens_per_expert=per_expert, topk_idx=topk,
                                                          topk_weights=weights)
        buffer.combine(recv_x, handle, topk_weights=recv_w)
    assert_no_memory_growth(step)


# ------------------------------------------------------------------------------------------------------
# Cases with Buffers of their own


def short_timeout_buffer():
    """A Buffer whose kernels give up on a missing peer after 3 s."""
    with environment(CUEP_TIMEOUT_S="3"):
        return make_buffer(64 << 20)


def peer_that_skips_dispatch_times_out():
    short = short_timeout_buffer()
    inputs = all_inputs(100, 512, EXPERTS, 4)
    times_out_without_rank_0(comm, "dispatch", lambda: dispatch_and_check(short, inputs, EXPERTS))
    rejoin(comm, short)
    short.destroy()


def peer_that_skips_a_call_on_a_handle_times_out(what, call):
    """After a dispatch on every rank, every rank but 0 runs ``call(short, recv_x, recv_w, handle, x)``."""
    short = short_timeout_buffer()
    inputs = all_inputs(100, 512, EXPERTS, 4)
    recv_x, recv_w, handle = dispatch_and_check(short, inputs, EXPERTS)

    def call_then_barrier():
        call(short, recv_x, recv_w, handle, cupy.asarray(inputs[rank].x))
        short.barrier(timeout_s=3)  # raises what the call recorded first

    times_out_without_rank_0(comm, what, call_then_barrier)
    rejoin(comm, short, behind=2 if ACROSS_NODES else 1)  # across nodes each call starts with a barrier too
    short.destroy()


def peer_that_skips_cached_dispatch_times_out():
    peer_that_skips_a_call_on_a_handle_times_out(
        "cached dispatch", lambda short, recv_x, recv_w, handle, x: short.dispatch(x, handle=handle))


def peer_that_skips_combine_times_out():
    # The others push into rank 0's buffer at once, then wait for its rows.
    peer_that_skips_a_call_on_a_handle_times_out(
        "combine", lambda short, recv_x, recv_w, handle, x: short.combine(recv_x, handle, topk_weights=recv_w))


def any_batch_through_a_buffer_of_a_few_rounds():
    """A Buffer whose rounds take one unit of tokens (128) moves batches of many rounds, with token counts
    that differ between ranks (one rank with none), every token to one rank, FP8, cached dispatches with new
    rows, num_worst_tokens, and combines: each round reuses the same two regions, and every row and sum
    must come out as the reference's."""
    hidden, unit = 1024, intranode.ROUND_UNIT_TOKENS
    if ACROSS_NODES:  # the hints' buffers for rounds of one unit
        config = cuep.Config()
        small = make_buffer(config.get_nvl_buffer_size_hint(2 * hidden, num_ranks, num_tokens=unit),
                            num_rdma_bytes=config.get_rdma_buffer_size_hint(2 * hidden, num_ranks, num_tokens=unit))
    else:
        row = max(intranode.push_row_bytes(2 * hidden, 0), intranode.landing_row_bytes(hidden, 8))
        small = cuep.Buffer(comm, num_nvl_bytes=intranode.round_nvl_bytes(row, num_ranks, unit))
    tokens = lambda s: 0 if s == 1 else 700 + 131 * s  # noqa: E731 - up to 8 rounds of 128
    inputs = all_inputs(tokens, hidden, EXPERTS, 8)
    recv_x, recv_w, handle = dispatch_and_check(small, inputs, EXPERTS)
    combine_and_check(small, inputs, EXPERTS, recv_x, recv_w, handle)
    outputs = []
    for step in range(3):  # no host sync between the calls
        new_x = [bf16_normals(6001 + step, tokens(s), hidden, s) for s in range(num_ranks)]
        recv_x, _, _, _, _, _ = small.dispatch(cupy.asarray(new_x[rank]), handle=handle)
        combined, _, _ = small.combine(recv_x, handle, topk_weights=recv_w)
        outputs.append((new_x, recv_x, combined))
    for new_x, recv_x, combined in outputs:
        new_inputs = inputs.with_tokens(new_x)
        expected = reference.dispatch(new_inputs.xs, new_inputs.topk_idxs, EXPERTS, new_inputs.topk_weights)
        np.testing.assert_array_equal(bits(recv_x.get()), bits(expected[rank].recv_x))
        want_x, _ = reference.combine([r.recv_x for r in expected], [r.recv_src for r in expected],
                                      new_inputs.num_tokens, [r.recv_topk_weights for r in expected])
        magnitude, _ = reference.combine([np.abs(r.recv_x.astype(np.float32)) for r in expected],
                                         [r.recv_src for r in expected], new_inputs.num_tokens)
        assert_sum_close(combined.get().astype(np.float32), want_x[rank], magnitude[rank], ACROSS_NODES)
    to_rank_0 = all_inputs(1000, hidden, EXPERTS, 4, masked=0.0, route=lambda t: t % (EXPERTS // num_ranks))
    recv_x, recv_w, handle = dispatch_and_check(small, to_rank_0, EXPERTS)
    combine_and_check(small, to_rank_0, EXPERTS, recv_x, recv_w, handle)
    fp8 = all_inputs(lambda s: 600 + 97 * s, hidden, EXPERTS, 8, fp8=True)
    dispatch_and_check(small, fp8, EXPERTS)
    if ACROSS_NODES:  # num_worst_tokens waits for no count on the CPU: its batch goes in one round
        inputs = all_inputs(lambda s: 40 + 30 * (s % 3), hidden, EXPERTS, 8)  # at most 100 < 128
        worst = sum(40 + 30 * (s % 3) for s in range(num_ranks))
    else:
        worst = sum(tokens(s) for s in range(num_ranks))
    recv_x, recv_w, handle = dispatch_and_check(small, inputs, EXPERTS, num_worst_tokens=worst)
    combine_and_check(small, inputs, EXPERTS, recv_x, recv_w, handle)
    if ACROSS_NODES:  # one rank's batch past that one round: every rank's next call says so, then all serve on
        past = all_inputs(lambda s: 300 if s == 0 else 50, hidden, EXPERTS, 8)
        x, _, topk, weights = past[rank].on_gpu()
        cupy.cuda.get_current_stream().synchronize()
        per_rank, per_node, per_expert, in_rank, _ = small.get_dispatch_layout(topk, EXPERTS)

        def past_one_round():  # raised by the dispatch itself if its kernels are done by then, else the next call
            small.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node,
                           is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk,
                           topk_weights=weights, num_worst_tokens=300 * num_ranks)
            cupy.cuda.Device().synchronize()
            small.get_dispatch_layout(topk, EXPERTS)
        expect_error(ValueError, past_one_round, "a num_worst_tokens batch past one round was not reported",
                     match="one round")
        cupy.cuda.Device().synchronize()
        recv_x, recv_w, handle = dispatch_and_check(small, inputs, EXPERTS)
        combine_and_check(small, inputs, EXPERTS, recv_x, recv_w, handle)
    small.barrier()
    small.destroy()


def too_few_worst_tokens_raise_and_the_buffer_serves_on():
    """Rank 0 receives more rows than num_worst_tokens, through a Buffer of many rounds. Its next call
    raises ValueError naming num_worst_tokens (on that rank only); it does not await its rows, but before
    each round ends it waits until every peer has pushed them all, so no late count lands in a later call's
    counters: the dispatches and combines after it on the same Buffer come out as the reference's."""
    hidden, unit = 1024, intranode.ROUND_UNIT_TOKENS
    row = max(intranode.push_row_bytes(2 * hidden, 0), intranode.landing_row_bytes(hidden, 8))
    small = cuep.Buffer(comm, num_nvl_bytes=intranode.round_nvl_bytes(row, num_ranks, unit))
    to_rank_0 = all_inputs(1000, hidden, EXPERTS, 4, masked=0.0, route=lambda t: t % (EXPERTS // num_ranks))
    x, _, topk, weights = to_rank_0[rank].on_gpu()
    cupy.cuda.get_current_stream().synchronize()
    per_rank, _, per_expert, in_rank, _ = small.get_dispatch_layout(topk, EXPERTS)

    def overflow():  # raised by the dispatch itself if its kernels are done by then, else by the next call
        small.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                       topk_idx=topk, topk_weights=weights, num_worst_tokens=1000 * num_ranks - 1)
        cupy.cuda.Device().synchronize()
        small.get_dispatch_layout(topk, EXPERTS)
    if rank == 0:
        expect_error(ValueError, overflow, "a dispatch that overflowed num_worst_tokens was not reported",
                     match="num_worst_tokens")
    else:
        overflow()
    cupy.cuda.Device().synchronize()
    comm.Barrier()
    for step in range(3):
        inputs = all_inputs(lambda s: 500 + 77 * s + step, hidden, EXPERTS, 8)
        recv_x, recv_w, handle = dispatch_and_check(small, inputs, EXPERTS)
        combine_and_check(small, inputs, EXPERTS, recv_x, recv_w, handle)
    small.barrier()
    small.destroy()


def buffer_below_one_round_raises():
    # Every rank works out the same round size, so all of them raise, before any kernel runs.
    hidden = 1024
    row = intranode.push_row_bytes(2 * hidden, 0)  # a BF16 dispatch's landing row
    tiny = cuep.Buffer(comm, num_nvl_bytes=intranode.round_nvl_bytes(row, num_ranks, 1) - 4096)
    inputs = all_inputs(300, hidden, EXPERTS, 8)
    expect_error(ValueError, lambda: dispatch_and_check(tiny, inputs, EXPERTS),
                 "a dispatch through a buffer below one round ran", match="num_nvl_bytes >= ")
    tiny.barrier()
    tiny.destroy()


def rdma_buffer_below_one_round_raises():
    # Every rank works out the same round from the same sizes, so all of them raise, before any kernel runs.
    hidden, tokens = 1024, 300
    row = internode.dispatch_row_bytes(2 * hidden, 0, 4, RANKS_PER_NODE)
    num_nodes = num_ranks // RANKS_PER_NODE
    small = make_buffer(64 << 20, num_rdma_bytes=internode.rdma_bytes_for(100 * row, num_ranks, num_nodes))
    inputs = all_inputs(tokens, hidden, EXPERTS, 4)
    expect_error(ValueError, lambda: dispatch_and_check(small, inputs, EXPERTS),
                 "a dispatch through partitions below one round of 128 tokens ran", match="num_rdma_bytes")
    small.barrier()
    small.destroy()


def buffer_without_rdma_bytes_across_nodes_raises():
    # Every rank finds it at construction, before anything is allocated.
    expect_error(ValueError, lambda: make_buffer(64 << 20, num_rdma_bytes=0),
                 "a Buffer spanning nodes without num_rdma_bytes was created", match="num_rdma_bytes")


def bytes_across_nodes_are_one_row_per_token_and_node(buffer):
    """Each dispatch puts every token once per destination node but its own, and each combine one
    partial per (token, node) back: the counts of rows and bytes on the network say so exactly."""
    for tokens, hidden, num_topk, fp8 in ((1200, 2048, 8, False), (513, 7168, 8, True), (300, 1024, 4, False)):
        inputs = all_inputs(tokens, hidden, EXPERTS, num_topk, fp8=fp8)
        before = buffer.get_internode_traffic()
        recv_x, recv_w, handle = dispatch_and_check(buffer, inputs, EXPERTS)
        after_dispatch = buffer.get_internode_traffic()
        copies = reference.cross_node_copies(inputs[rank].topk_idx, EXPERTS, num_ranks, RANKS_PER_NODE, rank)
        row = internode.dispatch_row_bytes(hidden * (1 if fp8 else 2), hidden // 128 if fp8 else 0, num_topk,
                                           RANKS_PER_NODE)
        assert after_dispatch["dispatch_rows"] - before["dispatch_rows"] == copies, (after_dispatch, before, copies)
        assert after_dispatch["dispatch_bytes"] - before["dispatch_bytes"] == copies * row
        if not fp8:
            # A combine's partials go out from the forwarders: this rank sends one per token it forwarded
            # from another node (a source on its rail whose token went to this rank's node).
            node, local = divmod(rank, RANKS_PER_NODE)
            here = slice(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE)
            forwarded = sum(int(reference.get_dispatch_layout(inputs[s].topk_idx, EXPERTS, num_ranks, RANKS_PER_NODE)
                                .is_token_in_rank[:, here].any(axis=1).sum())
                            for s in range(local, num_ranks, RANKS_PER_NODE) if s // RANKS_PER_NODE != node)
            combine_and_check(buffer, inputs, EXPERTS, recv_x, recv_w, handle)
            after = buffer.get_internode_traffic()
            assert after["combine_rows"] - after_dispatch["combine_rows"] == forwarded, (after, after_dispatch,
                                                                                         forwarded)
            assert after["combine_bytes"] - after_dispatch["combine_bytes"] == \
                forwarded * internode.combine_row_bytes(hidden, num_topk)
            assert comm.allreduce(forwarded) == comm.allreduce(copies)  # every copy that went out comes back


def larger_buffers_after_the_first_grow_the_heap(buffer):
    """Frameworks make a second, larger Buffer in one process (Megatron grows its Buffer, vLLM keeps one per
    configuration) with no NVSHMEM variable set: NVSHMEM grows its heap beyond what the first Buffer sized
    (through CUDA VMM), the new Buffer serves calls, and a destroyed Buffer's memory serves the next one."""
    first_heap = int(os.environ["NVSHMEM_SYMMETRIC_SIZE"])  # cuep sized it for the first Buffer
    inputs = all_inputs(300, 1024, EXPERTS, 8)
    size = first_heap + (1 << 30)
    larger = make_buffer(size)
    recv_x, recv_w, handle = dispatch_and_check(larger, inputs, EXPERTS)
    combine_and_check(larger, inputs, EXPERTS, recv_x, recv_w, handle)
    larger.barrier()
    larger.destroy()
    comm.Barrier()
    free_before = cupy.cuda.runtime.memGetInfo()[0]
    again = make_buffer(size)
    again.barrier()
    comm.Barrier()
    taken = free_before - cupy.cuda.runtime.memGetInfo()[0]
    assert taken < (64 << 20), f"a Buffer of the size just destroyed took {taken >> 20} MiB more of the GPU"
    recv_x, recv_w, handle = dispatch_and_check(again, inputs, EXPERTS)
    combine_and_check(again, inputs, EXPERTS, recv_x, recv_w, handle)
    again.barrier()
    again.destroy()


def buffer_sizes_that_differ_between_ranks_raise():
    # On every rank, before any memory is allocated.
    expect_error(ValueError, lambda: cuep.Buffer(comm, num_nvl_bytes=(1 << 20) * (1 + rank)),
                 "a Buffer with a different num_nvl_bytes on each rank was created", match="num_nvl_bytes")


def main() -> None:
    buffer = make_buffer(512 << 20)
    on_the_buffer = [
        ("bf16 top-8, -1 entries, odd token counts, combine with weights", bf16_topk8_masked_odd_tokens),
        ("fp8 with column-major scales, hidden 7168", fp8_column_major_scales_hidden_7168),
        ("fp8 with packed UE8M0 (int32) scales, then cached", fp8_packed_ue8m0_scales_then_cached),
        ("combine on 1 to 96 SMs: bulk pushes and the warps' copies", combine_on_few_and_many_sms),
        ("without top-k", without_topk),
        ("top-17 and top-32", wide_topk_17_and_32),
        ("cached dispatch with new x", cached_dispatch_new_x),
        ("cached FP8 dispatches back to back, then a cached BF16 dispatch and combine",
         cached_dispatches_back_to_back_fp8_then_combine),
        ("ranks that start calls late, no host sync between calls", skewed_ranks_run_calls_back_to_back),
        ("expert_alignment=4, one and two biases", alignment_and_two_biases),
        ("0 tokens on rank 1", zero_tokens_on_rank_1),
        ("every token to rank 0", every_token_to_rank_0),
        ("hidden 128, 384, 1152 and 7168", unusual_hidden_sizes),
        ("async, previous_event, allocate_on_comm_stream", async_previous_event_comm_stream_allocation),
        ("num_worst_tokens (no CPU wait)", num_worst_tokens_no_cpu_wait),
        ("CUDA graph: capture once, replay 5x with new inputs", cuda_graph_capture_then_replay_with_new_inputs),
        ("async call keeps inputs alive after the caller drops them", async_inputs_outlive_the_callers_references),
        ("calls on two streams with no sync between run in order", calls_on_two_streams_are_ordered),
        ("1000 dispatch+combine without memory growth", thousand_calls_hold_no_memory),
        ("larger Buffers after the first grow the heap; a destroyed one's memory serves the next",
         larger_buffers_after_the_first_grow_the_heap),
    ]
    with_own_buffers = [
        ("a peer that skips dispatch makes the others time out", peer_that_skips_dispatch_times_out),
        ("a peer that skips a cached dispatch makes the others time out", peer_that_skips_cached_dispatch_times_out),
        ("a peer that skips a combine makes the others time out", peer_that_skips_combine_times_out),
        ("buffer sizes that differ between ranks raise on every rank", buffer_sizes_that_differ_between_ranks_raise),
    ]
    if ACROSS_NODES:
        on_the_buffer.append(("rows and bytes across nodes: one per (token, other node)",
                              bytes_across_nodes_are_one_row_per_token_and_node))
        with_own_buffers += [
            ("an RDMA buffer below one round raises on every rank", rdma_buffer_below_one_round_raises),
            ("any batch through buffers of a few rounds", any_batch_through_a_buffer_of_a_few_rounds),
            ("a Buffer across nodes without num_rdma_bytes raises at construction",
             buffer_without_rdma_bytes_across_nodes_raises)]
    else:
        with_own_buffers += [
            ("any batch through a buffer of a few rounds", any_batch_through_a_buffer_of_a_few_rounds),
            ("too few num_worst_tokens raise on that rank; the Buffer serves on",
             too_few_worst_tokens_raise_and_the_buffer_serves_on),
            ("a buffer below one round raises on every rank", buffer_below_one_round_raises)]
    cases = [(name, functools.partial(case, buffer)) for name, case in on_the_buffer] + with_own_buffers
    run_cases(comm, selected_cases(cases, lambda named: getattr(named[1], "func", named[1]).__name__))
    buffer.destroy()
    if rank == 0:
        layout = f"{num_ranks // RANKS_PER_NODE} nodes x {RANKS_PER_NODE}" if ACROSS_NODES else "one node"
        print(f"[rank 0] intranode worker passed on {num_ranks} ranks ({layout})", flush=True)


if __name__ == "__main__":
    main()
