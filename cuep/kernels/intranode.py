"""Launch module of ``cuda_src/intranode.cu``: the NVLink dispatch (pull) and combine (push).

C++ entries (see the .cu file for the protocol)::

    cuep_intranode_stage(x, hidden_bytes, scales, scale_token_stride, scale_channel_stride, num_scales,
                         topk_idx, topk_weights, num_topk, is_token_in_rank, num_tokens_per_expert,
                         num_experts, num_tokens, num_ranks, buffer, scales_offset, topk_idx_offset,
                         topk_weights_offset, send_lists_offset, send_pos, cached)
    cuep_intranode_notify(peer_bases, rank, num_ranks, num_experts, expert_alignment, recv_info, plans,
                          combine_offsets, send_offsets)
    cuep_intranode_pull(plans, recv_info, rank, num_ranks, num_experts, num_rows, hidden_bytes, num_scales,
                        num_topk, recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx,
                        cached, status, next_row)
    cuep_intranode_push(peer_bases, recv_info, combine_offsets, rank, num_ranks, x, hidden_bytes, topk_weights,
                        num_topk, landing_row_bytes, next_row)
    cuep_intranode_reduce(buffer, send_pos, send_offsets, num_ranks, num_tokens, hidden, num_topk,
                          landing_row_bytes, bias0, bias1, has_weights, combined_x, combined_topk_weights)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .. import _deps
from ..jit import KernelSpec, Library

NUM_THREADS = 512
MAX_RANKS = 8
META_BYTES = 64 * 1024          # mirrors kMetaBytes
META_HEADER_BYTES = 6 * 8 + MAX_RANKS * 4
MAX_EXPERTS = (META_BYTES - META_HEADER_BYTES) // 4
PLAN_WORDS = 5                  # pointers in one SourcePlan
ALIGN = 16
SCALE_BLOCK = 128


def spec(arch: str, **features) -> KernelSpec:
    return KernelSpec.create("intranode", arch, **features)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class StagingLayout:
    """Where a sender's dispatch arrays sit in its buffer (byte offsets from its start)."""

    scales_offset: int
    topk_idx_offset: int
    topk_weights_offset: int
    send_lists_offset: int
    end: int


def staging_layout(num_tokens: int, hidden_bytes: int, num_scales: int, num_topk: int, num_ranks: int) -> StagingLayout:
    scales = META_BYTES + _aligned(num_tokens * hidden_bytes)
    topk_idx = scales + _aligned(num_tokens * num_scales * 4)
    topk_weights = topk_idx + _aligned(num_tokens * num_topk * 8)
    send_lists = topk_weights + _aligned(num_tokens * num_topk * 4)
    return StagingLayout(scales, topk_idx, topk_weights, send_lists, send_lists + _aligned(num_ranks * num_tokens * 4))


def landing_row_bytes(hidden: int, num_weights: int) -> int:
    """One combine landing row: the bf16 hidden vector, then the top-k weights."""
    return _aligned(hidden * 2 + num_weights * 4)


@dataclass
class Handle:
    """What a dispatch leaves for combine and for cached dispatch (opaque to users).

    ``recv_info``: ``[num_recv, num_send_copies, rank_prefix[R + 1], per-expert counts]`` on the GPU.
    ``send_pos[t, r]``: row of token ``t`` among those sent to rank ``r`` (-1 if not sent).
    ``recv_src_idx[i]``: source token index of received row ``i``.
    """

    num_tokens: int
    num_rows: int
    num_recv_tokens: int | None
    num_send_copies: int | None
    recv_info: Any
    plans: Any
    combine_offsets: Any
    send_offsets: Any
    send_pos: Any
    recv_src_idx: Any
    is_token_in_rank: Any


@dataclass
class Context:
    """What the launch functions need from a Buffer."""

    library: Library
    rank: int
    num_ranks: int
    buffer_ptr: int
    buffer_bytes: int
    peer_bases: Any               # [num_ranks] uint64 device array
    status: Any                   # [4] int32 device array (timeouts, overflow)
    next_row: Any                 # [num_ranks] int32 device array: per-source work counters of pull/push
    barrier: Callable[[Any], None]
    core_stream: Callable[[Any], Any]
    raise_if_failed: Callable[[], None]  # reads the status words mirrored after each barrier


def _launch(ctx: Context, stream, grid: int, entry: str, *args) -> None:
    core = _deps.cuda_core()
    core.launch(ctx.core_stream(stream), core.LaunchConfig(grid=grid, block=NUM_THREADS), ctx.library.kernel(entry),
                *args)


def _ptr(array) -> int:
    return 0 if array is None else array.data.ptr


def _reset_work_counters(ctx: Context, stream) -> None:
    _deps.cupy().cuda.runtime.memsetAsync(ctx.next_row.data.ptr, 0, ctx.next_row.nbytes, stream.ptr)


def need_nvl_bytes(call: str, ctx: Context, needed: int, what: str) -> None:
    if needed > ctx.buffer_bytes:
        raise ValueError(f"{call}: {what} needs an NVL buffer of {needed} bytes, but this Buffer has num_nvl_bytes="
                         f"{ctx.buffer_bytes}; create it with num_nvl_bytes >= {needed} "
                         f"(Config.get_nvl_buffer_size_hint gives a size for a batch)")


def dispatch(ctx: Context, stream, x, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert,
             num_experts: int, handle: Handle | None, expert_alignment: int, num_worst_tokens: int, num_sms: int):
    """Enqueue a dispatch on ``stream`` (allocating on the current stream) and return
    ``(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle)``."""
    cupy = _deps.cupy()
    num_tokens, hidden_bytes = x.shape[0], x.shape[1] * x.itemsize
    num_scales = scales.shape[1] if scales is not None else 0
    num_topk = topk_idx.shape[1] if topk_idx is not None else 0
    cached = handle is not None
    layout = staging_layout(num_tokens, hidden_bytes, num_scales, num_topk, ctx.num_ranks)
    need_nvl_bytes("dispatch()", ctx, layout.end, f"dispatching {num_tokens} tokens")
    send_pos = None if cached else cupy.empty((num_tokens, ctx.num_ranks), dtype=cupy.int32)
    scale_strides = (scales.strides[0] // 4, scales.strides[1] // 4) if scales is not None else (0, 0)
    _launch(ctx, stream, (0 if cached else ctx.num_ranks) + num_sms, "cuep_intranode_stage",
            x.data.ptr, np.int64(hidden_bytes), np.uint64(_ptr(scales)), np.int64(scale_strides[0]),
            np.int64(scale_strides[1]), np.int32(num_scales), np.uint64(_ptr(topk_idx)),
            np.uint64(_ptr(topk_weights)), np.int32(num_topk), np.uint64(0 if cached else _ptr(is_token_in_rank)),
            np.uint64(_ptr(num_tokens_per_expert)), np.int32(num_experts), np.int32(num_tokens),
            np.int32(ctx.num_ranks), np.uint64(ctx.buffer_ptr), np.int64(layout.scales_offset),
            np.int64(layout.topk_idx_offset), np.int64(layout.topk_weights_offset),
            np.int64(layout.send_lists_offset), np.uint64(_ptr(send_pos)), np.int32(cached))
    ctx.barrier(stream)

    # Everything a kernel reads lives as long as the handle, so a captured CUDA graph stays valid; a
    # cached call rewrites its handle's plan in place (same values, the senders' offsets aside).
    if cached:
        recv_info, plans = handle.recv_info, handle.plans
        combine_offsets, send_offsets = handle.combine_offsets, handle.send_offsets
    else:
        num_local_experts = num_experts // ctx.num_ranks
        recv_info = cupy.empty(3 + ctx.num_ranks + num_local_experts, dtype=cupy.int32)
        plans = cupy.empty(ctx.num_ranks * PLAN_WORDS, dtype=cupy.uint64)
        combine_offsets = cupy.empty(ctx.num_ranks, dtype=cupy.int32)
        send_offsets = cupy.empty(ctx.num_ranks, dtype=cupy.int32)
    _launch(ctx, stream, 1, "cuep_intranode_notify", ctx.peer_bases.data.ptr, np.int32(ctx.rank),
            np.int32(ctx.num_ranks), np.int32(num_experts), np.int32(expert_alignment), recv_info.data.ptr,
            plans.data.ptr, combine_offsets.data.ptr, send_offsets.data.ptr)

    per_expert: list[int] = []
    num_recv = num_copies = None
    if cached:
        num_rows, num_recv = handle.num_rows, handle.num_recv_tokens
    elif num_worst_tokens > 0:
        num_rows = num_worst_tokens
    else:
        info = recv_info.get(stream=stream)  # the one CPU wait of a non-cached dispatch: sizes the outputs
        ctx.raise_if_failed()  # a peer that never staged leaves counts that mean nothing
        num_recv, num_copies = int(info[0]), int(info[1])
        num_rows, per_expert = num_recv, [int(c) for c in info[3 + ctx.num_ranks:]]

    recv_x = cupy.empty((num_rows, x.shape[1]), dtype=x.dtype)
    recv_scales = cupy.empty((num_rows, num_scales), dtype=cupy.float32) if scales is not None else None
    recv_topk_idx = cupy.empty((num_rows, num_topk), dtype=cupy.int64) if topk_idx is not None else None
    recv_topk_weights = cupy.empty((num_rows, num_topk), dtype=cupy.float32) if topk_weights is not None else None
    recv_src_idx = handle.recv_src_idx if cached else cupy.empty(num_rows, dtype=cupy.int32)
    _reset_work_counters(ctx, stream)
    _launch(ctx, stream, num_sms, "cuep_intranode_pull", plans.data.ptr, recv_info.data.ptr, np.int32(ctx.rank),
            np.int32(ctx.num_ranks), np.int32(num_experts), np.int32(num_rows), np.int64(hidden_bytes),
            np.int32(num_scales), np.int32(num_topk), recv_x.data.ptr, np.uint64(_ptr(recv_scales)),
            np.uint64(_ptr(recv_topk_idx)), np.uint64(_ptr(recv_topk_weights)), recv_src_idx.data.ptr,
            np.int32(cached), ctx.status.data.ptr, ctx.next_row.data.ptr)
    ctx.barrier(stream)

    if not cached:
        handle = Handle(num_tokens=num_tokens, num_rows=num_rows,
                        num_recv_tokens=num_recv, num_send_copies=num_copies, recv_info=recv_info, plans=plans,
                        combine_offsets=combine_offsets, send_offsets=send_offsets, send_pos=send_pos,
                        recv_src_idx=recv_src_idx, is_token_in_rank=is_token_in_rank)
    return recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert, handle


def combine(ctx: Context, stream, x, handle: Handle, topk_weights, bias0, bias1, num_sms: int):
    """Enqueue a combine on ``stream`` (allocating on the current stream); returns
    ``(combined_x, combined_topk_weights)``."""
    cupy = _deps.cupy()
    hidden = x.shape[1]
    num_topk = topk_weights.shape[1] if topk_weights is not None else 0
    row_bytes = landing_row_bytes(hidden, num_topk)
    copies = handle.num_send_copies if handle.num_send_copies is not None else handle.num_tokens * ctx.num_ranks
    need_nvl_bytes("combine()", ctx, META_BYTES + copies * row_bytes, f"combining {handle.num_tokens} tokens")
    ctx.barrier(stream)  # every source's landing region is free
    _reset_work_counters(ctx, stream)
    _launch(ctx, stream, num_sms, "cuep_intranode_push", ctx.peer_bases.data.ptr, handle.recv_info.data.ptr,
            handle.combine_offsets.data.ptr, np.int32(ctx.rank), np.int32(ctx.num_ranks), x.data.ptr,
            np.int64(hidden * x.itemsize), np.uint64(_ptr(topk_weights)), np.int32(num_topk), np.int64(row_bytes),
            ctx.next_row.data.ptr)
    ctx.barrier(stream)  # every copy has landed
    combined_x = cupy.empty((handle.num_tokens, hidden), dtype=x.dtype)
    combined_weights = cupy.empty((handle.num_tokens, num_topk), dtype=cupy.float32) if num_topk else None
    _launch(ctx, stream, num_sms, "cuep_intranode_reduce", np.uint64(ctx.buffer_ptr), handle.send_pos.data.ptr,
            handle.send_offsets.data.ptr, np.int32(ctx.num_ranks), np.int32(handle.num_tokens), np.int32(hidden),
            np.int32(num_topk), np.int64(row_bytes), np.uint64(_ptr(bias0)), np.uint64(_ptr(bias1)),
            np.int32(num_topk > 0), combined_x.data.ptr, np.uint64(_ptr(combined_weights)))
    return combined_x, combined_weights
