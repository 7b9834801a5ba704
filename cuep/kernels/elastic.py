"""Launch module of ``cuda_src/elastic.cu``: DeepEP V2's received layouts, made on the receiving rank from a
normal-mode dispatch's compact rows (no communication).

C++ entries, each taking one argument struct by value (mirrored below)::

    cuep::elastic::count_rows(const RowsArgs)     a block per chunk of received rows
    cuep::elastic::scan_counts(const RowsArgs)    one block
    cuep::elastic::place_rows(const PlaceArgs)    a block per chunk, then one per expert's padding
    cuep::elastic::slot_rows(const SlotArgs)      a thread per (token, lane)
    cuep::elastic::reduce_rows(const ReduceArgs)  a warp per compact row
    cuep::elastic::route_back(const RouteBackArgs) a thread per expanded row, per (compact row, lane), per own lane
    cuep::elastic::index_lanes(const LanesArgs)   a thread per row received back
    cuep::elastic::sum_lanes(const LanesArgs)     a warp per token

The last three serve an expanded combine with ``allow_multiple_reduction=False``: each expanded row goes back
alone, as a normal-mode dispatch's row, and its token's rank sums them lane by lane.
"""

from __future__ import annotations

import ctypes

from .._math import ceil_div
from ..jit import KernelSpec, Library
from . import launcher
from .common import family_constants
from .launcher import KernelArgs, entries_of

NUM_THREADS = 256
CHUNK_ROWS = 128            # received rows a count_rows / place_rows block takes
MAX_LOCAL_EXPERTS = 1024    # per-expert counters of a block live in shared memory
MAX_TOPK = 32               # a top-k row's lanes fit one warp
REDUCE_BLOCKS_PER_SM = 4
CONSTANTS = {"num_threads": NUM_THREADS, "chunk_rows": CHUNK_ROWS, "max_local_experts": MAX_LOCAL_EXPERTS,
             "max_topk": MAX_TOPK}

_ptr, _i32, _i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64


class RowsArgs(KernelArgs):
    """``count_rows`` and ``scan_counts``: per-expert counts and the rows' metadata."""

    cxx_name = "RowsArgs"
    entries = ("cuep::elastic::count_rows", "cuep::elastic::scan_counts")
    _fields_ = [("recv_topk_idx", _ptr), ("recv_src_idx", _ptr), ("num_rows", _ptr), ("rank_prefix", _ptr),
                ("capacity", _i32), ("num_topk", _i32), ("num_local_experts", _i32), ("num_ranks", _i32),
                ("ranks_per_node", _i32), ("num_max_tokens_per_rank", _i32), ("expert_alignment", _i32),
                ("num_chunks", _i32), ("expand", _i32), ("chunk_counts", _ptr), ("metadata", _ptr),
                ("num_unaligned", _ptr), ("psum", _ptr), ("psum_local", _ptr), ("stats", _ptr)]


class PlaceArgs(KernelArgs):
    """``place_rows``: the expanded layout's rows, scales and weights."""

    cxx_name = "PlaceArgs"
    entry = "cuep::elastic::place_rows"
    _fields_ = [("num_rows", _ptr), ("capacity", _i32), ("num_topk", _i32), ("num_local_experts", _i32),
                ("expert_alignment", _i32), ("num_chunks", _i32), ("chunk_starts", _ptr), ("num_unaligned", _ptr),
                ("psum", _ptr), ("recv_topk_idx", _ptr), ("metadata", _ptr), ("x", _ptr), ("row_bytes", _i64),
                ("scales", _ptr), ("num_scales", _i32), ("weights", _ptr), ("out_x", _ptr), ("out_scales", _ptr),
                ("scale_row_stride", _i64), ("scale_col_stride", _i64), ("out_weights", _ptr),
                ("out_rows", _i32), ("zero_padding", _i32)]


class ReduceArgs(KernelArgs):
    """``reduce_rows``: compact rows summed from an expanded layout, in top-k lane order."""

    cxx_name = "ReduceArgs"
    entry = "cuep::elastic::reduce_rows"
    _fields_ = [("num_rows", _ptr), ("capacity", _i32), ("num_topk", _i32), ("metadata", _ptr), ("x", _ptr),
                ("row_bytes", _i64), ("weights", _ptr), ("out_x", _ptr), ("out_weights", _ptr)]


class SlotArgs(KernelArgs):
    """``slot_rows``: where each (token, lane) landed on its expert's rank."""

    cxx_name = "SlotArgs"
    entry = "cuep::elastic::slot_rows"
    _fields_ = [("topk_idx", _ptr), ("send_pos", _ptr), ("rank_prefix_matrix", _ptr), ("num_tokens", _i32),
                ("num_topk", _i32), ("num_ranks", _i32), ("rank", _i32), ("experts_per_rank", _i32),
                ("slots", _ptr)]


class RouteBackArgs(KernelArgs):
    """``route_back``: where each expanded row goes back, and which (token, lane) it is."""

    cxx_name = "RouteBackArgs"
    entry = "cuep::elastic::route_back"
    _fields_ = [("num_rows", _ptr), ("capacity", _i32), ("num_topk", _i32), ("num_local_experts", _i32),
                ("expert_alignment", _i32), ("num_max_tokens_per_rank", _i32), ("metadata", _ptr), ("psum", _ptr),
                ("expanded_rows", _i32), ("dest", _ptr), ("lane_tag", _ptr), ("lane_rows", _ptr),
                ("num_lanes", _i32)]


class LanesArgs(KernelArgs):
    """``index_lanes`` and ``sum_lanes``: the rows received back, summed per token in top-k lane order."""

    cxx_name = "LanesArgs"
    entries = ("cuep::elastic::index_lanes", "cuep::elastic::sum_lanes")
    _fields_ = [("recv_topk_idx", _ptr), ("recv_lane_tag", _ptr), ("x", _ptr), ("capacity", _i32),
                ("row_bytes", _i64), ("topk_idx", _ptr), ("num_tokens", _i32), ("num_topk", _i32),
                ("num_experts", _i32), ("lane_rows", _ptr), ("bias0", _ptr), ("bias1", _ptr), ("out_x", _ptr)]


#: The lane tags travel as floats, exact below 2 ** 24: tokens * top-k of a rank must stay below it.
MAX_LANE_TAGS = 1 << 24

ARGUMENT_STRUCTS = (RowsArgs, PlaceArgs, SlotArgs, ReduceArgs, RouteBackArgs, LanesArgs)
ENTRIES = entries_of(ARGUMENT_STRUCTS)


def spec(arch: str, **features) -> KernelSpec:
    """The family's spec (its block shape is a constant)."""
    return KernelSpec.create("elastic", arch, constants=family_constants(CONSTANTS), entries=ENTRIES, **features)


def num_chunks(capacity: int) -> int:
    """Blocks of ``count_rows`` (and the row blocks of ``place_rows``) for ``capacity`` received rows."""
    return ceil_div(capacity, CHUNK_ROWS)


def count_and_scan(library: Library, stream, args: RowsArgs) -> None:
    """Enqueue ``count_rows`` (unless there are no rows) and ``scan_counts``."""
    if args.num_chunks > 0:
        launcher.launch(library, "cuep::elastic::count_rows", stream, args.num_chunks, NUM_THREADS, args)
    launcher.launch(library, "cuep::elastic::scan_counts", stream, 1, NUM_THREADS, args)


def place(library: Library, stream, args: PlaceArgs) -> None:
    """Enqueue ``place_rows``: a block per chunk, then one per expert when zeroing the padding."""
    grid = args.num_chunks + (args.num_local_experts if args.zero_padding else 0)
    if grid > 0:
        launcher.launch(library, PlaceArgs.entry, stream, grid, NUM_THREADS, args)


def slots(library: Library, stream, args: SlotArgs, device_sms: int) -> None:
    """Enqueue ``slot_rows`` (unless there are no entries)."""
    entries = args.num_tokens * args.num_topk
    if entries > 0:
        launcher.launch(library, SlotArgs.entry, stream, min(device_sms * 4, ceil_div(entries, NUM_THREADS)),
                        NUM_THREADS, args)


def reduce(library: Library, stream, args: ReduceArgs, device_sms: int) -> None:
    """Enqueue ``reduce_rows`` over the GPU's SMs."""
    warps = NUM_THREADS // 32
    grid = max(1, min(device_sms * REDUCE_BLOCKS_PER_SM, ceil_div(args.capacity, warps)))
    launcher.launch(library, ReduceArgs.entry, stream, grid, NUM_THREADS, args)


def route_back(library: Library, stream, args: RouteBackArgs, device_sms: int) -> None:
    """Enqueue ``route_back`` (unless it has nothing to write)."""
    work = max(args.expanded_rows, args.capacity * args.num_topk if args.expanded_rows else 0, args.num_lanes)
    if work > 0:
        launcher.launch(library, RouteBackArgs.entry, stream, min(device_sms * 4, ceil_div(work, NUM_THREADS)),
                        NUM_THREADS, args)


def sum_lanes(library: Library, stream, args: LanesArgs, device_sms: int) -> None:
    """Enqueue ``index_lanes`` (unless nothing came back) and ``sum_lanes`` (unless there are no tokens)."""
    if args.capacity > 0:
        grid = min(device_sms * 4, ceil_div(args.capacity, NUM_THREADS))
        launcher.launch(library, "cuep::elastic::index_lanes", stream, grid, NUM_THREADS, args)
    if args.num_tokens > 0:
        warps = NUM_THREADS // 32
        grid = min(device_sms * REDUCE_BLOCKS_PER_SM, ceil_div(args.num_tokens, warps))
        launcher.launch(library, "cuep::elastic::sum_lanes", stream, grid, NUM_THREADS, args)
