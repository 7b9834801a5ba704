"""The intranode (NVLink) mode: normal-mode dispatch and combine between the ranks of one node.

What a Buffer hands this mode (:class:`Context`), what a dispatch leaves for combine and for cached
dispatch (:class:`Handle`), how each call lays out its rows in the NVL buffer (and so the buffer size
it needs), and the kernel sequence of each call, launched from ``cuda_src/intranode.cu`` through
:mod:`cuep.kernels.intranode`:

* non-cached :func:`dispatch`: stage, device barrier, notify, the CPU wait for the received count
  (unless ``num_worst_tokens``), routing, then the rows as a cached dispatch pushes them;
* :func:`cached_dispatch` (a dispatch given a handle): one push kernel;
* :func:`combine`: one push-and-reduce kernel.

The NVL buffer holds a meta region of :data:`META_BYTES`, then two regions of
:func:`region_bytes` each, which successive calls use in turn (see the top of ``intranode.cu``). The
kernels that move rows go through any number of tokens in rounds that fit one region
(:func:`round_tokens`), so the buffer's size sets how many rounds a batch takes, not which batches fit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import numpy as np

from .. import _deps, _interop
from .._front import Front, carve
from .._status import StatusWords
from .._math import align_up, ceil_div
from ..jit import Library
from ..kernels import intranode as kernels
from ..kernels.intranode import (MAX_EXPERTS, MAX_RANKS, MAX_ROUND_ROWS, META_BYTES, ROUND_UNIT_TOKENS, STATE_WORDS,
                                 pusher_warps)
from ..kernels.launcher import KernelArgs, allow_shared_bytes, launch
from ..kernels.status import Status
from ..runtime.regions import SymmetricMemory
from .handles import FlatHandle

__all__ = ["ALIGN", "HANDLE_ARRAYS", "LANDING_ROW_ALIGN", "MAX_EXPERTS", "MAX_RANKS", "META_BYTES", "ROUND_UNIT_TOKENS",
           "STATE_WORDS", "Context", "Handle", "StagingLayout", "cached_dispatch", "combine", "dispatch",
           "landing_row_bytes", "need_region_bytes", "nvl_bytes_for", "push_row_bytes", "pusher_warps", "region_bytes",
           "round_tokens", "staging_layout"]

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
    """Where a sender's dispatch routing sits in its call's region (byte offsets from the region's start;
    ``end``: the bytes it takes). The rows are not staged: they are pushed in rounds."""

    topk_idx_offset: int
    topk_weights_offset: int
    send_lists_offset: int
    end: int


def staging_layout(num_tokens: int, num_topk: int, num_ranks: int) -> StagingLayout:
    """The staging of a non-cached dispatch of ``num_tokens`` tokens: top-k ids (int64) from offset 0 and
    weights (float32), then one send list per destination (int32)."""
    topk_weights = align_up(num_tokens * num_topk * 8, ALIGN)
    send_lists = topk_weights + align_up(num_tokens * num_topk * 4, ALIGN)
    return StagingLayout(0, topk_weights, send_lists, send_lists + align_up(num_ranks * num_tokens * 4, ALIGN))


def region_bytes(num_nvl_bytes: int) -> int:
    """The size of each of the two regions after the meta region (whole 128-byte lines)."""
    return max(0, (num_nvl_bytes - META_BYTES) // 2) // LANDING_ROW_ALIGN * LANDING_ROW_ALIGN


def nvl_bytes_for(region_need: int) -> int:
    """The smallest ``num_nvl_bytes`` whose regions each hold ``region_need`` bytes."""
    return META_BYTES + 2 * align_up(region_need, LANDING_ROW_ALIGN)


def round_tokens(num_nvl_bytes: int, row_bytes: int, num_ranks: int) -> int:
    """Source tokens per round of a kernel that moves rows of ``row_bytes`` (a landing row) through a buffer
    of ``num_nvl_bytes``: a region holds one section of that many landing rows per rank, whole units of
    :data:`ROUND_UNIT_TOKENS`, at most :data:`MAX_ROUND_ROWS` rows in all. 0: not even one unit fits."""
    per_section = min(region_bytes(num_nvl_bytes) // row_bytes, MAX_ROUND_ROWS) // num_ranks
    return per_section // ROUND_UNIT_TOKENS * ROUND_UNIT_TOKENS


def round_nvl_bytes(row_bytes: int, num_ranks: int, num_tokens: int) -> int:
    """The smallest ``num_nvl_bytes`` whose rounds take ``num_tokens`` source tokens (rounded up to whole
    units) of landing rows of ``row_bytes``."""
    tokens = min(align_up(max(num_tokens, 1), ROUND_UNIT_TOKENS),
                 max(ROUND_UNIT_TOKENS, MAX_ROUND_ROWS // num_ranks // ROUND_UNIT_TOKENS * ROUND_UNIT_TOKENS))
    return nvl_bytes_for(num_ranks * tokens * row_bytes)


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
    ``recv_info``: ``[num_recv, num_send_copies, max_tokens, rank_prefix[R + 1], per-expert counts]`` on the
    GPU (``max_tokens``: the most tokens any rank dispatched, which sets the rounds of every call).
    ``send_pos[t, r]``: row of token ``t`` among those sent to rank ``r`` (-1 if not sent).
    ``send_prefix[u, r]``: this rank's tokens before token ``u * ROUND_UNIT_TOKENS`` sent to rank ``r``; the
    last row holds the totals.
    ``recv_src_idx[i]``: source token index of received row ``i``.

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
    send_pos: Any
    send_prefix: Any
    recv_src_idx: Any
    is_token_in_rank: Any

    ARRAY_DTYPES: ClassVar[dict[str, Any]] = {
        "rank_prefix_matrix": np.int32, "recv_info": np.int32, "send_pos": np.int32, "send_prefix": np.int32,
        "recv_src_idx": np.int32, "is_token_in_rank": np.bool_}

    def scalars(self) -> list[int]:
        return [-1 if c is None else c for c in (self.num_recv_tokens, self.num_send_copies)]

    @classmethod
    def from_arrays(cls, arrays: dict[str, Any]) -> "Handle":
        """The handle whose flat tuple held ``arrays`` (CuPy arrays, ``scalars`` on the host), by name.

        Raises ``ValueError`` when their shapes do not fit together."""
        send_pos, recv_src_idx, scalars = arrays["send_pos"], arrays["recv_src_idx"], arrays["scalars"]
        num_ranks = send_pos.shape[1] if send_pos.ndim == 2 else -1
        cls.check_dtypes(arrays)
        units = ceil_div(send_pos.shape[0], ROUND_UNIT_TOKENS) if send_pos.ndim == 2 else -1
        if (num_ranks < 1 or arrays["send_prefix"].shape != (units + 1, num_ranks) or recv_src_idx.ndim != 1
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
        dispatch_state: `[STATE_WORDS]` `uint64` device array, zeroed: the finished dispatch epoch and
            intranode call, the running kernel's blocks done with its round and its rounds ended
            (``kState*`` in ``intranode.cu``).
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


def need_round_tokens(call: str, ctx: Context, row_bytes: int, what: str) -> int:
    """The source tokens per round of ``call``'s kernel, whose landing rows are ``row_bytes`` each; raises
    ``ValueError`` naming ``call`` when the buffer holds less than one round of :data:`ROUND_UNIT_TOKENS`."""
    tokens = round_tokens(ctx.buffer_bytes, row_bytes, ctx.num_ranks)
    if tokens == 0:
        needed = round_nvl_bytes(row_bytes, ctx.num_ranks, ROUND_UNIT_TOKENS)
        raise ValueError(f"{call}: {what} needs an NVL buffer of at least {needed} bytes (two regions, each holding "
                         f"{ROUND_UNIT_TOKENS} rows of {row_bytes} bytes from each of {ctx.num_ranks} ranks), but this "
                         f"Buffer has num_nvl_bytes={ctx.buffer_bytes}; create it with num_nvl_bytes >= {needed} "
                         f"(Config.get_nvl_buffer_size_hint gives a size)")
    return tokens


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


def _sender_tokens(ctx: Context, num_tokens: int, topk_idx, topk_weights,
                   layout: StagingLayout) -> kernels.SenderTokens:
    """This rank's routing and its staging, as the stage kernel takes them."""
    return kernels.SenderTokens(
        topk_idx=_ptr(topk_idx), topk_weights=_ptr(topk_weights),
        num_topk=topk_idx.shape[1] if topk_idx is not None else 0, num_tokens=num_tokens, buffer=ctx.buffer_ptr,
        topk_idx_offset=layout.topk_idx_offset, topk_weights_offset=layout.topk_weights_offset,
        send_lists_offset=layout.send_lists_offset)


RECV_INFO_RANK_PREFIX = 3  # recv_info: [num_recv, num_send_copies, max_tokens, rank_prefix[R + 1], per-expert counts]


@functools.lru_cache(maxsize=64)
def _routing_arrays(num_tokens: int, num_ranks: int, num_local_experts: int) -> tuple[tuple, int]:
    """Where a non-cached dispatch's routing arrays (its handle's) sit in their one allocation, in the order
    the dispatch unpacks them, and its bytes."""
    units = ceil_div(num_tokens, ROUND_UNIT_TOKENS)
    regions, nbytes = carve([("send_pos", (num_tokens, num_ranks), np.int32, None),
                             ("send_prefix", (units + 1, num_ranks), np.int32, None),
                             ("recv_info", (RECV_INFO_RANK_PREFIX + num_ranks + 1 + num_local_experts,), np.int32,
                              None),
                             ("rank_prefix_matrix", (num_ranks, num_ranks), np.int32, None)])
    return tuple(regions.values()), nbytes


def dispatch(ctx: Context, stream, x, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert,
             num_experts: int, handle: Handle | None, expert_alignment: int, num_worst_tokens: int, num_sms: int,
             known_rows: int | None = None):
    """Enqueue a dispatch on ``stream`` (a CuPy stream; outputs are allocated on the current stream).

    Cached (``handle`` given): :func:`cached_dispatch`. Otherwise stage, barrier, notify, the CPU wait
    for the received count (none with ``num_worst_tokens``), the routing, then the rows, pushed in rounds
    as a cached dispatch pushes them.

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
        known_rows: the rows this rank receives, known beforehand (a repeat of an earlier dispatch's routing):
            the received arrays have this many rows and nothing waits on the CPU; ``None`` otherwise.

    Returns:
        ``(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle)``;
        a cached dispatch returns ``None`` for the top-k arrays and ``[]`` for the list.
    """
    num_sms = min(num_sms, ctx.device_sms)
    if handle is not None:
        recv_x, recv_scales = cached_dispatch(ctx, stream, x, scales, handle, num_sms)
        return recv_x, recv_scales, None, None, [], handle
    front = ctx.front
    num_tokens = x.shape[0]
    num_topk = topk_idx.shape[1] if topk_idx is not None else 0
    rows = _rows_in_rounds(ctx, x, scales)
    layout = staging_layout(num_tokens, num_topk, ctx.num_ranks)
    need_region_bytes("dispatch()", ctx, layout.end, f"staging the routing of {num_tokens} tokens")

    # Everything a kernel reads lives as long as the handle, so a captured CUDA graph stays valid.
    per_expert: list[int] = []
    num_recv = num_copies = None
    num_local_experts = num_experts // ctx.num_ranks
    regions, nbytes = _routing_arrays(num_tokens, ctx.num_ranks, num_local_experts)
    send_pos, send_prefix, recv_info, rank_prefix_matrix = front.readable_views(
        front.storage(nbytes, regions[0].dtype), regions)
    stage = ctx.args_of(kernels.StageArgs)
    stage.tokens = _sender_tokens(ctx, num_tokens, topk_idx, topk_weights, layout)
    stage.is_token_in_rank = _ptr(is_token_in_rank)
    stage.num_tokens_per_expert, stage.num_experts = _ptr(num_tokens_per_expert), num_experts
    stage.send_pos, stage.send_prefix = send_pos.data.ptr, send_prefix.data.ptr
    launch(ctx.library, stage.entry, stream, kernels.stage_grid(ctx.num_ranks, num_sms), kernels.NUM_THREADS, stage)
    ctx.barrier(stream)
    notify = ctx.args_of(kernels.NotifyArgs)
    notify.num_experts, notify.expert_alignment = num_experts, expert_alignment
    notify.recv_info, notify.rank_prefix_matrix = recv_info.data.ptr, rank_prefix_matrix.data.ptr
    launch(ctx.library, notify.entry, stream, 1, kernels.NUM_THREADS, notify)
    if known_rows is not None:
        num_rows = known_rows
    elif num_worst_tokens > 0:
        num_rows = num_worst_tokens
    else:
        info = _interop.read_on_host(recv_info, stream)  # the one CPU wait of a non-cached dispatch: sizes the outputs
        ctx.raise_if_failed()  # a peer that never staged leaves counts that mean nothing
        num_recv, num_copies = int(info[0]), int(info[1])
        num_rows, per_expert = num_recv, info[RECV_INFO_RANK_PREFIX + ctx.num_ranks + 1:].tolist()

    recv_topk_idx = front.empty((num_rows, num_topk), np.int64) if topk_idx is not None else None
    recv_topk_weights = front.empty((num_rows, num_topk), np.float32) if topk_weights is not None else None
    recv_src_idx = front.empty((num_rows,), np.int32)
    routing = ctx.args_of(kernels.RoutingArgs)
    routing.num_topk, routing.recv_info, routing.num_experts, routing.num_rows = (num_topk, recv_info.data.ptr,
                                                                                  num_experts, num_rows)
    routing.recv = kernels.RecvRouting(topk_idx=_ptr(recv_topk_idx), topk_weights=_ptr(recv_topk_weights),
                                       src_idx=recv_src_idx.data.ptr)
    launch(ctx.library, routing.entry, stream, num_sms, kernels.NUM_THREADS, routing)
    handle = Handle(num_tokens=num_tokens, num_rows=num_rows, num_recv_tokens=num_recv, num_send_copies=num_copies,
                    rank_prefix_matrix=rank_prefix_matrix, recv_info=recv_info, send_pos=send_pos,
                    send_prefix=send_prefix, recv_src_idx=recv_src_idx, is_token_in_rank=is_token_in_rank)
    recv_x, recv_scales = _push_rows(ctx, stream, x, scales, handle, num_sms, rows)
    return recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert, handle


def cached_dispatch(ctx: Context, stream, x, scales, handle: Handle, num_sms: int):
    """Enqueue a cached dispatch (push form) on ``stream``; returns ``(recv_x, recv_scales)``.

    The rows go in rounds of :func:`round_tokens` source tokens, as many as the largest token count
    of the handle's dispatch needs.

    Arguments:
        x, scales: as in :func:`dispatch`, with the handle's token count.
        handle: the non-cached dispatch's handle, whose routing this dispatch repeats.
        num_sms: blocks of the kernel (at most the GPU's SMs).
    """
    return _push_rows(ctx, stream, x, scales, handle, num_sms, _rows_in_rounds(ctx, x, scales))


def _rows_in_rounds(ctx: Context, x, scales) -> tuple[int, int]:
    """A dispatch's landing row (:func:`push_row_bytes`) and its source tokens per round; raises
    ``ValueError`` (before any kernel runs) when the buffer holds less than one round of them."""
    row_bytes = push_row_bytes(x.shape[1] * x.itemsize, scales.shape[1] if scales is not None else 0)
    return row_bytes, need_round_tokens("dispatch()", ctx, row_bytes, "a dispatch of these rows")


def _push_rows(ctx: Context, stream, x, scales, handle: Handle, num_sms: int, rows: tuple[int, int]):
    """Enqueue the push kernel that moves a dispatch's rows along ``handle``'s routing, ``rows`` being
    :func:`_rows_in_rounds`'s; returns ``(recv_x, recv_scales)``."""
    num_scales = scales.shape[1] if scales is not None else 0
    recv_x = ctx.front.empty((handle.num_rows, x.shape[1]), x.dtype)
    recv_scales = ctx.front.empty((handle.num_rows, num_scales), scales.dtype) if scales is not None else None
    push = ctx.args_of(kernels.PushArgs)
    push.rows, push.num_tokens, push.send_pos = _token_rows(x, scales), x.shape[0], handle.send_pos.data.ptr
    push.send_prefix, push.recv_src_idx = handle.send_prefix.data.ptr, handle.recv_src_idx.data.ptr
    push.push_warps, push.deal_by_warp = pusher_warps(ctx.num_ranks), kernels.push_deal_by_warp(num_sms)
    push.row_bytes, push.round_tokens = rows
    push.recv_info, push.num_rows = handle.recv_info.data.ptr, handle.num_rows
    push.recv_x, push.recv_scales = recv_x.data.ptr, _ptr(recv_scales)
    launch(ctx.library, push.entry, stream, num_sms, kernels.NUM_THREADS, push,
           cluster=kernels.cluster_blocks(kernels.PUSH_CLUSTER, ctx.library.spec.sm90_features, num_sms))
    return recv_x, recv_scales


def combine(ctx: Context, stream, x, handle: Handle, topk_weights, bias0, bias1, num_sms: int,
            order_topk_idx=None, experts_per_rank: int = 0):
    """Enqueue a combine on ``stream`` (outputs are allocated on the current stream), in rounds of
    :func:`round_tokens` source tokens.

    Arguments:
        x: `[handle.num_rows, hidden]` `bfloat16`, one row per received row of the handle's dispatch.
        handle: that dispatch's handle.
        topk_weights: `[handle.num_rows, num_topk]` `float32` summed back too, or ``None``.
        bias0, bias1: `[num_tokens, hidden]` `bfloat16` added to each result, or ``None``.
        num_sms: blocks of the kernel (capped at the GPU's SMs).
        order_topk_idx: `[num_tokens, num_topk]` `int64`, the dispatch's expert ids, for DeepEP V2's
            summation order (the biases first, then each holder's copy in the order of its highest top-k
            lane; ``experts_per_rank`` experts per rank), or ``None`` for holders in rank order and the
            biases last.

    Returns:
        ``(combined_x, combined_topk_weights)``: `[num_tokens, hidden]` `bfloat16`, and
        `[num_tokens, num_topk]` `float32` or ``None``.
    """
    hidden = x.shape[1]
    num_topk = topk_weights.shape[1] if topk_weights is not None else 0
    row_bytes = landing_row_bytes(hidden, num_topk)
    num_sms = min(num_sms, ctx.device_sms)
    row_tokens = need_round_tokens("combine()", ctx, row_bytes, "a combine of these rows")
    combined_x = ctx.front.empty((handle.num_tokens, hidden), x.dtype)
    combined_weights = ctx.front.empty((handle.num_tokens, num_topk), np.float32) if num_topk else None
    args = ctx.args_of(kernels.CombineArgs)
    args.recv_info, args.send_pos = handle.recv_info.data.ptr, handle.send_pos.data.ptr
    args.send_prefix, args.recv_src_idx = handle.send_prefix.data.ptr, handle.recv_src_idx.data.ptr
    args.num_tokens, args.round_tokens, args.num_rows = handle.num_tokens, row_tokens, handle.num_rows
    args.x = x.data.ptr
    args.hidden_bytes = hidden * x.itemsize
    args.topk_weights, args.num_topk, args.landing_row_bytes = _ptr(topk_weights), num_topk, row_bytes
    args.bias0, args.bias1 = _ptr(bias0), _ptr(bias1)
    args.order_topk_idx = _ptr(order_topk_idx)
    args.order_num_topk = order_topk_idx.shape[1] if order_topk_idx is not None else 0
    args.experts_per_rank = experts_per_rank
    args.combined_x, args.combined_topk_weights = combined_x.data.ptr, _ptr(combined_weights)
    entry, shared_bytes = kernels.combine_launch(ctx.library.spec.sm90_features, num_sms)
    allow_shared_bytes(ctx.library, entry, shared_bytes)
    launch(ctx.library, entry, stream, num_sms, kernels.NUM_THREADS, args, shared_bytes,
           cluster=kernels.cluster_blocks(kernels.COMBINE_CLUSTER, ctx.library.spec.sm90_features, num_sms))
    return combined_x, combined_weights
