"""GPU worker for the low-latency shrink mode (``Buffer(..., enable_shrink=True)``), run under mpirun.

One rank, the victim (the last one), stops making cuep calls for a while: at a dispatch, at a combine,
between two calls, between the replays of a CUDA graph, or after rank 0 masked it by hand. Its process
stays alive: it waits at an MPI barrier that the others reach after their calls. The live ranks' calls
must end within ``CUEP_TIMEOUT_S`` (2 s here) plus slack, mask the victim on every live rank, and
return what the reference gives without it: its tokens are not received (as if it sent none) and the
top-k entries naming its experts add nothing to the combine (as if they were -1). Their later calls must
not wait for it. Then every rank, the victim too, calls ``low_latency_clean_mask_buffer()``, and a call
on every rank must match the full reference again with nobody masked.

Every rank rebuilds every rank's inputs from one seed (``common.SeededInputs``) and works out each
call's reference before any rank makes the call: with a 2 s timeout, host work that takes the ranks
different times between two calls would get a live peer masked. For the same reason every call starts
right after a barrier of the ranks making it. Moved data is compared bit for bit and combined sums
within the BF16 combine's rounding (``low_latency_worker``'s checks).
"""

from __future__ import annotations

import functools
import time
from typing import Any, NamedTuple

import cupy
import numpy as np
from common import AllInputs, RankInputs, SeededInputs, environment, expect_error, run_cases
from low_latency_worker import check_combined, check_received, expert_outputs
from mpi4py import MPI

import cuep
from cuep import reference

comm = MPI.COMM_WORLD
rank, num_ranks = comm.Get_rank(), comm.Get_size()
VICTIM = num_ranks - 1          # at 2 ranks, rank 0 goes on alone
SEED = 29
MAX_TOKENS = 128                # at 8 ranks more (source, token) pairs than a combine has warp groups
HIDDEN = 2048
EXPERTS = 8 * num_ranks
PER_RANK = EXPERTS // num_ranks
NUM_TOPK = 8
TIMEOUT_S = 2.0
SLOW_S = TIMEOUT_S + 3.0        # a call that finds the victim missing: the timeout, then the rest of the call
FAST_S = 1.0                    # a call once the victim is masked: nothing to wait for
RDMA_BYTES = cuep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, HIDDEN, num_ranks, EXPERTS)
all_inputs = SeededInputs(SEED, num_ranks)


# ------------------------------------------------------------------------------------------------------
# What the live ranks must see without the victim


def without_victim_experts(inputs: AllInputs) -> AllInputs:
    """The same inputs with each live rank's top-k entries naming one of the victim's experts set to -1,
    which is what the kernels make of them once the victim is masked (the victim's own routing is kept:
    its tokens still number the rows of the experts they reached)."""
    out = AllInputs()
    for s, i in enumerate(inputs):
        topk = i.topk_idx
        if s != VICTIM:
            topk = np.where((topk >= 0) & (topk // PER_RANK == VICTIM), -1, topk)
        out.append(i._replace(topk_idx=topk))
    return out


def victim_sends_nothing(inputs: AllInputs) -> AllInputs:
    """What a call on the live ranks alone must give: the victim sent no tokens and the live ranks'
    entries naming its experts count as -1."""
    out = without_victim_experts(inputs)
    v = out[VICTIM]
    out[VICTIM] = RankInputs(v.x[:0], None if v.scales is None else v.scales[:0], v.topk_idx[:0], v.topk_weights[:0])
    return out


class Planned(NamedTuple):
    """One dispatch + combine, worked out before any rank makes it."""

    use_fp8: bool
    expected: list           # every rank's reference dispatch result: what this call must deliver
    outputs: list            # every rank's expert outputs (the combine's x), from ``expected``
    routing: AllInputs       # the routing the combine's result is checked against
    x: Any                   # this rank's arguments, as CuPy arrays (the real routing, victim's experts included)
    topk: Any
    weights: Any
    combine_x: Any


def plan(inputs: AllInputs, use_fp8: bool = True, victim_dispatches: bool = True,
         victim_combines: bool = True) -> Planned:
    """Reference of a call on ``inputs``: ``victim_dispatches`` / ``victim_combines`` say whether the
    victim takes part in its dispatch / combine (when it does not, the live ranks mask it)."""
    sent = inputs if victim_dispatches else victim_sends_nothing(inputs)
    expected = reference.low_latency_dispatch(sent.xs, sent.topk_idxs, EXPERTS, MAX_TOKENS, use_fp8)
    outputs = expert_outputs(expected, EXPERTS)
    routing = sent if victim_combines else without_victim_experts(sent)
    mine = inputs[rank]
    return Planned(use_fp8, expected, outputs, routing, cupy.asarray(mine.x), cupy.asarray(mine.topk_idx),
                   cupy.asarray(mine.topk_weights), cupy.asarray(outputs[rank]))


def draw(num_tokens=MAX_TOKENS, **kwargs) -> Planned:
    """The next inputs of ``all_inputs`` (every rank draws them, whether it calls or not), planned."""
    return plan(all_inputs(num_tokens, HIDDEN, EXPERTS, NUM_TOPK), **kwargs)


# ------------------------------------------------------------------------------------------------------
# Calls and checks


def dispatch(buffer, p: Planned, hooks: bool = False):
    received, recv_count, handle, _, hook = buffer.low_latency_dispatch(p.x, p.topk, MAX_TOKENS, EXPERTS,
                                                                        use_fp8=p.use_fp8, return_recv_hook=hooks)
    if hooks:
        hook()
    return received, recv_count, handle


def combine(buffer, p: Planned, handle, hooks: bool = False):
    combined, _, hook = buffer.low_latency_combine(p.combine_x, p.topk, p.weights, handle, return_recv_hook=hooks)
    if hooks:
        hook()
    return combined


def whole_call(buffer, p: Planned, hooks: bool = False):
    received, recv_count, handle = dispatch(buffer, p, hooks)
    return received, recv_count, combine(buffer, p, handle, hooks)


def timed(group, work):
    """``work()`` right after a barrier of ``group`` (the ranks making the call); returns the seconds until
    the GPU finished it, and what it returned."""
    cupy.cuda.Device().synchronize()
    group.Barrier()
    start = time.monotonic()
    result = work()
    cupy.cuda.Device().synchronize()
    return time.monotonic() - start, result


def check_call(p: Planned, received, recv_count, combined) -> None:
    check_received(received, recv_count, p.expected[rank], p.use_fp8)
    check_combined(combined, p.routing, p.outputs, EXPERTS)


def check_mask(buffer, masked=()) -> None:
    """``low_latency_query_mask_buffer`` on this rank shows exactly the ranks in ``masked``."""
    status = cupy.full(num_ranks, -1, dtype=cupy.int32)
    buffer.low_latency_query_mask_buffer(status)
    want = np.zeros(num_ranks, dtype=np.int32)
    want[list(masked)] = 1
    np.testing.assert_array_equal(status.get(), want, err_msg=f"the mask rank {rank} sees")


def full_call(buffer, p: Planned, hooks: bool = False) -> None:
    """Every rank makes the call: full results, and nobody got masked. Ranks meet afterwards: a live rank
    that went on could otherwise mask the victim (and write that into its mask) before it checked."""
    _, results = timed(comm, lambda: whole_call(buffer, p, hooks))
    check_call(p, *results)
    check_mask(buffer)
    comm.Barrier()


def live_ranks_go_on(buffer, live, masking: Planned, later: list[Planned], hooks: bool = False) -> None:
    """On the live ranks, the victim away: the call that finds it missing (with receive hooks when
    ``hooks``) ends within the timeout plus slack and masks it on every live rank; the ``later`` calls
    do not wait for it. Every result is checked against the reference without the victim."""
    elapsed, results = timed(live, lambda: whole_call(buffer, masking, hooks))
    assert elapsed < SLOW_S, f"the call that masks rank {VICTIM} took {elapsed:.2f} s (timeout {TIMEOUT_S} s)"
    check_call(masking, *results)
    cupy.cuda.Device().synchronize()
    live.Barrier()
    check_mask(buffer, {VICTIM})
    times = []
    for p in later:
        took, results = timed(live, lambda p=p: whole_call(buffer, p))
        assert took < FAST_S, f"a call after rank {VICTIM} was masked took {took:.2f} s: it waited for it"
        check_call(p, *results)
        times.append(took)
    check_mask(buffer, {VICTIM})
    if rank == 0:
        print(f"[rank 0]   masking call {elapsed:.2f} s, later calls {', '.join(f'{t:.3f}' for t in times)} s",
              flush=True)


def clean_with_every_rank(buffer) -> None:
    """Every rank, the victim back, unmasks everyone; nobody is masked afterwards."""
    cupy.cuda.Device().synchronize()
    comm.Barrier()
    buffer.low_latency_clean_mask_buffer()
    check_mask(buffer)


# ------------------------------------------------------------------------------------------------------
# Cases


def victim_stops_at_a_dispatch(buffer, live):
    """Every rank makes a call; the victim then skips the next dispatch and combine (and three more)."""
    first = draw()
    masking = draw(lambda s: MAX_TOKENS - 5 * s, victim_dispatches=False, victim_combines=False)
    later = [draw(use_fp8=i % 2 == 1, victim_dispatches=False, victim_combines=False) for i in range(3)]
    full_call(buffer, first)
    if rank != VICTIM:
        live_ranks_go_on(buffer, live, masking, later)
    comm.Barrier()  # the victim waits here, away from cuep, through the live ranks' calls
    if rank == VICTIM:
        check_mask(buffer, {VICTIM})  # a rank that masks a peer writes the mask into that peer too
    clean_with_every_rank(buffer)
    full_call(buffer, draw())


def victim_stops_at_a_combine(buffer, live):
    """Every rank dispatches (full results, the victim's tokens included); the victim skips the combine,
    whose results on the live ranks leave its experts out."""
    first = draw()
    dispatched = draw(use_fp8=False, victim_combines=False)
    later = draw(victim_dispatches=False, victim_combines=False)
    full_call(buffer, first)
    cupy.cuda.Device().synchronize()
    comm.Barrier()
    start = time.monotonic()
    received, recv_count, handle = dispatch(buffer, dispatched)
    combined = combine(buffer, dispatched, handle) if rank != VICTIM else None
    cupy.cuda.Device().synchronize()
    elapsed = time.monotonic() - start
    check_received(received, recv_count, dispatched.expected[rank], dispatched.use_fp8)
    if rank != VICTIM:
        assert elapsed < SLOW_S, f"the combine that masks rank {VICTIM} took {elapsed:.2f} s (timeout {TIMEOUT_S} s)"
        check_combined(combined, dispatched.routing, dispatched.outputs, EXPERTS)
        cupy.cuda.Device().synchronize()
        live.Barrier()
        check_mask(buffer, {VICTIM})
        took, results = timed(live, lambda: whole_call(buffer, later))
        assert took < FAST_S, f"a call after rank {VICTIM} was masked took {took:.2f} s: it waited for it"
        check_call(later, *results)
        check_mask(buffer, {VICTIM})
    comm.Barrier()
    # The victim sat out after a dispatch, so its call numbers are one call off the live ranks': clean must
    # line the ranks up again, the call order's state included.
    clean_with_every_rank(buffer)
    full_call(buffer, draw())


def victim_stops_between_calls(buffer, live):
    """The victim completes a call, then makes no more; the live ranks go straight on to the next call
    (no barrier with the victim, no host work in between), through receive hooks."""
    last = draw(use_fp8=False)
    masking = draw(use_fp8=False, victim_dispatches=False, victim_combines=False)
    later = [draw(victim_dispatches=False, victim_combines=False) for _ in range(3)]
    _, last_results = timed(comm, lambda: whole_call(buffer, last))
    if rank != VICTIM:
        live_ranks_go_on(buffer, live, masking, later, hooks=True)
    check_call(last, *last_results)
    comm.Barrier()
    clean_with_every_rank(buffer)
    full_call(buffer, draw(), hooks=True)


def check_identity(combined, mine: RankInputs) -> None:
    """The graph's experts return their input (BF16 dispatch): token t comes back as x_t times the sum of
    its weights whose entries count, within the BF16 combine's rounding (2^-7 of sum |w x|)."""
    x = mine.x.astype(np.float32)
    weight_sum = np.where(mine.topk_idx >= 0, mine.topk_weights, 0).sum(axis=1, keepdims=True)
    got = combined.get().astype(np.float32)
    excess = np.abs(got - x * weight_sum) - (np.abs(x) * weight_sum * 2.0 ** -7 + 1e-5)
    assert (excess <= 0).all(), (float(np.abs(got - x * weight_sum).max()), float(excess.max()))


def cuda_graph_replays_without_the_victim(buffer, live):
    """Every rank captures dispatch + combine in a graph and replays it; the victim stops replaying; the
    live ranks' first replay masks it, their second does not wait; after the clean every rank replays
    the same graph with full results."""
    inputs = all_inputs(MAX_TOKENS, HIDDEN, EXPERTS, NUM_TOPK)
    full = reference.low_latency_dispatch(inputs.xs, inputs.topk_idxs, EXPERTS, MAX_TOKENS, use_fp8=False)
    alone = victim_sends_nothing(inputs)
    partial = reference.low_latency_dispatch(alone.xs, alone.topk_idxs, EXPERTS, MAX_TOKENS, use_fp8=False)
    mine = inputs[rank]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        x, topk, weights = (cupy.asarray(a) for a in (mine.x, mine.topk_idx, mine.topk_weights))

        def step():
            received, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, topk, MAX_TOKENS, EXPERTS,
                                                                             use_fp8=False)
            combined, _, _ = buffer.low_latency_combine(received, topk, weights, handle)
            return received, recv_count, combined

        stream.synchronize()
        comm.Barrier()
        step()
        stream.synchronize()
        stream.begin_capture()
        received, recv_count, combined = step()  # the graph writes into these arrays: they must outlive it
        graph = stream.end_capture()

        def replay(group) -> float:
            stream.synchronize()
            group.Barrier()
            start = time.monotonic()
            graph.launch(stream)
            stream.synchronize()
            return time.monotonic() - start

        def check(expected, routing: AllInputs) -> None:
            check_received(received, recv_count, expected[rank], False)
            check_identity(combined, routing[rank])

        replay(comm)
        check(full, inputs)
        if rank != VICTIM:
            for bound in (SLOW_S, FAST_S):  # the first replay masks the victim, the second must not wait
                took = replay(live)
                assert took < bound, f"a replay without rank {VICTIM} took {took:.2f} s (bound {bound} s)"
                check(partial, alone)
            cupy.cuda.Device().synchronize()
            live.Barrier()
            check_mask(buffer, {VICTIM})
        comm.Barrier()
        clean_with_every_rank(buffer)
        for _ in range(2):
            replay(comm)
            check(full, inputs)
        check_mask(buffer)


def victim_masked_by_hand(buffer, live):
    """Rank 0 masks the victim with ``low_latency_update_mask_buffer``; a call on the live ranks alone
    leaves every live rank seeing it masked, with results that leave it out."""
    first = draw()
    alone = draw(victim_dispatches=False, victim_combines=False)
    full_call(buffer, first)
    if rank == 0:
        buffer.low_latency_update_mask_buffer(VICTIM, True)
        check_mask(buffer, {VICTIM})
        buffer.low_latency_update_mask_buffer(VICTIM, False)
        check_mask(buffer)
        buffer.low_latency_update_mask_buffer(VICTIM, True)
        check_mask(buffer, {VICTIM})
    if rank != VICTIM:
        # Rank 0 does not wait for the victim; the others may, until rank 0's mask reaches them or they time out.
        elapsed, results = timed(live, lambda: whole_call(buffer, alone))
        assert elapsed < SLOW_S, f"the call without rank {VICTIM} took {elapsed:.2f} s (timeout {TIMEOUT_S} s)"
        check_call(alone, *results)
        cupy.cuda.Device().synchronize()
        live.Barrier()
        check_mask(buffer, {VICTIM})
        if rank == 0:
            print(f"[rank 0]   call after masking by hand {elapsed:.2f} s", flush=True)
    comm.Barrier()
    clean_with_every_rank(buffer)
    full_call(buffer, draw())


def put_path_and_a_victim_that_comes_back_without_clean(live):
    """On a Buffer whose peers all take NVSHMEM puts (signals instead of direct flags): the victim stops at
    a dispatch and is masked; it then calls again without a clean, and its calls do nothing and raise
    MaskedRankError; after a clean every rank gets full results."""
    with environment(CUEP_TIMEOUT_S=str(TIMEOUT_S)):
        put = cuep.Buffer(comm, 0, RDMA_BYTES, low_latency_mode=True, enable_shrink=True,
                          allow_nvlink_for_low_latency_mode=False)
    first = draw()
    masking = draw(victim_dispatches=False, victim_combines=False)
    later = [draw(victim_dispatches=False, victim_combines=False)]
    full_call(put, first)
    if rank != VICTIM:
        live_ranks_go_on(put, live, masking, later)
    comm.Barrier()
    if rank == VICTIM:
        ignored = draw()

        def call_twice():
            whole_call(put, ignored)  # sits out: the kernels see the mask the live ranks wrote into it
            cupy.cuda.Device().synchronize()
            whole_call(put, ignored)
        expect_error(cuep.MaskedRankError, call_twice, "a masked rank's calls did not raise MaskedRankError",
                     match="low_latency_clean_mask_buffer")
    else:
        draw()  # every rank draws the same inputs
    clean_with_every_rank(put)
    full_call(put, draw())
    put.destroy()


def main() -> None:
    live = comm.Split(MPI.UNDEFINED if rank == VICTIM else 0, rank)  # MPI.COMM_NULL on the victim
    with environment(CUEP_TIMEOUT_S=str(TIMEOUT_S)):
        buffer = cuep.Buffer(comm, 0, RDMA_BYTES, low_latency_mode=True, enable_shrink=True)

    def on_buffer(case):
        return functools.partial(case, buffer, live)

    run_cases(comm, [
        ("the victim stops at a dispatch", on_buffer(victim_stops_at_a_dispatch)),
        ("the victim stops at a combine", on_buffer(victim_stops_at_a_combine)),
        ("the victim stops between calls (receive hooks)", on_buffer(victim_stops_between_calls)),
        ("CUDA graph replays without the victim", on_buffer(cuda_graph_replays_without_the_victim)),
        ("rank 0 masks the victim by hand", on_buffer(victim_masked_by_hand)),
        ("NVSHMEM put path; a masked rank that calls again raises",
         lambda: put_path_and_a_victim_that_comes_back_without_clean(live)),
    ])
    buffer.destroy()
    if live != MPI.COMM_NULL:
        live.Free()
    if rank == 0:
        print(f"[rank 0] shrink worker passed on {num_ranks} ranks", flush=True)


if __name__ == "__main__":
    main()
