"""``cuep.torch.Buffer``: DeepEP V1's ``deep_ep.Buffer`` for torch frameworks, a thin front over the core
(its public path is :mod:`cuep.torch.buffer`, as DeepEP's ``deep_ep.buffer``).

Each method hands its arguments to the same core as ``cuep.Buffer`` (the same checks, modes and
launches), made with a :class:`~cuep.torch.front.TorchFront`: torch tensors are read in place (no DLPack
round trip), outputs come from torch's caching allocator, work runs on torch's current stream. What
comes back is DeepEP's: torch tensors (FP8 as ``torch.float8_e4m3fn``), Python lists, DeepEP's handles
and :class:`~cuep.torch.event.EventOverlap`\\ s.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any

from .. import _deps
from ..buffer import Buffer as CoreBuffer
from ..config import Config
from ..modes import low_latency
from .event import EventHandle, EventOverlap, core_event, wrap
from .front import TorchFront
from .handles import DispatchHandle, LowLatencyHandle


def _torch_function_off(method):
    """``method`` with torch's ``__torch_function__`` handling off while it runs (not in hooks it returns).

    Under a Python torch-function mode every torch call of the host path runs through the mode in Python:
    ``torch.set_default_device``, which DeepEP's tests and some frameworks set, makes a low-latency call's
    views, allocations and tensor queries cost more than twice as much. DeepEP makes its tensors in C++,
    where no such mode reaches. cuep names every device, dtype and stream itself, so a mode has nothing to
    add here, and its arguments are plain tensors: a subclass's ``__torch_function__`` is not consulted
    either, as DeepEP's C++ never consults it."""
    torch_function_off = getattr(_deps.torch()._C, "DisableTorchFunction", contextlib.nullcontext)

    @functools.wraps(method)
    def call(*args, **kwargs):
        with torch_function_off():
            return method(*args, **kwargs)
    return call


def record_on_current_stream(torch, tensors) -> None:
    """Outputs allocated on the comm stream are used on the current one: tell torch's allocator, as DeepEP
    does, so that their memory is not handed out again before the current stream is done with them."""
    stream = torch.cuda.current_stream()
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
            tensor.record_stream(stream)


class Buffer:
    """The communication buffers of one rank for expert-parallel dispatch and combine, on torch tensors.

    ``import cuep.torch as deep_ep`` and use it as DeepEP V1's ``deep_ep.Buffer``. Creating a Buffer is
    collective over ``group``: it finds each rank's host and GPU (torch's current device), bootstraps the
    process's NVSHMEM world through the group's store (no MPI), allocates the buffers in NVSHMEM symmetric
    memory and compiles or loads the kernels (one rank per node compiles).

    Arguments:
        group: the ``torch.distributed`` process group of the expert-parallel ranks, of any backend (gloo
            CPU groups as vLLM passes them, NCCL), or ``None`` with ``comm``.
        num_nvl_bytes: bytes of the intranode (NVLink) buffer, used by normal-mode dispatch and combine.
        num_rdma_bytes: bytes of the internode buffer, used by the internode and low-latency modes.
        low_latency_mode: whether this Buffer serves the low-latency (decode) kernels.
        num_qps_per_rank: IBGDA's queue pairs per peer: sets ``NVSHMEM_IBGDA_NUM_RC_PER_PE`` unless that
            is set (the process's first Buffer's value counts: NVSHMEM starts once per process).
        allow_nvlink_for_low_latency_mode: let low-latency kernels store over NVLink to peers NVSHMEM can
            reach directly (``False`` forces NVSHMEM puts).
        allow_mnnvl, use_fabric: accepted for DeepEP compatibility (NVSHMEM picks multi-node NVLink and
            fabric memory itself).
        explicitly_destroy: resources are released only by :meth:`destroy` (or at exit).
        enable_shrink: low-latency shrink mode (see ``cuep.Buffer``).
        comm: an ``mpi4py`` communicator, used when ``group`` is ``None``.

    Differs from DeepEP: see docs/from-deepep.md.
    """

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm=None):
        torch = _deps.torch()
        ranks = group if group is not None else comm
        if ranks is None:
            raise ValueError("Buffer(): pass the expert-parallel group as group (a torch.distributed ProcessGroup) "
                             "or comm (an mpi4py communicator)")
        device_index = torch.cuda.current_device()
        self._front = TorchFront(device_index)
        self._core = CoreBuffer(ranks, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank,
                                allow_nvlink_for_low_latency_mode, explicitly_destroy, enable_shrink,
                                front=self._front, device_id=device_index)
        if self._core.device_id != device_index:
            raise ValueError(f"Buffer(): torch's current device is cuda:{device_index}, but this process's first "
                             f"Buffer runs on cuda:{self._core.device_id} (one NVSHMEM world per process); call "
                             f"torch.cuda.set_device({self._core.device_id}) first")
        self.group, self.comm = group, comm
        self.rank, self.group_size = self._core.rank, self._core.group_size
        self.num_nvl_bytes, self.num_rdma_bytes = self._core.num_nvl_bytes, self._core.num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy = self._core.low_latency_mode, bool(explicitly_destroy)
        self.enable_shrink = self._core.enable_shrink
        self.allow_mnnvl, self.use_fabric = bool(allow_mnnvl), bool(use_fabric)
        self._torch = torch

    #: SMs of the high-throughput kernels when no Config is given: DeepEP's 20 unless :meth:`set_num_sms`
    #: changed it (the count frameworks read to leave the other SMs to their GEMMs).
    num_sms: int = CoreBuffer.num_sms

    # ----------------------------------------------------------------------------------------------
    # Setup, sizes, streams
    def destroy(self) -> None:
        """Collective: release this Buffer's symmetric memory now (DeepEP's ``destroy``). Idempotent."""
        self._core.destroy()

    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether the kernels' Hopper (sm_90) path is built for the current GPU (see ``cuep.Buffer``)."""
        return CoreBuffer.is_sm90_compiled()

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SMs the high-throughput kernels use when no Config is passed (every Buffer)."""
        CoreBuffer.set_num_sms(new_num_sms)
        Buffer.num_sms = CoreBuffer.num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An :class:`EventOverlap` recorded on torch's current stream now (for ``previous_event``)."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of ``num_rdma_bytes`` that low-latency calls of up to this many tokens per rank need."""
        return CoreBuffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                                         num_experts)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """The dispatch Config for ``num_ranks`` ranks, with :attr:`num_sms` SMs."""
        return CoreBuffer.get_dispatch_config(num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """The combine Config for ``num_ranks`` ranks, with :attr:`num_sms` SMs."""
        return CoreBuffer.get_combine_config(num_ranks)

    def get_comm_stream(self):
        """The torch stream on which calls with ``previous_event``, ``async_finish`` or
        ``allocate_on_comm_stream`` (or captured into a CUDA graph) run their kernels."""
        return self._front.torch_stream(self._core.get_comm_stream())

    @_torch_function_off
    def get_local_buffer_tensor(self, dtype, size=None, offset: int = 0, use_rdma_buffer: bool = False):
        """A torch view of this rank's own buffer memory (NVSHMEM symmetric memory, peers can reach it).

        Arguments:
            dtype: the view's torch dtype.
            size: the view's shape (a ``torch.Size``, tuple or int); default every whole element from ``offset``.
            offset: where the view starts, in bytes from the buffer's start.
            use_rdma_buffer: view the ``num_rdma_bytes`` buffer instead of the ``num_nvl_bytes`` one.
        """
        shape = tuple(size) if isinstance(size, (tuple, list, self._torch.Size)) else size
        view = self._core.get_local_buffer_tensor(dtype, shape, offset, use_rdma_buffer)
        tensor = self._torch.from_dlpack(view)
        return tensor.view(dtype) if tensor.dtype != dtype else tensor

    def barrier(self, timeout_s: float | None = None) -> None:
        """Block until every rank reaches this barrier, on the device (cuep's; DeepEP has none)."""
        self._core.barrier(timeout_s)

    def get_internode_traffic(self) -> dict[str, int]:
        """Rows and bytes this rank has put to other nodes (cuep's; see ``cuep.Buffer``)."""
        return self._core.get_internode_traffic()

    # ----------------------------------------------------------------------------------------------
    # Normal mode
    @_torch_function_off
    def get_dispatch_layout(self, topk_idx, num_experts: int, previous_event: EventOverlap | None = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Count, from the top-k routing, what each rank, node and expert will receive.

        Arguments and returns as DeepEP's (``cuep.Buffer.get_dispatch_layout`` has the details), as torch
        tensors: ``(num_tokens_per_rank, num_tokens_per_rdma_rank or None, num_tokens_per_expert,
        is_token_in_rank, event)``.
        """
        call = "get_dispatch_layout()"
        per_rank, per_node, per_expert, in_rank, event = self._core.get_dispatch_layout(
            topk_idx, num_experts, core_event(call, previous_event), async_finish, allocate_on_comm_stream)
        export = self._front.export
        outputs = export(per_rank), export(per_node), export(per_expert), export(in_rank)
        if allocate_on_comm_stream:
            self._record_on_current_stream(outputs)
        return (*outputs, wrap(event))

    @_torch_function_off
    def dispatch(self, x, handle: tuple | None = None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                 previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Send each token to every rank that holds one of its experts (NVLink on one node; RDMA and NVLink
        across nodes).

        Arguments and returns as DeepEP's (``cuep.Buffer.dispatch`` has the details): ``x`` a `bfloat16`
        tensor or ``(x_fp8, scales)`` with `float8_e4m3fn` data; returns ``(recv_x, recv_topk_idx,
        recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)``, ``recv_x`` a tensor or the
        tuple ``(recv_x_fp8, recv_scales)``, the list a Python list of ints, ``handle`` a
        :class:`DispatchHandle`.
        """
        call = "dispatch()"
        recv_x, recv_topk_idx, recv_topk_weights, per_expert, core_handle, event = self._core.dispatch(
            x, self._core_handle(call, handle), num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
            num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens, config,
            core_event(call, previous_event), async_finish, allocate_on_comm_stream)
        export = self._front.export
        recv_x = (export(recv_x[0]), export(recv_x[1])) if isinstance(recv_x, tuple) else export(recv_x)
        if handle is None or not isinstance(handle, DispatchHandle):
            handle = self._dispatch_handle(core_handle)
        recv_topk_idx, recv_topk_weights = export(recv_topk_idx), export(recv_topk_weights)
        if allocate_on_comm_stream:
            self._record_on_current_stream((*(recv_x if isinstance(recv_x, tuple) else (recv_x,)), recv_topk_idx,
                                            recv_topk_weights, *handle))
        return recv_x, recv_topk_idx, recv_topk_weights, per_expert, handle, wrap(event)

    @_torch_function_off
    def combine(self, x, handle: tuple, topk_weights=None, bias=None, config: Config | None = None,
                previous_event: EventOverlap | None = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Send each received token back to its source rank and sum its copies there.

        Arguments and returns as DeepEP's (``cuep.Buffer.combine`` has the details): ``(combined_x,
        combined_topk_weights or None, event)``.
        """
        call = "combine()"
        combined_x, combined_weights, event = self._core.combine(
            x, self._core_handle(call, handle), topk_weights, bias, config, core_event(call, previous_event),
            async_finish, allocate_on_comm_stream)
        export = self._front.export
        combined_x, combined_weights = export(combined_x), export(combined_weights)
        if allocate_on_comm_stream:
            self._record_on_current_stream((combined_x, combined_weights))
        return combined_x, combined_weights, wrap(event)

    # DeepEP's Buffer.dispatch forwards to these across nodes; cuep's dispatch and combine serve both.
    internode_dispatch = dispatch
    internode_combine = combine

    # ----------------------------------------------------------------------------------------------
    # Low-latency mode
    @_torch_function_off
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False):
        """Send each token to the ranks holding its experts, laid out per local expert (decode).

        Arguments and returns as DeepEP's (``cuep.Buffer.low_latency_dispatch`` has the details):
        ``(recv_x, recv_count, handle, event, hook)``; ``recv_x`` is `[num_local_experts, num_ranks *
        num_max_dispatch_tokens_per_rank, hidden]` `bfloat16`, or with ``use_fp8`` the tuple of
        `float8_e4m3fn` data and its scales (`float32` `[..., hidden // 128]`, or packed UE8M0 `int32`
        `[..., hidden // 512]`, column-major in the last two dims); ``handle`` a :class:`LowLatencyHandle`.
        """
        arguments = (x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
                     dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook)
        done = self._core._eager_low_latency_dispatch(*arguments)  # the decode loop's call, once known: one step
        if done is not None:
            return (*done, EventOverlap(), None)
        recv_x, recv_count, handle, event, hook = self._core._full_low_latency_dispatch(*arguments)
        # The front made recv_x (FP8 as float8_e4m3fn), its scales, recv_count and the handle for torch already.
        return recv_x, recv_count, handle, wrap(event), hook

    @_torch_function_off
    def low_latency_combine(self, x, topk_idx, topk_weights, handle: tuple, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False,
                            out=None, combine_wait_recv_cost_stats=None):
        """Send the expert outputs back to their tokens' ranks and reduce them with the top-k weights.

        Arguments and returns as DeepEP's (``cuep.Buffer.low_latency_combine`` has the details):
        ``(combined_x, event, hook)``, ``combined_x`` `[num_tokens, hidden]` `bfloat16` (``out`` if given).
        """
        # A handle this Buffer's dispatch made, checked inline (the call counts microseconds); else the full check.
        core_handle = (handle.core if type(handle) is LowLatencyHandle and handle.front is self._front else
                       self._core_low_latency_handle("low_latency_combine()", handle))
        arguments = (x, topk_idx, topk_weights, core_handle, use_logfmt, async_finish, return_recv_hook, out,
                     combine_wait_recv_cost_stats)
        combined = self._core._eager_low_latency_combine(*arguments)  # the decode loop's call, once known: one step
        if combined is not None:
            return combined, EventOverlap(), None
        combined_x, event, hook = self._core._full_low_latency_combine(*arguments)
        return combined_x, wrap(event), hook

    @_torch_function_off
    def get_next_low_latency_combine_buffer(self, handle: tuple):
        """A `[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]` `bfloat16` tensor for
        the next :meth:`low_latency_combine`'s expert outputs (cuep reads any ``x`` in place, so this only
        saves DeepEP code a change)."""
        call = "get_next_low_latency_combine_buffer()"
        return self._front.export(self._core.get_next_low_latency_combine_buffer(
            self._core_low_latency_handle(call, handle)))

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Collective: zero the low-latency buffer (see ``cuep.Buffer.clean_low_latency_buffer``)."""
        self._core.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask=True``) or unmask a rank in shrink mode (see ``cuep.Buffer``)."""
        self._core.low_latency_update_mask_buffer(rank_to_mask, mask)

    @_torch_function_off
    def low_latency_query_mask_buffer(self, mask_status) -> None:
        """Write this rank's mask into ``mask_status``, `[num_ranks]` `torch.int` (1: masked), in stream order."""
        self._core.low_latency_query_mask_buffer(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Collective: unmask every rank and resume together (shrink mode)."""
        self._core.low_latency_clean_mask_buffer()

    @_torch_function_off
    def get_low_latency_trace(self):
        """In a ``CUEP_TRACE=1`` build, the last low-latency kernel's per-block phase times (cuep's own)."""
        trace = self._core.get_low_latency_trace()
        return None if trace is None else self._torch.from_dlpack(trace)

    # ----------------------------------------------------------------------------------------------
    # Outputs and handles
    def _record_on_current_stream(self, tensors) -> None:
        record_on_current_stream(self._torch, tensors)

    def _dispatch_handle(self, core_handle) -> DispatchHandle:
        torch = self._torch
        items = [torch.from_numpy(item) if not isinstance(item, torch.Tensor) else item for item in core_handle]
        handle = DispatchHandle(items)
        handle.core, handle.buffer = core_handle, self
        return handle

    def _core_handle(self, call: str, handle: Any):
        """The core handle of a normal-mode ``handle`` (a :class:`DispatchHandle` or the tuple of its items)."""
        if isinstance(handle, DispatchHandle):
            if handle.buffer is not self:
                raise ValueError(f"{call}: handle comes from another Buffer's dispatch; pass a handle of this one")
            return handle.core
        return handle  # None, or a rebuilt tuple the core checks item by item

    def _core_low_latency_handle(self, call: str, handle: Any) -> low_latency.Handle:
        if not isinstance(handle, LowLatencyHandle) or handle.core is None:
            what = "a handle rebuilt from its items" if isinstance(handle, LowLatencyHandle) else type(handle).__name__
            raise TypeError(f"{call}: handle must be the handle a low_latency_dispatch() on this Buffer returned, "
                            f"got {what}")
        if handle.front is not self._front:
            raise ValueError(f"{call}: handle comes from another Buffer's low_latency_dispatch(); pass a handle of "
                             f"this one")
        return handle.core

    def __del__(self) -> None:
        try:
            if self.explicitly_destroy and not self._core._resources.destroyed:
                warnings.warn("cuep.torch.Buffer(explicitly_destroy=True) was garbage-collected without destroy(); "
                              "its memory is released at exit", ResourceWarning, stacklevel=2)
                self._core.explicitly_destroy = False  # one warning, not a second from the core
        except Exception:  # a destructor never raises
            pass


__all__ = ["Buffer", "DispatchHandle", "LowLatencyHandle"]
