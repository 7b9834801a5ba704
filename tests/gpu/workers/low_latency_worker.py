"""GPU worker for low-latency dispatch/combine against cuep.reference (run under mpirun).

Every rank rebuilds every rank's inputs from one seed, so it can compute what it must receive and
what its tokens must combine to. Moved data (FP8 bytes and scales, BF16 rows, counts, row order) is
compared bit for bit; combined sums within the rounding the combine performs (one BF16 rounding of
each rank's partial sum, then of the result: 2^-7 of sum |w x| at most). Each case below checks one
behaviour; ``main`` runs them in order (the order fixes each case's inputs, see ``common.SeededInputs``).

``--pressure N``: instead of the cases, N calls with fresh random routing and shapes, every result
checked against the reference (the test suite runs a few hundred; run it long by hand to soak a machine).
"""

from __future__ import annotations

import functools
import os
import sys
import time

import cupy
import numpy as np
from common import (
    BF16,
    AbsoluteRows,
    AllInputs,
    SeededInputs,
    assert_no_memory_growth,
    assert_sum_close,
    bits,
    environment,
    expect_error,
    expect_peer_timeout,
    expert_outputs,
    run_cases,
    selected_cases,
)
from mpi4py import MPI

import cuep
from cuep import reference
from cuep.kernels.common import WARP_SIZE
from cuep.kernels.low_latency import MAX_TOKENS_PER_RANK, NUM_THREADS

comm = MPI.COMM_WORLD
rank, num_ranks = comm.Get_rank(), comm.Get_size()
SEED = 11
MAX_TOKENS = 128
HIDDEN_MAX = 7168
EXPERTS = 64 * num_ranks
FEW_EXPERTS = 4 * num_ranks
RDMA_BYTES = cuep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, HIDDEN_MAX, num_ranks, EXPERTS)
LATE_S = 0.2  # how late a late rank is
OWN_ONLY_TOKENS = 4  # LogFMT cases: tokens of each rank that name its own experts alone
all_inputs = SeededInputs(SEED, num_ranks)


# ------------------------------------------------------------------------------------------------------
# Checks against the reference


def check_received(received, recv_count, expected, use_fp8):
    counts = recv_count.get()
    np.testing.assert_array_equal(counts, expected.recv_count)
    data, scales = received if use_fp8 else (received, None)
    data = data.get()
    for e, n in enumerate(counts):
        np.testing.assert_array_equal(bits(data[e, :n]), bits(expected.recv_x[e, :n]), err_msg=f"local expert {e}")
        if use_fp8:
            np.testing.assert_array_equal(scales[e, :n].get(), expected.recv_scales[e, :n], err_msg=f"scales of {e}")


def dispatch_and_check(buffer, inputs: AllInputs, num_experts, use_fp8=True, round_scale=False, use_ue8m0=False,
                       hook=False, async_finish=False, stats=None, max_tokens=MAX_TOKENS):
    mine = inputs[rank]
    received, recv_count, handle, event, recv_hook = buffer.low_latency_dispatch(
        cupy.asarray(mine.x), cupy.asarray(mine.topk_idx), max_tokens, num_experts,
        cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
        async_finish=async_finish, return_recv_hook=hook)
    assert (recv_hook is not None) == hook
    if hook:
        recv_hook()
    if async_finish:
        event.current_stream_wait()
    expected = reference.low_latency_dispatch(inputs.xs, inputs.topk_idxs, num_experts, max_tokens, use_fp8,
                                              round_scale, use_ue8m0)
    check_received(received, recv_count, expected[rank], use_fp8)
    return handle, expected


def check_combined(combined, inputs: AllInputs, outputs, num_experts):
    topks, weights = inputs.topk_idxs, inputs.topk_weights
    want = reference.low_latency_combine(outputs, topks, weights, num_experts)[rank]
    bound = reference.low_latency_combine([AbsoluteRows(o) for o in outputs], topks, [np.abs(w) for w in weights],
                                          num_experts)[rank]
    got = combined.get().astype(np.float32)
    # Each rank's partial is rounded to BF16 once (unit roundoff 2^-8), then the sum: at most 2^-7 of
    # sum |w x| in all.
    excess = np.abs(got - want) - (bound * 2.0 ** -7 + 1e-6)
    assert (excess <= 0).all(), (np.abs(got - want).max(), float(excess.max()))


def combine_and_check(buffer, inputs: AllInputs, expected, num_experts, handle, hook=False, async_finish=False,
                      out=None, zero_copy=False):
    outputs = expert_outputs(expected, num_experts)
    x = cupy.asarray(outputs[rank])
    if zero_copy:
        target = buffer.get_next_low_latency_combine_buffer(handle)
        target[...] = x
        x = target
    mine = inputs[rank]
    combined, event, recv_hook = buffer.low_latency_combine(x, cupy.asarray(mine.topk_idx),
                                                            cupy.asarray(mine.topk_weights), handle,
                                                            zero_copy=zero_copy, async_finish=async_finish,
                                                            return_recv_hook=hook, out=out)
    if hook:
        recv_hook()
    if async_finish:
        event.current_stream_wait()
    if out is not None:
        assert combined is out
    check_combined(combined, inputs, outputs, num_experts)


def pressure(iterations: int) -> None:
    """``iterations`` calls, each with fresh shapes, routing and tokens, each checked against the reference:
    every received row bit for bit in its expert's rows, and every combined token (experts scale their
    rows by a factor of their own, so a row in another expert's slot shows)."""
    buffer = cuep.Buffer(comm, 0, cuep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, 7168, num_ranks, num_ranks),
                         low_latency_mode=True)
    shapes = np.random.default_rng([SEED, 77])  # the same on every rank
    fresh = SeededInputs(SEED + 77, num_ranks)
    for _ in range(iterations):
        hidden = int(shapes.choice([640, 2048, 7168]))  # 640: a last warp with a partial set of FP8 scales
        num_experts = num_ranks * int(shapes.choice([4, 16, 64]))
        num_topk = min(int(shapes.choice([1, 8, 16])), num_experts)
        use_fp8 = bool(shapes.integers(2))
        tokens = shapes.integers(0, MAX_TOKENS + 1, num_ranks)
        inputs = fresh(lambda s: int(tokens[s]), hidden, num_experts, num_topk)
        handle, expected = dispatch_and_check(buffer, inputs, num_experts, use_fp8=use_fp8)
        combine_and_check(buffer, inputs, expected, num_experts, handle)
    buffer.destroy()
    if rank == 0:
        print(f"[rank 0] low-latency pressure: {iterations} calls checked; passed on {num_ranks} ranks", flush=True)


# ------------------------------------------------------------------------------------------------------
# Cases


def fp8_topk8_hidden_7168_uneven_tokens(buffer):
    inputs = all_inputs(lambda s: MAX_TOKENS - 17 * s, 7168, EXPERTS, 8)
    handle, expected = dispatch_and_check(buffer, inputs, EXPERTS)
    combine_and_check(buffer, inputs, expected, EXPERTS, handle)


def fp8_round_scale_topk1_hidden_2048(buffer):
    inputs = all_inputs(MAX_TOKENS, 2048, EXPERTS, 1)
    handle, expected = dispatch_and_check(buffer, inputs, EXPERTS, round_scale=True)
    combine_and_check(buffer, inputs, expected, EXPERTS, handle)


def fp8_ue8m0_topk16(buffer):
    inputs = all_inputs(100, 2048, EXPERTS, 16)
    handle, expected = dispatch_and_check(buffer, inputs, EXPERTS, round_scale=True, use_ue8m0=True)
    combine_and_check(buffer, inputs, expected, EXPERTS, handle)


def first_choice_twice(topk: np.ndarray) -> np.ndarray:
    """Every third token names its first expert again as its second choice (one row for both)."""
    topk = topk.copy()
    topk[::3, 1] = topk[::3, 0]
    return topk


def many_local_experts_and_repeated_choices(buffer):
    """The receive's layout holds every local expert in each block: more local experts than the GPU has SMs
    (160), and about 2400 experts in all, whose layout takes more than a block's default 48 KiB of shared
    memory (the kernel opts in); tokens naming one expert twice; FP8 and BF16, whole calls and hooks."""
    for experts_per_rank, hidden, use_fp8, hook in ((160, 512, True, False), (160, 512, False, True),
                                                    (2400 // num_ranks, 256, True, True)):
        num_experts = experts_per_rank * num_ranks
        inputs = all_inputs(lambda s: MAX_TOKENS - 5 * s, hidden, num_experts, 8, route=first_choice_twice)
        handle, expected = dispatch_and_check(buffer, inputs, num_experts, use_fp8=use_fp8, hook=hook)
        combine_and_check(buffer, inputs, expected, num_experts, handle, hook=hook)


def bf16_zero_tokens_on_rank_1_out_and_zero_copy(buffer):
    inputs = all_inputs(lambda s: 0 if s == 1 else 77, 2048, FEW_EXPERTS, 8, masked=0.3)
    handle, expected = dispatch_and_check(buffer, inputs, FEW_EXPERTS, use_fp8=False)
    out = cupy.empty((len(inputs[rank].x), 2048), dtype=BF16)
    combine_and_check(buffer, inputs, expected, FEW_EXPERTS, handle, out=out, zero_copy=True)


def hooks_two_micro_batches(buffer):
    a, b = (all_inputs(MAX_TOKENS, 7168, EXPERTS, 8) for _ in range(2))
    sent = []
    for inputs in (a, b):
        mine = inputs[rank]
        sent.append(buffer.low_latency_dispatch(cupy.asarray(mine.x), cupy.asarray(mine.topk_idx), MAX_TOKENS,
                                                EXPERTS, return_recv_hook=True))
    combines = []
    for inputs, (received, recv_count, handle, _, hook) in zip((a, b), sent):
        hook()
        expected = reference.low_latency_dispatch(inputs.xs, inputs.topk_idxs, EXPERTS, MAX_TOKENS)
        check_received(received, recv_count, expected[rank], True)
        outputs = expert_outputs(expected, EXPERTS)
        mine = inputs[rank]
        combined, _, combine_hook = buffer.low_latency_combine(cupy.asarray(outputs[rank]), cupy.asarray(mine.topk_idx),
                                                               cupy.asarray(mine.topk_weights), handle,
                                                               return_recv_hook=True)
        combines.append((inputs, outputs, combined, combine_hook))
    for inputs, outputs, combined, combine_hook in combines:
        combine_hook()
        check_combined(combined, inputs, outputs, EXPERTS)
        expect_error(cuep.CuepError, combine_hook, "a hook ran twice")


def async_finish_and_cumulative_stats(buffer):
    stats = cupy.zeros(EXPERTS // num_ranks, dtype=cupy.int32)
    total = np.zeros(EXPERTS // num_ranks, dtype=np.int64)
    for _ in range(2):
        inputs = all_inputs(90, 2048, EXPERTS, 8)
        handle, expected = dispatch_and_check(buffer, inputs, EXPERTS, async_finish=True, stats=stats)
        total += expected[rank].recv_count
        combine_and_check(buffer, inputs, expected, EXPERTS, handle, async_finish=True)
    np.testing.assert_array_equal(stats.get(), total)


def fp8_more_pairs_than_warp_pairs():
    """An FP8 dispatch of more (source, token) pairs than the receive has two warps for: each pair's rows and
    scales then come from one warp (smaller calls give its scales to a second warp), in a whole call and through
    a hook (a receive-only launch has twice the receiving warps), float and UE8M0 scales, then combined."""
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    warp_pairs = NUM_THREADS // WARP_SIZE // 2 * sms  # of a receive-only launch, one block per SM
    max_tokens = min(MAX_TOKENS_PER_RANK, warp_pairs // num_ranks + 1)
    if num_ranks * max_tokens <= warp_pairs:
        raise AssertionError(f"{sms} SMs: no call of at most {MAX_TOKENS_PER_RANK} tokens a rank has more pairs "
                             f"than warp pairs")
    hidden, num_experts = 2048, 8 * num_ranks
    big = cuep.Buffer(comm, 0, cuep.Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, num_ranks, num_experts),
                      low_latency_mode=True)
    fresh = SeededInputs(SEED + 91, num_ranks)
    for hook, use_ue8m0 in ((False, False), (True, False), (True, True)):
        inputs = fresh(lambda s: max_tokens - 7 * s, hidden, num_experts, 8)
        handle, expected = dispatch_and_check(big, inputs, num_experts, round_scale=use_ue8m0, use_ue8m0=use_ue8m0,
                                              hook=hook, max_tokens=max_tokens)
        combine_and_check(big, inputs, expected, num_experts, handle)
    big.destroy()


def forced_put_path():
    put_buffer = cuep.Buffer(comm, 0, RDMA_BYTES, low_latency_mode=True, allow_nvlink_for_low_latency_mode=False)
    for use_fp8 in (True, False):
        inputs = all_inputs(MAX_TOKENS - 5, 7168, EXPERTS, 8)
        handle, expected = dispatch_and_check(put_buffer, inputs, EXPERTS, use_fp8=use_fp8)
        combine_and_check(put_buffer, inputs, expected, EXPERTS, handle)
    put_buffer.destroy()


def cuda_graph_capture_then_1000_replays(buffer):
    """Captured once (dispatch, then the combine of the received rows as the experts' outputs), replayed 1000
    times with fresh tokens and routing copied into the captured arrays; every replay's received rows are
    checked bit for bit against the reference, and its combined tokens within the combine's rounding (a
    small hidden size and few experts keep 1000 reference checks short at 8 ranks)."""
    tokens, hidden, num_topk = MAX_TOKENS, 512, 4
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        x, _, topk, weights = all_inputs(tokens, hidden, FEW_EXPERTS, num_topk)[rank].on_gpu()

        def step():
            received, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, topk, MAX_TOKENS, FEW_EXPERTS,
                                                                             use_fp8=False)
            combined, _, _ = buffer.low_latency_combine(received, topk, weights, handle)
            return received, recv_count, combined

        step()
        stream.synchronize()
        stream.begin_capture()
        received, recv_count, combined = step()  # the graph writes into these arrays: they must outlive it
        graph = stream.end_capture()
        for _ in range(1000):
            inputs = all_inputs(tokens, hidden, FEW_EXPERTS, num_topk)
            mine = inputs[rank]
            x[...], topk[...], weights[...] = (cupy.asarray(a) for a in (mine.x, mine.topk_idx, mine.topk_weights))
            graph.launch(stream)
            stream.synchronize()
            expected = reference.low_latency_dispatch(inputs.xs, inputs.topk_idxs, FEW_EXPERTS, MAX_TOKENS, False)
            check_received(received, recv_count, expected[rank], False)
            check_combined(combined, inputs, [e.recv_x for e in expected], FEW_EXPERTS)


# ------------------------------------------------------------------------------------------------------
# The call order across real GPUs: which buffer a call uses is decided on the device, in every pattern the
# rules allow (cuda_src/low_latency.cu, "Call order"). Each step is a BF16 dispatch, then the combine of the
# received rows as the experts' outputs; a small shape keeps thousands of reference checks short.

STEP_TOKENS, STEP_HIDDEN, STEP_TOPK = 64, 512, 4


def step_inputs(count: int):
    """``count`` fresh inputs (every rank's, for the reference) and this rank's of each on the GPU."""
    inputs = [all_inputs(STEP_TOKENS, STEP_HIDDEN, FEW_EXPERTS, STEP_TOPK) for _ in range(count)]
    return inputs, [i[rank].on_gpu() for i in inputs]


def check_step(inputs: AllInputs, received, recv_count, combined) -> None:
    """A step's received rows bit for bit, and its combined tokens within the combine's rounding."""
    expected = reference.low_latency_dispatch(inputs.xs, inputs.topk_idxs, FEW_EXPERTS, MAX_TOKENS, False)
    check_received(received, recv_count, expected[rank], False)
    check_combined(combined, inputs, [e.recv_x for e in expected], FEW_EXPERTS)


def eager_step(buffer, mine, hooks: bool = False):
    """One step's calls, the receives from hooks if asked; returns (received, recv_count, combined)."""
    received, recv_count, handle, _, hook = buffer.low_latency_dispatch(mine.x, mine.topk_idx, MAX_TOKENS, FEW_EXPERTS,
                                                                        use_fp8=False, return_recv_hook=hooks)
    if hooks:
        hook()
    combined, _, hook = buffer.low_latency_combine(received, mine.topk_idx, mine.topk_weights, handle,
                                                   return_recv_hook=hooks)
    if hooks:
        hook()
    return received, recv_count, combined


def outputs_let_go_of_come_back_and_held_ones_keep_their_rows(buffer):
    """A step's outputs come back to the next step as the same arrays once the caller has let go of them
    (the decode loop's host path); an output still held in any way keeps its rows through the steps after it."""
    inputs, on_gpu = step_inputs(6)
    received, recv_count, combined = eager_step(buffer, on_gpu[0])
    first = (id(received), id(recv_count), id(combined), received.data.ptr, combined.data.ptr)
    del received, recv_count, combined
    received, recv_count, combined = eager_step(buffer, on_gpu[1])
    assert (id(received), id(recv_count), id(combined), received.data.ptr, combined.data.ptr) == first, \
        "a step's outputs, let go of, did not come back to the next step"
    check_step(inputs[1], received, recv_count, combined)
    del received, recv_count, combined
    for step, hold in enumerate(("received rows", "a slice of them", "the combined tokens", "the handle"), start=2):
        received, recv_count, handle, _, _ = buffer.low_latency_dispatch(on_gpu[step].x, on_gpu[step].topk_idx,
                                                                        MAX_TOKENS, FEW_EXPERTS, use_fp8=False)
        combined, _, _ = buffer.low_latency_combine(received, on_gpu[step].topk_idx, on_gpu[step].topk_weights,
                                                    handle)
        held = {"received rows": received, "a slice of them": received[:, 1:5], "the combined tokens": combined,
                "the handle": handle}[hold]
        pointers = {received.data.ptr, combined.data.ptr}
        check_step(inputs[step], received, recv_count, combined)
        rows = held.get() if hold != "the handle" else None
        del received, recv_count, handle, combined
        later = eager_step(buffer, on_gpu[(step + 1) % len(on_gpu)])
        check_step(inputs[(step + 1) % len(on_gpu)], *later)
        if hold == "the handle":
            assert later[0].data.ptr not in pointers, "a dispatch's allocation went to the next step while its handle was held"
        else:
            np.testing.assert_array_equal(bits(held.get()), bits(rows), err_msg=f"held {hold} changed by a later step")
        del held, later


def thousand_eager_steps_without_a_sync(buffer):
    """1000 steps issued 100 at a time with no host sync between calls (inputs uploaded beforehand), half of
    them through hooks; every step's received rows and combined tokens checked against the reference."""
    for window in range(10):
        inputs, on_gpu = step_inputs(100)
        results = [eager_step(buffer, mine, hooks=bool(i % 2)) for i, mine in enumerate(on_gpu)]
        for step, result in zip(inputs, results, strict=True):
            check_step(step, *result)


def hook_send_and_receive_replayed_from_separate_graphs(buffer):
    """A step as three CUDA graphs replayed in turn 1000 times: the dispatch's send; its receive (the hook)
    with the combine's send; the combine's receive. No graph holds a whole call, so a buffer baked into one
    would break at once. Fresh inputs copied in on the device before each replay, each replay's results copied
    aside on the device, checked 100 replays at a time (no host sync between replays)."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        _, (first,) = step_inputs(1)
        x, topk, weights = first.x.copy(), first.topk_idx.copy(), first.topk_weights.copy()  # the graphs read these
        eager_step(buffer, first, hooks=True)  # compiled and planned before the capture
        stream.synchronize()
        graphs, captured = [], {}

        def capture(body) -> None:
            stream.begin_capture()
            body()
            graphs.append(stream.end_capture())

        def send_dispatch():
            captured["received"], captured["recv_count"], captured["handle"], _, captured["dispatch_hook"] = \
                buffer.low_latency_dispatch(x, topk, MAX_TOKENS, FEW_EXPERTS, use_fp8=False, return_recv_hook=True)

        def receive_dispatch_send_combine():
            captured["dispatch_hook"]()
            captured["combined"], _, captured["combine_hook"] = buffer.low_latency_combine(
                captured["received"], topk, weights, captured["handle"], return_recv_hook=True)

        capture(send_dispatch)
        capture(receive_dispatch_send_combine)
        capture(lambda: captured["combine_hook"]())
        for window in range(10):
            inputs, on_gpu = step_inputs(100)
            kept = []
            for mine in on_gpu:
                x[...], topk[...], weights[...] = mine.x, mine.topk_idx, mine.topk_weights
                for graph in graphs:
                    graph.launch(stream)
                kept.append(tuple(captured[name].copy() for name in ("received", "recv_count", "combined")))
            stream.synchronize()
            for step, result in zip(inputs, kept, strict=True):
                check_step(step, *result)


def graph_of_three_calls_with_eager_calls_between_replays(buffer):
    """A graph of three low-latency calls (a dispatch, its combine, another dispatch) replayed 100 times; after
    each replay the second dispatch is combined eagerly and an eager step of other tokens follows (so the
    graph's calls land on a different buffer at each replay). Every result checked."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        _, (a, b) = step_inputs(2)
        graph_inputs = [tuple(array.copy() for array in (i.x, i.topk_idx, i.topk_weights)) for i in (a, b)]
        (xa, topka, weightsa), (xb, topkb, _) = graph_inputs
        eager_step(buffer, a)
        stream.synchronize()
        stream.begin_capture()
        first = eager_step(buffer, a._replace(x=xa, topk_idx=topka, topk_weights=weightsa))
        second, second_count, second_handle, _, _ = buffer.low_latency_dispatch(xb, topkb, MAX_TOKENS, FEW_EXPERTS,
                                                                                use_fp8=False)
        graph = stream.end_capture()
        for _ in range(100):
            inputs, (mine_a, mine_b, mine_c) = step_inputs(3)
            for (x, topk, weights), mine in zip(graph_inputs, (mine_a, mine_b)):
                x[...], topk[...], weights[...] = mine.x, mine.topk_idx, mine.topk_weights
            graph.launch(stream)
            combined, _, _ = buffer.low_latency_combine(second, graph_inputs[1][1], graph_inputs[1][2], second_handle)
            third = eager_step(buffer, mine_c)
            stream.synchronize()
            check_step(inputs[0], *first)
            check_step(inputs[1], second, second_count, combined)
            check_step(inputs[2], *third)


def one_rank_late_before_each_call(buffer):
    """The last rank sleeps 1-5 ms before each call and each hook, for 30 steps (every other one through
    hooks): its peers wait for it on the device, and every result is right."""
    lag = np.random.default_rng([SEED, rank])

    def late() -> None:
        if rank == num_ranks - 1:
            time.sleep(lag.uniform(1e-3, 5e-3))

    for i in range(30):
        inputs, (mine,) = step_inputs(1)
        hooks = bool(i % 2)
        late()
        received, recv_count, handle, _, hook = buffer.low_latency_dispatch(
            mine.x, mine.topk_idx, MAX_TOKENS, FEW_EXPERTS, use_fp8=False, return_recv_hook=hooks)
        if hooks:
            late()
            hook()
        late()
        combined, _, hook = buffer.low_latency_combine(received, mine.topk_idx, mine.topk_weights, handle,
                                                       return_recv_hook=hooks)
        if hooks:
            late()
            hook()
        check_step(inputs[0], received, recv_count, combined)


def calls_outside_the_order_are_refused_within_a_second(buffer):
    """Three dispatch sends with no receive: the third breaks the two-in-flight rule, moves nothing, and the
    rank's next call raises CallOrderError naming the rule within a second (no wait for a timeout). The refused
    send's hook is refused too; clean_low_latency_buffer then starts over and a step is right again. Then two
    combines of one handle: the second is refused, and the first one's hook still completes it."""
    _, (mine,) = step_inputs(1)

    def send():
        return buffer.low_latency_dispatch(mine.x, mine.topk_idx, MAX_TOKENS, FEW_EXPERTS, use_fp8=False,
                                           return_recv_hook=True)

    comm.Barrier()
    started = time.monotonic()
    sent = [send() for _ in range(3)]
    cupy.cuda.Device().synchronize()
    error = expect_error(cuep.CallOrderError, send, "a third result in flight was not refused",
                         match="at most two results may be in flight")
    assert error.call > 0 and error.peer == -1, error
    assert time.monotonic() - started < 1.0, time.monotonic() - started
    sent[2][4]()  # the refused send's receive
    cupy.cuda.Device().synchronize()
    expect_error(cuep.CallOrderError, send, "the refused send's receive ran", match="whose send never ran")
    cupy.cuda.Device().synchronize()
    comm.Barrier()
    buffer.clean_low_latency_buffer(MAX_TOKENS, STEP_HIDDEN, FEW_EXPERTS)
    inputs, (mine,) = step_inputs(1)
    check_step(inputs[0], *eager_step(buffer, mine, hooks=True))
    # Two combines of one handle in flight would share its record: the second is refused, the first completes.
    inputs, (mine,) = step_inputs(1)
    received, recv_count, handle, _, hook = buffer.low_latency_dispatch(
        mine.x, mine.topk_idx, MAX_TOKENS, FEW_EXPERTS, use_fp8=False, return_recv_hook=True)
    hook()
    combined, _, first_hook = buffer.low_latency_combine(received, mine.topk_idx, mine.topk_weights, handle,
                                                         return_recv_hook=True)
    buffer.low_latency_combine(received, mine.topk_idx, mine.topk_weights, handle, return_recv_hook=True)
    cupy.cuda.Device().synchronize()
    expect_error(cuep.CallOrderError, first_hook, "a second combine of a handle in flight was not refused",
                 match="another combine of the same dispatch's handle")
    first_hook()  # the error came before the hook ran its receive
    check_step(inputs[0], received, recv_count, combined)
    cupy.cuda.Device().synchronize()
    comm.Barrier()
    buffer.clean_low_latency_buffer(MAX_TOKENS, STEP_HIDDEN, FEW_EXPERTS)  # the refused combine was never received


def zeroed_buffer_and_cleaned_masks_serve_again():
    """vLLM's fault-tolerant reset on a shrink-mode Buffer: every rank zeroes its whole low-latency buffer
    (get_local_buffer_tensor(int8, use_rdma_buffer=True)), then calls low_latency_clean_mask_buffer(); the
    steps after it are right."""
    shrink = cuep.Buffer(comm, 0, RDMA_BYTES, low_latency_mode=True, enable_shrink=True)
    for _ in range(2):
        inputs, (mine,) = step_inputs(1)
        check_step(inputs[0], *eager_step(shrink, mine, hooks=True))
        cupy.cuda.Device().synchronize()
        comm.Barrier()
        shrink.get_local_buffer_tensor(np.int8, use_rdma_buffer=True).fill(0)
        shrink.low_latency_clean_mask_buffer()
    inputs, (mine,) = step_inputs(1)
    check_step(inputs[0], *eager_step(shrink, mine))
    shrink.destroy()


def normal_and_low_latency_calls_share_one_buffer():
    """SGLang's auto mode: one low_latency_mode=True Buffer with both modes' sizes serves normal-mode calls
    too (the internode mode across nodes, where the two share the RDMA buffer and each one's first call after
    the other's hands it over), alternating with low-latency calls and a clean; every row and sum checked."""
    hidden, tokens, config = 2048, 300, cuep.Config()
    nvl_bytes = config.get_nvl_buffer_size_hint(hidden * 2, num_ranks, tokens)
    rdma_bytes = max(RDMA_BYTES, config.get_rdma_buffer_size_hint(hidden * 2, num_ranks, tokens))
    shared = cuep.Buffer(comm, nvl_bytes, rdma_bytes, low_latency_mode=True)
    across_nodes = int(os.environ.get("CUEP_RANKS_PER_NODE") or num_ranks) < num_ranks
    for step in range(3):
        inputs = all_inputs(tokens, hidden, EXPERTS, 8)
        mine = inputs[rank]
        topk_idx = cupy.asarray(mine.topk_idx)
        per_rank, per_rdma_rank, per_expert, in_rank, _ = shared.get_dispatch_layout(topk_idx, EXPERTS)
        recv_x, _, recv_w, _, handle, _ = shared.dispatch(
            cupy.asarray(mine.x), num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx,
            topk_weights=cupy.asarray(mine.topk_weights))
        expected = reference.dispatch(inputs.xs, inputs.topk_idxs, EXPERTS, inputs.topk_weights)
        np.testing.assert_array_equal(bits(recv_x.get()), bits(expected[rank].recv_x))
        np.testing.assert_array_equal(recv_w.get(), expected[rank].recv_topk_weights)
        combined, _, _ = shared.combine(recv_x, handle)
        want, _ = reference.combine([r.recv_x for r in expected], [r.recv_src for r in expected], inputs.num_tokens)
        magnitude, _ = reference.combine([np.abs(r.recv_x.astype(np.float32)) for r in expected],
                                         [r.recv_src for r in expected], inputs.num_tokens)
        assert_sum_close(combined.get().astype(np.float32), want[rank], magnitude[rank], across_nodes)
        if across_nodes:  # the internode mode moved them, through the RDMA buffer the low-latency mode shares
            assert shared.get_internode_traffic()["dispatch_rows"] > 0
        ll_inputs = all_inputs(lambda s: 100 + 7 * s, hidden, EXPERTS, 8)
        if step == 2:  # as SGLang switches back: clean first, then the low-latency calls
            shared.clean_low_latency_buffer(MAX_TOKENS, hidden, EXPERTS)
        ll_handle, ll_expected = dispatch_and_check(shared, ll_inputs, EXPERTS)
        combine_and_check(shared, ll_inputs, ll_expected, EXPERTS, ll_handle)
    shared.destroy()


def thousand_calls_hold_no_memory(buffer):
    x, _, topk, weights = all_inputs(64, 1024, FEW_EXPERTS, 4)[rank].on_gpu()

    def step():
        received, _, handle, _, _ = buffer.low_latency_dispatch(x, topk, MAX_TOKENS, FEW_EXPERTS, use_fp8=False)
        buffer.low_latency_combine(received, topk, weights, handle)
    assert_no_memory_growth(step)


def bad_expert_id_is_reported_by_the_next_call(buffer):
    x, _, topk, _ = all_inputs(16, 1024, FEW_EXPERTS, 4, masked=0.0)[rank].on_gpu()
    topk[0, 0] = FEW_EXPERTS  # out of range: treated as -1 by the kernel, reported afterwards
    buffer.low_latency_dispatch(x, topk, MAX_TOKENS, FEW_EXPERTS, use_fp8=False)
    cupy.cuda.Device().synchronize()
    expect_error(ValueError, lambda: buffer.low_latency_dispatch(x, topk, MAX_TOKENS, FEW_EXPERTS, use_fp8=False),
                 "an out-of-range expert id was not reported",
                 match=f"low_latency_dispatch()/low_latency_combine() on rank {rank}: topk_idx held expert id "
                       f"{FEW_EXPERTS}, but num_experts={FEW_EXPERTS}")
    cupy.cuda.Device().synchronize()
    comm.Barrier()
    buffer.clean_low_latency_buffer(MAX_TOKENS, 1024, FEW_EXPERTS)


def argument_errors_name_the_argument(buffer):
    x = cupy.zeros((MAX_TOKENS + 1, 1024), dtype=BF16)
    topk = cupy.zeros((MAX_TOKENS + 1, 4), dtype=cupy.int64)
    for call, match in [
        (lambda: buffer.low_latency_dispatch(x, topk, MAX_TOKENS, FEW_EXPERTS), "num_max_dispatch_tokens_per_rank"),
        (lambda: buffer.low_latency_dispatch(cupy.zeros((4, 100), dtype=BF16), topk[:4], MAX_TOKENS, FEW_EXPERTS),
         "hidden"),
        (lambda: buffer.low_latency_dispatch(x[:4], topk[:4], MAX_TOKENS, FEW_EXPERTS, use_ue8m0=True), "use_ue8m0"),
        (lambda: buffer.low_latency_dispatch(x[:4], topk[:4], MAX_TOKENS, FEW_EXPERTS + 1), "num_experts"),
        (lambda: buffer.low_latency_dispatch(x[:4], topk[:4], MAX_TOKENS, FEW_EXPERTS, async_finish=True,
                                             return_recv_hook=True), "return_recv_hook"),
        (lambda: buffer.low_latency_dispatch(x[:4], topk[:4], 1 << 20, FEW_EXPERTS),
         "num_max_dispatch_tokens_per_rank"),
    ]:
        expect_error((ValueError, TypeError), call, f"no error for {match}", match=match)


def peer_that_skips_a_call_times_out():
    with environment(CUEP_TIMEOUT_S="3"):
        short = cuep.Buffer(comm, 0, RDMA_BYTES, low_latency_mode=True)
    x, _, topk, _ = all_inputs(32, 1024, FEW_EXPERTS, 4)[rank].on_gpu()
    comm.Barrier()
    if rank != 0:
        short.low_latency_dispatch(x, topk, MAX_TOKENS, FEW_EXPERTS)
        cupy.cuda.Device().synchronize()  # the kernel gave up after 3 s instead of hanging
        expect_peer_timeout(rank, short.barrier, "a dispatch")
    comm.Barrier()
    short.destroy()


# ------------------------------------------------------------------------------------------------------
# LogFMT combine and wait statistics


def partials_coded(expected, outputs, inputs: AllInputs, num_experts):
    """The FP32 partials this rank's LogFMT combine codes, one row per (source rank, token) it received from
    another rank (its own tokens' partials go as BF16): the weighted sum of its rows for that token, or the row
    itself where it holds just one of the token's experts (the source applies that weight)."""
    per_rank = num_experts // num_ranks
    terms = {}
    for e, pairs in enumerate(expected[rank].recv_src):
        for row, (s, t) in enumerate(pairs):
            if s == rank:
                continue
            k = np.flatnonzero(inputs[s].topk_idx[t] == rank * per_rank + e)[0]
            terms.setdefault((int(s), int(t)), []).append((np.float32(inputs[s].topk_weights[t, k]),
                                                           outputs[rank][e, row].astype(np.float32)))
    rows = [held[0][1] if len(held) == 1 else np.sum([w * v for w, v in held], axis=0, dtype=np.float32)
            for held in terms.values()]
    return np.stack(rows) if rows else np.zeros((0, outputs[rank].shape[-1]), dtype=np.float32)


def combined_error(combined, want, scale, use_logfmt: bool, what: str) -> np.ndarray:
    """|combined - want|, asserted within the combine's rounding: with LogFMT each partial element within
    ``logfmt.MAX_RELATIVE_ERROR`` (BF16 blocks: 2^-8), then the BF16 rounding of the result, so (MAX_RELATIVE_ERROR +
    2^-8 (1 + MAX_RELATIVE_ERROR)) sum_k |w_k x_k| (+ float32 summation slack); BF16, 2^-7 of it. ``scale``: that
    sum (the reference's combine of the absolute values)."""
    from cuep import logfmt
    error = np.abs(combined.get().astype(np.float32) - want)
    relative = (logfmt.MAX_RELATIVE_ERROR + 2.0 ** -8 * (1 + logfmt.MAX_RELATIVE_ERROR) + 2.0 ** -16
                if use_logfmt else 2.0 ** -7)
    excess = error - (scale * relative + 1e-6)
    assert (excess <= 0).all(), (what, float(error.max()), float(excess.max()), np.argwhere(excess > 0)[:4].tolist())
    return error


def combine_with_a_late_rank(buffer, late_source, what: str, *args, **kwargs):
    """``buffer.low_latency_combine(*args, **kwargs)``'s output; with a ``late_source`` rank, through a hook, that rank
    starting its combine LATE_S after the others, whose sends must finish meanwhile (a hook's send waits for no
    peer: its pairs for the late rank go as their rows, one by one), then the receive."""
    if late_source is None:
        return buffer.low_latency_combine(*args, **kwargs)[0]
    cupy.cuda.get_current_stream().synchronize()
    comm.Barrier()
    if rank == late_source:
        time.sleep(LATE_S)
    started = time.perf_counter()
    combined, _, hook = buffer.low_latency_combine(*args, return_recv_hook=True, **kwargs)
    cupy.cuda.get_current_stream().synchronize()
    sent_in = time.perf_counter() - started
    assert rank == late_source or sent_in < LATE_S / 2, (
        f"{what}: rank {rank}'s hook send took {sent_in:.3f} s while rank {late_source} was {LATE_S} s late: it "
        f"waited for that rank (CUEP_COMBINE_HOOK_SPLIT_US set?), so no pair split")
    hook()
    return combined


def logfmt_against_bf16(buffer, hidden, use_fp8, huge_channel=None, late_source=None):
    """The same dispatch combined with BF16 partials, then with LogFMT ones: each within its bound of
    the exact result. LogFMT: each partial element within ``logfmt.MAX_RELATIVE_ERROR`` (BF16 blocks:
    2^-8), then the BF16 rounding of the result, so |error| <= (MAX_RELATIVE_ERROR + 2^-8 (1 +
    MAX_RELATIVE_ERROR)) sum_k |w_k x_k| (+ float32 summation slack). With ``huge_channel``, that channel
    of every expert output row is about 1e6, so the block holding it spans more than 16 octaves in
    every partial and must travel as BF16 while the other blocks stay LogFMT. With ``late_source``, the
    combines go through hooks and that rank starts its combine LATE_S after the others, whose sends must
    finish meanwhile (a hook's send waits for no peer): their pairs of several rows for the late rank go
    as those rows one by one, BF16 with either format, for it to weigh beside the LogFMT partials of the
    others. The first OWN_ONLY_TOKENS tokens of each rank name its own experts alone: their one partial is the
    rank's own, which goes as BF16 with either format, so both combines give them the same bits. Prints both
    worst errors relative to sum |w x| on rank 0."""
    from cuep import logfmt
    inputs = all_inputs(MAX_TOKENS, hidden, EXPERTS, 8)
    per_rank = EXPERTS // num_ranks
    for s, source in enumerate(inputs):
        source.topk_idx[:OWN_ONLY_TOKENS] = s * per_rank + np.arange(8)
    expected = reference.low_latency_dispatch(inputs.xs, inputs.topk_idxs, EXPERTS, MAX_TOKENS, use_fp8)
    outputs = expert_outputs(expected, EXPERTS)
    if huge_channel is not None:
        for r, (out, result) in enumerate(zip(outputs, expected)):
            for e, n in enumerate(result.recv_count):
                out[e, :n, huge_channel] = np.float32(1e6 * (1 + e / 8 + r))
    topks, weights = inputs.topk_idxs, inputs.topk_weights
    want = reference.low_latency_combine(outputs, topks, weights, EXPERTS)[rank]
    scale = reference.low_latency_combine([AbsoluteRows(o) for o in outputs], topks, [np.abs(w) for w in weights],
                                          EXPERTS)[rank]
    fallback = logfmt.fallback_blocks(partials_coded(expected, outputs, inputs, EXPERTS))
    if huge_channel is not None:
        block = huge_channel // logfmt.BLOCK
        assert fallback[:, block].all(), f"a partial's block {block} does not fall back: the case tests nothing"
        fallback = np.delete(fallback, block, axis=1)
    encoded, blocks = comm.allreduce(int((~fallback).sum())), comm.allreduce(int(fallback.size))
    assert encoded > blocks // 2, f"only {encoded} of {blocks} blocks are encoded: the case would test BF16 only"

    mine = inputs[rank]
    x, topk, topk_weights, expert_x = (cupy.asarray(a) for a in (mine.x, mine.topk_idx, mine.topk_weights,
                                                                  outputs[rank]))
    worst, results = {}, {}
    for use_logfmt in (False, True):
        received, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, topk, MAX_TOKENS, EXPERTS,
                                                                         use_fp8=use_fp8)
        check_received(received, recv_count, expected[rank], use_fp8)
        combined = combine_with_a_late_rank(buffer, late_source, f"use_logfmt={use_logfmt}", expert_x, topk,
                                            topk_weights, handle, use_logfmt=use_logfmt)
        results[use_logfmt] = combined.get().view(np.uint16)
        error = combined_error(combined, want, scale, use_logfmt, f"use_logfmt={use_logfmt}")
        counted = scale > 0
        ratio = float((error[counted] / scale[counted]).max()) if counted.any() else 0.0
        worst[use_logfmt] = comm.allreduce(ratio, op=MPI.MAX)
    # The coding shows in the error (1.6-1.9x BF16's in every case so far): a LogFMT combine as exact as a BF16
    # one coded nothing.
    assert worst[True] > 1.2 * worst[False], (
        f"the LogFMT combine's worst error {worst[True]:.3e} is BF16's ({worst[False]:.3e}): nothing was coded")
    ids = mine.topk_idx
    own_only = ((ids < 0) | (ids // per_rank == rank)).all(axis=1)
    assert own_only[:OWN_ONLY_TOKENS].all() and not own_only.all(), "no token of both kinds: the checks test nothing"
    differ = (results[True] != results[False]).any(axis=1)
    assert not differ[own_only].any(), (
        f"tokens {np.flatnonzero(differ & own_only)[:8].tolist()}, whose one partial is this rank's own, differ "
        f"between the LogFMT and BF16 combines: the own partial was coded")
    assert differ[~own_only].any(), "no token with another rank's partial differs: nothing was coded"
    if rank == 0:
        what = f"hidden {hidden}, {'FP8' if use_fp8 else 'BF16'} dispatch" + (
            f", channel {huge_channel} ~1e6" if huge_channel is not None else "")
        print(f"[rank 0]   {what}: max |error| / sum|w x|: BF16 combine {worst[False]:.3e}, "
              f"LogFMT combine {worst[True]:.3e}; {encoded / blocks:.2%} of "
              f"{'the other ' if huge_channel is not None else ''}blocks encoded", flush=True)


def rows_one_by_one_to_a_late_source_hidden_8192():
    """Rank 0 late to its combine by LATE_S: the others' hook sends go without its weights, as BF16 rows one
    by one, which rank 0 sums beside LogFMT partials in the LogFMT combine (logfmt_against_bf16). Hidden
    8192: a LogFMT message in two strides of a warp group's stage, the second of 8 blocks; channel 3 about
    1e6, so block 0 travels as BF16."""
    big = cuep.Buffer(comm, 0, cuep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, 8192, num_ranks, EXPERTS),
                      low_latency_mode=True)
    logfmt_against_bf16(big, 8192, use_fp8=True, huge_channel=3, late_source=0)
    big.destroy()


def logfmt_hidden_2176_half_a_warp_past_the_end(buffer):
    """17 blocks of 128: the last warp of a row codes one block while its other half-warp idles."""
    logfmt_against_bf16(buffer, 2176, use_fp8=False)


def logfmt_on_the_put_path():
    """Partials put by NVSHMEM: only the coded bytes travel, or the whole message when a block fell back."""
    put_buffer = cuep.Buffer(comm, 0, RDMA_BYTES, low_latency_mode=True, allow_nvlink_for_low_latency_mode=False)
    logfmt_against_bf16(put_buffer, 2048, use_fp8=False)
    logfmt_against_bf16(put_buffer, 2048, use_fp8=False, huge_channel=3)
    put_buffer.destroy()


def logfmt_combine_hidden_2048(buffer):
    logfmt_against_bf16(buffer, 2048, use_fp8=False)


def logfmt_combine_hidden_7168_fp8(buffer):
    logfmt_against_bf16(buffer, 7168, use_fp8=True)


def logfmt_block_with_a_huge_channel_falls_back(buffer):
    logfmt_against_bf16(buffer, 2048, use_fp8=False, huge_channel=3)


def wait_stats_point_at_a_late_rank(buffer):
    """The last rank starts its dispatch 1 s after the others, then its combine 1 s after them, twice:
    on every other rank that hears from it, its entry is the largest and grew by >= 0.5 s each call;
    the stats only grow, the dispatch's and the combine's apart; wrongly sized stats are refused."""
    late, per_rank = num_ranks - 1, EXPERTS // num_ranks
    dispatch_waits = cupy.zeros(num_ranks, dtype=cupy.int64)
    combine_waits = cupy.zeros(num_ranks, dtype=cupy.int64)
    before = (np.zeros(num_ranks, dtype=np.int64), np.zeros(num_ranks, dtype=np.int64))
    for _ in range(2):
        inputs = all_inputs(90, 2048, EXPERTS, 8)
        # The late rank's tokens reach at most one expert per rank: the others send their partials for them
        # unweighted, without waiting for its weights in their combine's send, so they wait for it in the
        # receive, where it is counted.
        routed = inputs[late].topk_idx.copy()
        owner = np.where(routed >= 0, routed // per_rank, -1)
        for k in range(1, routed.shape[1]):
            routed[:, k][(owner[:, k] >= 0) & (owner[:, :k] == owner[:, k:k + 1]).any(axis=1)] = -1
        inputs[late] = inputs[late]._replace(topk_idx=routed)
        expected = reference.low_latency_dispatch(inputs.xs, inputs.topk_idxs, EXPERTS, MAX_TOKENS)
        outputs = expert_outputs(expected, EXPERTS)
        mine = inputs[rank]
        x, topk, weights, expert_x = (cupy.asarray(a) for a in (mine.x, mine.topk_idx, mine.topk_weights,
                                                                 outputs[rank]))
        cupy.cuda.Device().synchronize()
        comm.Barrier()
        if rank == late:
            time.sleep(1.0)
        received, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, topk, MAX_TOKENS, EXPERTS,
                                                                         dispatch_wait_recv_cost_stats=dispatch_waits)
        after_dispatch = dispatch_waits.get(), combine_waits.get()
        comm.Barrier()
        if rank == late:
            time.sleep(1.0)
        combined, _, _ = buffer.low_latency_combine(expert_x, topk, weights, handle,
                                                    combine_wait_recv_cost_stats=combine_waits)
        after_combine = dispatch_waits.get(), combine_waits.get()
        check_received(received, recv_count, expected[rank], True)
        check_combined(combined, inputs, outputs, EXPERTS)

        np.testing.assert_array_equal(after_dispatch[1], before[1], err_msg="the dispatch added to combine stats")
        np.testing.assert_array_equal(after_combine[0], after_dispatch[0], err_msg="a combine added to dispatch stats")
        dispatch_added, combine_added = after_dispatch[0] - before[0], after_combine[1] - after_dispatch[1]
        assert (dispatch_added >= 0).all() and (combine_added >= 0).all(), (dispatch_added, combine_added)
        hears_from_late = ((routed >= 0) & (routed // per_rank == rank)).any()
        routes_to_late = ((mine.topk_idx >= 0) & (mine.topk_idx // per_rank == late)).any()
        if rank != late and hears_from_late:
            assert int(np.argmax(dispatch_added)) == late and dispatch_added[late] >= 0.5e9, dispatch_added
        if rank != late and routes_to_late:
            assert int(np.argmax(combine_added)) == late and combine_added[late] >= 0.5e9, combine_added
        before = after_combine
    for name, call in [
        ("dispatch_wait_recv_cost_stats", lambda: buffer.low_latency_dispatch(
            x, topk, MAX_TOKENS, EXPERTS, dispatch_wait_recv_cost_stats=cupy.zeros(num_ranks + 1, cupy.int64))),
        ("dispatch_wait_recv_cost_stats", lambda: buffer.low_latency_dispatch(
            x, topk, MAX_TOKENS, EXPERTS, dispatch_wait_recv_cost_stats=cupy.zeros(num_ranks, cupy.int32))),
        ("combine_wait_recv_cost_stats", lambda: buffer.low_latency_combine(
            expert_x, topk, weights, handle, combine_wait_recv_cost_stats=cupy.zeros(num_ranks + 1, cupy.int64))),
    ]:
        expect_error((ValueError, TypeError), call, f"no error for a bad {name}", match=name)
    np.testing.assert_array_equal(dispatch_waits.get(), before[0])
    np.testing.assert_array_equal(combine_waits.get(), before[1])


def ids_set_to_minus_one_after_the_dispatch(buffer, late_rank: bool = True):
    """The combine's topk_idx sets some of the dispatch's choices to -1 (about a third, the same on every rank):
    a rank's second choice of a token, leaving it one, a rank's only choice, all of a rank's choices, a rank's
    first choice while it keeps another. Each token gets exactly its choices still routed: whole, BF16 and
    LogFMT, and with ``late_rank`` the same through hooks with rank 0 late to its combine, whose pairs the others'
    sends split into rows (a rank left with one choice sends that row)."""
    hidden, per_rank = 2048, FEW_EXPERTS // num_ranks
    inputs = all_inputs(MAX_TOKENS, hidden, FEW_EXPERTS, 4, masked=0.0)
    dispatched = inputs.topk_idxs
    combined_ids = []
    for s, ids in enumerate(dispatched):
        drop = np.random.default_rng([SEED, 4646, s]).random(ids.shape) < 0.35
        combined_ids.append(np.where(drop, -1, ids))

    def held(ids):  # [num_ranks, tokens]: how many of each token's routed choices each rank holds
        return np.stack([((ids >= 0) & (ids // per_rank == r)).sum(axis=1) for r in range(num_ranks)])

    def first_dropped(ids, now):  # [num_ranks, tokens]: the rank's first choice of the token dropped, another kept
        tokens, dropped = np.arange(len(ids)), []
        for r in range(num_ranks):
            on_r = (ids >= 0) & (ids // per_rank == r)
            first = on_r.argmax(axis=1)  # the first choice on r (0 where none)
            dropped.append(on_r.any(axis=1) & (now[tokens, first] < 0) & (held(now)[r] > 0))
        return np.stack(dropped)

    # What the case is for: a rank that held several of a token's choices at the dispatch and holds one now, among
    # them a rank other than 0 for rank 0's tokens (whose rows the late combine splits); and the others above.
    left_one = [((held(ids) > 1) & (held(now) == 1)).sum(axis=1) for ids, now in zip(dispatched, combined_ids)]
    assert sum(int(n.sum()) for n in left_one) > 0 and (num_ranks == 1 or left_one[0][1:].sum() > 0), \
        "no rank keeps one of several choices: the case tests nothing"
    for what, count in (("its only choice", lambda ids, now: (held(ids) == 1) & (held(now) == 0)),
                        ("all of several choices", lambda ids, now: (held(ids) > 1) & (held(now) == 0)),
                        ("its first choice, keeping another", first_dropped)):
        assert sum(int(count(ids, now).sum()) for ids, now in zip(dispatched, combined_ids)) > 0, \
            f"no rank loses {what}: the case tests less than it says"
    expected = reference.low_latency_dispatch(inputs.xs, dispatched, FEW_EXPERTS, MAX_TOKENS, use_fp8=False)
    outputs = expert_outputs(expected, FEW_EXPERTS)
    weights = inputs.topk_weights
    want = reference.low_latency_combine(outputs, combined_ids, weights, FEW_EXPERTS, dispatched)[rank]
    scale = reference.low_latency_combine([AbsoluteRows(o) for o in outputs], combined_ids,
                                          [np.abs(w) for w in weights], FEW_EXPERTS, dispatched)[rank]
    mine = inputs[rank]
    x, topk, now, topk_weights, expert_x = (cupy.asarray(a) for a in (mine.x, mine.topk_idx, combined_ids[rank],
                                                                       mine.topk_weights, outputs[rank]))
    for use_logfmt, late in ((False, False), (True, False)) + (((False, True), (True, True)) if late_rank else ()):
        received, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, topk, MAX_TOKENS, FEW_EXPERTS,
                                                                         use_fp8=False)
        check_received(received, recv_count, expected[rank], use_fp8=False)
        combined = combine_with_a_late_rank(buffer, 0 if late else None, f"use_logfmt={use_logfmt}", expert_x, now,
                                            topk_weights, handle, use_logfmt=use_logfmt)
        combined_error(combined, want, scale, use_logfmt, f"use_logfmt={use_logfmt}, late={late}")


def ids_set_to_minus_one_on_the_put_path():
    """The same on the NVSHMEM put path, whose pairs of several rows wait for their source's weights (so no rank
    is late: a put peer's pairs would wait for it)."""
    put_buffer = cuep.Buffer(comm, 0, RDMA_BYTES, low_latency_mode=True, allow_nvlink_for_low_latency_mode=False)
    ids_set_to_minus_one_after_the_dispatch(put_buffer, late_rank=False)
    put_buffer.destroy()


def main() -> None:
    buffer = cuep.Buffer(comm, 0, RDMA_BYTES, low_latency_mode=True)

    def on_buffer(case):
        return functools.partial(case, buffer)

    run_cases(comm, selected_cases([
        ("fp8, top-8, hidden 7168, uneven token counts, -1 entries", on_buffer(fp8_topk8_hidden_7168_uneven_tokens)),
        ("fp8 round_scale, top-1, hidden 2048", on_buffer(fp8_round_scale_topk1_hidden_2048)),
        ("fp8 UE8M0, top-16", on_buffer(fp8_ue8m0_topk16)),
        ("more local experts than SMs, a layout past 48 KiB, tokens naming one expert twice",
         on_buffer(many_local_experts_and_repeated_choices)),
        ("bf16, 0 tokens on rank 1, combine into out= from the zero-copy buffer",
         on_buffer(bf16_zero_tokens_on_rank_1_out_and_zero_copy)),
        ("hooks: two micro-batches in flight", on_buffer(hooks_two_micro_batches)),
        ("async_finish and cumulative stats", on_buffer(async_finish_and_cumulative_stats)),
        ("forced NVSHMEM put path", forced_put_path),
        ("fp8 with more pairs than pairs of receiving warps, whole and hook", fp8_more_pairs_than_warp_pairs),
        ("CUDA graph: capture once, 1000 replays with fresh inputs", on_buffer(cuda_graph_capture_then_1000_replays)),
        ("1000 eager steps without a host sync, half through hooks", on_buffer(thousand_eager_steps_without_a_sync)),
        ("outputs let go of come back to the next step; held ones keep their rows",
         on_buffer(outputs_let_go_of_come_back_and_held_ones_keep_their_rows)),
        ("a hook's send and receive replayed from separate CUDA graphs, 1000 times",
         on_buffer(hook_send_and_receive_replayed_from_separate_graphs)),
        ("a graph of three calls, eager calls between its replays",
         on_buffer(graph_of_three_calls_with_eager_calls_between_replays)),
        ("one rank 1-5 ms late before each call", on_buffer(one_rank_late_before_each_call)),
        ("calls outside the order are refused within a second", on_buffer(calls_outside_the_order_are_refused_within_a_second)),
        ("vLLM's reset: the whole buffer zeroed, masks cleaned", zeroed_buffer_and_cleaned_masks_serve_again),
        ("normal and low-latency calls share one low_latency_mode Buffer", normal_and_low_latency_calls_share_one_buffer),
        ("1000 calls without memory growth", on_buffer(thousand_calls_hold_no_memory)),
        ("an out-of-range expert id is reported", on_buffer(bad_expert_id_is_reported_by_the_next_call)),
        ("argument errors name the argument", on_buffer(argument_errors_name_the_argument)),
        ("LogFMT combine, hidden 2048", on_buffer(logfmt_combine_hidden_2048)),
        ("LogFMT combine, hidden 7168, fp8 dispatch", on_buffer(logfmt_combine_hidden_7168_fp8)),
        ("LogFMT, hidden 2176: half a warp past the end", on_buffer(logfmt_hidden_2176_half_a_warp_past_the_end)),
        ("LogFMT on the NVSHMEM put path, with and without a fallen-back block", logfmt_on_the_put_path),
        ("LogFMT: a block with a huge channel falls back to BF16",
         on_buffer(logfmt_block_with_a_huge_channel_falls_back)),
        ("rows sent one by one to a late source, BF16 and LogFMT combines, hidden 8192",
         rows_one_by_one_to_a_late_source_hidden_8192),
        ("wait statistics point at a late rank", on_buffer(wait_stats_point_at_a_late_rank)),
        ("choices set to -1 between a dispatch and its combine, whole, LogFMT and split by a late rank",
         on_buffer(ids_set_to_minus_one_after_the_dispatch)),
        ("choices set to -1 between a dispatch and its combine, on the NVSHMEM put path",
         ids_set_to_minus_one_on_the_put_path),
        ("a peer that skips a call makes the others time out", peer_that_skips_a_call_times_out),
    ], lambda named: getattr(named[1], "func", named[1]).__name__))
    buffer.destroy()
    if rank == 0:
        print(f"[rank 0] low-latency worker passed on {num_ranks} ranks", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--pressure":
        run_cases(comm, [("pressure", lambda: pressure(int(sys.argv[2])))])  # a failure aborts every rank
    else:
        main()
