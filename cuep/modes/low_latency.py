"""Low-latency (decode) mode: the host side of ``cuda_src/low_latency.cu``'s protocol.

It lays out the low-latency region of a Buffer, sizes it (:func:`size_hint`, :func:`check_fits`),
and turns each call into one kernel launch: :func:`checked_dispatch` and :func:`checked_combine` check the
arguments (or find their signature checked before) and give their addresses, then :func:`dispatch` and
:func:`combine` fill the argument struct of :mod:`cuep.kernels.low_latency` and return a :class:`Run`, which
the Buffer runs with the phases it wants (both, or the send now and the receive from a hook)::

    shape, *addresses = low_latency.checked_dispatch(call, ctx, x, topk_idx, ...)
    run = low_latency.dispatch(ctx, shape, *addresses)[-1]
    run(stream, SEND_PHASE | RECV_PHASE)

Region layout (byte offsets from the start of the low-latency region, the same on every rank)::

    [mask: R int32]        shrink mode: this rank's mask of its peers (cuep::MaskedStatus::masked)
    [buffer 0][buffer 1][buffer 2][buffer 3]     NUM_BUFFERS of buffer_bytes each; call n uses buffer n % 4
    buffer: [flags: routing R | weights R | dispatch tokens R x MAX_TOKENS | combine tokens R x MAX_TOKENS |
                    combine choices MAX_TOKENS x CHOICE_SLOTS]
            [tables: routing R x ROUTING_WORDS | weights R x WEIGHT_WORDS]   tagged 64-bit words
            [data: see DataLayout]

Which buffer a call uses is decided on the device from its call number (``cuda_src/low_latency.cu``, "Call
order"): the host passes buffer 0's addresses and the distance between buffers, so a captured graph
never bakes a buffer in. Flags and tables are polled, so they sit at fixed offsets whatever the call's
shape: a flag word only ever holds call numbers (which only grow) and a table word only zeros or tagged
words of earlier calls, never message bytes that could pass for a tag. Data regions move with
``(max_tokens, hidden, num_experts)`` and are never polled.

The eager decode path is host-bound, so what every call of one shape shares is worked out on its first
call and kept (:class:`Plan`), what the checks concluded is kept per signature of the arguments
(:class:`DispatchCall`, :class:`CombineCall`), and each pooled allocation keeps its filled struct (and a
dispatch's its handle): a later call sets only its own fields.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _deps, _interop, env, logfmt
from .. import _checks
from .._checks import KnownCalls, bf16_dtype
from .._front import Front, View, carve
from .._status import StatusWords
from .._math import align_up
from ..jit import Library
from ..kernels.common import SCALE_BLOCK, UE8M0_SCALES_PER_WORD, fp8_row_bytes
from ..kernels.launcher import Functions, KernelArgs, Launch, allow_shared_bytes, block_shared_bytes
from ..kernels.low_latency import (CHOICE_SLOTS, COMBINE_ENTRY, DISPATCH_ENTRY, DISPATCH_STATIC_SHARED_BYTES,
                                   MASKED_TO_TELL, MAX_COUNT_WORDS, MAX_TOKENS_PER_RANK, MAX_TOPK, NUM_BUFFERS,
                                   NUM_THREADS, RECV_PHASE, ROUTING_HEADER_WORDS, SEND_PHASE, SEQ_LATEST, SEQ_RECEIVED,
                                   SEQ_WORDS, TRACE_POINTS, CombineArgs, DispatchArgs, check_dispatch_shared_bytes,
                                   dispatch_staging, grid)
from ..kernels.status import MaskedStatus
from ..runtime.regions import REGION_ALIGN

# Per source, the largest table: the most tokens of the most choices with up to MAX_COUNT_WORDS local experts' counts
# (more experts fit beside fewer tokens or choices; _dispatch_plan checks the call's).
ROUTING_WORDS = ROUTING_HEADER_WORDS + MAX_COUNT_WORDS + MAX_TOKENS_PER_RANK * MAX_TOPK
WEIGHT_WORDS = MAX_TOKENS_PER_RANK * MAX_TOPK
_FLAG_BYTES = 8
_MASK_ENTRY_BYTES = 4           # an int32 per rank
_TABLE_WORD_BYTES = 8           # a table word: its value and its call number's tag (kernel: tagged_word)
_SLOT_ALIGN = 128               # a message never shares a cache line with the next
_REGION_ALIGN = REGION_ALIGN  # the mask, buffers, flags, tables and data start on pages, like the regions


def mask_bytes(num_ranks: int) -> int:
    """Bytes of the shrink-mode mask at the start of the region (page-aligned)."""
    return align_up(num_ranks * _MASK_ENTRY_BYTES, _REGION_ALIGN)


def flags_bytes(num_ranks: int) -> int:
    """Bytes of one buffer's flags, at its start."""
    flags = 2 * num_ranks + 2 * num_ranks * MAX_TOKENS_PER_RANK + MAX_TOKENS_PER_RANK * CHOICE_SLOTS
    return align_up(flags * _FLAG_BYTES, _REGION_ALIGN)


def _tables_bytes(num_ranks: int) -> int:
    return num_ranks * (ROUTING_WORDS + WEIGHT_WORDS) * _TABLE_WORD_BYTES


def fixed_bytes(num_ranks: int) -> int:
    """Bytes at the start of each buffer that never move with the calls' shape: its flags and tables."""
    return flags_bytes(num_ranks) + align_up(_tables_bytes(num_ranks), _REGION_ALIGN)


@dataclass(frozen=True)
class DataLayout:
    """Byte offsets inside one buffer's data region for calls of ``max_tokens`` tokens of ``hidden``."""

    dispatch_slot_bytes: int
    combine_slot_bytes: int
    routing_staging_words: int      # per destination: the largest routing table of max_tokens tokens
    weight_staging_words: int
    dispatch_slots: int
    combine_slots: int
    choice_slots: int               # [max_tokens][CHOICE_SLOTS] combine rows sent one by one
    routing_staging: int
    dispatch_staging: int
    weight_staging: int
    combine_staging: int
    end: int


def dispatch_message_bytes(hidden: int, use_fp8: bool) -> int:
    """Bytes of one token's dispatch message: BF16 rows, or e4m3 rows then a float32 scale per block."""
    return fp8_row_bytes(hidden) if use_fp8 else 2 * hidden


def routing_table_words(max_tokens: int, num_topk: int, num_experts: int, num_ranks: int) -> int:
    """Words of a source's routing table for calls of this shape (``count_words`` in low_latency.cu): the header,
    the destination's expert counts, then each token's routed words, each section padded to even."""
    return ROUTING_HEADER_WORDS + align_up(num_experts // num_ranks, 2) + max_tokens * align_up(num_topk, 2)


@functools.lru_cache(maxsize=64)  # every eager call asks; a decode loop asks for one shape
def data_layout(max_tokens: int, hidden: int, num_ranks: int, num_experts: int) -> DataLayout:
    """Where each region of a buffer's data sits for calls of up to ``max_tokens`` tokens of ``hidden`` to
    ``num_experts`` experts."""
    dispatch_slot = align_up(max(dispatch_message_bytes(hidden, False), dispatch_message_bytes(hidden, True)),
                             _SLOT_ALIGN)
    # A partial as BF16, or as LogFMT, whose message with every block fallen back is a little larger.
    logfmt_message = logfmt.message_bytes(hidden) if hidden % logfmt.BLOCK == 0 else 0
    combine_slot = align_up(max(2 * hidden, logfmt_message), _SLOT_ALIGN)
    # Staged tables (put path) are never polled, so unlike the tables they are sized for this call's shape.
    routing_staging_words = routing_table_words(max_tokens, MAX_TOPK, num_experts, num_ranks)
    weight_staging_words = max_tokens * MAX_TOPK
    sizes = [("dispatch_slots", num_ranks * max_tokens * dispatch_slot),
             ("combine_slots", num_ranks * max_tokens * combine_slot),
             ("choice_slots", max_tokens * CHOICE_SLOTS * combine_slot),
             ("routing_staging", num_ranks * routing_staging_words * _TABLE_WORD_BYTES),
             ("dispatch_staging", max_tokens * dispatch_slot),
             ("weight_staging", num_ranks * weight_staging_words * _TABLE_WORD_BYTES),
             ("combine_staging", num_ranks * max_tokens * combine_slot)]
    offsets, cursor = {}, 0
    for name, size in sizes:
        offsets[name] = cursor
        cursor += align_up(size, _SLOT_ALIGN)
    return DataLayout(dispatch_slot, combine_slot, routing_staging_words, weight_staging_words, **offsets, end=cursor)


def size_hint(max_tokens: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """Bytes of low-latency buffer that calls of up to ``max_tokens`` tokens per rank to ``num_experts`` experts
    need."""
    data = align_up(data_layout(max_tokens, hidden, num_ranks, num_experts).end, _REGION_ALIGN)
    return mask_bytes(num_ranks) + NUM_BUFFERS * (fixed_bytes(num_ranks) + data)


def buffer_bytes(region_bytes: int, num_ranks: int) -> int:
    """Bytes of each of the NUM_BUFFERS buffers of a low-latency region of ``region_bytes`` (page-aligned)."""
    return max(0, (region_bytes - mask_bytes(num_ranks)) // NUM_BUFFERS // _REGION_ALIGN * _REGION_ALIGN)


def data_bytes(region_bytes: int, num_ranks: int) -> int:
    """Capacity of each buffer's data region in a low-latency region of ``region_bytes``."""
    return max(0, buffer_bytes(region_bytes, num_ranks) - fixed_bytes(num_ranks))


@dataclass
class Context:
    """What a Buffer's low-latency calls share: its region, its device state and the compiled family.

    ``seq_state`` and ``status`` are the kernels' own (zeroed at creation and never reset): the call
    numbers, and with them which buffer each call uses, count on across calls, graph replays included.
    """

    library: Library              # the family's build, which every launch but a hook's receive takes
    receive_library: Library      # its receive-only build, which the hooks' receives take (kReceiveOnly)
    front: Front                  # where the outputs come from (cuep._front)
    rank: int
    num_ranks: int
    region_ptr: int               # start of this rank's low-latency region (a symmetric address)
    region_bytes: int
    num_sms: int
    force_put: bool
    timeout_ns: int
    split_after_ns: int           # CUEP_COMBINE_SPLIT_US: how long a combine send looks for a source's weights
    hook_split_after_ns: int      # CUEP_COMBINE_HOOK_SPLIT_US: the same, in a hook's send outside a CUDA graph
    seq_state: Any                # [SEQ_WORDS] uint64 device array
    status: Any                   # [STATUS_WORDS] int32 device array
    status_host_ptr: int          # device address of the pinned host mirror of ``status``
    trace: Any = None             # [num_sms, TRACE_POINTS] uint64 device array in CUEP_TRACE builds
    status_words: StatusWords | None = None  # owner of ``status`` and its host mirror
    shrink: bool = False          # a timed-out peer is masked instead of failing the call (enable_shrink)
    all_direct: bool = False      # every peer takes direct stores (SymmetricMemory.reaches_every_rank), force_put off
    source_decisions: Any = None  # shrink mode: [NUM_BUFFERS, num_ranks] uint64, what each receive counts each source sent

    plans: dict = field(default_factory=dict)       # see Plan
    known: KnownCalls = field(default_factory=KnownCalls)  # argument signatures that passed: DispatchCall, CombineCall
    combine_buffers: dict = field(default_factory=dict)  # (parity, shape) -> array, for zero-copy callers
    combine_parity: int = 0       # which of the two zero-copy arrays of a shape the next caller gets

    @classmethod
    def create(cls, library: Library, receive_library: Library, front: Front, region_ptr: int, region_bytes: int,
               rank: int, num_ranks: int, num_sms: int, force_put: bool, timeout_s: float, trace: bool,
               shrink: bool = False, all_direct: bool = False) -> "Context":
        """The context of a Buffer's low-latency region (zeroed), with status words of its own;
        ``receive_library``: the family's receive-only build; ``all_direct``: this GPU reaches every
        rank's region by load and store (ignored with ``force_put``)."""
        cupy = _deps.cupy()
        status = StatusWords()
        return cls(library=library, receive_library=receive_library, front=front, rank=rank, num_ranks=num_ranks,
                   region_ptr=region_ptr, region_bytes=region_bytes, num_sms=num_sms, force_put=force_put,
                   all_direct=all_direct and not force_put,
                   timeout_ns=int(timeout_s * 1e9),
                   split_after_ns=int(env.get("CUEP_COMBINE_SPLIT_US") * 1e3),
                   hook_split_after_ns=int(env.get("CUEP_COMBINE_HOOK_SPLIT_US") * 1e3),
                   seq_state=cupy.zeros(SEQ_WORDS, dtype=cupy.uint64), status=status.device,
                   status_host_ptr=status.host_ptr, status_words=status,
                   trace=cupy.zeros((num_sms, TRACE_POINTS), dtype=cupy.uint64) if trace else None, shrink=shrink,
                   source_decisions=cupy.zeros((NUM_BUFFERS, num_ranks), dtype=cupy.uint64) if shrink else None)

    @functools.cached_property
    def mask(self):
        """This rank's mask of its peers, `[num_ranks]` `int32` in the region (non-zero: masked; the
        kernels' values are :data:`~cuep.kernels.low_latency.MASKED_TO_TELL` and ``MASKED_TOLD``)."""
        cupy = _deps.cupy()
        address = self.region_ptr
        memory = cupy.cuda.UnownedMemory(address, self.num_ranks * _MASK_ENTRY_BYTES, self)
        return cupy.ndarray((self.num_ranks,), dtype=cupy.int32, memptr=cupy.cuda.MemoryPointer(memory, 0))

    def set_mask(self, rank: int, masked: bool) -> None:
        """Mask (or unmask) ``rank`` in this rank's mask, in stream order; a rank masked here reaches
        the peers by the end of this rank's next low-latency kernel."""
        self.mask[rank] = MASKED_TO_TELL if masked else 0

    def query_mask(self, out) -> None:
        """``out[r] = 1`` where rank ``r`` is masked here, else 0, in stream order."""
        _deps.cupy().not_equal(self.mask, 0, out=_interop.to_cupy(out), casting="unsafe")

    def newest_call(self) -> int:
        """The number of the newest call this rank sent (waits for the device)."""
        return int(self.seq_state[SEQ_LATEST].get())

    def restart(self, call_number: int) -> None:
        """Unmask every rank and go on from ``call_number`` (every rank the same; nothing in flight), in
        stream order: a rank that sat calls out catches up with the others' call numbers, and every call
        up to it counts as received."""
        self.mask.fill(0)
        self.seq_state.fill(0)  # the launch counts too: a launch that sat out in some blocks left them behind
        self.seq_state[SEQ_LATEST] = call_number
        self.seq_state[SEQ_RECEIVED:SEQ_RECEIVED + NUM_BUFFERS] = call_number

    def combine_buffer(self, handle: "Handle"):
        """A `[num_local_experts, num_ranks * max_tokens, hidden]` `bfloat16` array for the next combine of
        ``handle``'s shape: two per shape, handed out in turn (at most two results are in flight), reused."""
        shape = (handle.num_experts // self.num_ranks, self.num_ranks * handle.num_max_dispatch_tokens_per_rank,
                 handle.hidden)
        key = (self.combine_parity, shape)
        self.combine_parity ^= 1
        if key not in self.combine_buffers:
            self.combine_buffers = {k: v for k, v in self.combine_buffers.items() if k[1] == shape}
            self.combine_buffers[key] = self.front.empty(shape, bf16_dtype())
        return self.combine_buffers[key]

    # The region's layout depends only on the rank count and the region's size: worked out once, not
    # on every call (the eager decode path counts microseconds). The kernels take buffer 0's addresses
    # and buffer_bytes, and move to their call's buffer themselves.
    @functools.cached_property
    def buffer_bytes(self) -> int:
        """Bytes from one buffer to the next (``buffer_bytes`` of this region)."""
        return buffer_bytes(self.region_bytes, self.num_ranks)

    @functools.cached_property
    def data_capacity(self) -> int:
        """Bytes of each buffer's data region (``data_bytes`` of this region)."""
        return data_bytes(self.region_bytes, self.num_ranks)

    @functools.cached_property
    def _buffer_start(self) -> int:
        return self.region_ptr + mask_bytes(self.num_ranks)

    def flags(self) -> tuple[int, int, int, int, int]:
        """Addresses of buffer 0's (routing, weights, dispatch token, combine token, combine choice) flags."""
        per_source = self.num_ranks * _FLAG_BYTES
        per_tokens = self.num_ranks * MAX_TOKENS_PER_RANK * _FLAG_BYTES
        base = self._buffer_start
        return (base, base + per_source, base + 2 * per_source, base + 2 * per_source + per_tokens,
                base + 2 * per_source + 2 * per_tokens)

    def tables(self) -> tuple[int, int]:
        """Addresses of buffer 0's (routing, weights) tables."""
        base = self._buffer_start + flags_bytes(self.num_ranks)
        return base, base + self.num_ranks * ROUTING_WORDS * _TABLE_WORD_BYTES

    def data(self) -> int:
        """Address of buffer 0's data region (laid out by :func:`data_layout`)."""
        return self._buffer_start + fixed_bytes(self.num_ranks)


class Handle:
    """What a low-latency dispatch leaves for its combine (opaque to users).

    It holds the dispatch's allocation, whose regions (``regions``, from the call's plan) the kernels
    read through their addresses: ``recv_src_info[e, i]``, source token of row ``i`` of local expert
    ``e``; ``layout_range[e, s]``, ``(first row << 32) | rows`` that came from rank ``s``;
    ``combine_rows[s, t, k]``, the flat row of the combine input holding choice ``k`` of token ``t`` of
    rank ``s`` (-1 when the expert is elsewhere); ``source_tokens[s]``, tokens rank ``s`` sent;
    ``call_record[i]``, the call number of the dispatch (``i = 0``) and of its latest combine (``1``),
    written by their sends on the device, from which a receive-only launch (a hook, or a receive replayed
    from its own graph) learns which call, and so which buffer, it completes. ``items``: the front's arrays
    of ``recv_src_info`` and ``layout_range`` (DeepEP's handle items 0 and 1).

    A handle comes with its allocation from the front's pool (made once per allocation): ``num_tokens`` is
    the latest dispatch's.
    """

    __slots__ = ("num_max_dispatch_tokens_per_rank", "hidden", "num_experts", "num_tokens", "num_topk", "storage",
                 "regions", "items", "combine_rows", "source_tokens", "call_record")

    def __init__(self, max_tokens: int, hidden: int, num_experts: int, num_tokens: int, num_topk: int, storage: Any,
                 regions: dict, items: tuple):
        self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts = max_tokens, hidden, num_experts
        self.num_tokens, self.num_topk, self.storage, self.regions, self.items = (num_tokens, num_topk, storage,
                                                                                  regions, items)
        # The addresses every combine of this handle passes, worked out once.
        self.combine_rows, self.source_tokens, self.call_record = (self.address(name) for name in
                                                                   ("combine_rows", "source_tokens", "call_record"))

    def address(self, name: str) -> int:
        """Device address of region ``name`` of the dispatch's allocation."""
        return self.storage.ptr + self.regions[name].offset


def check_fits(call: str, ctx: Context, max_tokens: int, hidden: int, num_experts: int) -> DataLayout:
    """The data layout of calls of this shape, or ValueError (naming ``call`` and the size to ask for)
    when this Buffer's region is too small for it."""
    layout = data_layout(max_tokens, hidden, ctx.num_ranks, num_experts)
    capacity = ctx.data_capacity
    if layout.end > capacity:
        need = size_hint(max_tokens, hidden, ctx.num_ranks, num_experts)
        raise ValueError(f"{call}: {max_tokens} tokens per rank of hidden {hidden} need a low-latency buffer of "
                         f"{need} bytes, but this Buffer has num_rdma_bytes={ctx.region_bytes}; create it with "
                         f"num_rdma_bytes >= Buffer.get_low_latency_rdma_size_hint({max_tokens}, {hidden}, "
                         f"{ctx.num_ranks}, {num_experts})")
    return layout


@dataclass(frozen=True)
class Plan:
    """What every call of one kernel with one shape and one set of options shares, worked out on its
    first call (the eager decode path counts microseconds): the argument struct with everything but
    the call's own arrays filled in, and where the call's outputs sit in its one allocation."""

    key: tuple
    entry: str
    grid: int
    args: bytes
    shared_bytes: int = 0
    regions: dict = field(default_factory=dict)   # name -> View
    storage_bytes: int = 0
    output_offsets: tuple[int, ...] = ()          # of the regions named by _OUTPUT_FIELDS, in that order
    outputs: tuple[View, ...] = ()                # recv_x, recv_count, [FP8: recv_scales,] recv_src_info, layout_range
    choice_slots: int = 0                         # the combine's choice slots (0: a pair of several rows waits)
    attach: Any = None                            # what a pooled allocation keeps (cuep._front.Attach), bound here

    def arguments(self, struct: type[KernelArgs]) -> KernelArgs:
        """A fresh copy of the planned struct, for one call (or one pooled allocation) to complete."""
        return struct.from_buffer_copy(self.args)


_MAX_PLANS = 64  # per Context; a decode loop uses a handful of shapes

# A dispatch's output addresses: adjacent pointer fields of DispatchArgs, written with one pack per allocation.
_OUTPUT_FIELDS = ("recv_x", "recv_scales", "recv_count", "recv_src_info", "layout_range", "combine_rows",
                  "source_tokens")
_RECORD_BYTES = 8  # a call record's word
_OUTPUT_POINTERS = struct.Struct(f"<{len(_OUTPUT_FIELDS)}Q")
_OUTPUT_START = DispatchArgs.recv_x.offset
assert [getattr(DispatchArgs, name).offset for name in _OUTPUT_FIELDS] == \
    [_OUTPUT_START + i * ctypes.sizeof(ctypes.c_void_p) for i in range(len(_OUTPUT_FIELDS))], "DispatchArgs order"


def _new_plan(ctx: Context, key: tuple, build: Callable[[], Plan], attach: Callable[..., tuple[tuple, tuple]]) -> Plan:
    """The plan of ``key`` (which ``ctx.plans`` lacks), built now and kept, with ``attach(ctx, plan, storage,
    views)`` bound to it. A call looks its plan up in ``ctx.plans`` first: a hit costs no function call."""
    if len(ctx.plans) >= _MAX_PLANS:
        ctx.plans.clear()
    built = build()
    plan = ctx.plans[key] = dataclasses.replace(built, attach=functools.partial(attach, ctx, built))
    return plan


def _common(ctx: Context, args) -> None:
    args.phases, args.buffer, args.buffer_bytes = SEND_PHASE | RECV_PHASE, 0, ctx.buffer_bytes
    args.rank, args.num_ranks, args.force_put = ctx.rank, ctx.num_ranks, int(ctx.force_put)
    args.all_direct = int(ctx.all_direct)
    args.flag_stride = MAX_TOKENS_PER_RANK
    args.seq_state, args.timeout_ns = ctx.seq_state.data.ptr, ctx.timeout_ns
    args.status = MaskedStatus(ctx.status.data.ptr, ctx.status_host_ptr, ctx.mask.data.ptr if ctx.shrink else 0,
                               ctx.rank, ctx.num_ranks)
    args.trace = ctx.trace.data.ptr if ctx.trace is not None else 0


class Run:
    """A call's kernel, ``run(stream, phases)``: launched with the phases given (both, the send alone, or the
    receive alone) set in its argument struct, ``args``. ``launch`` is of the family's build; the receive alone
    (a hook's) launches the same kernel of the receive-only build, ``receive_library``, on the same struct: the
    one place that picks a build, so the receive-only kernels never get a send phase (kReceiveOnly). Its
    :class:`Launch` is made at the first such launch (a call with ``out=`` makes its Run per call, and most calls
    receive whole)."""

    __slots__ = ("launch", "args", "receive_library", "receive")

    def __init__(self, launch: Launch, receive_library: Functions):
        self.launch, self.args, self.receive_library, self.receive = launch, launch.args, receive_library, None

    def __call__(self, stream, phases: int) -> None:
        self.args.phases = phases
        if phases != RECV_PHASE:
            self.launch(stream)
            return
        if self.receive is None:
            whole = self.launch
            self.receive = Launch(self.receive_library, whole.entry, whole.grid, whole.block, whole.args,
                                  whole.shared_bytes, whole.cluster)
        self.receive(stream)


class CombineRun(Run):
    """A combine's :class:`Run`, which also sets how long a hook's send looks for its peers' weights before it
    sends a token's several rows one by one: captured into a CUDA graph, as long as a combine that also receives
    (the struct's ``split_after_ns``, ``CUEP_COMBINE_SPLIT_US``), since ranks replaying graphs run in step; eager,
    ``eager_look_ns`` (``CUEP_COMBINE_HOOK_SPLIT_US``, 0 by default: one look, no wait for a peer)."""

    __slots__ = ("eager_look_ns",)

    def __init__(self, launch: Launch, receive_library: Functions, eager_look_ns: int):
        super().__init__(launch, receive_library)
        self.eager_look_ns = eager_look_ns

    def __call__(self, stream, phases: int) -> None:
        if phases == SEND_PHASE:
            args = self.args
            args.hook_split_after_ns = args.split_after_ns if stream.is_capturing() else self.eager_look_ns
        Run.__call__(self, stream, phases)  # (not super(): its lookup costs more, on every combine)


def dispatch_regions(num_ranks: int, max_tokens: int, hidden: int, num_experts: int, num_topk: int, use_fp8: bool,
                     use_ue8m0: bool, x_dtype) -> tuple[dict[str, View], int]:
    """Where a dispatch's outputs and its handle's arrays sit in the call's one allocation, and its bytes."""
    num_local = num_experts // num_ranks
    rows = num_ranks * max_tokens
    columns = hidden // SCALE_BLOCK // (UE8M0_SCALES_PER_WORD if use_ue8m0 else 1)
    scale_dtype = np.dtype(np.int32 if use_ue8m0 else np.float32)
    # Scales are column-major in the last two dims: each scale column is contiguous over rows.
    scale_strides = (columns * rows * scale_dtype.itemsize, scale_dtype.itemsize, rows * scale_dtype.itemsize)
    return carve([
        ("recv_x", (num_local, rows, hidden), np.uint8 if use_fp8 else x_dtype, None),
        ("recv_scales", (num_local, rows, columns) if use_fp8 else (0,), scale_dtype,
         scale_strides if use_fp8 else None),
        ("recv_count", (num_local,), np.int32, None),
        ("recv_src_info", (num_local, rows), np.int32, None),
        ("layout_range", (num_local, num_ranks), np.int64, None),
        ("combine_rows", (num_ranks, max_tokens, num_topk), np.int32, None),
        ("source_tokens", (num_ranks,), np.int32, None),
        ("call_record", (2,), np.int64, None)])  # uint64 call numbers to the kernels; int64 for every front


@dataclass(frozen=True)
class DispatchCall:
    """What a dispatch's checked arguments fix, kept per signature of them (:class:`~cuep._checks.KnownCalls`)."""

    plan_key: tuple   # ("dispatch", max_tokens, hidden, num_experts, num_topk, use_fp8, round_scale, use_ue8m0)
    num_tokens: int
    ids_are_int64: int
    use_fp8: bool
    x_dtype: Any

    @classmethod
    def of(cls, max_tokens: int, hidden: int, num_experts: int, num_tokens: int, num_topk: int, ids_are_int64: bool,
           use_fp8: bool, round_scale: bool, use_ue8m0: bool, x_dtype) -> DispatchCall:
        """The call of these shapes and options (which the caller has checked)."""
        plan_key = ("dispatch", int(max_tokens), hidden, int(num_experts), num_topk, bool(use_fp8), bool(round_scale),
                    bool(use_ue8m0))
        return cls(plan_key, num_tokens, int(ids_are_int64), bool(use_fp8), x_dtype)


def checked_dispatch(call: str, ctx: Context, x, topk_idx, max_tokens, num_experts, cumulative_stats, wait_stats,
                     use_fp8: bool, round_scale: bool, use_ue8m0: bool) -> tuple[DispatchCall, int, int, int, int]:
    """A dispatch's :class:`DispatchCall` and the device addresses of ``x``, ``topk_idx``, ``cumulative_stats``
    and ``wait_stats`` (0 for ``None``): what an earlier call whose arguments had the same signature concluded,
    else the checks' conclusion (:func:`cuep._checks.low_latency_dispatch_inputs`), kept for the next call.

    Arguments are the Buffer's: ``x`` `[num_tokens, hidden]` `bfloat16`; ``topk_idx`` `[num_tokens, num_topk]`
    `int64` or `int32`; ``cumulative_stats`` `[num_local_experts]` `int32` or ``None``; ``wait_stats``
    `[num_ranks]` `int64` or ``None``."""
    front = ctx.front
    key = _dispatch_signature(front.signature, x, topk_idx, max_tokens, num_experts, cumulative_stats, wait_stats,
                              use_fp8, round_scale, use_ue8m0)
    known = ctx.known.get(key)
    if known is None:
        x, topk_idx = _checks.low_latency_dispatch_inputs(call, x, topk_idx, max_tokens, num_experts, ctx.num_ranks,
                                                          MAX_TOPK, MAX_TOKENS_PER_RANK, use_fp8, round_scale,
                                                          use_ue8m0)
        cumulative_stats = _checks.optional_vector(call, "cumulative_local_expert_recv_stats", cumulative_stats,
                                                   np.int32, num_experts // ctx.num_ranks)
        wait_stats = _checks.optional_vector(call, "dispatch_wait_recv_cost_stats", wait_stats, np.int64,
                                             ctx.num_ranks)
        num_tokens, hidden = x.shape
        known = DispatchCall.of(max_tokens, hidden, num_experts, num_tokens, topk_idx.shape[1], topk_idx.itemsize == 8,
                                use_fp8, round_scale, use_ue8m0, x.dtype)
        ctx.known.add(key, known)
    pointer = front.pointer
    return (known, pointer(x), pointer(topk_idx), 0 if cumulative_stats is None else pointer(cumulative_stats),
            0 if wait_stats is None else pointer(wait_stats))


def _dispatch_signature(signature: Callable[[Any], Any], x, topk_idx, max_tokens, num_experts, cumulative_stats,
                        wait_stats, use_fp8, round_scale, use_ue8m0) -> tuple:
    """The key a dispatch's checked conclusion is kept under: what the front's ``signature`` reads of each array,
    and the other arguments (with the types of the two counts, which the checks read too)."""
    return ("dispatch", signature(x), signature(topk_idx), signature(cumulative_stats), signature(wait_stats),
            type(max_tokens), max_tokens, type(num_experts), num_experts, use_fp8, round_scale, use_ue8m0)


def _dispatch_plan(ctx: Context, key: tuple, x_dtype) -> Plan:
    """Checks the buffer and shared memory fit (ValueError otherwise), then plans the dispatch."""
    _, max_tokens, hidden, num_experts, num_topk, use_fp8, round_scale, use_ue8m0 = key
    layout = check_fits("low_latency_dispatch()", ctx, max_tokens, hidden, num_experts)
    table_words = routing_table_words(max_tokens, num_topk, num_experts, ctx.num_ranks)
    if table_words > ROUTING_WORDS:
        raise ValueError(f"low_latency_dispatch(): num_max_dispatch_tokens_per_rank={max_tokens} tokens of top-{num_topk} "
                         f"to num_experts={num_experts} need a routing table of {table_words} words, more than its "
                         f"{ROUTING_WORDS}; use fewer tokens per rank or fewer experts")
    layout_bytes = check_dispatch_shared_bytes("low_latency_dispatch()", max_tokens, ctx.num_ranks, num_experts,
                                               block_shared_bytes())
    staged_tokens, stage_bytes, shared_bytes = dispatch_staging(
        max_tokens, ctx.num_ranks, grid(ctx.num_sms), dispatch_message_bytes(hidden, use_fp8), layout_bytes,
        block_shared_bytes())
    regions, storage_bytes = dispatch_regions(ctx.num_ranks, max_tokens, hidden, num_experts, num_topk, use_fp8,
                                              use_ue8m0, x_dtype)
    routing_flags, _, token_flags, *_ = ctx.flags()
    data = ctx.data()
    a = DispatchArgs()
    _common(ctx, a)
    a.hidden, a.num_topk, a.num_experts, a.max_tokens = hidden, num_topk, num_experts, max_tokens
    a.use_fp8, a.round_scale, a.use_ue8m0 = int(use_fp8), int(round_scale), int(use_ue8m0)
    a.routing_flags, a.token_flags = routing_flags, token_flags
    a.routing, a.routing_words = ctx.tables()[0], ROUTING_WORDS
    a.slots, a.slot_bytes = data + layout.dispatch_slots, layout.dispatch_slot_bytes
    a.routing_staging, a.slot_staging = data + layout.routing_staging, data + layout.dispatch_staging
    a.staging_words = layout.routing_staging_words
    a.staged_tokens, a.stage_bytes = staged_tokens, stage_bytes
    a.source_decisions = ctx.source_decisions.data.ptr if ctx.source_decisions is not None else 0
    for library in (ctx.library, ctx.receive_library):
        library.function(DISPATCH_ENTRY)  # a missing entry fails here, on the first call, not at launch
        allow_shared_bytes(library, DISPATCH_ENTRY, shared_bytes, DISPATCH_STATIC_SHARED_BYTES)
    outputs = ("recv_x", "recv_count", "recv_scales") if use_fp8 else ("recv_x", "recv_count")
    return Plan(key, DISPATCH_ENTRY, grid(ctx.num_sms), bytes(a), shared_bytes, regions, storage_bytes,
                tuple(regions[name].offset for name in _OUTPUT_FIELDS),
                tuple(regions[name] for name in (*outputs, "recv_src_info", "layout_range")))


def _attach_dispatch(ctx: Context, plan: Plan, storage, views: list) -> tuple[tuple, tuple]:
    """What a dispatch keeps with its allocation (``attach`` of :class:`cuep._front.OutputPool`): the handle, the
    front's export of it, the argument struct with the outputs' addresses, and its :class:`Run`; the exported
    handle (and the core's) count as holders of the allocation."""
    _, max_tokens, hidden, num_experts, num_topk, use_fp8, *_ = plan.key
    handle = Handle(max_tokens, hidden, num_experts, 0, num_topk, storage, plan.regions, tuple(views[-2:]))
    a = plan.arguments(DispatchArgs)
    base = storage.ptr
    _OUTPUT_POINTERS.pack_into(a, _OUTPUT_START, *[base + offset for offset in plan.output_offsets])
    if not use_fp8:
        a.recv_scales = 0
    a.call_record = handle.call_record
    exported = ctx.front.export_handle(handle)
    run = Run(Launch(ctx.library, plan.entry, plan.grid, NUM_THREADS, a, plan.shared_bytes), ctx.receive_library)
    return (handle, exported, a, run), ((exported,) if exported is handle else (exported, handle))


def dispatch(ctx: Context, call: DispatchCall, x: int, topk_idx: int, cumulative_stats: int, wait_stats: int,
             reuse_outputs: bool = True):
    """A dispatch's outputs (on the current stream; reused, see ``Front.outputs``) and its launch, for the
    device addresses of its arrays (from :func:`checked_dispatch`; 0 for an absent one). The kernel picks the
    call's buffer.

    ``reuse_outputs``: take the outputs from the front's pool (``Front.outputs``); ``False`` for a one-off call
    whose allocation should not be kept.

    Returns:
        ``(recv_x, recv_scales, recv_count, handle, exported, run)``: the outputs (views of one allocation that
        ``handle`` holds; ``recv_scales`` ``None`` without FP8), the handle and the front's export of it (what
        the callers get), and the call's :class:`Run`.
    """
    key = call.plan_key
    plan = ctx.plans.get(key) or _new_plan(ctx, key, lambda: _dispatch_plan(ctx, key, call.x_dtype), _attach_dispatch)
    front = ctx.front
    # One allocation for every output of the call (each allocation costs host time on the decode path), the
    # same one again, with its handle and filled arguments, once the caller has let go of it.
    _, views, (handle, exported, a, run) = front.outputs(
        key if reuse_outputs else None, front.current_stream(), plan.storage_bytes, plan.outputs[0].dtype,
        plan.outputs, attach=plan.attach)
    _fill_dispatch(a, handle, call, x, topk_idx, cumulative_stats, wait_stats)
    return views[0], views[2] if call.use_fp8 else None, views[1], handle, exported, run


def eager_dispatch(ctx: Context, stream, x, topk_idx, max_tokens, num_experts, cumulative_stats, wait_stats,
                   use_fp8, round_scale, use_ue8m0) -> tuple[Any, Any, Any, Any] | None:
    """A plain eager dispatch (no hook, no ``async_finish``) whose signature was checked before, in one step: the
    same conclusion, pooled outputs and handle, argument struct and launch (both phases, on ``stream``, the current
    one) as :func:`checked_dispatch`, :func:`dispatch` and ``CallStreams.run_with_hook`` make of it, with fewer
    Python calls between them (see :func:`eager_combine`).

    Returns ``(recv_x, recv_scales, recv_count, exported)`` as :func:`dispatch` does, its kernel launched; ``None``,
    having done nothing, where the call needs those three: a signature not checked yet, a plan not made yet.
    Arguments are those :func:`checked_dispatch` takes."""
    front = ctx.front
    call = ctx.known.get(_dispatch_signature(front.signature, x, topk_idx, max_tokens, num_experts, cumulative_stats,
                                             wait_stats, use_fp8, round_scale, use_ue8m0))
    if call is None:
        return None
    plan = ctx.plans.get(call.plan_key)
    if plan is None:
        return None
    _, views, (handle, exported, a, run) = front.outputs(call.plan_key, stream, plan.storage_bytes,
                                                         plan.outputs[0].dtype, plan.outputs, False, plan.attach)
    pointer = front.pointer
    _fill_dispatch(a, handle, call, pointer(x), pointer(topk_idx),
                   0 if cumulative_stats is None else pointer(cumulative_stats),
                   0 if wait_stats is None else pointer(wait_stats))
    run(stream, SEND_PHASE | RECV_PHASE)
    return views[0], views[2] if call.use_fp8 else None, views[1], exported


def _fill_dispatch(a: DispatchArgs, handle: Handle, call: DispatchCall, x: int, topk_idx: int, cumulative_stats: int,
                   wait_stats: int) -> None:
    """Set this call's own fields of a dispatch's argument struct ``a`` and its ``handle``'s token count (the rest
    are its plan's and its outputs')."""
    num_tokens = handle.num_tokens = call.num_tokens
    a.x, a.num_tokens, a.topk_idx, a.ids_are_int64 = x, num_tokens, topk_idx, call.ids_are_int64
    a.cumulative_stats, a.wait_stats = cumulative_stats, wait_stats


@dataclass(frozen=True)
class CombineCall:
    """What a combine's checked arguments fix, kept per signature of them (:class:`~cuep._checks.KnownCalls`)."""

    plan_key: tuple               # ("combine", max_tokens, hidden, num_experts)
    num_tokens: int
    num_topk: int
    ids_are_int64: int
    out_regions: tuple[View, ...]  # the combined output, where the caller passes no ``out``
    out_bytes: int
    # The pooled outputs' key: the plan's (the attached struct holds its layout) and the output's shape, as plain
    # values, which hash faster than the regions' Views on every call.
    outputs_key: tuple

    @classmethod
    def of(cls, max_tokens: int, hidden: int, num_experts: int, num_tokens: int, num_topk: int,
           ids_are_int64: bool) -> CombineCall:
        """The call of these shapes (which the caller has checked)."""
        out_regions, out_bytes = combined_regions(num_tokens, hidden)
        plan_key = ("combine", max_tokens, hidden, num_experts)
        return cls(plan_key, num_tokens, num_topk, int(ids_are_int64), out_regions, out_bytes, (*plan_key, num_tokens))


@functools.lru_cache(maxsize=64)
def combined_regions(num_tokens: int, hidden: int) -> tuple[tuple[View, ...], int]:
    """The combine's output, `[num_tokens, hidden]` `bfloat16`, as a call's one region, and its bytes (one tuple
    per shape)."""
    regions, nbytes = carve([("combined_x", (num_tokens, hidden), bf16_dtype(), None)])
    return tuple(regions.values()), nbytes


def checked_combine(call: str, ctx: Context, x, topk_idx, topk_weights, handle: Handle, out,
                    wait_stats) -> tuple[CombineCall, int, int, int, Any, int]:
    """A combine's :class:`CombineCall`, the device addresses of ``x``, ``topk_idx``, ``topk_weights``, ``out``
    as an array (``None`` when not given) and the address of ``wait_stats`` (0 for ``None``): what an earlier
    call whose arguments had the same signature concluded, else the checks' conclusion
    (:func:`cuep._checks.low_latency_combine_inputs`), kept for the next call.

    Arguments are the Buffer's: ``x`` `[num_local_experts, num_ranks * max_tokens, hidden]` `bfloat16`;
    ``topk_idx`` and ``topk_weights`` `[num_tokens, num_topk]`; ``handle`` from the matching dispatch; ``out``
    `[num_tokens, hidden]` `bfloat16` or ``None``; ``wait_stats`` `[num_ranks]` `int64` or ``None``."""
    if not isinstance(handle, Handle):
        raise TypeError(f"{call}: handle must be the handle a low_latency_dispatch() on this Buffer returned")
    front = ctx.front
    key = _combine_signature(front.signature, x, topk_idx, topk_weights, out, wait_stats, handle)
    known = ctx.known.get(key)
    if known is None:
        x, topk_idx, topk_weights, out = _checks.low_latency_combine_inputs(call, x, topk_idx, topk_weights, handle,
                                                                            out, ctx.num_ranks)
        wait_stats = _checks.optional_vector(call, "combine_wait_recv_cost_stats", wait_stats, np.int64,
                                             ctx.num_ranks)
        known = CombineCall.of(handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts,
                               handle.num_tokens, handle.num_topk, topk_idx.itemsize == 8)
        ctx.known.add(key, known)
    pointer = front.pointer
    return (known, pointer(x), pointer(topk_idx), pointer(topk_weights), out,
            0 if wait_stats is None else pointer(wait_stats))


def _combine_signature(signature: Callable[[Any], Any], x, topk_idx, topk_weights, out, wait_stats,
                       handle: Handle) -> tuple:
    """The key a combine's checked conclusion is kept under: what the front's ``signature`` reads of each array,
    and the shapes of the dispatch ``handle`` came from."""
    return ("combine", signature(x), signature(topk_idx), signature(topk_weights), signature(out),
            signature(wait_stats), handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts,
            handle.num_tokens, handle.num_topk)


def _combine_plan(ctx: Context, key: tuple) -> Plan:
    _, max_tokens, hidden, num_experts = key
    layout = check_fits("low_latency_combine()", ctx, max_tokens, hidden, num_experts)
    _, weight_flags, _, token_flags, choice_flags = ctx.flags()
    data = ctx.data()
    a = CombineArgs()
    _common(ctx, a)
    a.hidden, a.num_experts, a.max_tokens = hidden, num_experts, max_tokens
    a.weight_flags, a.token_flags = weight_flags, token_flags
    a.weights, a.weight_words = ctx.tables()[1], WEIGHT_WORDS
    a.slots, a.slot_bytes = data + layout.combine_slots, layout.combine_slot_bytes
    # Shrink mode keeps each rank's messages in slots of its own: a masked rank that still runs must not
    # overwrite a live rank's rows, as it could in the choice slots. There a pair of several rows waits.
    a.choice_flags, a.choice_slots = choice_flags, 0 if ctx.shrink else data + layout.choice_slots
    a.split_after_ns = ctx.split_after_ns  # hook_split_after_ns: per launch (CombineRun)
    a.weight_staging, a.slot_staging = data + layout.weight_staging, data + layout.combine_staging
    a.staging_words = layout.weight_staging_words
    for library in (ctx.library, ctx.receive_library):
        library.function(COMBINE_ENTRY)
    return Plan(key, COMBINE_ENTRY, grid(ctx.num_sms), bytes(a), choice_slots=a.choice_slots)


def _combine_arguments(ctx: Context, plan: Plan, out: int) -> tuple[CombineArgs, Run]:
    """A combine's argument struct writing into ``out`` (an address), and its :class:`Run`."""
    a = plan.arguments(CombineArgs)
    a.combined_x = out
    return a, CombineRun(Launch(ctx.library, plan.entry, plan.grid, NUM_THREADS, a, plan.shared_bytes),
                         ctx.receive_library, ctx.hook_split_after_ns)


def _attach_combine(ctx: Context, plan: Plan, storage, views: list) -> tuple[tuple, tuple]:
    """What a combine keeps with its pooled output (``attach`` of :class:`cuep._front.OutputPool`)."""
    return _combine_arguments(ctx, plan, views[0].data.ptr), ()


def combine(ctx: Context, call: CombineCall, handle: Handle, x: int, topk_idx: int, topk_weights: int, out,
            wait_stats: int, use_logfmt: bool = False) -> tuple[Any, Run]:
    """A combine's output and launch, for the device addresses of its arrays (from :func:`checked_combine`).

    ``out``: the array to write into (from :func:`checked_combine`), or ``None`` for one from the front's pool
    (reused once the caller has let go of an earlier one, see ``Front.outputs``); ``use_logfmt``: partials
    travel as LogFMT (:mod:`cuep.logfmt`).

    Returns:
        ``(out, run)``: the combined output, `[num_tokens, hidden]` `bfloat16`, and the call's :class:`Run`.
    """
    key = call.plan_key
    plan = ctx.plans.get(key) or _new_plan(ctx, key, lambda: _combine_plan(ctx, key), _attach_combine)
    front = ctx.front
    if out is None:
        regions = call.out_regions
        _, (out,), (a, run) = front.outputs(call.outputs_key, front.current_stream(), call.out_bytes, regions[0].dtype,
                                            regions, readable=True, attach=plan.attach)
    else:
        a, run = _combine_arguments(ctx, plan, front.pointer(out))
    _fill_combine(a, plan, call, handle, x, topk_idx, topk_weights, wait_stats, use_logfmt)
    return out, run


def eager_combine(ctx: Context, stream, x, topk_idx, topk_weights, handle: Handle, wait_stats,
                  use_logfmt: bool) -> Any | None:
    """A plain eager combine (no ``out``, no hook, no ``async_finish``) whose signature was checked before, in one
    step: the same conclusion, pooled output, argument struct and launch (both phases, on ``stream``, the current
    one) as :func:`checked_combine`, :func:`combine` and ``CallStreams.run_with_hook`` make of it, with fewer Python
    calls between them: an eager decode step's host time is what users compare with DeepEP's.

    Returns the combined output, its kernel launched; ``None``, having done nothing, where the call needs those
    three: a handle not of this module (the checks name the error), a signature not checked yet, a plan not made
    yet. Arguments are the device arrays :func:`checked_combine` takes (``wait_stats`` ``None`` or an array)."""
    if type(handle) is not Handle:
        return None
    front = ctx.front
    call = ctx.known.get(_combine_signature(front.signature, x, topk_idx, topk_weights, None, wait_stats, handle))
    if call is None:
        return None
    plan = ctx.plans.get(call.plan_key)
    if plan is None:
        return None
    regions = call.out_regions
    _, (out,), (a, run) = front.outputs(call.outputs_key, stream, call.out_bytes, regions[0].dtype, regions, True,
                                        plan.attach)
    pointer = front.pointer
    _fill_combine(a, plan, call, handle, pointer(x), pointer(topk_idx), pointer(topk_weights),
                  0 if wait_stats is None else pointer(wait_stats), use_logfmt)
    run(stream, SEND_PHASE | RECV_PHASE)
    return out


def _fill_combine(a: CombineArgs, plan: Plan, call: CombineCall, handle: Handle, x: int, topk_idx: int,
                  topk_weights: int, wait_stats: int, use_logfmt: bool) -> None:
    """Set this call's own fields of a combine's argument struct ``a`` (the rest are its plan's and its output's)."""
    num_topk = call.num_topk
    a.x, a.topk_idx, a.ids_are_int64, a.topk_weights = x, topk_idx, call.ids_are_int64, topk_weights
    a.num_tokens, a.num_topk = call.num_tokens, num_topk
    # A token of more choices than slots cannot send its rows one by one: a pair of several rows waits.
    a.choice_slots = plan.choice_slots if num_topk <= CHOICE_SLOTS else 0
    a.combine_rows, a.source_tokens = handle.combine_rows, handle.source_tokens
    a.call_record = handle.call_record + _RECORD_BYTES
    a.use_logfmt, a.wait_stats = use_logfmt, wait_stats


__all__ = ["MAX_TOKENS_PER_RANK", "MAX_TOPK", "NUM_BUFFERS", "RECV_PHASE", "ROUTING_WORDS", "SEND_PHASE", "SEQ_WORDS",
           "TRACE_POINTS", "WEIGHT_WORDS", "CombineCall", "CombineRun", "Context", "DataLayout", "DispatchCall",
           "Handle", "Plan", "Run", "View", "buffer_bytes", "check_fits", "checked_combine", "checked_dispatch",
           "combine", "combined_regions", "data_bytes", "data_layout", "dispatch", "dispatch_regions", "eager_combine",
           "eager_dispatch", "fixed_bytes", "flags_bytes", "mask_bytes", "size_hint"]
