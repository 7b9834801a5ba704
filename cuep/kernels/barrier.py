"""Launch module of ``cuda_src/barrier.cu`` (the bounded device barrier over NVSHMEM).

C++ entry::

    cuep_barrier(uint64_t* signals, int rank, int num_ranks, uint64_t* epoch_counter, uint64_t timeout_ns,
                 int32_t* status_words, int32_t* status_host)
"""

from __future__ import annotations

import numpy as np

from .. import _deps
from ..jit import KernelSpec, Library

WARP_SIZE = 32
MAX_THREADS = 1024
SIGNAL_BYTES = 8


def spec(arch: str, **features) -> KernelSpec:
    return KernelSpec.create("barrier", arch, uses_nvshmem=True, **features)


def signal_bytes(num_ranks: int) -> int:
    """Symmetric memory the barrier needs on every rank: one uint64 signal per peer."""
    return num_ranks * SIGNAL_BYTES


def launch(library: Library, stream, signals_ptr: int, rank: int, num_ranks: int, epoch_counter,
           timeout_s: float, status, status_host_ptr: int) -> None:
    """Enqueue the next barrier on ``stream`` (``epoch_counter``: a device uint64 the kernel increments,
    so graph replays keep counting); a timeout is recorded in ``status`` and in its pinned host mirror
    (``status_host_ptr``, a device address)."""
    core = _deps.cuda_core()
    threads = min(MAX_THREADS, -(-num_ranks // WARP_SIZE) * WARP_SIZE)
    config = core.LaunchConfig(grid=1, block=threads)
    core.launch(stream, config, library.kernel("cuep_barrier"), np.uint64(signals_ptr), np.int32(rank),
                np.int32(num_ranks), epoch_counter.data.ptr, np.uint64(int(timeout_s * 1e9)), status.data.ptr,
                np.uint64(status_host_ptr))
