"""GPU worker: user code raises after making a Buffer and never destroys it (run under mpirun).

Every rank raises the same exception; the process must exit through cuep's teardown without an
NVSHMEM error about symmetric memory left allocated, and without hanging.
"""

from __future__ import annotations

from mpi4py import MPI

import cuep

buffer = cuep.Buffer(MPI.COMM_WORLD, num_nvl_bytes=16 << 20)
raise RuntimeError(f"user code failed on rank {buffer.rank} with its Buffer alive")
