"""DeepEP V2's ``ElasticBuffer`` and ``EPHandle`` on torch tensors (``deep_ep.ElasticBuffer``): the core's
:class:`cuep.elastic.ElasticBuffer` with torch's streams and tensors, as :class:`cuep.torch.Buffer` is V1's."""

from __future__ import annotations

from .. import _deps
from ..elastic import EPHandle as CoreHandle
from ..elastic import ElasticBuffer as CoreElasticBuffer
from ._buffer import _torch_function_off, record_on_current_stream
from .event import EventHandle, core_event, wrap
from .front import TorchFront

# The handle's tensors, exported from the core's arrays when the handle is made.
_HANDLE_TENSORS = ("topk_idx", "psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                   "num_unaligned_recv_tokens_per_expert", "recv_src_metadata", "token_metadata_at_forward")


class EPHandle:
    """What :meth:`ElasticBuffer.dispatch` returns for :meth:`ElasticBuffer.combine` and cached dispatch, with
    DeepEP V2's fields as torch tensors (:class:`cuep.elastic.EPHandle` documents each). Reassigning a field
    (V2's test trims ``recv_src_metadata``) changes what the caller reads, not what combine uses."""

    def __init__(self, core: CoreHandle, front: TorchFront):
        self._core, self._front = core, front
        for name in ("do_expand", "num_experts", "expert_alignment", "num_max_tokens_per_rank", "num_sms",
                     "num_recv_tokens", "num_expanded_tokens", "num_recv_tokens_per_expert_list",
                     "channel_linked_list"):
            setattr(self, name, getattr(core, name))
        for name in _HANDLE_TENSORS:
            setattr(self, name, front.export(getattr(core, name)))

    @property
    def dst_buffer_slot_idx(self):
        """`int32`, as the core handle's: `[num_tokens, num_topk]` on one node, the forwarders' record across nodes."""
        return self._front.export(self._core.dst_buffer_slot_idx)


class ElasticBuffer:
    """DeepEP V2's ``ElasticBuffer`` on cuep's kernels, for torch: ``import cuep.torch as deep_ep`` and use
    ``deep_ep.ElasticBuffer(group, ...)``. Arguments, methods and returns as :class:`cuep.elastic.ElasticBuffer`
    (DeepEP V2's signatures), with torch tensors, :class:`EventOverlap` and :class:`EventHandle`; ``group`` a
    ``torch.distributed`` process group; the GPU is torch's current device."""

    def __init__(self, group, num_bytes: int | None = None, num_cpu_bytes: int = 0, num_max_tokens_per_rank: int = 0,
                 hidden: int = 0, num_topk: int = 0, use_fp8_dispatch: bool = False, deterministic: bool = False,
                 allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True, sl_idx: int = 3, num_allocated_qps: int = 0,
                 num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False):
        torch = _deps.torch()
        device_index = torch.cuda.current_device()
        self._torch, self._front = torch, TorchFront(device_index)
        self._core = CoreElasticBuffer(group, num_bytes, num_cpu_bytes, num_max_tokens_per_rank, hidden, num_topk,
                                       use_fp8_dispatch, deterministic, allow_hybrid_mode, allow_multiple_reduction,
                                       prefer_overlap_with_compute, sl_idx, num_allocated_qps, num_cpu_timeout_secs,
                                       num_gpu_timeout_secs, explicitly_destroy, front=self._front,
                                       device_id=device_index)
        core = self._core
        for name in ("group", "num_bytes", "rank_idx", "num_ranks", "num_max_tokens_per_rank", "deterministic",
                     "allow_hybrid_mode", "allow_multiple_reduction", "prefer_overlap_with_compute",
                     "explicitly_destroy", "num_allocated_qps", "num_scaleout_ranks", "num_scaleup_ranks",
                     "scaleout_rank_idx", "scaleup_rank_idx", "num_rdma_ranks", "num_nvlink_ranks"):
            setattr(self, name, getattr(core, name))

    get_buffer_size_hint = staticmethod(CoreElasticBuffer.get_buffer_size_hint)

    def destroy(self) -> None:
        """Collective: release the buffer now (needs ``explicitly_destroy=True``). Idempotent."""
        self._core.destroy()

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """Every rank waits for every other, on the device (see the core's)."""
        self._core.barrier(use_comm_stream, with_cpu_sync, sequential)

    @staticmethod
    def capture() -> EventHandle:
        """An :class:`EventHandle` recorded on torch's current stream now (for ``previous_event``)."""
        return EventHandle()

    def get_comm_stream(self):
        """The torch stream of the calls with ``previous_event``, ``async_with_compute_stream`` or
        ``allocate_on_comm_stream``."""
        return self._front.torch_stream(self._core.get_comm_stream())

    def get_physical_domain_size(self) -> tuple[int, int]:
        """``(num_rdma_ranks, num_nvlink_ranks)``."""
        return self._core.get_physical_domain_size()

    def get_logical_domain_size(self) -> tuple[int, int]:
        """``(num_scaleout_ranks, num_scaleup_ranks)``."""
        return self._core.get_logical_domain_size()

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """V2's analytic SM count (see the core's)."""
        return self._core.get_theoretical_num_sms(num_experts, num_topk, num_scaleout_topk, rdma_gbs, nvlink_gbs,
                                                  sm_read_gbs, sm_write_gbs)

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """V2's queue-pair count for ``num_sms`` SMs."""
        return self._core.get_theoretical_num_qps(num_sms)

    def __getattr__(self, name: str):
        return getattr(self._core, name) if not name.startswith("_") else super().__getattribute__(name)

    @_torch_function_off
    def dispatch(self, x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None,
                 num_experts: int | None = None, num_max_tokens_per_rank: int | None = None,
                 expert_alignment: int | None = None, num_sms: int = 0, num_qps: int = 0, previous_event=None,
                 previous_event_before_epilogue=None, async_with_compute_stream: bool = False,
                 allocate_on_comm_stream: bool = False, handle: EPHandle | None = None, do_handle_copy: bool = True,
                 do_cpu_sync: bool | None = None, do_expand: bool = False, do_zero_padding: bool = False,
                 use_tma_aligned_col_major_sf: bool = False):
        """Send each token to every rank that holds one of its experts; returns ``(recv_x, recv_topk_idx,
        recv_topk_weights, handle, event)`` (see the core's)."""
        call = "ElasticBuffer.dispatch()"
        if handle is not None and not isinstance(handle, EPHandle):
            raise TypeError(f"{call}: handle must be an EPHandle from ElasticBuffer.dispatch(), got "
                            f"{type(handle).__name__}")
        recv_x, recv_topk_idx, recv_topk_weights, core_handle, event = self._core.dispatch(
            x, topk_idx, topk_weights, cumulative_local_expert_recv_stats, num_experts, num_max_tokens_per_rank,
            expert_alignment, num_sms, num_qps, core_event(call, previous_event),
            core_event(call, previous_event_before_epilogue), async_with_compute_stream, allocate_on_comm_stream,
            handle._core if handle is not None else None, do_handle_copy, do_cpu_sync, do_expand, do_zero_padding,
            use_tma_aligned_col_major_sf)
        export = self._front.export
        recv_x = tuple(export(t) for t in recv_x) if isinstance(recv_x, tuple) else export(recv_x)
        recv_topk_idx, recv_topk_weights = export(recv_topk_idx), export(recv_topk_weights)
        handle = handle if handle is not None else EPHandle(core_handle, self._front)
        if allocate_on_comm_stream:
            record_on_current_stream(self._torch, (*(recv_x if isinstance(recv_x, tuple) else (recv_x,)), recv_topk_idx,
                                            recv_topk_weights, *(getattr(handle, n) for n in _HANDLE_TENSORS)))
        return recv_x, recv_topk_idx, recv_topk_weights, handle, wrap(event)

    @_torch_function_off
    def combine(self, x, handle: EPHandle, topk_weights=None, bias=None, num_sms: int = 0, num_qps: int = 0,
                previous_event=None, previous_event_before_epilogue=None, async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False):
        """Send each received row back to its token's rank and sum it there in V2's order; returns
        ``(combined_x, combined_topk_weights or None, event)`` (see the core's)."""
        call = "ElasticBuffer.combine()"
        if not isinstance(handle, EPHandle):
            raise TypeError(f"{call}: handle must be an EPHandle from ElasticBuffer.dispatch(), got "
                            f"{type(handle).__name__}")
        combined_x, combined_weights, event = self._core.combine(
            x, handle._core, topk_weights, bias, num_sms, num_qps, core_event(call, previous_event),
            core_event(call, previous_event_before_epilogue), async_with_compute_stream, allocate_on_comm_stream)
        export = self._front.export
        combined_x, combined_weights = export(combined_x), export(combined_weights)
        if allocate_on_comm_stream:
            record_on_current_stream(self._torch, (combined_x, combined_weights))
        return combined_x, combined_weights, wrap(event)


__all__ = ["EPHandle", "ElasticBuffer"]
