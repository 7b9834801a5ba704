"""The torch.distributed group on the CPU: processes started by torch.multiprocessing over a gloo group,
as torchrun or vLLM start them, with no MPI (needs torch; skipped with the reason without it)."""

from __future__ import annotations

import socket
import time

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch)")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from cuep.errors import CuepError, PeerTimeoutError  # noqa: E402
from cuep.runtime import as_group, discover_topology  # noqa: E402
from cuep.runtime.torch_group import TorchGroup  # noqa: E402

NUM_RANKS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(worker, num_ranks: int, *args) -> None:
    port = _free_port()
    mp.start_processes(_init_then, args=(worker, num_ranks, port, *args), nprocs=num_ranks, start_method="spawn")


def _init_then(rank: int, worker, num_ranks: int, port: int, *args) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_ranks)
    try:
        worker(rank, num_ranks, *args)
        dist.barrier()  # over gloo: every rank is done reading the store before rank 0, its host, takes it down
    finally:
        dist.destroy_process_group()


def _collectives(rank: int, num_ranks: int) -> None:
    group = as_group("test", dist.group.WORLD)
    assert isinstance(group, TorchGroup) and (group.rank, group.num_ranks) == (rank, num_ranks)
    store = dist.distributed_c10d._get_default_store()
    group.wait_for_all("warm up")
    keys_before = store.num_keys()
    for round_ in range(5):  # keys of earlier rounds are deleted as later ones complete
        assert group.allgather((rank, round_, "x" * rank), "allgather") == [(r, round_, "x" * r) for r in range(num_ranks)]
    assert store.num_keys() <= keys_before + num_ranks, (keys_before, store.num_keys())  # one pending key per rank
    assert group.broadcast(b"uid" if rank == 1 else None, "broadcast", root=1) == b"uid"
    group.wait_for_all("barrier")
    # A second group object over the same ranks shares the sequence (a second Buffer on the same group).
    again = as_group("test", dist.group.WORLD)
    assert again.same_ranks(group) and again.allgather(rank * 10, "again") == [r * 10 for r in range(num_ranks)]
    topology = discover_topology(group)
    assert (topology.rank, topology.num_ranks, topology.num_nodes, topology.local_rank) == (rank, num_ranks, 1, rank)
    # A subgroup of ranks 0 and 2: its own namespace, its own rank numbers.
    pair = dist.new_group([0, 2])
    if rank != 1:
        sub = as_group("test", pair)
        assert not sub.same_ranks(group)
        assert sub.allgather(rank, "pair") == [0, 2] and sub.rank == rank // 2


def _one_rank_never_comes(rank: int, num_ranks: int, missing: int) -> None:
    group = as_group("test", dist.group.WORLD)
    group.wait_for_all("start")
    if rank != missing:
        with pytest.raises(PeerTimeoutError, match=f"rank {rank} waited 1 s for rank {missing} in bootstrap"):
            group.allgather(rank, "bootstrap", timeout_s=1.0)
    else:
        time.sleep(3.0)  # the others give up meanwhile; then the late rank catches up with them
        group.allgather(rank, "bootstrap")
    group.wait_for_all("end", timeout_s=30.0)


def _last_barrier_then_leave(rank: int, num_ranks: int, port: int) -> None:
    """A job whose last collective is cuep's barrier, after which rank 0, which hosts the store here, takes
    its process group down at once, while the others are slow to see the barrier complete."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_ranks)
    group = as_group("test", dist.group.WORLD)
    if rank != 0:
        wait = group._wait
        group._wait = lambda keys, phase, timeout_s: (time.sleep(0.5), wait(keys, phase, timeout_s))
    group.wait_for_all("last")
    dist.destroy_process_group()


def _ranks_out_of_step(rank: int, num_ranks: int) -> None:
    group = as_group("test", dist.group.WORLD)
    phase = "dispatch" if rank == 0 else "combine"
    stray = "combine" if rank == 0 else "dispatch"
    with pytest.raises(CuepError, match=f"rank {rank} reached '{phase}' while rank {1 if rank == 0 else 0} reached "
                                        f"'{stray}'"):
        group.allgather(rank, phase)


def test_collectives_over_gloo():
    _run(_collectives, NUM_RANKS)


def test_ranks_in_different_collectives_raise():
    _run(_ranks_out_of_step, NUM_RANKS)


def test_a_rank_that_never_joins_is_named():
    _run(_one_rank_never_comes, NUM_RANKS, 2)


def test_the_store_host_leaves_the_last_barrier_last():
    mp.start_processes(_last_barrier_then_leave, args=(NUM_RANKS, _free_port()), nprocs=NUM_RANKS,
                       start_method="spawn")


def test_a_group_must_be_mpi_or_torch():
    with pytest.raises(TypeError, match="Buffer\\(\\): the group must be an mpi4py communicator or a "
                                        "torch.distributed ProcessGroup, got builtins.str"):
        as_group("Buffer()", "world")


def test_an_uninitialised_torch_distributed_is_named():
    if dist.is_initialized():
        pytest.skip("torch.distributed is initialised in this process")
    with pytest.raises(CuepError, match="torch.distributed is not initialised"):
        TorchGroup("Buffer()", None)
