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
from typing import Any, Callable

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
    plans: dict = field(default_factory=dict)       # see Plan

    def function(self, entry: str) -> int:
        """The driver handle of ``entry`` as an integer (a CUkernel, which launches as a CUfunction), looked up once."""
        if entry not in self.functions:
            self.functions[entry] = int(self.library.kernel(entry).handle)
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


@dataclass(frozen=True)
class View:
    """One array carved out of a call's single allocation: ``strides`` ``None`` means C order."""

    shape: tuple[int, ...]
    dtype: Any
    offset: int
    strides: tuple[int, ...] | None = None

    def of(self, cupy, storage):
        """This region of ``storage`` (a ``cupy.cuda.MemoryPointer``) as an array."""
        return cupy.ndarray(self.shape, dtype=self.dtype, memptr=storage + self.offset, strides=self.strides)


@dataclass
class Handle:
    """What a low-latency dispatch leaves for its combine (opaque to users).

    It holds the dispatch's allocation, whose regions (``regions``, from the call's plan) the kernels
    read through their addresses: ``recv_src_info[e, i]``, source token of row ``i`` of local expert
    ``e``; ``layout_range[e, s]``, ``(first row << 32) | rows`` that came from rank ``s``;
    ``combine_rows[s, t, k]``, the flat row of the combine input holding choice ``k`` of token ``t`` of
    rank ``s`` (-1 when the expert is elsewhere); ``source_tokens[s]``, tokens rank ``s`` sent.
    """

    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    num_tokens: int
    num_topk: int
    storage: Any                  # the dispatch's one allocation, a MemoryPointer (its outputs are views of it too)
    regions: dict                 # name -> View

    def address(self, name: str) -> int:
        return self.storage.ptr + self.regions[name].offset


class Launch:
    """One kernel with its argument struct, relaunchable with other phases (the receive hook)."""

    def __init__(self, function: int, grid: int, args: ctypes.Structure, shared_bytes: int):
        self.function, self.grid, self.args, self.shared_bytes = function, grid, args, shared_bytes
        # cuLaunchKernel's kernelParams as an address: the struct is the kernel's one parameter.
        self._params = (ctypes.c_void_p * 1)(ctypes.addressof(args))

    def __call__(self, stream, phases: int) -> None:
        # The eager decode path is host-bound. CuPy's driver binding took 5-6 us of host time per launch
        # on both machines measured; cuda.bindings' cuLaunchKernel took 4.4 us on one and 14 on the other.
        cupy = _deps.cupy()
        self.args.phases = phases
        try:
            cupy.cuda.driver.launchKernel(self.function, self.grid, 1, 1, NUM_THREADS, 1, 1, self.shared_bytes,
                                          stream.ptr, ctypes.addressof(self._params), 0)
        except cupy.cuda.driver.CUDADriverError as exc:
            raise RuntimeError(f"cuep: launching low-latency kernel {self.function:#x} failed: {exc}") from None


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


def _carve(specs) -> tuple[dict[str, View], int]:
    """Regions ``name -> View`` for ``(name, shape, dtype, strides)`` packed into one allocation, and its bytes."""
    regions, total = {}, 0
    for name, shape, dtype, strides in specs:
        regions[name] = View(shape, dtype, total, strides)
        total += _align(math.prod(shape) * np.dtype(dtype).itemsize, _SLOT_ALIGN)
    return regions, total


@dataclass(frozen=True)
class Plan:
    """What every call of one kernel with one shape and one set of options shares, worked out on its
    first call (the eager decode path counts microseconds): the argument struct with everything but
    the call's own arrays filled in, and where the call's outputs sit in its one allocation."""

    function: int                 # Context.function's driver handle
    grid: int
    args: bytes
    shared_bytes: int = 0
    regions: dict = field(default_factory=dict)   # name -> View
    storage_bytes: int = 0

    def arguments(self, struct: type[ctypes.Structure]) -> ctypes.Structure:
        return struct.from_buffer_copy(self.args)


_MAX_PLANS = 64  # per Context; a decode loop uses a handful of shapes


def _plan(ctx: Context, key: tuple, build: Callable[[], Plan]) -> Plan:
    plan = ctx.plans.get(key)
    if plan is None:
        if len(ctx.plans) >= _MAX_PLANS:
            ctx.plans.clear()
        plan = ctx.plans[key] = build()
    return plan


def _common(ctx: Context, args, half: int) -> None:
    args.phases, args.half = SEND_PHASE | RECV_PHASE, half
    args.rank, args.num_ranks, args.force_put = ctx.rank, ctx.num_ranks, int(ctx.force_put)
    args.flag_stride = MAX_TOKENS_PER_RANK
    args.seq_state, args.timeout_ns = ctx.seq_state.data.ptr, ctx.timeout_ns
    args.status = _Status(ctx.status.data.ptr, ctx.status_host_ptr)
    args.trace = ctx.trace.data.ptr if ctx.trace is not None else 0


def dispatch_regions(num_ranks: int, max_tokens: int, hidden: int, num_experts: int, num_topk: int, use_fp8: bool,
                     use_ue8m0: bool, x_dtype) -> tuple[dict[str, View], int]:
    """Where a dispatch's outputs and its handle's arrays sit in the call's one allocation, and its bytes."""
    num_local = num_experts // num_ranks
    rows = num_ranks * max_tokens
    columns = hidden // SCALE_BLOCK // (UE8M0_SCALES_PER_WORD if use_ue8m0 else 1)
    scale_dtype = np.dtype(np.int32 if use_ue8m0 else np.float32)
    # Scales are column-major in the last two dims: each scale column is contiguous over rows.
    scale_strides = (columns * rows * scale_dtype.itemsize, scale_dtype.itemsize, rows * scale_dtype.itemsize)
    return _carve([
        ("recv_x", (num_local, rows, hidden), np.uint8 if use_fp8 else x_dtype, None),
        ("recv_scales", (num_local, rows, columns) if use_fp8 else (0,), scale_dtype,
         scale_strides if use_fp8 else None),
        ("recv_count", (num_local,), np.int32, None),
        ("recv_src_info", (num_local, rows), np.int32, None),
        ("layout_range", (num_local, num_ranks), np.int64, None),
        ("combine_rows", (num_ranks, max_tokens, num_topk), np.int32, None),
        ("source_tokens", (num_ranks,), np.int32, None)])


def _dispatch_plan(ctx: Context, half: int, max_tokens: int, hidden: int, num_experts: int, num_topk: int,
                   use_fp8: bool, round_scale: bool, use_ue8m0: bool, x_dtype) -> Plan:
    """Checks the buffer and shared memory fit (ValueError otherwise), then plans the dispatch."""
    layout = check_fits("low_latency_dispatch()", ctx, max_tokens, hidden, num_experts)
    shared_bytes = check_dispatch_shared_bytes("low_latency_dispatch()", max_tokens, ctx.num_ranks)
    regions, storage_bytes = dispatch_regions(ctx.num_ranks, max_tokens, hidden, num_experts, num_topk, use_fp8,
                                              use_ue8m0, x_dtype)
    routing_flags, _, token_flags, _ = ctx.flags(half)
    data = ctx.data(half)
    a = DispatchArgs()
    _common(ctx, a, half)
    a.hidden, a.num_topk, a.num_experts, a.max_tokens = hidden, num_topk, num_experts, max_tokens
    a.use_fp8, a.round_scale, a.use_ue8m0 = int(use_fp8), int(round_scale), int(use_ue8m0)
    a.routing_flags, a.token_flags = routing_flags, token_flags
    a.routing, a.routing_words = ctx.tables(half)[0], ROUTING_WORDS
    a.slots, a.slot_bytes = data + layout.dispatch_slots, layout.dispatch_slot_bytes
    a.routing_staging, a.slot_staging = data + layout.routing_staging, data + layout.dispatch_staging
    a.staging_words = layout.routing_staging_words
    a.num_parts = max(1, ctx.num_sms // (num_experts // ctx.num_ranks))
    return Plan(ctx.function("cuep_ll_dispatch"), ctx.num_sms, bytes(a), shared_bytes, regions, storage_bytes)


def dispatch(ctx: Context, half: int, x, topk_idx, max_tokens: int, num_experts: int, cumulative_stats,
             use_fp8: bool, round_scale: bool, use_ue8m0: bool):
    """Allocate the outputs (on the current stream) and build the launch; returns
    ``(recv_x, recv_scales, recv_count, handle, launch)``."""
    cupy = _deps.cupy()
    num_tokens, hidden = x.shape
    num_topk = topk_idx.shape[1]
    key = ("dispatch", half, max_tokens, hidden, num_experts, num_topk, use_fp8, round_scale, use_ue8m0)
    plan = _plan(ctx, key, lambda: _dispatch_plan(ctx, half, max_tokens, hidden, num_experts, num_topk, use_fp8,
                                                  round_scale, use_ue8m0, x.dtype))
    # One allocation for every output of the call (each allocation costs host time on the decode path).
    storage = cupy.cuda.alloc(plan.storage_bytes)  # a pool allocation, without an array object around it
    regions = plan.regions
    recv_x, recv_count = regions["recv_x"].of(cupy, storage), regions["recv_count"].of(cupy, storage)
    recv_scales = regions["recv_scales"].of(cupy, storage) if use_fp8 else None
    handle = Handle(max_tokens, hidden, num_experts, num_tokens, num_topk, storage, regions)
    address = handle.address
    a = plan.arguments(DispatchArgs)
    a.x, a.num_tokens = x.data.ptr, num_tokens
    a.topk_idx, a.ids_are_int64 = topk_idx.data.ptr, int(topk_idx.itemsize == 8)
    a.recv_x, a.recv_count = address("recv_x"), address("recv_count")
    a.recv_scales = address("recv_scales") if use_fp8 else 0
    a.recv_src_info, a.layout_range = address("recv_src_info"), address("layout_range")
    a.combine_rows, a.source_tokens = address("combine_rows"), address("source_tokens")
    a.cumulative_stats = cumulative_stats.data.ptr if cumulative_stats is not None else 0
    return recv_x, recv_scales, recv_count, handle, Launch(plan.function, plan.grid, a, plan.shared_bytes)


def _combine_plan(ctx: Context, half: int, max_tokens: int, hidden: int, num_experts: int) -> Plan:
    layout = check_fits("low_latency_combine()", ctx, max_tokens, hidden, num_experts)
    _, weight_flags, _, token_flags = ctx.flags(half)
    data = ctx.data(half)
    a = CombineArgs()
    _common(ctx, a, half)
    a.hidden, a.num_experts, a.max_tokens = hidden, num_experts, max_tokens
    a.weight_flags, a.token_flags = weight_flags, token_flags
    a.weights, a.weight_words = ctx.tables(half)[1], WEIGHT_WORDS
    a.slots, a.slot_bytes = data + layout.combine_slots, layout.combine_slot_bytes
    a.weight_staging, a.slot_staging = data + layout.weight_staging, data + layout.combine_staging
    a.staging_words = layout.weight_staging_words
    return Plan(ctx.function("cuep_ll_combine"), ctx.num_sms, bytes(a))


def combine(ctx: Context, half: int, x, topk_idx, topk_weights, handle: Handle, out) -> Launch:
    """Build the combine launch writing into ``out``."""
    max_tokens, hidden, num_experts = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
    plan = _plan(ctx, ("combine", half, max_tokens, hidden, num_experts),
                 lambda: _combine_plan(ctx, half, max_tokens, hidden, num_experts))
    a = plan.arguments(CombineArgs)
    a.x, a.topk_idx, a.ids_are_int64 = x.data.ptr, topk_idx.data.ptr, int(topk_idx.itemsize == 8)
    a.topk_weights = topk_weights.data.ptr
    a.num_tokens, a.num_topk = handle.num_tokens, handle.num_topk
    a.combine_rows, a.source_tokens = handle.address("combine_rows"), handle.address("source_tokens")
    a.combined_x = out.data.ptr
    return Launch(plan.function, plan.grid, a, plan.shared_bytes)
