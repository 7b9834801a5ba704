"""A Group over an mpi4py communicator, whose collectives give up.

MPI's blocking collectives wait forever for a rank that never comes. Here each collective first meets
the peers in a non-blocking barrier polled against a deadline; once all have arrived, the blocking
collective that follows cannot stall. MPI cannot tell which rank is missing, so the error names none.
"""

from __future__ import annotations

from typing import Any

from .. import _deps
from .group import Group, poll_until


class MpiGroup(Group):
    """The ranks of the mpi4py communicator ``comm``."""

    def __init__(self, comm):
        self.comm = comm
        self.rank, self.num_ranks = comm.Get_rank(), comm.Get_size()

    def wait_for_all(self, phase: str, timeout_s: float | None = None) -> None:
        request = self.comm.Ibarrier()
        poll_until(request.Test, self.rank, phase, self.timeout(timeout_s), lambda: -1)

    def allgather(self, value: Any, phase: str, timeout_s: float | None = None) -> list[Any]:
        self.wait_for_all(phase, timeout_s)
        return self.comm.allgather(value)

    def same_ranks(self, other: Group) -> bool:
        mpi = _deps.mpi()
        return isinstance(other, MpiGroup) and mpi.Comm.Compare(self.comm, other.comm) in (mpi.IDENT, mpi.CONGRUENT)

    def usable(self) -> bool:
        return not _deps.mpi().Is_finalized()
