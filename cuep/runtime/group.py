"""MPI collectives that give up: every wait on peers is bounded and raises PeerTimeoutError.

MPI's blocking collectives wait forever for a rank that never comes. Here each collective first
meets the peers in a non-blocking barrier polled against a deadline; once all have arrived, the
blocking collective that follows cannot stall.
"""

from __future__ import annotations

import time
from typing import Any

from .. import _deps, env
from ..errors import PeerTimeoutError

_FIRST_POLL_S, _MAX_POLL_S = 1e-4, 0.05


def wait_for_all(comm, phase: str, timeout_s: float | None = None, rank: int | None = None) -> None:
    """Non-blocking barrier on ``comm``, polled until every rank arrives or the timeout passes.

    ``rank`` names this process in the error (default: its rank in ``comm``)."""
    timeout_s = env.get("CUEP_TIMEOUT_S") if timeout_s is None else timeout_s
    request = comm.Ibarrier()
    deadline, pause = time.monotonic() + timeout_s, _FIRST_POLL_S
    while not request.Test():
        if time.monotonic() > deadline:
            raise PeerTimeoutError(comm.Get_rank() if rank is None else rank, -1, phase, timeout_s)
        time.sleep(pause)
        pause = min(pause * 2, _MAX_POLL_S)


class MpiGroup:
    """The ranks of ``comm`` and their hosts, as :class:`cuep.jit.library.CompileGroup` needs them."""

    def __init__(self, comm, local_comm, timeout_s: float):
        self.comm, self.local_comm, self.timeout_s = comm, local_comm, timeout_s
        self.rank, self.num_ranks = comm.Get_rank(), comm.Get_size()
        self.local_rank = local_comm.Get_rank()

    @classmethod
    def by_host(cls, comm, timeout_s: float) -> "MpiGroup":
        """The group of ``comm`` with its ranks split by host; :meth:`close` frees the split."""
        return cls(comm, comm.Split_type(_deps.mpi().COMM_TYPE_SHARED), timeout_s)

    def close(self) -> None:
        """Free the per-host communicator (collective over the host's ranks)."""
        self.local_comm.Free()

    def allgather(self, value: Any, phase: str) -> list[Any]:
        wait_for_all(self.comm, phase, self.timeout_s)
        return self.comm.allgather(value)

    def node_broadcast(self, value: Any, phase: str) -> Any:
        """``value`` of local rank 0, once it gets here (it may be compiling meanwhile)."""
        wait_for_all(self.local_comm, phase, self.timeout_s, rank=self.rank)
        return self.local_comm.bcast(value, root=0)
