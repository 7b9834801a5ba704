"""Launch module of ``cuda_src/probe.cu``, the NVLink ceiling probe of ``python -m cuep.bench --mode ceiling``:
its spec, the constants this side shares with the CUDA side, its argument struct and its launch.

A benchmark-only family: no :class:`cuep.Buffer` compiles or launches it (it is not in
:func:`cuep.kernels.buffer_specs`). Its entries take one :class:`ProbeArgs` by value::

    cuep::probe::copy(ProbeArgs)         the warps' loads and stores
    cuep::probe::bulk_copy(ProbeArgs)    the Hopper bulk-copy unit (TMA); Hopper builds only

both with :data:`NUM_THREADS` threads a block, every block resident at once.
"""

from __future__ import annotations

import ctypes
import dataclasses

from ..jit import KernelSpec, Library
from . import common, intranode, launcher
from .launcher import KernelArgs, entries_of
from .status import Status

NUM_THREADS = intranode.NUM_THREADS  # the probe copies as the intranode kernels' blocks do
MAX_RANKS = intranode.MAX_RANKS
HEADER_BYTES = 4096   # the probe's flags (ProbeFlags) at the start of its buffer; rows start on a page
WARPS_PER_BLOCK = NUM_THREADS // 32
COPY_BATCHES = (4, 8, 16)  # vectors a lane of a warp copy has in flight (the intranode kernels': 4)
MAX_BULK_STAGES = 16       # kMaxBulkStages
STATE_WORDS = 2       # uint64 device state: finished launches, blocks done of the running one
COPY_ENTRY, BULK_ENTRY = "cuep::probe::copy", "cuep::probe::bulk_copy"

CONSTANTS = {"num_threads": NUM_THREADS, "max_ranks": MAX_RANKS, "header_bytes": HEADER_BYTES,
             "state_words": STATE_WORDS}
"""What ``probe.cu`` reads as ``CUEP_<NAME>`` macros besides the shared ones."""


def spec(arch: str, **features) -> KernelSpec:
    """The probe family for ``arch``; ``features``: ``force_fallback``, ``aggressive_ptx``. The bulk-copy
    entry exists in Hopper-path builds only."""
    built = KernelSpec.create("probe", arch, constants=common.family_constants(CONSTANTS), entries=(COPY_ENTRY,),
                              **features)
    return dataclasses.replace(built, entries=ENTRIES) if built.sm90_features else built


def buffer_bytes(num_ranks: int, max_rows: int, row_bytes: int) -> int:
    """Symmetric memory the probe needs on every rank: its header, then a source and a landing region of
    ``num_ranks * max_rows`` rows of ``row_bytes`` each."""
    return HEADER_BYTES + 2 * num_ranks * max_rows * row_bytes


class ProbeArgs(KernelArgs):
    """Mirror of ``cuep::ProbeArgs`` (fields described there)."""

    cxx_name = "ProbeArgs"
    entries = (COPY_ENTRY, BULK_ENTRY)
    _fields_ = [("peer_bases", ctypes.c_void_p), ("rank_prefix", ctypes.c_void_p), ("rank", ctypes.c_int32),
                ("num_ranks", ctypes.c_int32), ("row_bytes", ctypes.c_int64), ("max_rows", ctypes.c_int32),
                ("pull", ctypes.c_int32), ("awaited", ctypes.c_int32), ("copy_warps", ctypes.c_int32),
                ("copy_batch", ctypes.c_int32), ("bulk_chunk_bytes", ctypes.c_int32), ("bulk_stages", ctypes.c_int32),
                ("state", ctypes.c_void_p),
                ("next_row", ctypes.c_void_p), ("status", Status), ("timeout_ns", ctypes.c_uint64)]


#: The structs this module mirrors (``tests/test_kernel_args.py`` checks their layouts).
ARGUMENT_STRUCTS = (ProbeArgs,)
ENTRIES = entries_of(ARGUMENT_STRUCTS)


def launch(library: Library, stream, args: ProbeArgs, grid: int, buffer_bytes_per_rank: int,
           bulk: bool = False) -> None:
    """Enqueue one probe launch on ``stream`` (a CuPy stream).

    Every rank must launch it, with the same ``grid`` (at most the GPU's SMs) and ``args`` but its own
    rank, with nothing else using the probe buffers; it overwrites this rank's and its peers' rows.

    Arguments:
        library: the loaded probe family (:func:`spec`).
        args: the launch's arguments; ``args.row_bytes`` a multiple of 16, ``args.awaited`` only with a
            push (``pull == 0``) by the warps; ``args.copy_warps`` from 1 to :data:`WARPS_PER_BLOCK`;
            ``args.copy_batch`` one of :data:`COPY_BATCHES` (warp copies); ``args.bulk_chunk_bytes`` a
            multiple of 16 and ``args.bulk_stages`` from 2 to :data:`MAX_BULK_STAGES` (bulk copies), whose
            shared memory (:func:`cuep.kernels.common.bulk_ring_shared_bytes`) must fit a block.
        grid: blocks of the launch.
        buffer_bytes_per_rank: the size of each rank's probe buffer (at least :func:`buffer_bytes`).
        bulk: copy with the Hopper bulk-copy unit (TMA) instead of the warps' loads and stores.

    Raises:
        ValueError: ``bulk`` on a build without the Hopper path, ``awaited`` with a pull or ``bulk``, a
            copy shape out of range, or rows that do not fit the buffers; nothing is launched then.
    """
    if bulk and not library.spec.sm90_features:
        raise ValueError(f"probe: bulk copies need the Hopper (sm_90) path, but the probe was built as "
                         f"{library.spec.name}")
    if args.awaited and (args.pull or bulk):
        raise ValueError("probe: an awaited probe times the warps' pushes only (pull=0, bulk=False)")
    if args.row_bytes % 16:
        raise ValueError(f"probe: row_bytes must be a multiple of 16, got {args.row_bytes}")
    needed = buffer_bytes(args.num_ranks, args.max_rows, args.row_bytes)
    if needed > buffer_bytes_per_rank:
        raise ValueError(f"probe: {args.max_rows} rows of {args.row_bytes} bytes a peer need a buffer of {needed} "
                         f"bytes, this one has {buffer_bytes_per_rank}")
    if not 1 <= args.copy_warps <= WARPS_PER_BLOCK:
        raise ValueError(f"probe: copy_warps must be 1 to {WARPS_PER_BLOCK}, got {args.copy_warps}")
    shared_bytes = 0
    if bulk:
        if args.bulk_chunk_bytes <= 0 or args.bulk_chunk_bytes % 16 or not 2 <= args.bulk_stages <= MAX_BULK_STAGES:
            raise ValueError(f"probe: bulk_chunk_bytes must be a positive multiple of 16 and bulk_stages 2 to "
                             f"{MAX_BULK_STAGES}, got {args.bulk_chunk_bytes} and {args.bulk_stages}")
        shared_bytes = common.bulk_ring_shared_bytes(args.copy_warps, args.bulk_stages, args.bulk_chunk_bytes)
        launcher.allow_shared_bytes(library, BULK_ENTRY, shared_bytes)
    elif args.copy_batch not in COPY_BATCHES:
        raise ValueError(f"probe: copy_batch must be one of {COPY_BATCHES}, got {args.copy_batch}")
    launcher.launch(library, BULK_ENTRY if bulk else COPY_ENTRY, stream, grid, NUM_THREADS, args, shared_bytes)

