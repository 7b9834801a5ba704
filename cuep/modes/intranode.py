"""The intranode (NVLink) mode: normal-mode dispatch and combine between the ranks of one node.

What a Buffer hands this mode (:class:`Context`), what a dispatch leaves for combine and for cached
dispatch (:class:`Handle`), how each call lays out its rows in the NVL buffer (and so the buffer size
it needs), and the kernel sequence of each call, launched from ``cuda_src/intranode.cu`` through
:mod:`cuep.kernels.intranode`:

* non-cached :func:`dispatch`: stage, device barrier, notify, the CPU wait for the received count
  (unless ``num_worst_tokens``), pull;
* :func:`cached_dispatch` (a dispatch given a handle): one push kernel;
* :func:`combine`: one push-and-reduce kernel.

The NVL buffer holds a meta region of :data:`META_BYTES`, then two regions of
:func:`region_bytes` each, which successive dispatches and combines use in turn (see the top of
``intranode.cu``), so a call needs room in one region only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import numpy as np

from .. import _deps, _interop
from .._front import Front, carve
from .._status import StatusWords
from .._math import align_up
from ..jit import Library
from ..kernels import intranode as kernels
from ..kernels.intranode import MAX_EXPERTS, MAX_RANKS, META_BYTES, STATE_WORDS, pusher_warps
from ..kernels.launcher import KernelArgs, launch
from ..kernels.status import Status
from ..runtime.regions import SymmetricMemory
from .handles import FlatHandle

__all__ = ["ALIGN", "HANDLE_ARRAYS", "LANDING_ROW_ALIGN", "MAX_EXPERTS", "MAX_RANKS", "META_BYTES", "STATE_WORDS",
           "Context", "Handle", "StagingLayout", "cached_dispatch", "combine", "dispatch", "landing_row_bytes",
           "need_region_bytes", "nvl_bytes_for", "push_row_bytes", "pusher_warps", "region_bytes", "staging_layout"]

ALIGN = 16  # each staged array starts on a 16-byte vector

# Landing rows start on a 128-byte line. Rows pushed over NVLink at a stride that is not a multiple of
# 128 bytes split each warp's stores over one more line: measured on H200s at EP4 (push probe, 64
# SMs), 14368-byte rows took 476.3 us against 459.8 for the same rows at 14464, and 7392-byte rows
# 246.0 us against 241.7 at 7424.
LANDING_ROW_ALIGN = 128


# ------------------------------------------------------------------------------------------------
# Buffer layout and sizes

@dataclass(frozen=True)
class StagingLayout:
    """Where a sender's dispatch arrays sit in its call's region (byte offsets from the region's start;
    ``end``: the bytes they take)."""

    scales_offset: int
    topk_idx_offset: int
    topk_weights_offset: int
    send_lists_offset: int
    end: int


def staging_layout(num_tokens: int, hidden_bytes: int, num_scales: int, num_topk: int, num_ranks: int) -> StagingLayout:
    """The staging of a non-cached dispatch of ``num_tokens`` tokens: their rows (from offset 0), FP8
    scales, top-k ids (int64) and weights (float32), then one send list per destination (int32)."""
    scales = align_up(num_tokens * hidden_bytes, ALIGN)
    topk_idx = scales + align_up(num_tokens * num_scales * 4, ALIGN)
    topk_weights = topk_idx + align_up(num_tokens * num_topk * 8, ALIGN)
    send_lists = topk_weights + align_up(num_tokens * num_topk * 4, ALIGN)
    return StagingLayout(scales, topk_idx, topk_weights, send_lists, send_lists + align_up(num_ranks * num_tokens * 4,
                                                                                           ALIGN))


def region_bytes(num_nvl_bytes: int) -> int:
    """The size of each of the two regions after the meta region (whole 128-byte lines)."""
    return max(0, (num_nvl_bytes - META_BYTES) // 2) // LANDING_ROW_ALIGN * LANDING_ROW_ALIGN


def nvl_bytes_for(region_need: int) -> int:
    """The smallest ``num_nvl_bytes`` whose regions each hold ``region_need`` bytes."""
    return META_BYTES + 2 * align_up(region_need, LANDING_ROW_ALIGN)


def push_row_bytes(hidden_bytes: int, num_scales: int) -> int:
    """One cached-dispatch landing row: the hidden bytes, then the FP8 scales (float32)."""
    return align_up(hidden_bytes + num_scales * 4, LANDING_ROW_ALIGN)


def landing_row_bytes(hidden: int, num_weights: int) -> int:
    """One combine landing row: the bf16 hidden vector, then the top-k weights (float32)."""
    return align_up(hidden * 2 + num_weights * 4, LANDING_ROW_ALIGN)


# ------------------------------------------------------------------------------------------------
# Handle

@dataclass
class Handle(FlatHandle):
    """What a dispatch leaves for combine and for cached dispatch.

    ``rank_prefix_matrix``: DeepEP's, `[R, R]` (``[s][d]``: the tokens senders ``0..s`` send to ``d``), the
    flat tuple's first item, where DeepEP's users read it.
    ``recv_info``: ``[num_recv, num_send_copies, rank_prefix[R + 1], per-expert counts]`` on the GPU.
    ``send_pos[t, r]``: row of token ``t`` among those sent to rank ``r`` (-1 if not sent).
    ``recv_src_idx[i]``: source token index of received row ``i``.
    ``push_offsets``: ``[2R]`` this rank's first row among each destination's received rows, then each
    destination's received row count (what a cached push dispatch needs).

    Like DeepEP's handle it iterates as a flat tuple of arrays (:data:`HANDLE_ARRAYS` in order: the GPU
    arrays, then ``scalars``, a host ``int64`` array of the counts a CPU wait found, -1 where none did),
    so frameworks can save it with their tensors; :meth:`from_arrays` takes that tuple back.
    """

    num_tokens: int
    num_rows: int
    num_recv_tokens: int | None
    num_send_copies: int | None
    rank_prefix_matrix: Any
    recv_info: Any
    combine_offsets: Any
    send_offsets: Any
    push_offsets: Any
    send_pos: Any
    recv_src_idx: Any
    is_token_in_rank: Any

    ARRAY_DTYPES: ClassVar[dict[str, Any]] = {
        "rank_prefix_matrix": np.int32, "recv_info": np.int32, "combine_offsets": np.int32, "send_offsets": np.int32, "push_offsets": np.int32,
        "send_pos": np.int32, "recv_src_idx": np.int32, "is_token_in_rank": np.bool_}

    def scalars(self) -> list[int]:
        return [-1 if c is None else c for c in (self.num_recv_tokens, self.num_send_copies)]

    @classmethod
    def from_arrays(cls, arrays: dict[str, Any]) -> "Handle":
        """The handle whose flat tuple held ``arrays`` (CuPy arrays, ``scalars`` on the host), by name.

        Raises ``ValueError`` when their shapes do not fit together."""
        send_pos, recv_src_idx, scalars = arrays["send_pos"], arrays["recv_src_idx"], arrays["scalars"]
        num_ranks = send_pos.shape[1] if send_pos.ndim == 2 else -1
        cls.check_dtypes(arrays)
        if (num_ranks < 1 or arrays["push_offsets"].shape != (2 * num_ranks,) or recv_src_idx.ndim != 1
                or arrays["rank_prefix_matrix"].shape != (num_ranks, num_ranks)
                or arrays["is_token_in_rank"].shape != send_pos.shape or scalars.shape != (2,)):
            raise ValueError("handle: its arrays do not fit together; pass back the tuple a dispatch's handle gave")
        num_recv, num_copies = (int(c) if c >= 0 else None for c in scalars)
        return cls(num_tokens=send_pos.shape[0], num_rows=recv_src_idx.shape[0], num_recv_tokens=num_recv,
                   num_send_copies=num_copies, **{name: arrays[name] for name in cls.ARRAY_DTYPES})


#: The handle's flat tuple, in order: its GPU arrays, then the host ``scalars``.
HANDLE_ARRAYS = Handle.item_names()


# ------------------------------------------------------------------------------------------------
# Context

@dataclass
class Context:
    """What the intranode calls need from a Buffer: one per Buffer with an NVL buffer.

    Attributes:
        library: the loaded intranode family.
        rank, num_ranks: this rank and the ranks of the node (at most :data:`MAX_RANKS`).
        buffer_ptr: this rank's NVL buffer (device address), ``buffer_bytes`` long, zeroed before first use.
        buffer_bytes: ``num_nvl_bytes``, the same on every rank.
        peer_bases: `[num_ranks]` `uint64` device array: each rank's NVL buffer as this GPU addresses it.
        status: `[STATUS_WORDS]` `int32` device array, where kernels record timeouts and overflows.
        status_host_ptr: device address of its pinned host mirror (kernels write both, no copy).
        next_row: `[num_ranks + 1]` `int32` device array of work counters, zero between kernels.
        dispatch_state: `[STATE_WORDS]` `uint64` device array, zeroed: the finished dispatch and combine
            epochs and the running kernel's finished blocks (``kState*`` in ``intranode.cu``).
        device_sms: the GPU's SM count. Blocks of the dispatch and combine kernels wait on each other,
            so their grid must fit on the GPU at once.
        timeout_ns: the bound on every wait inside the kernels.
        barrier: ``barrier(stream)`` enqueues a device barrier of every rank on a CuPy stream.
        raise_if_failed: ``raise_if_failed()`` raises what the status words' host mirror recorded.
        front: where the outputs come from (:mod:`cuep._front`).
    """

    library: Library
    rank: int
    num_ranks: int
    buffer_ptr: int
    buffer_bytes: int
    peer_bases: Any
    status: Any
    status_host_ptr: int
    next_row: Any
    dispatch_state: Any
    device_sms: int
    timeout_ns: int
    barrier: Callable[[Any], None]
    raise_if_failed: Callable[[], None]
    front: Front
    templates: dict = field(default_factory=dict)  # argument struct -> its shared fields, as bytes (args_of)

    @classmethod
    def create(cls, library: Library, memory: SymmetricMemory, status: StatusWords, rank: int, num_ranks: int,
               device_sms: int, timeout_s: float, barrier: Callable[[Any], None],
               raise_if_failed: Callable[[], None], front: Front) -> "Context":
        """The context of a Buffer whose symmetric ``memory`` holds an NVL buffer (zeroed)."""
        cupy = _deps.cupy()
        bases = memory.peer_addresses(memory.regions.nvl_offset, num_ranks, rank)
        return cls(library=library, rank=rank, num_ranks=num_ranks, buffer_ptr=memory.nvl,
                   buffer_bytes=memory.regions.nvl_bytes, peer_bases=cupy.asarray(np.array(bases, dtype=np.uint64)),
                   status=status.device, status_host_ptr=status.host_ptr,
                   next_row=cupy.zeros(num_ranks + 1, dtype=cupy.int32),
                   dispatch_state=cupy.zeros(STATE_WORDS, dtype=cupy.uint64), device_sms=device_sms,
                   timeout_ns=int(timeout_s * 1e9), barrier=barrier, raise_if_failed=raise_if_failed, front=front)

    def status_mirror(self) -> Status:
        """The kernels' ``Status`` member."""
        return Status(self.status.data.ptr, self.status_host_ptr)

    def args_of(self, struct: type[KernelArgs]) -> KernelArgs:
        """A fresh ``struct`` with the fields that every call of this Buffer passes alike already set (its
        peers' bases, rank, ranks, region size, state, status, work counters, timeout: those it has),
        worked out on first use; each call sets the rest."""
        template = self.templates.get(struct)
        if template is None:
            shared = {"peer_bases": self.peer_bases.data.ptr, "rank": self.rank, "num_ranks": self.num_ranks,
                      "region_bytes": region_bytes(self.buffer_bytes), "state": self.dispatch_state.data.ptr,
                      "status": self.status_mirror(), "next_row": self.next_row.data.ptr,
                      "timeout_ns": self.timeout_ns}
            names = {name for name, *_ in struct._fields_}
            args = struct(**{name: value for name, value in shared.items() if name in names})
            template = self.templates[struct] = bytes(args)
        return struct.from_buffer_copy(template)


def need_region_bytes(call: str, ctx: Context, region_need: int, what: str) -> None:
    """Raises ``ValueError`` naming ``call`` unless each of the buffer's two regions holds ``region_need`` bytes."""
    if region_need > region_bytes(ctx.buffer_bytes):
        needed = nvl_bytes_for(region_need)
        raise ValueError(f"{call}: {what} needs an NVL buffer of {needed} bytes (two regions of {region_need}, "
                         f"used in turn by successive calls), but this Buffer has num_nvl_bytes={ctx.buffer_bytes}; "
                         f"create it with num_nvl_bytes >= {needed} "
                         f"(Config.get_nvl_buffer_size_hint gives a size for a batch)")


# ------------------------------------------------------------------------------------------------
# Calls

def _ptr(array) -> int:
    return 0 if array is None else array.data.ptr


def _token_rows(x, scales) -> kernels.TokenRows:
    """``x`` `[num_tokens, hidden]` and its FP8 ``scales`` `[num_tokens, num_scales]` (any strides) or ``None``."""
    rows = kernels.TokenRows(x=x.data.ptr, hidden_bytes=x.shape[1] * x.itemsize)
    if scales is not None:
        rows.scales, rows.num_scales = scales.data.ptr, scales.shape[1]
        rows.scale_token_stride, rows.scale_channel_stride = scales.strides[0] // 4, scales.strides[1] // 4
    return rows


def _sender_tokens(ctx: Context, x, scales, topk_idx, topk_weights, layout: StagingLayout) -> kernels.SenderTokens:
    """This rank's tokens and their staging, as the stage and dispatch kernels take them."""
    return kernels.SenderTokens(
        rows=_token_rows(x, scales), topk_idx=_ptr(topk_idx), topk_weights=_ptr(topk_weights),
        num_topk=topk_idx.shape[1] if topk_idx is not None else 0, num_tokens=x.shape[0], buffer=ctx.buffer_ptr,
        scales_offset=layout.scales_offset, topk_idx_offset=layout.topk_idx_offset,
        topk_weights_offset=layout.topk_weights_offset, send_lists_offset=layout.send_lists_offset)


@functools.lru_cache(maxsize=64)
def _routing_arrays(num_tokens: int, num_ranks: int, num_local_experts: int) -> tuple[tuple, int]:
    """Where a non-cached dispatch's routing arrays (its handle's) sit in their one allocation, in the order
    the dispatch unpacks them, and its bytes."""
    regions, nbytes = carve([("send_pos", (num_tokens, num_ranks), np.int32, None),
                             ("recv_info", (3 + num_ranks + num_local_experts,), np.int32, None),
                             ("combine_offsets", (2 * num_ranks,), np.int32, None),
                             ("send_offsets", (num_ranks,), np.int32, None),
                             ("push_offsets", (2 * num_ranks,), np.int32, None),
                             ("rank_prefix_matrix", (num_ranks, num_ranks), np.int32, None)])
    return tuple(regions.values()), nbytes


def dispatch(ctx: Context, stream, x, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert,
             num_experts: int, handle: Handle | None, expert_alignment: int, num_worst_tokens: int, num_sms: int):
    """Enqueue a dispatch on ``stream`` (a CuPy stream; outputs are allocated on the current stream).

    Cached (``handle`` given): :func:`cached_dispatch`. Otherwise stage, barrier, notify, the CPU wait
    for the received count (none with ``num_worst_tokens``), then the pull.

    Arguments:
        x: `[num_tokens, hidden]` (bf16, or FP8 bytes as uint8), C-contiguous.
        scales: `[num_tokens, hidden / 128]` `float32` FP8 scales (any strides), or ``None``.
        topk_idx: `[num_tokens, num_topk]` `int64` expert ids (-1: none), or ``None`` (non-cached only).
        topk_weights: `[num_tokens, num_topk]` `float32`, or ``None``.
        is_token_in_rank: `[num_tokens, num_ranks]` `bool`, whether each token goes to each rank.
        num_tokens_per_expert: `[num_experts]` `int32`, or ``None``.
        num_experts: the experts of all ranks (a multiple of ``num_ranks``).
        handle: a previous dispatch's handle for a cached dispatch, or ``None``.
        expert_alignment: the per-expert received counts are rounded up to a multiple of it.
        num_worst_tokens: if > 0, the received arrays have this many rows and nothing waits on the CPU.
        num_sms: blocks of the copy kernels (capped at the GPU's SMs).

    Returns:
        ``(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle)``;
        a cached dispatch returns ``None`` for the top-k arrays and ``[]`` for the list.
    """
    num_sms = min(num_sms, ctx.device_sms)
    if handle is not None:
        recv_x, recv_scales = cached_dispatch(ctx, stream, x, scales, handle, num_sms)
        return recv_x, recv_scales, None, None, [], handle
    front = ctx.front
    num_tokens, hidden_bytes = x.shape[0], x.shape[1] * x.itemsize
    num_scales = scales.shape[1] if scales is not None else 0
    num_topk = topk_idx.shape[1] if topk_idx is not None else 0
    layout = staging_layout(num_tokens, hidden_bytes, num_scales, num_topk, ctx.num_ranks)
    need_region_bytes("dispatch()", ctx, layout.end, f"dispatching {num_tokens} tokens")
    tokens = _sender_tokens(ctx, x, scales, topk_idx, topk_weights, layout)

    # Everything a kernel reads lives as long as the handle, so a captured CUDA graph stays valid.
    per_expert: list[int] = []
    num_recv = num_copies = None
    num_local_experts = num_experts // ctx.num_ranks
    regions, nbytes = _routing_arrays(num_tokens, ctx.num_ranks, num_local_experts)
    send_pos, recv_info, combine_offsets, send_offsets, push_offsets, rank_prefix_matrix = front.readable_views(
        front.storage(nbytes, regions[0].dtype), regions)
    stage = ctx.args_of(kernels.StageArgs)
    stage.tokens, stage.is_token_in_rank = tokens, _ptr(is_token_in_rank)
    stage.num_tokens_per_expert, stage.num_experts = _ptr(num_tokens_per_expert), num_experts
    stage.send_pos = send_pos.data.ptr
    launch(ctx.library, stage.entry, stream, kernels.stage_grid(ctx.num_ranks, num_sms), kernels.NUM_THREADS, stage)
    ctx.barrier(stream)
    notify = ctx.args_of(kernels.NotifyArgs)
    notify.num_experts, notify.expert_alignment = num_experts, expert_alignment
    notify.recv_info, notify.combine_offsets = recv_info.data.ptr, combine_offsets.data.ptr
    notify.send_offsets, notify.push_offsets = send_offsets.data.ptr, push_offsets.data.ptr
    notify.rank_prefix_matrix = rank_prefix_matrix.data.ptr
    launch(ctx.library, notify.entry, stream, 1, kernels.NUM_THREADS, notify)
    if num_worst_tokens > 0:
        num_rows = num_worst_tokens
    else:
        info = _interop.read_on_host(recv_info, stream)  # the one CPU wait of a non-cached dispatch: sizes the outputs
        ctx.raise_if_failed()  # a peer that never staged leaves counts that mean nothing
        num_recv, num_copies = int(info[0]), int(info[1])
        num_rows, per_expert = num_recv, info[3 + ctx.num_ranks:].tolist()

    recv_x = front.empty((num_rows, x.shape[1]), x.dtype)
    recv_scales = front.empty((num_rows, num_scales), scales.dtype) if scales is not None else None
    recv_topk_idx = front.empty((num_rows, num_topk), np.int64) if topk_idx is not None else None
    recv_topk_weights = front.empty((num_rows, num_topk), np.float32) if topk_weights is not None else None
    recv_src_idx = front.empty((num_rows,), np.int32)
    pull = ctx.args_of(kernels.DispatchArgs)
    pull.tokens, pull.recv_info, pull.num_experts, pull.num_rows = tokens, recv_info.data.ptr, num_experts, num_rows
    pull.recv = kernels.RecvArrays(x=recv_x.data.ptr, scales=_ptr(recv_scales), topk_idx=_ptr(recv_topk_idx),
                                   topk_weights=_ptr(recv_topk_weights), src_idx=recv_src_idx.data.ptr)
    launch(ctx.library, pull.entry, stream, num_sms, kernels.NUM_THREADS, pull)
    handle = Handle(num_tokens=num_tokens, num_rows=num_rows, num_recv_tokens=num_recv, num_send_copies=num_copies,
                    rank_prefix_matrix=rank_prefix_matrix, recv_info=recv_info, combine_offsets=combine_offsets, send_offsets=send_offsets,
                    push_offsets=push_offsets, send_pos=send_pos, recv_src_idx=recv_src_idx,
                    is_token_in_rank=is_token_in_rank)
    return recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert, handle


def cached_dispatch(ctx: Context, stream, x, scales, handle: Handle, num_sms: int):
    """Enqueue a cached dispatch (push form) on ``stream``; returns ``(recv_x, recv_scales)``.

    Every receiver's region must hold its received rows (:func:`push_row_bytes` each); this rank checks
    its own before launching, and the kernel checks every rank's (a rank whose buffer is too small
    raises here, the others from the kernel's status).

    Arguments:
        x, scales: as in :func:`dispatch`, with the handle's token count.
        handle: the non-cached dispatch's handle, whose routing this dispatch repeats.
        num_sms: blocks of the kernel (at most the GPU's SMs).
    """
    hidden_bytes = x.shape[1] * x.itemsize
    num_scales = scales.shape[1] if scales is not None else 0
    row_bytes = push_row_bytes(hidden_bytes, num_scales)
    need_region_bytes("dispatch()", ctx, handle.num_rows * row_bytes,
                      f"this cached dispatch, landing {handle.num_rows} rows of {row_bytes} bytes on rank {ctx.rank},")
    recv_x = ctx.front.empty((handle.num_rows, x.shape[1]), x.dtype)
    recv_scales = ctx.front.empty((handle.num_rows, num_scales), scales.dtype) if scales is not None else None
    push = ctx.args_of(kernels.PushArgs)
    push.rows, push.num_tokens, push.send_pos = _token_rows(x, scales), x.shape[0], handle.send_pos.data.ptr
    push.push_offsets, push.push_warps = handle.push_offsets.data.ptr, pusher_warps(ctx.num_ranks)
    push.row_bytes, push.recv_info, push.num_rows = row_bytes, handle.recv_info.data.ptr, handle.num_rows
    push.recv_x, push.recv_scales = recv_x.data.ptr, _ptr(recv_scales)
    launch(ctx.library, push.entry, stream, num_sms, kernels.NUM_THREADS, push)
    return recv_x, recv_scales


def combine(ctx: Context, stream, x, handle: Handle, topk_weights, bias0, bias1, num_sms: int):
    """Enqueue a combine on ``stream`` (outputs are allocated on the current stream).

    Arguments:
        x: `[handle.num_rows, hidden]` `bfloat16`, one row per received row of the handle's dispatch.
        handle: that dispatch's handle.
        topk_weights: `[handle.num_rows, num_topk]` `float32` summed back too, or ``None``.
        bias0, bias1: `[num_tokens, hidden]` `bfloat16` added to each result, or ``None``.
        num_sms: blocks of the kernel (capped at the GPU's SMs).

    Returns:
        ``(combined_x, combined_topk_weights)``: `[num_tokens, hidden]` `bfloat16`, and
        `[num_tokens, num_topk]` `float32` or ``None``.
    """
    hidden = x.shape[1]
    num_topk = topk_weights.shape[1] if topk_weights is not None else 0
    row_bytes = landing_row_bytes(hidden, num_topk)
    num_sms = min(num_sms, ctx.device_sms)
    copies = handle.num_send_copies if handle.num_send_copies is not None else handle.num_tokens * ctx.num_ranks
    need_region_bytes("combine()", ctx, copies * row_bytes, f"combining {handle.num_tokens} tokens")
    combined_x = ctx.front.empty((handle.num_tokens, hidden), x.dtype)
    combined_weights = ctx.front.empty((handle.num_tokens, num_topk), np.float32) if num_topk else None
    args = ctx.args_of(kernels.CombineArgs)
    args.recv_info, args.combine_offsets = handle.recv_info.data.ptr, handle.combine_offsets.data.ptr
    args.send_pos, args.send_offsets = handle.send_pos.data.ptr, handle.send_offsets.data.ptr
    args.num_tokens, args.x, args.hidden_bytes = handle.num_tokens, x.data.ptr, hidden * x.itemsize
    args.topk_weights, args.num_topk, args.landing_row_bytes = _ptr(topk_weights), num_topk, row_bytes
    args.bias0, args.bias1 = _ptr(bias0), _ptr(bias1)
    args.combined_x, args.combined_topk_weights = combined_x.data.ptr, _ptr(combined_weights)
    launch(ctx.library, args.entry, stream, num_sms, kernels.NUM_THREADS, args)
    return combined_x, combined_weights
