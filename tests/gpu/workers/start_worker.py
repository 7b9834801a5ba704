"""GPU worker: a Buffer asked to start NVSHMEM on a transport this host cannot give (run with
``NVSHMEM_REMOTE_TRANSPORT=ibgda`` on a host without an RDMA NIC) raises cuep's ``CuepError`` on every rank,
naming the transport, what the doctor finds, and ``python -m cuep doctor``: no abort, no hang. (NVSHMEM
itself would start there, over P2P and without the transport: cuep refuses before it starts.)"""

from __future__ import annotations

import os

from mpi4py import MPI

import cuep
from cuep.errors import CuepError

comm = MPI.COMM_WORLD
rank, num_ranks = comm.Get_rank(), comm.Get_size()
TRANSPORT = os.environ["NVSHMEM_REMOTE_TRANSPORT"]


def start_error() -> str:
    """What this rank's Buffer() raised, or a line saying it started."""
    try:
        cuep.Buffer(comm, num_nvl_bytes=1 << 20)
    except CuepError as exc:
        return str(exc)
    return "Buffer() started"


def main() -> None:
    message = start_error()
    expected = (f"rank {rank}: NVSHMEM was not started", f"NVSHMEM_REMOTE_TRANSPORT={TRANSPORT}",
                "no RDMA device in /sys/class/infiniband", f"python -m cuep doctor --transport {TRANSPORT}")
    missing = [text for text in expected if text not in message]
    every_rank = comm.gather((missing, message), root=0)
    if rank == 0:
        wrong = {r: message for r, (missing, message) in enumerate(every_rank) if missing}
        assert not wrong, f"ranks without the clear start error: {wrong}"
        print(message)
        print(f"start error passed on {num_ranks} ranks")


if __name__ == "__main__":
    main()
