"""Launch module of ``cuda_src/intranode.cu``: the NVLink dispatch (pull when non-cached, push when
cached) and combine (push).

C++ entries (see the .cu file for the protocol); the first fifteen arguments of stage and dispatch
describe this rank's tokens and where they are staged (``_stage_args``)::

    cuep_intranode_stage(<stage args>, is_token_in_rank, num_tokens_per_expert, num_experts, num_ranks, send_pos,
                         peer_bases, rank, region_bytes, state, status_words, status_host, timeout_ns)
    cuep_intranode_notify(peer_bases, rank, num_ranks, num_experts, expert_alignment, recv_info,
                          combine_offsets, send_offsets, push_offsets)
    cuep_intranode_dispatch_push(x, hidden_bytes, scales, scale_token_stride, scale_channel_stride, num_scales,
                                 num_tokens, send_pos, push_offsets, push_warps, row_bytes, peer_bases, recv_info,
                                 rank, num_ranks, region_bytes, num_rows, recv_x, recv_scales, state,
                                 status_words, status_host, next_row, timeout_ns)
    cuep_intranode_dispatch(<stage args>, peer_bases, recv_info, rank, num_ranks, num_experts, num_rows, recv_x,
                            recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx, state, status_words,
                            status_host, next_row, timeout_ns)
    cuep_intranode_combine(peer_bases, recv_info, combine_offsets, send_pos, send_offsets, rank, num_ranks,
                           num_tokens, x, hidden_bytes, topk_weights, num_topk, landing_row_bytes, region_bytes,
                           bias0, bias1, combined_x, combined_topk_weights, state, status_words, status_host,
                           next_row, timeout_ns)
    cuep_intranode_probe(peer_bases, rank_prefix, rank, num_ranks, row_bytes, max_rows, pull, awaited, state,
                         next_row, timeout_ns)
    cuep_intranode_bulk_probe(peer_bases, rank_prefix, rank, num_ranks, row_bytes, max_rows, pull, state,
                              next_row)  (Hopper path only)

After the meta region the buffer holds two regions of ``region_bytes(num_nvl_bytes)`` each; successive
dispatches and combines use them in turn (see the .cu file), so a call needs room in one region only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .. import _deps
from ..jit import KernelSpec, Library

NUM_THREADS = 512
MAX_RANKS = 8
META_BYTES = 64 * 1024          # mirrors kMetaBytes
CONTROL_BYTES = 20 * 1024       # mirrors kControlBytes: the protocol's flags, at the end of the meta region
META_HEADER_BYTES = 6 * 8 + MAX_RANKS * 4
MAX_EXPERTS = (META_BYTES - CONTROL_BYTES - META_HEADER_BYTES) // 4
STATE_WORDS = 4                 # device-side state: finished dispatch epoch, blocks done, finished combine epoch,
                                # finished probe epoch
ALIGN = 16
SCALE_BLOCK = 128


def spec(arch: str, **features) -> KernelSpec:
    return KernelSpec.create("intranode", arch, **features)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


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
    scales = _aligned(num_tokens * hidden_bytes)
    topk_idx = scales + _aligned(num_tokens * num_scales * 4)
    topk_weights = topk_idx + _aligned(num_tokens * num_topk * 8)
    send_lists = topk_weights + _aligned(num_tokens * num_topk * 4)
    return StagingLayout(scales, topk_idx, topk_weights, send_lists, send_lists + _aligned(num_ranks * num_tokens * 4))


# Landing rows start on a 128-byte line. Rows pushed over NVLink at a stride that is not a multiple of
# 128 bytes split each warp's stores over one more line: measured on H200s at EP4 (push probe, 64
# SMs), 14368-byte rows took 476.3 us against 459.8 for the same rows at 14464, and 7392-byte rows
# 246.0 us against 241.7 at 7424.
LANDING_ROW_ALIGN = 128


def _landing_aligned(nbytes: int) -> int:
    return -(-nbytes // LANDING_ROW_ALIGN) * LANDING_ROW_ALIGN


def region_bytes(num_nvl_bytes: int) -> int:
    """The size of each of the two regions after the meta region (128-byte lines)."""
    return max(0, (num_nvl_bytes - META_BYTES) // 2) // LANDING_ROW_ALIGN * LANDING_ROW_ALIGN


def nvl_bytes_for(region_need: int) -> int:
    """The smallest ``num_nvl_bytes`` whose regions each hold ``region_need`` bytes."""
    return META_BYTES + 2 * _landing_aligned(region_need)


def push_row_bytes(hidden_bytes: int, num_scales: int) -> int:
    """One push-dispatch landing row: the hidden bytes, then the FP8 scales."""
    return _landing_aligned(hidden_bytes + num_scales * 4)


# Warps per block of a cached (push) dispatch that push this rank's tokens before copying rows out;
# the others copy landed rows out from the start. Measured on H200s at 128 SMs (BF16 / FP8 us, graph
# replays, v0.5.3): at 4 ranks 9, 10, 11, 12 and 13 pushers gave 492.4 / 274.2, 489.4-490.8 /
# 273.4-274.1, 485.5-488.9 / 272.5-273.1, 487.9-488.9 / 273.2-274.0 and 500.1 / 282.4; at 8 ranks
# 11 and 12 gave 867.3-867.7 / 485.6-486.5 and 863.1-864.0 / 484.8-486.6; at 2 ranks 8 and 12 were
# within 1% (v0.5.0).
_PUSHER_WARPS = {4: 11}
_DEFAULT_PUSHER_WARPS = 12


def pusher_warps(num_ranks: int) -> int:
    return _PUSHER_WARPS.get(num_ranks, _DEFAULT_PUSHER_WARPS)


def landing_row_bytes(hidden: int, num_weights: int) -> int:
    """One combine landing row: the bf16 hidden vector, then the top-k weights."""
    return _landing_aligned(hidden * 2 + num_weights * 4)


@dataclass
class Handle:
    """What a dispatch leaves for combine and for cached dispatch.

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
    recv_info: Any
    combine_offsets: Any
    send_offsets: Any
    push_offsets: Any
    send_pos: Any
    recv_src_idx: Any
    is_token_in_rank: Any

    def __iter__(self):
        counts = (self.num_recv_tokens, self.num_send_copies)
        scalars = np.array([-1 if c is None else c for c in counts], dtype=np.int64)
        return iter((*(getattr(self, name) for name in _HANDLE_ARRAY_DTYPES), scalars))

    def __len__(self) -> int:
        return len(HANDLE_ARRAYS)

    @classmethod
    def from_arrays(cls, arrays: dict[str, Any]) -> "Handle":
        """The handle whose flat tuple held ``arrays`` (CuPy arrays, ``scalars`` on the host), by name.

        Raises ``ValueError`` when their shapes do not fit together."""
        send_pos, recv_src_idx, scalars = arrays["send_pos"], arrays["recv_src_idx"], arrays["scalars"]
        num_ranks = send_pos.shape[1] if send_pos.ndim == 2 else -1
        for name, dtype in _HANDLE_ARRAY_DTYPES.items():
            if arrays[name].dtype != dtype:
                raise ValueError(f"handle item {name} must be {np.dtype(dtype)}, got {arrays[name].dtype}")
        if (num_ranks < 1 or arrays["push_offsets"].shape != (2 * num_ranks,) or recv_src_idx.ndim != 1
                or arrays["is_token_in_rank"].shape != send_pos.shape or scalars.shape != (2,)):
            raise ValueError("handle: its arrays do not fit together; pass back the tuple a dispatch's handle gave")
        num_recv, num_copies = (int(c) if c >= 0 else None for c in scalars)
        return cls(num_tokens=send_pos.shape[0], num_rows=recv_src_idx.shape[0], num_recv_tokens=num_recv,
                   num_send_copies=num_copies, **{name: arrays[name] for name in _HANDLE_ARRAY_DTYPES})


# The handle's GPU arrays and their dtypes, in the order of its flat tuple.
_HANDLE_ARRAY_DTYPES = {"recv_info": np.int32, "combine_offsets": np.int32, "send_offsets": np.int32,
                        "push_offsets": np.int32, "send_pos": np.int32, "recv_src_idx": np.int32,
                        "is_token_in_rank": np.bool_}
#: The handle's flat tuple, in order: its GPU arrays, then the host ``scalars``.
HANDLE_ARRAYS = (*_HANDLE_ARRAY_DTYPES, "scalars")


@dataclass
class Context:
    """What the launch functions need from a Buffer."""

    library: Library
    rank: int
    num_ranks: int
    buffer_ptr: int
    buffer_bytes: int
    peer_bases: Any               # [num_ranks] uint64 device array
    status: Any                   # [STATUS_WORDS] int32 device array (timeouts, overflow)
    status_host_ptr: int          # device address of its pinned host mirror: kernels write both, no copy
    next_row: Any                 # [num_ranks + 1] int32 device array: work counters, zero between kernels
    dispatch_state: Any           # [STATE_WORDS] uint64 device array: dispatch and combine epochs (kState*)
    device_sms: int               # the GPU's SM count: blocks of the fused kernels wait on each other, so
                                  # their grid must fit on the GPU at once
    timeout_ns: int               # bound on every wait inside the dispatch and combine kernels
    barrier: Callable[[Any], None]
    core_stream: Callable[[Any], Any]
    raise_if_failed: Callable[[], None]  # reads the status words' host mirror


@functools.lru_cache(maxsize=32)
def _launch_config(grid: int):
    return _deps.cuda_core().LaunchConfig(grid=grid, block=NUM_THREADS)


def _launch(ctx: Context, stream, grid: int, entry: str, *args) -> None:
    _deps.cuda_core().launch(ctx.core_stream(stream), _launch_config(grid), ctx.library.kernel(entry), *args)


def _ptr(array) -> int:
    return 0 if array is None else array.data.ptr


def need_region_bytes(call: str, ctx: Context, region_need: int, what: str) -> None:
    """Raises ValueError unless each of the buffer's two regions holds ``region_need`` bytes."""
    if region_need > region_bytes(ctx.buffer_bytes):
        needed = nvl_bytes_for(region_need)
        raise ValueError(f"{call}: {what} needs an NVL buffer of {needed} bytes (two regions of {region_need}, "
                         f"used in turn by successive calls), but this Buffer has num_nvl_bytes={ctx.buffer_bytes}; "
                         f"create it with num_nvl_bytes >= {needed} "
                         f"(Config.get_nvl_buffer_size_hint gives a size for a batch)")


def _scale_args(scales) -> tuple:
    """``scales, scale_token_stride, scale_channel_stride, num_scales`` (strides in floats) as kernel arguments."""
    if scales is None:
        return np.uint64(0), np.int64(0), np.int64(0), np.int32(0)
    return (np.uint64(scales.data.ptr), np.int64(scales.strides[0] // 4), np.int64(scales.strides[1] // 4),
            np.int32(scales.shape[1]))


def _stage_args(ctx: Context, x, scales, topk_idx, topk_weights, layout: StagingLayout) -> tuple:
    """The first fifteen arguments of the stage and dispatch kernels: this rank's tokens and their staging."""
    num_tokens, hidden_bytes = x.shape[0], x.shape[1] * x.itemsize
    return (x.data.ptr, np.int64(hidden_bytes), *_scale_args(scales), np.uint64(_ptr(topk_idx)),
            np.uint64(_ptr(topk_weights)), np.int32(topk_idx.shape[1] if topk_idx is not None else 0),
            np.int32(num_tokens), np.uint64(ctx.buffer_ptr), np.int64(layout.scales_offset),
            np.int64(layout.topk_idx_offset), np.int64(layout.topk_weights_offset), np.int64(layout.send_lists_offset))


def dispatch(ctx: Context, stream, x, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert,
             num_experts: int, handle: Handle | None, expert_alignment: int, num_worst_tokens: int, num_sms: int):
    """Enqueue a dispatch on ``stream`` (allocating on the current stream) and return
    ``(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle)``.

    Cached (``handle`` given): :func:`cached_dispatch`. Otherwise stage, barrier, notify, the CPU wait
    for the received count (unless ``num_worst_tokens``), then the pull."""
    num_sms = min(num_sms, ctx.device_sms)
    if handle is not None:
        recv_x, recv_scales = cached_dispatch(ctx, stream, x, scales, handle, num_sms)
        return recv_x, recv_scales, None, None, [], handle
    cupy = _deps.cupy()
    num_tokens, hidden_bytes = x.shape[0], x.shape[1] * x.itemsize
    num_scales = scales.shape[1] if scales is not None else 0
    num_topk = topk_idx.shape[1] if topk_idx is not None else 0
    layout = staging_layout(num_tokens, hidden_bytes, num_scales, num_topk, ctx.num_ranks)
    need_region_bytes("dispatch()", ctx, layout.end, f"dispatching {num_tokens} tokens")
    stage_args = _stage_args(ctx, x, scales, topk_idx, topk_weights, layout)
    waits = (ctx.status.data.ptr, np.uint64(ctx.status_host_ptr), np.uint64(ctx.timeout_ns))

    # Everything a kernel reads lives as long as the handle, so a captured CUDA graph stays valid.
    per_expert: list[int] = []
    num_recv = num_copies = None
    send_pos = cupy.empty((num_tokens, ctx.num_ranks), dtype=cupy.int32)
    _launch(ctx, stream, ctx.num_ranks + num_sms, "cuep_intranode_stage", *stage_args,
            np.uint64(_ptr(is_token_in_rank)), np.uint64(_ptr(num_tokens_per_expert)), np.int32(num_experts),
            np.int32(ctx.num_ranks), send_pos.data.ptr, ctx.peer_bases.data.ptr, np.int32(ctx.rank),
            np.int64(region_bytes(ctx.buffer_bytes)), ctx.dispatch_state.data.ptr, *waits)
    ctx.barrier(stream)
    num_local_experts = num_experts // ctx.num_ranks
    recv_info = cupy.empty(3 + ctx.num_ranks + num_local_experts, dtype=cupy.int32)
    combine_offsets = cupy.empty(2 * ctx.num_ranks, dtype=cupy.int32)
    send_offsets = cupy.empty(ctx.num_ranks, dtype=cupy.int32)
    push_offsets = cupy.empty(2 * ctx.num_ranks, dtype=cupy.int32)
    _launch(ctx, stream, 1, "cuep_intranode_notify", ctx.peer_bases.data.ptr, np.int32(ctx.rank),
            np.int32(ctx.num_ranks), np.int32(num_experts), np.int32(expert_alignment), recv_info.data.ptr,
            combine_offsets.data.ptr, send_offsets.data.ptr, push_offsets.data.ptr)
    if num_worst_tokens > 0:
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
    recv_src_idx = cupy.empty(num_rows, dtype=cupy.int32)
    _launch(ctx, stream, num_sms, "cuep_intranode_dispatch", *stage_args, ctx.peer_bases.data.ptr,
            recv_info.data.ptr, np.int32(ctx.rank), np.int32(ctx.num_ranks), np.int32(num_experts),
            np.int32(num_rows), recv_x.data.ptr, np.uint64(_ptr(recv_scales)), np.uint64(_ptr(recv_topk_idx)),
            np.uint64(_ptr(recv_topk_weights)), recv_src_idx.data.ptr, ctx.dispatch_state.data.ptr,
            ctx.status.data.ptr, np.uint64(ctx.status_host_ptr), ctx.next_row.data.ptr, np.uint64(ctx.timeout_ns))
    handle = Handle(num_tokens=num_tokens, num_rows=num_rows, num_recv_tokens=num_recv, num_send_copies=num_copies,
                    recv_info=recv_info, combine_offsets=combine_offsets, send_offsets=send_offsets,
                    push_offsets=push_offsets, send_pos=send_pos, recv_src_idx=recv_src_idx,
                    is_token_in_rank=is_token_in_rank)
    return recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert, handle


def cached_dispatch(ctx: Context, stream, x, scales, handle: Handle, num_sms: int):
    """Enqueue a cached dispatch (push form) on ``stream``; returns ``(recv_x, recv_scales)``.

    Every receiver's region must hold its received rows (``push_row_bytes`` each); this rank checks
    its own before launching, and the kernel checks every rank's (a rank whose buffer is too small
    raises here, the others from the kernel's status)."""
    cupy = _deps.cupy()
    num_tokens, hidden_bytes = x.shape[0], x.shape[1] * x.itemsize
    num_scales = scales.shape[1] if scales is not None else 0
    row_bytes = push_row_bytes(hidden_bytes, num_scales)
    need_region_bytes("dispatch()", ctx, handle.num_rows * row_bytes,
                      f"this cached dispatch, landing {handle.num_rows} rows of {row_bytes} bytes on rank {ctx.rank},")
    recv_x = cupy.empty((handle.num_rows, x.shape[1]), dtype=x.dtype)
    recv_scales = cupy.empty((handle.num_rows, num_scales), dtype=cupy.float32) if scales is not None else None
    _launch(ctx, stream, num_sms, "cuep_intranode_dispatch_push", x.data.ptr, np.int64(hidden_bytes),
            *_scale_args(scales), np.int32(num_tokens), handle.send_pos.data.ptr, handle.push_offsets.data.ptr,
            np.int32(pusher_warps(ctx.num_ranks)), np.int64(row_bytes), ctx.peer_bases.data.ptr,
            handle.recv_info.data.ptr, np.int32(ctx.rank), np.int32(ctx.num_ranks),
            np.int64(region_bytes(ctx.buffer_bytes)), np.int32(handle.num_rows), recv_x.data.ptr,
            np.uint64(_ptr(recv_scales)), ctx.dispatch_state.data.ptr, ctx.status.data.ptr,
            np.uint64(ctx.status_host_ptr), ctx.next_row.data.ptr, np.uint64(ctx.timeout_ns))
    return recv_x, recv_scales


def combine(ctx: Context, stream, x, handle: Handle, topk_weights, bias0, bias1, num_sms: int):
    """Enqueue a combine on ``stream`` (allocating on the current stream); returns
    ``(combined_x, combined_topk_weights)``."""
    cupy = _deps.cupy()
    hidden = x.shape[1]
    num_topk = topk_weights.shape[1] if topk_weights is not None else 0
    row_bytes = landing_row_bytes(hidden, num_topk)
    num_sms = min(num_sms, ctx.device_sms)
    copies = handle.num_send_copies if handle.num_send_copies is not None else handle.num_tokens * ctx.num_ranks
    need_region_bytes("combine()", ctx, copies * row_bytes, f"combining {handle.num_tokens} tokens")
    combined_x = cupy.empty((handle.num_tokens, hidden), dtype=x.dtype)
    combined_weights = cupy.empty((handle.num_tokens, num_topk), dtype=cupy.float32) if num_topk else None
    _launch(ctx, stream, num_sms, "cuep_intranode_combine", ctx.peer_bases.data.ptr, handle.recv_info.data.ptr,
            handle.combine_offsets.data.ptr, handle.send_pos.data.ptr, handle.send_offsets.data.ptr,
            np.int32(ctx.rank), np.int32(ctx.num_ranks), np.int32(handle.num_tokens), x.data.ptr,
            np.int64(hidden * x.itemsize), np.uint64(_ptr(topk_weights)), np.int32(num_topk), np.int64(row_bytes),
            np.int64(region_bytes(ctx.buffer_bytes)), np.uint64(_ptr(bias0)), np.uint64(_ptr(bias1)),
            combined_x.data.ptr, np.uint64(_ptr(combined_weights)),
            ctx.dispatch_state.data.ptr, ctx.status.data.ptr, np.uint64(ctx.status_host_ptr), ctx.next_row.data.ptr,
            np.uint64(ctx.timeout_ns))
    return combined_x, combined_weights


def probe_bytes(num_ranks: int, max_rows: int, row_bytes: int) -> int:
    """NVL buffer the ceiling probe needs: a source and a landing region of ``num_ranks * max_rows`` rows."""
    return META_BYTES + 2 * num_ranks * max_rows * row_bytes


def probe(ctx: Context, stream, rank_prefix, max_rows: int, row_bytes: int, pull: bool, num_sms: int,
          bulk: bool = False, awaited: bool = False) -> None:
    """Enqueue the NVLink ceiling probe: the row copies of a dispatch (``pull``) or a combine, nothing else.

    ``rank_prefix``: ``[num_ranks + 1]`` int32 device array, the prefix sum of the rows exchanged with
    each peer (at most ``max_rows`` each). ``bulk``: copy with the Hopper bulk-copy unit (TMA) instead of
    the warps' loads and stores. ``awaited`` (push only): the launch also ends only once every peer's
    rows have landed here, counted once per sender block, the least a call that pushes must wait for.
    It overwrites this rank's and its peers' buffers past the meta region, so every rank must run it,
    with the same ``num_sms``, with no dispatch or combine in flight (``cuep.bench --mode ceiling``)."""
    needed = probe_bytes(ctx.num_ranks, max_rows, row_bytes)
    if needed > ctx.buffer_bytes:
        raise ValueError(f"probe(): probing {max_rows} rows a peer needs num_nvl_bytes >= {needed}, but this Buffer "
                         f"has {ctx.buffer_bytes}")
    if bulk and not ctx.library.spec.sm90_features:
        raise ValueError(f"probe(): bulk=True needs the Hopper path, but the intranode kernels were built as "
                         f"{ctx.library.spec.name}")
    if awaited and (pull or bulk):
        raise ValueError("probe(): awaited=True times the warps' pushes only (pull=False, bulk=False)")
    args = (ctx.peer_bases.data.ptr, rank_prefix.data.ptr, np.int32(ctx.rank), np.int32(ctx.num_ranks),
            np.int64(row_bytes), np.int32(max_rows), np.int32(pull))
    grid = min(num_sms, ctx.device_sms)
    if bulk:
        _launch(ctx, stream, grid, "cuep_intranode_bulk_probe", *args, ctx.dispatch_state.data.ptr,
                ctx.next_row.data.ptr)
    else:
        _launch(ctx, stream, grid, "cuep_intranode_probe", *args, np.int32(awaited), ctx.dispatch_state.data.ptr,
                ctx.next_row.data.ptr, np.uint64(ctx.timeout_ns))
