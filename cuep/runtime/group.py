"""The ranks of a Buffer behind one interface, whatever launched them: an mpi4py communicator
(:class:`~cuep.runtime.mpi_group.MpiGroup`) or a torch process group
(:class:`~cuep.runtime.torch_group.TorchGroup`).

The core asks a group for a handful of host-side collectives (allgather, broadcast, barrier), each bounded:
a rank that never arrives makes the others raise :class:`~cuep.errors.PeerTimeoutError` instead of
hanging. Nothing here touches a GPU.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any, Callable

from .. import _deps, env
from ..errors import PeerTimeoutError

FIRST_POLL_S, MAX_POLL_S = 1e-4, 0.05


def poll_until(ready: Callable[[], bool], rank: int, phase: str, timeout_s: float,
               missing_rank: Callable[[], int]) -> None:
    """Poll ``ready()``, backing off, until it holds; past ``timeout_s`` raise
    :class:`~cuep.errors.PeerTimeoutError` for ``rank`` naming ``missing_rank()`` (-1: unknown)."""
    deadline, pause = time.monotonic() + timeout_s, FIRST_POLL_S
    while not ready():
        if time.monotonic() > deadline:
            raise PeerTimeoutError(rank, missing_rank(), phase, timeout_s)
        time.sleep(pause)
        pause = min(pause * 2, MAX_POLL_S)


class Group(ABC):
    """The ranks that make a Buffer together: this process's ``rank`` of ``num_ranks``.

    Every rank of the group calls the same collectives in the same order; ``phase`` names the step
    in a timeout's message, and ``timeout_s`` (default ``CUEP_TIMEOUT_S``) bounds each wait."""

    rank: int
    num_ranks: int

    @abstractmethod
    def allgather(self, value: Any, phase: str, timeout_s: float | None = None) -> list[Any]:
        """Every rank's ``value`` (picklable), by rank."""

    @abstractmethod
    def wait_for_all(self, phase: str, timeout_s: float | None = None) -> None:
        """Return once every rank has called this (a host barrier)."""

    @abstractmethod
    def same_ranks(self, other: "Group") -> bool:
        """Whether ``other`` spans the same processes in the same rank order."""

    @abstractmethod
    def usable(self) -> bool:
        """Whether collectives can still run (the launcher's runtime has not been torn down)."""

    def broadcast(self, value: Any, phase: str, root: int = 0, timeout_s: float | None = None) -> Any:
        """Rank ``root``'s ``value``, on every rank."""
        return self.allgather(value if self.rank == root else None, phase, timeout_s)[root]

    @staticmethod
    def timeout(timeout_s: float | None) -> float:
        return env.get("CUEP_TIMEOUT_S") if timeout_s is None else timeout_s


class NodeGroup:
    """A group and its hosts, as :class:`cuep.jit.library.CompileGroup` needs them: one rank per host
    (its local rank 0) compiles, the others of the host wait for its word, for up to ``timeout_s``."""

    def __init__(self, group: Group, local_rank: int, timeout_s: float):
        self.group, self.timeout_s = group, timeout_s
        self.rank, self.num_ranks, self.local_rank = group.rank, group.num_ranks, local_rank
        # Ranks are placed host by host (the topology refuses anything else): the host's first rank leads.
        self._leader = group.rank - local_rank

    def allgather(self, value: Any, phase: str) -> list[Any]:
        return self.group.allgather(value, phase, self.timeout_s)

    def node_broadcast(self, value: Any, phase: str) -> Any:
        """``value`` of this host's local rank 0, once it gets here (it may be compiling meanwhile).

        Collective over the whole group: every host's word travels in one exchange."""
        return self.allgather(value, phase)[self._leader]


def as_group(call: str, comm: Any) -> Group:
    """The group of ``comm``: a :class:`Group`, an mpi4py communicator, a torch ``ProcessGroup``, or
    ``None`` for ``MPI.COMM_WORLD``. Raises ``TypeError`` naming ``call`` for anything else."""
    if isinstance(comm, Group):
        return comm
    kind = type(comm)
    if comm is None or kind.__module__.startswith("mpi4py"):
        from .mpi_group import MpiGroup
        mpi = _deps.mpi()
        comm = mpi.COMM_WORLD if comm is None else comm
        if isinstance(comm, mpi.Comm):
            return MpiGroup(comm)
    elif kind.__module__.startswith("torch") and isinstance(comm, _deps.torch_distributed().ProcessGroup):
        from .torch_group import TorchGroup
        return TorchGroup(call, comm)
    raise TypeError(f"{call}: the group must be an mpi4py communicator or a torch.distributed ProcessGroup, got "
                    f"{kind.__module__}.{kind.__name__}")
