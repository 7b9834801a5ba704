"""Launch module of ``cuda_src/low_latency.cu``: the low-latency (decode) dispatch and combine.

C++ entries, each taking one argument struct by value (mirrored below with ctypes, field for field)::

    cuep_ll_dispatch(DispatchArgs)   phases: SEND_PHASE, RECV_PHASE or both
    cuep_ll_combine(CombineArgs)

Buffer layout (byte offsets from the start of the low-latency region, the same on every rank)::

    [flags: 2 halves x (routing R | weights R | dispatch tokens R x MAX_TOKENS | combine tokens R x MAX_TOKENS)]
    [tables: 2 halves x (routing R x ROUTING_WORDS | weights R x WEIGHT_WORDS)]   tagged 64-bit words
    [half 0 data][half 1 data]      each: see HalfLayout

Flags and tables are polled, so they sit at fixed offsets whatever the call's shape: a flag word only
ever holds call numbers (which only grow) and a table word only zeros or tagged words of earlier calls,
never message bytes that could pass for a tag. Data regions move with ``(max_tokens, hidden)`` and are
never polled.
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _deps, env
from ..jit import KernelSpec, Library

NUM_THREADS = 512
MAX_TOPK = 32                   # mirrors kMaxTopk
MAX_TOKENS_PER_RANK = 1024      # flags per (half, source): the largest num_max_dispatch_tokens_per_rank
SEND_PHASE, RECV_PHASE = 1, 2   # mirror kSendPhase / kRecvPhase
SEQ_WORDS = 8                   # latest call, call of each half, finished blocks and tables of each half,
                                # newest call whose routing tables went out
ROUTING_HEADER_WORDS = 4
ROUTING_WORDS = ROUTING_HEADER_WORDS + MAX_TOKENS_PER_RANK * MAX_TOPK  # per source, the largest table
WEIGHT_WORDS = MAX_TOKENS_PER_RANK * MAX_TOPK
SCALE_BLOCK = 128
UE8M0_SCALES_PER_WORD = 4
MAX_SHARED_BYTES = 48 * 1024    # static and dynamic together, without opting in to more
DISPATCH_STATIC_SHARED_BYTES = 1024  # a bound on the dispatch's own (~800 B: the send's destination lists)
TRACE_POINTS = 16               # mirrors kTracePoints (cuda_src/cuep/trace.cuh)
_FLAG_BYTES = 8
_TABLE_WORD_BYTES = 8           # a table word: its value and its call number's tag (kernel: tagged_word)
_SLOT_ALIGN = 128               # a message never shares a cache line with the next
_REGION_ALIGN = 4096


def spec(arch: str, **features) -> KernelSpec:
    """The family's spec; ``CUEP_TRACE`` builds the variant that stamps phase times (cuep.bench --trace)."""
    defines = {"trace": 1} if env.get("CUEP_TRACE") else None
    return KernelSpec.create("low_latency", arch, defines, uses_nvshmem=True, **features)


def _align(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment


def flags_bytes(num_ranks: int) -> int:
    per_half = (2 * num_ranks + 2 * num_ranks * MAX_TOKENS_PER_RANK) * _FLAG_BYTES
    return _align(2 * per_half, _REGION_ALIGN)


def _tables_half_bytes(num_ranks: int) -> int:
    return num_ranks * (ROUTING_WORDS + WEIGHT_WORDS) * _TABLE_WORD_BYTES


def fixed_bytes(num_ranks: int) -> int:
    """Bytes at the start of the region that never move: the flags, then both halves' tables."""
    return flags_bytes(num_ranks) + _align(2 * _tables_half_bytes(num_ranks), _REGION_ALIGN)


@dataclass(frozen=True)
class HalfLayout:
    """Byte offsets inside one half's data region for calls of ``max_tokens`` tokens of ``hidden``."""

    dispatch_slot_bytes: int
    combine_slot_bytes: int
    routing_staging_words: int      # per destination: the largest routing table of max_tokens tokens
    weight_staging_words: int
    dispatch_slots: int
    combine_slots: int
    routing_staging: int
    dispatch_staging: int
    weight_staging: int
    combine_staging: int
    end: int


@functools.lru_cache(maxsize=64)  # every eager call asks; a decode loop asks for one shape
def half_layout(max_tokens: int, hidden: int, num_ranks: int) -> HalfLayout:
    dispatch_slot = _align(max(2 * hidden, hidden + hidden // SCALE_BLOCK * 4), _SLOT_ALIGN)  # BF16, or FP8 + scales
    combine_slot = _align(2 * hidden, _SLOT_ALIGN)
    # Staged tables (put path) are never polled, so unlike the tables they are sized for this call's shape.
    routing_staging_words = _align(ROUTING_HEADER_WORDS + max_tokens * MAX_TOPK, 2)
    weight_staging_words = max_tokens * MAX_TOPK
    sizes = [("dispatch_slots", num_ranks * max_tokens * dispatch_slot),
             ("combine_slots", num_ranks * max_tokens * combine_slot),
             ("routing_staging", num_ranks * routing_staging_words * _TABLE_WORD_BYTES),
             ("dispatch_staging", max_tokens * dispatch_slot),
             ("weight_staging", num_ranks * weight_staging_words * _TABLE_WORD_BYTES),
             ("combine_staging", num_ranks * max_tokens * combine_slot)]
    offsets, cursor = {}, 0
    for name, size in sizes:
        offsets[name] = cursor
        cursor += _align(size, _SLOT_ALIGN)
    return HalfLayout(dispatch_slot, combine_slot, routing_staging_words, weight_staging_words, **offsets, end=cursor)


def size_hint(max_tokens: int, hidden: int, num_ranks: int) -> int:
    """Bytes of low-latency buffer that calls of up to ``max_tokens`` tokens per rank need."""
    return fixed_bytes(num_ranks) + 2 * _align(half_layout(max_tokens, hidden, num_ranks).end, _REGION_ALIGN)


def half_data_bytes(region_bytes: int, num_ranks: int) -> int:
    """Capacity of each half's data region in a low-latency region of ``region_bytes``."""
    return max(0, (region_bytes - fixed_bytes(num_ranks)) // 2 // _REGION_ALIGN * _REGION_ALIGN)


def dispatch_shared_bytes(max_tokens: int, num_ranks: int) -> int:
    """Dynamic shared memory of the dispatch: token counts, then per-expert bitmaps and their prefix."""
    words_per_source = -(-max_tokens // 32)
    return (num_ranks + 2 * num_ranks * words_per_source) * 4


def check_dispatch_shared_bytes(call: str, max_tokens: int, num_ranks: int) -> int:
    """The dispatch's shared memory, or ValueError when ``max_tokens`` from ``num_ranks`` ranks would need
    more than a block gets without opting in (the launch would fail with a bare CUDA error)."""
    needed = dispatch_shared_bytes(max_tokens, num_ranks)
    limit = MAX_SHARED_BYTES - DISPATCH_STATIC_SHARED_BYTES
    if needed > limit:
        most = (limit // (4 * num_ranks) - 1) // 2 * 32
        fix = f"use num_max_dispatch_tokens_per_rank <= {most}" if most > 0 else "use fewer ranks per Buffer"
        raise ValueError(f"{call}: num_max_dispatch_tokens_per_rank={max_tokens} on {num_ranks} ranks needs "
                         f"{needed} bytes of shared memory per block for the receive layout (at most {limit}); "
                         f"{fix} at this rank count")
    return needed


class _Status(ctypes.Structure):
    _fields_ = [("device", ctypes.c_void_p), ("host", ctypes.c_void_p)]


class DispatchArgs(ctypes.Structure):
    """Mirror of ``cuep::DispatchArgs`` (test_low_latency_layout checks the field order against the source)."""

    _fields_ = [
        ("phases", ctypes.c_int), ("half", ctypes.c_int),
        ("x", ctypes.c_void_p),
        ("num_tokens", ctypes.c_int), ("hidden", ctypes.c_int), ("use_fp8", ctypes.c_int),
        ("round_scale", ctypes.c_int), ("use_ue8m0", ctypes.c_int),
        ("topk_idx", ctypes.c_void_p),
        ("ids_are_int64", ctypes.c_int), ("num_topk", ctypes.c_int), ("num_experts", ctypes.c_int),
        ("rank", ctypes.c_int), ("num_ranks", ctypes.c_int), ("max_tokens", ctypes.c_int), ("force_put", ctypes.c_int),
        ("routing_flags", ctypes.c_void_p), ("token_flags", ctypes.c_void_p), ("flag_stride", ctypes.c_int),
        ("routing", ctypes.c_void_p), ("routing_words", ctypes.c_int),
        ("slots", ctypes.c_void_p), ("slot_bytes", ctypes.c_int64),
        ("routing_staging", ctypes.c_void_p), ("staging_words", ctypes.c_int), ("slot_staging", ctypes.c_void_p),
        ("recv_x", ctypes.c_void_p), ("recv_scales", ctypes.c_void_p), ("recv_count", ctypes.c_void_p),
        ("recv_src_info", ctypes.c_void_p), ("layout_range", ctypes.c_void_p), ("combine_rows", ctypes.c_void_p),
        ("source_tokens", ctypes.c_void_p), ("cumulative_stats", ctypes.c_void_p),
        ("num_parts", ctypes.c_int),
        ("seq_state", ctypes.c_void_p), ("timeout_ns", ctypes.c_uint64), ("status", _Status),
        ("trace", ctypes.c_void_p),
    ]


class CombineArgs(ctypes.Structure):
    """Mirror of ``cuep::CombineArgs``."""

    _fields_ = [
        ("phases", ctypes.c_int), ("half", ctypes.c_int),
        ("x", ctypes.c_void_p), ("topk_idx", ctypes.c_void_p), ("ids_are_int64", ctypes.c_int),
        ("topk_weights", ctypes.c_void_p),
        ("num_tokens", ctypes.c_int), ("num_topk", ctypes.c_int), ("hidden", ctypes.c_int),
        ("num_experts", ctypes.c_int), ("rank", ctypes.c_int), ("num_ranks", ctypes.c_int),
        ("max_tokens", ctypes.c_int), ("force_put", ctypes.c_int),
        ("combine_rows", ctypes.c_void_p), ("source_tokens", ctypes.c_void_p),
        ("weight_flags", ctypes.c_void_p), ("token_flags", ctypes.c_void_p), ("flag_stride", ctypes.c_int),
        ("weights", ctypes.c_void_p), ("weight_words", ctypes.c_int),
        ("slots", ctypes.c_void_p), ("slot_bytes", ctypes.c_int64),
        ("weight_staging", ctypes.c_void_p), ("staging_words", ctypes.c_int), ("slot_staging", ctypes.c_void_p),
        ("combined_x", ctypes.c_void_p),
        ("seq_state", ctypes.c_void_p), ("timeout_ns", ctypes.c_uint64), ("status", _Status),
        ("trace", ctypes.c_void_p),
    ]


@dataclass
class Context:
    """What the launch functions need from a Buffer."""

    library: Library
    rank: int
    num_ranks: int
    region_ptr: int               # start of this rank's low-latency region (a symmetric address)
    region_bytes: int
    num_sms: int
    force_put: bool
    timeout_ns: int
    seq_state: Any                # [SEQ_WORDS] uint64 device array
    status: Any                   # [STATUS_WORDS] int32 device array
    status_host_ptr: int          # device address of the pinned host mirror of ``status``
    trace: Any = None             # [num_sms, TRACE_POINTS] uint64 device array in CUEP_TRACE builds

    functions: dict = field(default_factory=dict)

    def function(self, entry: str):
        """The driver handle of ``entry`` (a CUkernel, which launches as a CUfunction), looked up once."""
        if entry not in self.functions:
            self.functions[entry] = _deps.cuda_driver().CUfunction(int(self.library.kernel(entry).handle))
        return self.functions[entry]

    def flags(self, half: int) -> tuple[int, int, int, int]:
        """Addresses of (routing, weights, dispatch token, combine token) flags of ``half``."""
        per_source = self.num_ranks * _FLAG_BYTES
        per_tokens = self.num_ranks * MAX_TOKENS_PER_RANK * _FLAG_BYTES
        base = self.region_ptr + half * (2 * per_source + 2 * per_tokens)
        return base, base + per_source, base + 2 * per_source, base + 2 * per_source + per_tokens

    # The region's layout depends only on the rank count and the region's size: worked out once, not
    # on every call (the eager decode path counts microseconds).
    @functools.cached_property
    def _tables_start(self) -> int:
        return self.region_ptr + flags_bytes(self.num_ranks)

    @functools.cached_property
    def _data_start(self) -> int:
        return self.region_ptr + fixed_bytes(self.num_ranks)

    @functools.cached_property
    def half_capacity(self) -> int:
        """Bytes of each half's data region (``half_data_bytes`` of this region)."""
        return half_data_bytes(self.region_bytes, self.num_ranks)

    def tables(self, half: int) -> tuple[int, int]:
        """Addresses of the (routing, weights) tables of ``half``."""
        base = self._tables_start + half * _tables_half_bytes(self.num_ranks)
        return base, base + self.num_ranks * ROUTING_WORDS * _TABLE_WORD_BYTES

    def data(self, half: int) -> int:
        return self._data_start + half * self.half_capacity


@dataclass
class Handle:
    """What a low-latency dispatch leaves for its combine (opaque to users).

    ``recv_src_info[e, i]``: source token of row ``i`` of local expert ``e``; ``layout_range[e, s]``:
    ``(first row << 32) | rows`` that came from rank ``s``; ``combine_rows[s, t, k]``: the flat row of
    the combine input holding choice ``k`` of token ``t`` of rank ``s``, -1 when the expert is elsewhere.
    """

    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    num_tokens: int
    num_topk: int
    recv_src_info: Any
    layout_range: Any
    combine_rows: Any
    source_tokens: Any


def _common(ctx: Context, args, half: int, phases: int) -> None:
    args.phases, args.half = phases, half
    args.rank, args.num_ranks, args.force_put = ctx.rank, ctx.num_ranks, int(ctx.force_put)
    args.flag_stride = MAX_TOKENS_PER_RANK
    args.seq_state, args.timeout_ns = ctx.seq_state.data.ptr, ctx.timeout_ns
    args.status = _Status(ctx.status.data.ptr, ctx.status_host_ptr)
    args.trace = ctx.trace.data.ptr if ctx.trace is not None else 0


class Launch:
    """One kernel with its argument struct, relaunchable with other phases (the receive hook)."""

    def __init__(self, ctx: Context, entry: str, args: ctypes.Structure, shared_bytes: int):
        self.function = ctx.function(entry)
        self.grid, self.args, self.shared_bytes = ctx.num_sms, args, shared_bytes

    def __call__(self, stream, phases: int) -> None:
        driver = _deps.cuda_driver()
        self.args.phases = phases
        (err,) = driver.cuLaunchKernel(self.function, self.grid, 1, 1, NUM_THREADS, 1, 1, self.shared_bytes,
                                       stream.ptr, ((self.args,), (None,)), 0)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuep: launching {self.function} failed: {err}")


def check_fits(call: str, ctx: Context, max_tokens: int, hidden: int, num_experts: int) -> HalfLayout:
    layout = half_layout(max_tokens, hidden, ctx.num_ranks)
    capacity = ctx.half_capacity
    if layout.end > capacity:
        need = size_hint(max_tokens, hidden, ctx.num_ranks)
        raise ValueError(f"{call}: {max_tokens} tokens per rank of hidden {hidden} need a low-latency buffer of "
                         f"{need} bytes, but this Buffer has num_rdma_bytes={ctx.region_bytes}; create it with "
                         f"num_rdma_bytes >= Buffer.get_low_latency_rdma_size_hint({max_tokens}, {hidden}, "
                         f"{ctx.num_ranks}, {num_experts})")
    return layout


def _carve(cupy, specs) -> dict[str, Any]:
    """Arrays ``name -> (shape, dtype)`` as views of one allocation (each view keeps it alive)."""
    offsets, total = [], 0
    for _, shape, dtype in specs:
        offsets.append(total)
        total += _align(math.prod(shape) * np.dtype(dtype).itemsize, _SLOT_ALIGN)  # math.prod: ~30x numpy's
    base = cupy.empty(total, dtype=cupy.uint8)
    return {name: cupy.ndarray(shape, dtype=dtype, memptr=base.data + offset)
            for (name, shape, dtype), offset in zip(specs, offsets)}


def dispatch(ctx: Context, half: int, x, topk_idx, max_tokens: int, num_experts: int, cumulative_stats,
             use_fp8: bool, round_scale: bool, use_ue8m0: bool):
    """Allocate the outputs (on the current stream) and build the launch; returns
    ``(recv_x, recv_scales, recv_count, handle, launch)``."""
    cupy = _deps.cupy()
    num_tokens, hidden = x.shape
    num_topk = topk_idx.shape[1]
    num_local = num_experts // ctx.num_ranks
    rows = ctx.num_ranks * max_tokens
    layout = check_fits("low_latency_dispatch()", ctx, max_tokens, hidden, num_experts)
    shared_bytes = check_dispatch_shared_bytes("low_latency_dispatch()", max_tokens, ctx.num_ranks)
    columns = hidden // SCALE_BLOCK // (UE8M0_SCALES_PER_WORD if use_ue8m0 else 1)
    # One allocation for every output of the call (each allocation costs host time on the decode path).
    arrays = _carve(cupy, [
        ("recv_x", (num_local, rows, hidden), cupy.uint8 if use_fp8 else x.dtype),
        ("recv_scales", (num_local, columns, rows) if use_fp8 else (0,), cupy.int32 if use_ue8m0 else cupy.float32),
        ("recv_count", (num_local,), cupy.int32),
        ("recv_src_info", (num_local, rows), cupy.int32),
        ("layout_range", (num_local, ctx.num_ranks), cupy.int64),
        ("combine_rows", (ctx.num_ranks, max_tokens, num_topk), cupy.int32),
        ("source_tokens", (ctx.num_ranks,), cupy.int32)])
    recv_x, recv_count = arrays["recv_x"], arrays["recv_count"]
    # column-major in the last two dims: each scale column is contiguous over rows
    recv_scales = arrays["recv_scales"].transpose(0, 2, 1) if use_fp8 else None
    handle = Handle(max_tokens, hidden, num_experts, num_tokens, num_topk, recv_src_info=arrays["recv_src_info"],
                    layout_range=arrays["layout_range"], combine_rows=arrays["combine_rows"],
                    source_tokens=arrays["source_tokens"])
    routing_flags, _, token_flags, _ = ctx.flags(half)
    data = ctx.data(half)
    a = DispatchArgs()
    _common(ctx, a, half, SEND_PHASE | RECV_PHASE)
    a.x, a.num_tokens, a.hidden = x.data.ptr, num_tokens, hidden
    a.use_fp8, a.round_scale, a.use_ue8m0 = int(use_fp8), int(round_scale), int(use_ue8m0)
    a.topk_idx, a.ids_are_int64, a.num_topk = topk_idx.data.ptr, int(topk_idx.itemsize == 8), num_topk
    a.num_experts, a.max_tokens = num_experts, max_tokens
    a.routing_flags, a.token_flags = routing_flags, token_flags
    a.routing, a.routing_words = ctx.tables(half)[0], ROUTING_WORDS
    a.slots, a.slot_bytes = data + layout.dispatch_slots, layout.dispatch_slot_bytes
    a.routing_staging, a.slot_staging = data + layout.routing_staging, data + layout.dispatch_staging
    a.staging_words = layout.routing_staging_words
    a.recv_x, a.recv_scales = recv_x.data.ptr, recv_scales.data.ptr if recv_scales is not None else 0
    a.recv_count, a.recv_src_info = recv_count.data.ptr, handle.recv_src_info.data.ptr
    a.layout_range, a.combine_rows = handle.layout_range.data.ptr, handle.combine_rows.data.ptr
    a.source_tokens = handle.source_tokens.data.ptr
    a.cumulative_stats = cumulative_stats.data.ptr if cumulative_stats is not None else 0
    a.num_parts = max(1, ctx.num_sms // num_local)
    launch = Launch(ctx, "cuep_ll_dispatch", a, shared_bytes)
    return recv_x, recv_scales, recv_count, handle, launch


def combine(ctx: Context, half: int, x, topk_idx, topk_weights, handle: Handle, out):
    """Build the combine launch writing into ``out``."""
    layout = check_fits("low_latency_combine()", ctx, handle.num_max_dispatch_tokens_per_rank, handle.hidden,
                        handle.num_experts)
    _, weight_flags, _, token_flags = ctx.flags(half)
    data = ctx.data(half)
    a = CombineArgs()
    _common(ctx, a, half, SEND_PHASE | RECV_PHASE)
    a.x, a.topk_idx, a.ids_are_int64 = x.data.ptr, topk_idx.data.ptr, int(topk_idx.itemsize == 8)
    a.topk_weights = topk_weights.data.ptr
    a.num_tokens, a.num_topk, a.hidden = handle.num_tokens, handle.num_topk, handle.hidden
    a.num_experts, a.max_tokens = handle.num_experts, handle.num_max_dispatch_tokens_per_rank
    a.combine_rows, a.source_tokens = handle.combine_rows.data.ptr, handle.source_tokens.data.ptr
    a.weight_flags, a.token_flags = weight_flags, token_flags
    a.weights, a.weight_words = ctx.tables(half)[1], WEIGHT_WORDS
    a.slots, a.slot_bytes = data + layout.combine_slots, layout.combine_slot_bytes
    a.weight_staging, a.slot_staging = data + layout.weight_staging, data + layout.combine_staging
    a.staging_words = layout.weight_staging_words
    a.combined_x = out.data.ptr
    return Launch(ctx, "cuep_ll_combine", a, 0)
