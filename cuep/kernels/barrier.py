"""Launch module of ``cuda_src/barrier.cu``: the bounded device barrier over NVSHMEM.

C++ entry, taking one argument struct by value (mirrored below)::

    cuep::barrier::arrive_and_wait(const BarrierArgs)    one block, a thread per peer
"""

from __future__ import annotations

import ctypes

from .._math import align_up
from ..jit import KernelSpec, Library
from . import launcher
from .common import WARP_SIZE, family_constants
from .launcher import KernelArgs, entries_of
from .status import Status

MAX_THREADS = 1024
SIGNAL_BYTES = 8
ENTRY = "cuep::barrier::arrive_and_wait"


class BarrierArgs(KernelArgs):
    """Mirror of ``cuep::BarrierArgs``."""

    cxx_name = "BarrierArgs"
    entry = ENTRY
    _fields_ = [("signals", ctypes.c_void_p),        # [num_ranks] uint64, symmetric
                ("rank", ctypes.c_int), ("num_ranks", ctypes.c_int),
                ("epoch_counter", ctypes.c_void_p),  # uint64, device memory the kernel increments
                ("timeout_ns", ctypes.c_uint64),
                ("status", Status)]


ARGUMENT_STRUCTS = (Status, BarrierArgs)
ENTRIES = entries_of(ARGUMENT_STRUCTS)


def spec(arch: str, **features) -> KernelSpec:
    """The family's spec (no compile-time parameters of its own)."""
    return KernelSpec.create("barrier", arch, constants=family_constants(), uses_nvshmem=True, entries=ENTRIES,
                             **features)


def signal_bytes(num_ranks: int) -> int:
    """Symmetric memory the barrier needs on every rank: one uint64 signal per peer."""
    return num_ranks * SIGNAL_BYTES


def block_threads(num_ranks: int) -> int:
    """Threads of the barrier's one block: a thread per peer, in whole warps."""
    return min(MAX_THREADS, align_up(num_ranks, WARP_SIZE))


def launch(library: Library, stream, signals_ptr: int, rank: int, num_ranks: int, epoch_counter,
           timeout_s: float, status, status_host_ptr: int) -> None:
    """Enqueue the next barrier on ``stream`` (a CuPy stream); arguments as :func:`prepare`'s."""
    prepare(library, signals_ptr, rank, num_ranks, epoch_counter, timeout_s, status, status_host_ptr)(stream)


def prepare(library: Library, signals_ptr: int, rank: int, num_ranks: int, epoch_counter, timeout_s: float,
            status, status_host_ptr: int) -> launcher.Launch:
    """The barrier's launch, to call with a CuPy stream once per barrier: its arguments never change (the
    kernel counts the epochs on the device), so a Buffer prepares it once.

    Arguments:
        signals_ptr: this rank's ``[num_ranks]`` uint64 signals (symmetric memory, :func:`signal_bytes`).
        epoch_counter: a ``[1]`` uint64 device array the kernel increments, so graph replays keep counting.
        timeout_s: how long a thread waits for its peer before recording a timeout.
        status, status_host_ptr: the status words and the device address of their pinned host mirror,
            where a timeout is recorded (the host raises from them).
    """
    args = BarrierArgs(signals=signals_ptr, rank=rank, num_ranks=num_ranks, epoch_counter=epoch_counter.data.ptr,
                       timeout_ns=int(timeout_s * 1e9), status=Status(status.data.ptr, status_host_ptr))
    return launcher.Launch(library, ENTRY, 1, block_threads(num_ranks), args)
