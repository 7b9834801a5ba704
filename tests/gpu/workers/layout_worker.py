"""GPU worker for get_dispatch_layout, the Buffer bootstrap and the device barrier (run under mpirun).

Each rank checks its own layout against ``cuep.reference.get_dispatch_layout``, exactly. Each case
below checks one behaviour; ``main`` runs them in order.
"""

from __future__ import annotations

import functools

import cupy
import numpy as np
from common import (
    assert_no_memory_growth,
    environment,
    expect_error,
    random_topk,
    rejoin,
    run_cases,
    times_out_without_rank_0,
)
from mpi4py import MPI

import cuep
from cuep import reference

comm = MPI.COMM_WORLD
rank, num_ranks = comm.Get_rank(), comm.Get_size()
SEED = 20261121


def check_layout(buffer: cuep.Buffer, topk: np.ndarray, num_experts: int, ranks_per_node: int | None = None,
                 **options) -> None:
    per_rank, per_node, per_expert, in_rank, event = buffer.get_dispatch_layout(
        cupy.asarray(topk), num_experts, **options)
    if options.get("async_finish"):
        event.current_stream_wait()
    expected = reference.get_dispatch_layout(topk, num_experts, num_ranks, ranks_per_node)
    np.testing.assert_array_equal(per_rank.get(), expected.num_tokens_per_rank)
    np.testing.assert_array_equal(per_expert.get(), expected.num_tokens_per_expert)
    np.testing.assert_array_equal(in_rank.get(), expected.is_token_in_rank)
    assert per_rank.dtype == per_expert.dtype == np.int32 and in_rank.dtype == np.bool_
    if expected.num_tokens_per_rdma_rank is None:
        assert per_node is None, "one node: num_tokens_per_rdma_rank must be None"
    else:
        np.testing.assert_array_equal(per_node.get(), expected.num_tokens_per_rdma_rank)


# ------------------------------------------------------------------------------------------------------
# Cases; ``rng`` is this rank's generator, drawn from by one case after another


def random_with_masked(buffer, rng):
    for num_tokens, num_experts, num_topk in ((1, 8 * num_ranks, 1), (1001, 16 * num_ranks, 6),
                                              (333, 3 * num_ranks, 3)):
        check_layout(buffer, random_topk(rng, num_tokens, num_experts, num_topk, 0.2), num_experts)


def int32_ids(buffer, rng):
    check_layout(buffer, random_topk(rng, 777, 64, 8, 0.1, dtype=np.int32), 64)


def zero_tokens_on_one_rank(buffer, rng):
    num_tokens = 0 if rank == 1 else 513
    check_layout(buffer, random_topk(rng, num_tokens, 64, 8, 0.1), 64)


def all_tokens_to_one_rank(buffer, rng):
    topk = random_topk(rng, 300, 8, 4) % 2  # experts 0 and 1 only: rank 0 of 32 experts' split
    check_layout(buffer, topk, 32 * num_ranks)


def all_masked(buffer, rng):
    check_layout(buffer, np.full((64, 8), -1, dtype=np.int64), 256)


def deepseek_shape(buffer, rng):
    check_layout(buffer, random_topk(rng, 4096, 256, 8, 0.05), 256)


def async_and_previous_event(buffer, rng):
    topk = random_topk(rng, 2048, 256, 8, 0.1)
    check_layout(buffer, topk, 256, previous_event=buffer.capture(), async_finish=True)
    check_layout(buffer, topk, 256, previous_event=buffer.capture(), async_finish=True,
                 allocate_on_comm_stream=True)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        check_layout(buffer, topk, 256)


def bad_expert_id_is_reported_by_the_next_call(buffer, rng):
    """No host sync: an id outside [-1, num_experts) counts nowhere (the outputs are the reference's with it
    as -1), and the Buffer's next call raises, naming the call and the id; the call after that works."""
    for bad_id, dtype in ((64, np.int64), (-5, np.int32), ((1 << 40) + 3, np.int64)):
        topk = random_topk(rng, 16, 64, 4)
        topk[3, 1] = bad_id
        as_minus_one = np.where((topk < -1) | (topk >= 64), -1, topk)
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(cupy.asarray(topk.astype(dtype)), 64)
        expected = reference.get_dispatch_layout(as_minus_one, 64, num_ranks)
        np.testing.assert_array_equal(per_rank.get(), expected.num_tokens_per_rank)
        np.testing.assert_array_equal(per_expert.get(), expected.num_tokens_per_expert)
        np.testing.assert_array_equal(in_rank.get(), expected.is_token_in_rank)
        cupy.cuda.Device().synchronize()
        expect_error(ValueError, lambda: buffer.get_dispatch_layout(cupy.asarray(as_minus_one), 64),
                     f"expert id {bad_id} was not reported",
                     match=f"get_dispatch_layout() on rank {rank}: topk_idx held expert id {bad_id}, "
                           f"but num_experts=64")
        check_layout(buffer, as_minus_one, 64)  # raised once, then forgotten


def repeated_calls_hold_no_memory(buffer, rng):
    topk = cupy.asarray(random_topk(rng, 1024, 256, 8, 0.1))
    assert_no_memory_growth(
        lambda: buffer.get_dispatch_layout(topk, 256, previous_event=buffer.capture(), async_finish=True),
        warmup_step=lambda: buffer.get_dispatch_layout(topk, 256),
        settle=lambda: buffer.get_dispatch_layout(topk, 256))  # prunes arrays kept for finished async calls


def two_nodes_override(buffer, rng):
    ranks_per_node = num_ranks // 2
    with environment(CUEP_RANKS_PER_NODE=str(ranks_per_node)):
        hierarchical = cuep.Buffer(comm)
    assert hierarchical.topology.num_nodes == 2
    check_layout(hierarchical, random_topk(rng, 4096, 256, 8, 0.05), 256, ranks_per_node)
    check_layout(hierarchical, random_topk(rng, 0 if rank == 0 else 99, 256, 8, 0.3), 256, ranks_per_node)
    hierarchical.destroy()
    hierarchical.destroy()  # idempotent


def barrier_timeout_names_missing_peer(buffer, rng):
    exc = times_out_without_rank_0(comm, "barrier", lambda: buffer.barrier(timeout_s=2.0))
    if exc is not None:
        assert "rank 0" in str(exc) and "waited 2 s" in str(exc), exc
    rejoin(comm, buffer)  # every rank at the same epoch again


def main() -> None:
    rng = np.random.default_rng([SEED, rank])
    buffer = cuep.Buffer(comm, num_nvl_bytes=64 << 20)
    cases = [
        ("random routing with -1 entries", random_with_masked),
        ("int32 topk_idx", int32_ids),
        ("0 tokens on rank 1", zero_tokens_on_one_rank),
        ("every token to rank 0", all_tokens_to_one_rank),
        ("every entry -1", all_masked),
        ("T=4096 E=256 K=8", deepseek_shape),
        ("async_finish, previous_event, allocate_on_comm_stream, side stream", async_and_previous_event),
        ("expert id out of range is reported by the next call", bad_expert_id_is_reported_by_the_next_call),
        ("1000 async calls hold no memory", repeated_calls_hold_no_memory),
        ("2 nodes by CUEP_RANKS_PER_NODE", two_nodes_override),
        ("barrier timeout names the missing peer", barrier_timeout_names_missing_peer),
    ]
    run_cases(comm, [(name, functools.partial(case, buffer, rng)) for name, case in cases])
    buffer.destroy()
    if rank == 0:
        print(f"[rank 0] layout worker passed on {num_ranks} ranks, device barrier epochs ok", flush=True)


if __name__ == "__main__":
    main()
