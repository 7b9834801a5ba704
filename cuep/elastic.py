"""ElasticBuffer: DeepEP V2's ``deep_ep.ElasticBuffer`` API on CuPy arrays, over cuep's normal-mode kernels.

One ``dispatch`` and one ``combine`` serve training, prefill and decode. The compact layout (each token
once per destination rank) is the normal mode's received rows; the expanded layout (one row per (token,
local expert), grouped by expert with each expert's rows aligned) is made from them on the receiving
rank by the elastic kernels (``cuda_src/elastic.cu``), which also write V2's per-row metadata and
per-expert prefix sums. Token counts stay run-time arguments: nothing is compiled per batch, and any
batch up to ``num_max_tokens_per_rank`` goes through a Buffer sized by DeepEP V1's hints, in rounds.

Combine sums in V2's order, bit for bit: on the expert's rank a token's expanded rows in top-k lane order
(FP32, rounded once), then on the token's rank the biases first and each rank's contribution in the
order of its highest top-k lane, rounded once. With ``allow_multiple_reduction=False`` an expanded combine
sends each expanded row back alone (a normal-mode dispatch whose one expert per rank is the token's rank)
and sums, on the token's rank, the biases and every lane's row in top-k lane order, rounded once.

Across nodes the compact rows come from the internode mode (a token crosses to each destination node once,
along its source's rail, and reaches that node's ranks over NVLink), and combine sums in V2's hybrid
order: each node's forwarder adds the node's rank contributions in the order of their highest lanes
(rounded once), then the token's rank adds, after the biases, each node's partial in the order of the
node's highest lane.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import _checks, _deps, _interop
from ._math import align_up
from .buffer import Buffer, _layout_outputs
from .config import MAX_TOPK_HINT
from .errors import CuepError
from .event import EventOverlap, record_event
from .kernels import elastic as kernels
from .modes import internode, intranode
from .runtime import as_group
from .runtime.regions import REGION_ALIGN
from .runtime.topology import discover_topology

#: What V2's size hint rounds to.
BUFFER_ALIGNMENT = 2 << 20
#: V2's analytic SM count assumes these per-SM HBM rates (GB/s) unless given.
SM_READ_GBS, SM_WRITE_GBS = 200.0, 50.0
#: Unidirectional NVLink bandwidth by compute capability (GB/s), derated by 10% as V2 derates what
#: ``nvidia-smi nvlink -s`` reports: V100 6 x 25, A100 12 x 25, H100/H200 18 x 26.5625, B200 18 x 50.
NVLINK_GBS = {70: 150.0 * 0.9, 80: 300.0 * 0.9, 90: 478.125 * 0.9, 100: 900.0 * 0.9}
#: The minimum SM count V2 takes when the calls are not overlapped with computation.
NO_OVERLAP_MIN_SMS = 64
MAX_ALLOCATED_QPS = {True: 129, False: 17}  # V2's default QP allocation, hybrid mode or not
#: The hidden size whose rows split a buffer across nodes when the constructor is not given one.
SPLIT_HIDDEN = 7168

_OUT_OF_SCOPE = ("engram_write", "engram_fetch", "get_engram_storage_size_hint", "pp_set_config", "pp_send",
                 "pp_recv", "get_pp_buffer_size_hint", "create_agrs_session", "destroy_agrs_session",
                 "agrs_new_session", "agrs_set_config", "agrs_get_inplace_tensor", "all_gather",
                 "get_agrs_num_max_session_bytes", "get_agrs_buffer_size_hint")


class EPHandle:
    """What an :meth:`ElasticBuffer.dispatch` leaves for :meth:`ElasticBuffer.combine` and for cached
    dispatch (DeepEP V2's ``EPHandle``, same fields).

    Attributes:
        do_expand: whether the dispatch used the expanded layout.
        num_experts, expert_alignment, num_max_tokens_per_rank, num_sms: the dispatch's.
        topk_idx: `[num_tokens, num_topk]` `int64`, the dispatch's ids (a copy with ``do_handle_copy``).
        num_recv_tokens: received rows (with ``do_cpu_sync``; otherwise the rows allocated).
        num_expanded_tokens: expanded rows (with ``do_cpu_sync``; otherwise the rows allocated).
        num_recv_tokens_per_expert_list: per local expert, received entries rounded up to
            ``expert_alignment`` (empty without ``do_cpu_sync``).
        psum_num_recv_tokens_per_scaleup_rank: `[num_scaleup_ranks]` `int32`, inclusive prefix sum of the rows
            received from the ranks of each local index (on one node, from each rank); the last is the
            received count. Rows are ordered by global source rank, so across nodes these count rows but do
            not bound ranges of them.
        psum_num_recv_tokens_per_expert: `[num_local_experts]` `int32`: compact layout, the inclusive
            prefix sum of the aligned counts; expanded, expert ``e``'s first row plus its count, so
            ``align(psum[e], expert_alignment)`` is expert ``e + 1``'s first row.
        num_unaligned_recv_tokens_per_expert: `[num_local_experts]` `int32`, received entries per expert.
        recv_src_metadata: `[rows, num_topk + 2]` `int32` per received row: ``source rank *
            num_max_tokens_per_rank + source token``, ``source rank * num_topk +`` the highest top-k lane
            this rank holds, then per lane its expanded row (-1 for other ranks' lanes, and everywhere in
            the compact layout).
        token_metadata_at_forward: across nodes, `[forwarded rows]` `int32`, the source token of each row this
            rank forwarded to its node, -1 past them without ``do_cpu_sync`` (``None`` on one node).
        channel_linked_list: ``None`` (V2's hybrid-mode channels; cuep's forwarders need no list).
    """

    def __init__(self, buffer: "ElasticBuffer", dispatch: intranode.Handle, do_expand: bool, num_experts: int,
                 expert_alignment: int, num_max_tokens_per_rank: int, num_sms: int, topk_idx, num_recv_tokens: int,
                 num_expanded_tokens: int, num_recv_tokens_per_expert_list: list[int],
                 psum_num_recv_tokens_per_scaleup_rank, psum_num_recv_tokens_per_expert,
                 num_unaligned_recv_tokens_per_expert, recv_src_metadata):
        self.do_expand, self.num_experts, self.expert_alignment = do_expand, num_experts, expert_alignment
        self.num_max_tokens_per_rank, self.num_sms, self.topk_idx = num_max_tokens_per_rank, num_sms, topk_idx
        self.num_recv_tokens, self.num_expanded_tokens = num_recv_tokens, num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.recv_src_metadata = recv_src_metadata
        self.token_metadata_at_forward = getattr(dispatch, "forward_src", None)
        self.channel_linked_list = None
        self._buffer, self._dispatch, self._slots, self._dispatched = buffer, dispatch, None, None
        self._recv_topk_idx = None  # across nodes: the received local ids, for combine's order

    @property
    def dst_buffer_slot_idx(self):
        """On one node, `[num_tokens, num_topk]` `int32`: for each of this rank's (token, lane), its compact row on
        its expert's rank (-1 without an expert); made when first read, after the dispatch. Across nodes (as
        V2's hybrid mode, whose array is its forwarders' bookkeeping): `[forwarded rows, ranks_per_node]`, for
        each row this rank forwarded, its place among the rows of its round each local rank received from its
        source (-1: none, and past the rows without ``do_cpu_sync``), written by the dispatch."""
        if isinstance(self._dispatch, internode.Handle):
            return self._dispatch.forward_pos
        if self._slots is None:
            self._slots = self._buffer._slot_rows(self)
        return self._slots

    @property
    def num_rows(self) -> int:
        """Rows of the layout the dispatch returned (the expanded rows when ``do_expand``)."""
        return self.num_expanded_tokens if self.do_expand else self.num_recv_tokens


class ElasticBuffer:
    """DeepEP V2's ``ElasticBuffer`` on cuep's kernels: one dispatch and one combine for training, prefill
    and decode, with a compact or an expanded received layout.

    Creating it is collective over ``group`` (as :class:`cuep.Buffer`). Its memory is a normal-mode
    NVLink buffer sized by DeepEP V1's hint for the hidden size (or ``num_bytes``): batches of any size up to
    ``num_max_tokens_per_rank`` go through it in rounds, and nothing is compiled per token count.

    Requirements:
        every rank calls each dispatch and combine, in the same order, with the same layout. Across nodes (the
        internode mode): ``allow_hybrid_mode`` and ``allow_multiple_reduction`` stay ``True`` (V2's direct order,
        each rank's row crossing between nodes alone, is not built). A dispatch with ``do_cpu_sync=False`` runs the
        rounds of ``num_max_tokens_per_rank`` tokens (as few as the buffer allows, split evenly), empty ones
        included, since no rank knows the others' batches.

    Arguments:
        group: an ``mpi4py`` communicator or a ``torch.distributed`` process group.
        num_bytes: the buffer's bytes; default :meth:`get_buffer_size_hint` of the MoE settings below. Across
            nodes they are split between the network partitions and the NVLink landing rows as a round of
            ``hidden`` needs them (:func:`split_bytes`).
        num_cpu_bytes: host memory for V2's Engram storage: must be 0 (Engram is out of scope).
        num_max_tokens_per_rank: the most tokens a rank dispatches (a call may pass its own).
        hidden: the hidden size, for the default size.
        num_topk: the choices per token (0: 8), for the default size and, across nodes, its split.
        use_fp8_dispatch: accepted for V2's signature (the size does not depend on it).
        deterministic: accepted; cuep's layouts are always deterministic (rows by source rank, then source
            token; expanded rows by expert, then received row).
        allow_hybrid_mode: across nodes it must stay ``True``: tokens cross once per node and their forwarders
            sum the node's rows (one node: accepted, no forwarding).
        allow_multiple_reduction: ``True``: an expanded combine sums a token's rows on the expert's rank first
            (as the compact layout's rows arrive). ``False`` (one node): each expanded row goes back to its
            token's rank alone and is added there in top-k lane order, rounded once (V2's single reduction; it
            moves a row per lane instead of one per rank, and takes no ``topk_weights``). Across nodes it must
            stay ``True``: the constructor raises ``NotImplementedError`` otherwise. Its combine stages the routing
            of the rows going back for the worst case (:meth:`get_buffer_size_hint` counts their lanes; beyond the
            hint, the expanded layout's padding rows: a combine the buffer cannot serve raises ``ValueError``
            naming the size).
        prefer_overlap_with_compute: :meth:`get_theoretical_num_sms` leaves SMs to computation (else at
            least 64).
        sl_idx: accepted (the network service level of V2's RDMA path).
        num_allocated_qps: the most queue pairs a call may ask for (0: V2's default, 129 or 17).
        num_cpu_timeout_secs, num_gpu_timeout_secs: accepted; cuep's waits are bounded by ``CUEP_TIMEOUT_S``
            and raise :class:`~cuep.PeerTimeoutError` naming the peer.
        explicitly_destroy: resources are released only by :meth:`destroy`.
        front, device_id: as :class:`cuep.Buffer`'s (``cuep.torch`` passes them).

    Differs from DeepEP V2: no NCCL (NVSHMEM); no run-time compiler; across nodes, the hybrid order only.
    """

    def __init__(self, group=None, num_bytes: int | None = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0, use_fp8_dispatch: bool = False,
                 deterministic: bool = False, allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True, sl_idx: int = 3, num_allocated_qps: int = 0,
                 num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False,
                 *, front=None, device_id: int | None = None):
        call = "ElasticBuffer()"
        num_max_tokens_per_rank = _checks.check_nonnegative_int(call, "num_max_tokens_per_rank",
                                                                num_max_tokens_per_rank)
        if num_cpu_bytes:
            raise NotImplementedError(f"{call}: num_cpu_bytes is V2's Engram storage, which cuep does not build "
                                      f"(out of scope of issue 48); pass 0")
        if num_bytes is None:
            if not hidden:
                raise ValueError(f"{call}: pass num_bytes, or hidden (with num_max_tokens_per_rank) to size the buffer")
            num_bytes = self.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                                                  allow_hybrid_mode, allow_multiple_reduction)
        num_bytes = _checks.check_nonnegative_int(call, "num_bytes", num_bytes)
        topology = discover_topology(as_group(call, group))
        if topology.num_nodes > 1 and not (allow_hybrid_mode and allow_multiple_reduction):
            raise NotImplementedError(f"{call}: across nodes cuep combines in V2's hybrid order (a forwarder sums its "
                                      f"node's rows); allow_hybrid_mode=False or allow_multiple_reduction=False (each "
                                      f"rank's row crossing between nodes alone) is not built")
        num_nvl_bytes, num_rdma_bytes = split_bytes(num_bytes, topology.ranks_per_node, topology.num_nodes, hidden,
                                                   num_topk or MAX_TOPK_HINT)
        self._buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes, False, 24, True, explicitly_destroy, front=front,
                              device_id=device_id, elastic=True, topology=topology)
        core = self._buffer
        self.group, self.num_bytes = group, num_bytes
        self.rank_idx, self.num_ranks = core.rank, core.group_size
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.deterministic, self.allow_hybrid_mode = bool(deterministic), bool(allow_hybrid_mode)
        self.allow_multiple_reduction = bool(allow_multiple_reduction)
        self.prefer_overlap_with_compute = bool(prefer_overlap_with_compute)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.num_allocated_qps = int(num_allocated_qps) or MAX_ALLOCATED_QPS[self.allow_hybrid_mode]
        nodes, local = core.topology.num_nodes, core.topology.ranks_per_node
        self.num_scaleout_ranks, self.num_scaleup_ranks = nodes, local
        self.scaleout_rank_idx, self.scaleup_rank_idx = divmod(self.rank_idx, local)
        self.num_rdma_ranks, self.num_nvlink_ranks = nodes, local
        self._across_nodes = nodes > 1
        self._front = core._front
        self._resources = core._resources
        # Rows per signalled put across nodes (DeepEP V1's RDMA chunk of the Configs).
        self._dispatch_chunk_tokens = Buffer.get_dispatch_config(self.num_ranks).num_max_rdma_chunked_send_tokens
        self._combine_chunk_tokens = Buffer.get_combine_config(self.num_ranks).num_max_rdma_chunked_send_tokens
        self._library = core._resources.elastic_library
        self._device_sms = core._resources.device.attributes["MultiProcessorCount"]
        self._compute_capability = int(core._resources.device.compute_capability)

    # ----------------------------------------------------------------------------------------------
    # Setup, sizes, streams
    @staticmethod
    def get_buffer_size_hint(group, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Bytes of buffer for these MoE settings, a multiple of 2 MiB: DeepEP V1's NVL hint for BF16 rows of
        ``hidden`` (its dispatch and combine configs), plus across nodes its RDMA hint. Any batch goes through
        them in rounds, so the size does not grow with ``num_max_tokens_per_rank``, except with
        ``allow_multiple_reduction=False``: its expanded combine sends each (token, lane) back as a dispatch's
        row, whose routing the buffer stages, so the hint is at least the room for every rank's
        ``num_max_tokens_per_rank * num_topk`` of them (the expanded layout's padding rows, which depend on the
        experts and their alignment, aside: the combine names the size it needs).

        Arguments:
            group: the ranks (a ``torch.distributed`` group, an ``mpi4py`` communicator, or ``None`` for
                ``MPI.COMM_WORLD``); their nodes are as V1's hints assume (``CUEP_RANKS_PER_NODE``, else
                up to 8 ranks a node).
            num_max_tokens_per_rank: the most tokens a rank dispatches (read with ``allow_multiple_reduction=False``).
            hidden: the hidden size.
            num_topk: the choices per token (0: 8), for the rows' top-k weights.
            use_fp8_dispatch, allow_hybrid_mode: accepted for V2's signature.
            allow_multiple_reduction: the constructor's.
        """
        call = "get_buffer_size_hint()"
        _checks.check_positive_ints(call, hidden=hidden)
        num_ranks = _group_size(group)
        hidden_bytes = hidden * 2
        configs = (Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks))
        topk = num_topk or MAX_TOPK_HINT
        hint = max(config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks, num_topk=topk) for config in configs)
        if not allow_multiple_reduction:
            lanes = num_ranks * num_max_tokens_per_rank * topk
            hint = max(hint, intranode.nvl_bytes_for(intranode.staging_layout(lanes, 1, num_ranks).end))
        hint += max(config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks, num_topk=topk) for config in configs)
        return align_up(hint, BUFFER_ALIGNMENT)

    def destroy(self) -> None:
        """Collective: release the buffer now (needs ``explicitly_destroy=True``, as V2's). Idempotent."""
        if not self.explicitly_destroy:
            raise CuepError("ElasticBuffer.destroy(): the buffer was made without explicitly_destroy=True, so it "
                            "is released when the process exits")
        self._buffer.destroy()

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """Every rank waits for every other, on the device, after the work on the current stream.

        Arguments:
            use_comm_stream, sequential: accepted for V2's signature (cuep's barrier is one kernel on the
                current stream).
            with_cpu_sync: also synchronize the GPU before and after.
        """
        cupy = _deps.cupy()
        if with_cpu_sync:
            cupy.cuda.runtime.deviceSynchronize()
        self._buffer.barrier()
        if with_cpu_sync:
            cupy.cuda.runtime.deviceSynchronize()

    def capture(self) -> EventOverlap:
        """An event recorded on the current stream now (for ``previous_event``)."""
        return EventOverlap(record_event(self._front.current_stream()))

    def get_comm_stream(self):
        """The stream of the calls with ``previous_event``, ``async_with_compute_stream`` or
        ``allocate_on_comm_stream``."""
        return self._buffer.get_comm_stream()

    def get_physical_domain_size(self) -> tuple[int, int]:
        """``(num_rdma_ranks, num_nvlink_ranks)``: the nodes and the ranks of each (``(1, num_ranks)`` on one node)."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> tuple[int, int]:
        """``(num_scaleout_ranks, num_scaleup_ranks)``: as :meth:`get_physical_domain_size` (cuep forwards between
        nodes in V2's hybrid way, so its logical domains are the physical ones)."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = SM_READ_GBS,
                                sm_write_gbs: float = SM_WRITE_GBS) -> int:
        """V2's analytic SM count for a balanced gate: enough SMs that their reads and writes keep NVLink
        busy, plus 25%, even, at least 4 (at least 64 without ``prefer_overlap_with_compute``), at most the GPU's.

        Arguments:
            num_experts, num_topk: the routing.
            num_scaleout_topk: must be 0 (as V2's).
            rdma_gbs: accepted (the count follows the NVLink traffic, across nodes too).
            nvlink_gbs: NVLink GB/s; 0: :data:`NVLINK_GBS` for this GPU.
            sm_read_gbs, sm_write_gbs: what one SM reads and writes of HBM, GB/s.
        """
        call = "get_theoretical_num_sms()"
        _checks.check_positive_ints(call, num_experts=num_experts, num_topk=num_topk)
        if num_scaleout_topk:
            raise ValueError(f"{call}: num_scaleout_topk must be 0 (a balanced gate), got {num_scaleout_topk}")
        num_ranks = self.num_ranks
        if num_experts % num_ranks or num_topk > num_experts:
            raise ValueError(f"{call}: num_experts ({num_experts}) must be a multiple of the ranks ({num_ranks}) "
                             f"and at least num_topk ({num_topk})")
        nvlink_gbs = nvlink_gbs or NVLINK_GBS.get(self._compute_capability // 10 * 10, NVLINK_GBS[90])
        # Expected ranks a token goes to: one minus the chance that none of its experts is on a rank, per rank.
        others = num_experts - num_experts // num_ranks
        expected_ranks = num_ranks * (1 - math.comb(others, num_topk) / math.comb(num_experts, num_topk))
        read_per_row, write_per_row = 1 / expected_ranks, 1.0
        nvlink_traffic = 1 - 1 / num_ranks
        num_sms = self._device_sms
        if nvlink_traffic > 0:
            rows_per_s = nvlink_gbs / nvlink_traffic
            num_sms = max(rows_per_s * read_per_row / sm_read_gbs, rows_per_s * write_per_row / sm_write_gbs)
        num_sms = align_up(max(4, math.ceil(num_sms * 1.25)), 2)
        if not self.prefer_overlap_with_compute:
            num_sms = max(num_sms, NO_OVERLAP_MIN_SMS)
        return min(num_sms, self._device_sms)

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """V2's queue-pair count for ``num_sms`` SMs (capped by ``num_allocated_qps``); one node uses none."""
        wanted = num_sms * 16 + 1 if self.allow_hybrid_mode else min(num_sms, 9)
        return min(wanted, self.num_allocated_qps)

    def __getattr__(self, name: str):
        if name in _OUT_OF_SCOPE:
            raise NotImplementedError(f"ElasticBuffer.{name}(): V2's Engram, pipeline-parallel and all-gather/"
                                      f"reduce-scatter sessions are out of scope in cuep (issue 48)")
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    # ----------------------------------------------------------------------------------------------
    # Dispatch and combine
    def dispatch(self, x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None,
                 num_experts: int | None = None, num_max_tokens_per_rank: int | None = None,
                 expert_alignment: int | None = None, num_sms: int = 0, num_qps: int = 0, previous_event=None,
                 previous_event_before_epilogue=None, async_with_compute_stream: bool = False,
                 allocate_on_comm_stream: bool = False, handle: EPHandle | None = None, do_handle_copy: bool = True,
                 do_cpu_sync: bool | None = None, do_expand: bool = False, do_zero_padding: bool = False,
                 use_tma_aligned_col_major_sf: bool = False):
        """Send each token to every rank that holds one of its experts.

        Arguments:
            x: `[num_tokens, hidden]` `bfloat16`, or ``(x_fp8, scales)``: FP8 e4m3 data (``uint8`` here) and
                `[num_tokens, hidden / 128]` `float32` scales.
            topk_idx: `[num_tokens, num_topk]` `int64` expert ids, -1 for none (``None`` with ``handle``).
            topk_weights: `[num_tokens, num_topk]` `float32`, or ``None``.
            cumulative_local_expert_recv_stats: `[num_local_experts]` `int32`, incremented by the entries each
                local expert receives (not in cached dispatch).
            num_experts: all ranks' experts (a multiple of the ranks; from ``handle`` if given).
            num_max_tokens_per_rank: at least every rank's token count, the same on every rank (default the Buffer's).
            expert_alignment: each local expert's received count is rounded up to it (default 1).
            num_sms: SMs of the kernels (0: :meth:`get_theoretical_num_sms`).
            num_qps: queue pairs (at most ``num_allocated_qps``; none are used on one node).
            previous_event: run after this event (needs ``allocate_on_comm_stream``, as V2).
            previous_event_before_epilogue: accepted for V2's signature (the layout kernels run right after
                the dispatch, on its stream, after ``previous_event``).
            async_with_compute_stream: the current stream does not wait; wait on the returned event.
            allocate_on_comm_stream: allocate the outputs on the comm stream.
            handle: an :class:`EPHandle` of an earlier dispatch: the same routing and row order, no CPU
                wait (``topk_idx`` ``None``; ``topk_weights`` may be given, e.g. for a backward pass).
            do_handle_copy: keep a copy of ``topk_idx`` in the handle (else the caller's array).
            do_cpu_sync: wait on the CPU for the received counts and size the outputs exactly (default: yes,
                unless ``handle``); without it the outputs have room for the worst case and only the
                handle's GPU counts tell the rows received (CUDA-graph capturable).
            do_expand: the expanded layout.
            do_zero_padding: zero the expanded padding rows (and their weights).
            use_tma_aligned_col_major_sf: the received FP8 scales column-major, their column stride the rows
                rounded up to 4.

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``: ``recv_x`` like ``x`` (FP8: with the
            received scales); compact: `recv_topk_idx` `[rows, num_topk]` `int64` local ids (-1 for other
            ranks' lanes) and `recv_topk_weights` `[rows, num_topk]` (zero on those lanes); expanded:
            ``recv_topk_idx`` ``None`` and `recv_topk_weights` `[rows]` per expanded row; ``handle`` the
            :class:`EPHandle` (the given one for a cached dispatch); ``event`` an :class:`EventOverlap`.
        """
        call = "ElasticBuffer.dispatch()"
        cached = handle is not None
        if cached:
            if not isinstance(handle, EPHandle):
                raise TypeError(f"{call}: handle must be an EPHandle from ElasticBuffer.dispatch(), got "
                                f"{type(handle).__name__}")
            if topk_idx is not None:
                raise ValueError(f"{call}: topk_idx must be None with a handle (the handle's routing is reused)")
            if do_cpu_sync:
                raise ValueError(f"{call}: do_cpu_sync cannot be set with a handle (a cached dispatch never waits)")
            if do_expand != handle.do_expand:
                raise ValueError(f"{call}: do_expand={do_expand} but the handle's dispatch used do_expand="
                                 f"{handle.do_expand}")
            for name, given, own in (("num_experts", num_experts, handle.num_experts),
                                     ("expert_alignment", expert_alignment, handle.expert_alignment),
                                     ("num_max_tokens_per_rank", num_max_tokens_per_rank,
                                      handle.num_max_tokens_per_rank)):
                if given is not None and given != own:
                    raise ValueError(f"{call}: {name}={given} differs from the handle's ({own})")
            topk_idx, num_experts = handle.topk_idx, handle.num_experts
            expert_alignment, num_max_tokens_per_rank = handle.expert_alignment, handle.num_max_tokens_per_rank
            do_cpu_sync = False
        else:
            num_max_tokens_per_rank = self.num_max_tokens_per_rank if num_max_tokens_per_rank is None \
                else num_max_tokens_per_rank
            expert_alignment = 1 if expert_alignment is None else expert_alignment
            do_cpu_sync = True if do_cpu_sync is None else bool(do_cpu_sync)
        if num_experts is None:
            raise ValueError(f"{call}: num_experts is required without a handle")
        _checks.check_num_experts(call, num_experts, self.num_ranks)
        num_local_experts = num_experts // self.num_ranks
        max_local_experts = internode.MAX_LOCAL_EXPERTS if self._across_nodes else kernels.MAX_LOCAL_EXPERTS
        if num_local_experts > max_local_experts:
            raise ValueError(f"{call}: {num_local_experts} experts per rank; at most {max_local_experts}"
                             f"{' across nodes' if self._across_nodes else ''}")
        expert_alignment = _checks.check_expert_alignment(call, expert_alignment)
        xs, scales = _checks.tokens(call, x)
        num_tokens = xs.shape[0]
        topk_idx = _checks.as_device_array(call, "topk_idx", topk_idx)
        _checks.check_matrix(call, "topk_idx", topk_idx, [np.int64], num_tokens)
        num_topk = topk_idx.shape[1]
        if not 1 <= num_topk <= kernels.MAX_TOPK:
            raise ValueError(f"{call}: topk_idx has {num_topk} columns; 1 to {kernels.MAX_TOPK} are supported")
        if topk_weights is not None:
            topk_weights = _checks.as_device_array(call, "topk_weights", topk_weights)
            _checks.check_matrix(call, "topk_weights", topk_weights, [np.float32], num_tokens, num_topk)
        stats = _checks.optional_vector(call, "cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats,
                                        np.int32, num_local_experts)
        if num_tokens > num_max_tokens_per_rank:
            raise ValueError(f"{call}: {num_tokens} tokens exceed num_max_tokens_per_rank={num_max_tokens_per_rank} "
                             f"(set it in the constructor or pass it here; every rank must use the same value)")
        if previous_event is not None and not allocate_on_comm_stream:
            raise ValueError(f"{call}: previous_event needs allocate_on_comm_stream=True (as DeepEP V2)")
        self._check_qps(call, num_qps)
        num_sms = num_sms or self.get_theoretical_num_sms(num_experts, num_topk)
        if do_zero_padding and not do_expand:
            raise ValueError(f"{call}: do_zero_padding needs do_expand=True (only the expanded layout pads)")
        if do_handle_copy and not cached:
            topk_idx_kept = None  # copied on the call's stream below
        else:
            topk_idx_kept = topk_idx
        ctx = self._resources.normal_ready(call)
        across_nodes = self._across_nodes
        front, num_ranks = self._front, self.num_ranks
        # A cached dispatch repeats its handle's routing (with the handle's top-k ids, which it sends again) into
        # as many rows as the handle's dispatch returned, without a CPU wait.
        num_worst = 0 if do_cpu_sync or cached else num_ranks * num_max_tokens_per_rank

        def enqueue(stream):
            nonlocal topk_idx_kept
            if topk_idx_kept is None:
                topk_idx_kept = front.empty(topk_idx.shape, np.int64)
                _copy(topk_idx_kept, topk_idx, stream)
            in_rank = per_expert = None
            if not (cached and across_nodes):  # the internode mode's cached dispatch keeps its handle's routing
                regions, nbytes = _layout_outputs(num_ranks, self.num_scaleout_ranks, num_experts, num_tokens)
                per_rank, per_expert, in_rank, *per_node = front.readable_views(front.storage(nbytes, regions[0].dtype),
                                                                                regions)
                self._resources.layout.launch(stream, topk_idx, num_experts, per_expert, per_rank,
                                              per_node[0] if per_node else None, in_rank)
            if across_nodes:
                recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert_list, dispatch = internode.dispatch(
                    ctx, stream, xs, scales, topk_idx, topk_weights, in_rank, per_expert, num_experts,
                    handle._dispatch if cached else None, expert_alignment, num_worst, num_sms,
                    self._dispatch_chunk_tokens, max_tokens_per_rank=num_max_tokens_per_rank)
            else:
                recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert_list, dispatch = intranode.dispatch(
                    ctx, stream, xs, scales, topk_idx, topk_weights, in_rank, per_expert, num_experts, None,
                    expert_alignment, num_worst, num_sms, known_rows=handle._dispatch.num_rows if cached else None)
            capacity, chunk_starts = dispatch.num_rows, None
            if cached:
                out = handle
            else:
                out, chunk_starts = self._describe_rows(
                    stream, dispatch, recv_topk_idx, num_topk, num_local_experts, num_max_tokens_per_rank,
                    expert_alignment, do_expand, stats, do_cpu_sync, per_expert_list, num_experts, num_sms,
                    topk_idx_kept)
                if across_nodes:  # combine's order: which lanes each received row holds (a copy: the caller may
                    out._recv_topk_idx = front.empty(recv_topk_idx.shape, np.int64)  # change the returned ids)
                    _copy(out._recv_topk_idx, recv_topk_idx, stream)
            compact = (recv_x, recv_scales, recv_topk_idx, recv_topk_weights)
            if do_expand:
                recv_x, recv_scales, recv_topk_weights = self._expand(
                    stream, out, recv_x, recv_scales, recv_topk_idx, recv_topk_weights, capacity, do_zero_padding,
                    use_tma_aligned_col_major_sf, chunk_starts)
                recv_topk_idx = None
            elif use_tma_aligned_col_major_sf and recv_scales is not None:
                recv_scales = self._column_major(stream, recv_scales)
            recv = (recv_x, recv_scales) if scales is not None else recv_x
            # What the stream still reads after this call returns: the inputs and the compact rows it expands.
            return (recv, recv_topk_idx, recv_topk_weights, out), (xs, scales, topk_idx, topk_weights, stats,
                                                                   in_rank, dispatch, chunk_starts, *compact)

        streams = self._buffer._streams
        outputs, event = streams.run(previous_event, async_with_compute_stream, allocate_on_comm_stream, enqueue)
        if not cached:
            outputs[3]._dispatched = event  # dst_buffer_slot_idx, made when first read, runs after it
        self._resources.raise_if_failed()
        return (*outputs, event)

    def combine(self, x, handle: EPHandle, topk_weights=None, bias=None, num_sms: int = 0, num_qps: int = 0,
                previous_event=None, previous_event_before_epilogue=None, async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False):
        """Send each received row back to its token's rank and sum it there, in DeepEP V2's order.

        Arguments:
            x: `[rows, hidden]` `bfloat16`, a row per row of the handle's dispatch (compact or expanded).
            handle: that dispatch's :class:`EPHandle`.
            topk_weights: compact: `[rows, num_topk]` `float32`; expanded: `[rows]`, one per expanded row; or
                ``None``. Each lane's weight comes back from the rank holding its lane's expert. Must be
                ``None`` in an expanded combine with ``allow_multiple_reduction=False``.
            bias: `[num_tokens, hidden]` `bfloat16`, or a tuple of two, added first.
            num_sms: SMs of the kernels (0: the dispatch's).
            num_qps, previous_event, previous_event_before_epilogue, async_with_compute_stream, allocate_on_comm_stream:
                as in :meth:`dispatch`.

        Returns:
            ``(combined_x, combined_topk_weights or None, event)``: `[num_tokens, hidden]` `bfloat16`, for
            each token the biases plus its ranks' rows, in FP32 in the order of each rank's highest top-k lane,
            rounded once (an expanded combine with ``allow_multiple_reduction=False``: the biases plus each
            lane's expanded row, in top-k lane order); `[num_tokens, num_topk]` `float32` (0 for lanes without
            an expert).
        """
        call = "ElasticBuffer.combine()"
        if not isinstance(handle, EPHandle):
            raise TypeError(f"{call}: handle must be an EPHandle from ElasticBuffer.dispatch(), got "
                            f"{type(handle).__name__}")
        dispatch = handle._dispatch
        num_topk = handle.topk_idx.shape[1]
        lanes_apart = handle.do_expand and not self.allow_multiple_reduction
        if lanes_apart:
            self._check_lanes_apart(call, handle, num_topk, topk_weights)
        rows = handle._expanded_rows if handle.do_expand else dispatch.num_rows
        xs = _checks.as_device_array(call, "x", x)
        _checks.check_matrix(call, "x", xs, [_checks.bf16_dtype()], rows)
        _checks.check_hidden(call, xs.shape[1], fp8=False)
        if topk_weights is not None:
            topk_weights = _checks.as_device_array(call, "topk_weights", topk_weights)
            if handle.do_expand:
                _checks.check_vector(call, "topk_weights", topk_weights, np.float32, rows)
            else:
                _checks.check_matrix(call, "topk_weights", topk_weights, [np.float32], rows, num_topk)
        biases = _checks.combine_biases(call, bias, dispatch.num_tokens, xs.shape[1])
        if previous_event is not None and not allocate_on_comm_stream:
            raise ValueError(f"{call}: previous_event needs allocate_on_comm_stream=True (as DeepEP V2)")
        self._check_qps(call, num_qps)
        num_sms = num_sms or handle.num_sms
        ctx = self._resources.normal_ready(call)
        topk_idx = _checks.as_device_array(call, "handle.topk_idx", handle.topk_idx)
        num_local_experts = handle.num_experts // self.num_ranks

        def enqueue(stream):
            if lanes_apart:
                return self._combine_lanes_apart(ctx, stream, xs, handle, topk_idx, biases, num_sms)
            compact_x, compact_weights = xs, topk_weights
            if handle.do_expand:
                compact_x = self._front.empty((dispatch.num_rows, xs.shape[1]), xs.dtype)
                compact_weights = self._front.empty((dispatch.num_rows, num_topk), np.float32) \
                    if topk_weights is not None else None
                args = kernels.ReduceArgs(num_rows=_received(dispatch)[0], capacity=dispatch.num_rows,
                                          num_topk=num_topk, metadata=handle.recv_src_metadata.data.ptr,
                                          x=xs.data.ptr, row_bytes=xs.shape[1] * xs.itemsize,
                                          weights=_ptr(topk_weights), out_x=compact_x.data.ptr,
                                          out_weights=_ptr(compact_weights))
                kernels.reduce(self._library, stream, args, self._device_sms)
            if self._across_nodes:
                combined_x, combined_weights = internode.combine(
                    ctx, stream, compact_x, dispatch, compact_weights, biases[0], biases[1], num_sms,
                    self._combine_chunk_tokens, order=(handle._recv_topk_idx, topk_idx, num_local_experts))
            else:
                combined_x, combined_weights = intranode.combine(ctx, stream, compact_x, dispatch, compact_weights,
                                                                 biases[0], biases[1], num_sms, topk_idx,
                                                                 num_local_experts)
            # What the stream still reads after this call returns: the inputs, the handle's arrays (a caller may
            # drop the handle right after an async combine) and the compact rows of an expanded one.
            return (combined_x, combined_weights), (xs, topk_weights, *biases, topk_idx, dispatch,
                                                    handle.recv_src_metadata, handle._recv_topk_idx, compact_x,
                                                    compact_weights)

        outputs, event = self._buffer._streams.run(previous_event, async_with_compute_stream, allocate_on_comm_stream,
                                                   enqueue)
        return (*outputs, event)

    def _check_lanes_apart(self, call: str, handle: EPHandle, num_topk: int, topk_weights) -> None:
        """Raises ``ValueError`` for an expanded combine with ``allow_multiple_reduction=False`` that
        :meth:`_combine_lanes_apart` cannot serve. Its limits follow from values every rank shares (the worst case
        of the expanded rows, not this rank's), so that all ranks raise together."""
        if topk_weights is not None:
            raise ValueError(f"{call}: topk_weights must be None in an expanded combine with "
                             f"allow_multiple_reduction=False (as DeepEP V2: only a rank's sum of its lanes carries "
                             f"their weights back)")
        tags = handle.num_max_tokens_per_rank * num_topk
        if tags > kernels.MAX_LANE_TAGS:
            raise ValueError(f"{call}: an expanded combine with allow_multiple_reduction=False tags each row with its "
                             f"token and lane, exactly up to {kernels.MAX_LANE_TAGS} tags; num_max_tokens_per_rank * "
                             f"num_topk is {tags}")
        rows = _worst_expanded_rows(self.num_ranks * handle.num_max_tokens_per_rank, num_topk,
                                    handle.num_experts // self.num_ranks, handle.expert_alignment)
        staging = intranode.staging_layout(rows, 1, self.num_ranks).end
        holds = intranode.region_bytes(self._buffer.num_nvl_bytes)  # on one node, all of num_bytes
        if staging > holds:
            raise ValueError(f"{call}: an expanded combine with allow_multiple_reduction=False sends up to {rows} "
                             f"expanded rows back as a dispatch, whose routing takes {staging} bytes of each of the "
                             f"buffer's two regions; this ElasticBuffer's num_bytes={self.num_bytes} holds {holds}: "
                             f"make it with num_bytes >= {intranode.nvl_bytes_for(staging)}, or a smaller "
                             f"num_max_tokens_per_rank")

    def _combine_lanes_apart(self, ctx, stream, xs, handle: EPHandle, topk_idx, biases, num_sms: int):
        """An expanded combine with ``allow_multiple_reduction=False`` (one node): each expanded row goes back to
        its token's rank alone, as the row of a normal-mode dispatch whose one expert per rank is the token's rank
        and whose top-k weight is the row's (token, lane) tag (route_back), and there each token is summed from
        its biases and its lanes' rows in top-k lane order, rounded once (index_lanes, sum_lanes). Returns
        ``enqueue``'s pair (see :meth:`combine`)."""
        front, num_ranks, dispatch = self._front, self.num_ranks, handle._dispatch
        num_tokens, num_topk = topk_idx.shape
        expanded_rows, hidden = xs.shape
        dest = front.empty((expanded_rows, 1), np.int64)
        lane_tag = front.empty((expanded_rows, 1), np.float32)
        lane_rows = front.empty((num_tokens * num_topk,), np.int32)
        kernels.route_back(self._library, stream, kernels.RouteBackArgs(
            num_rows=_received(dispatch)[0], capacity=dispatch.num_rows, num_topk=num_topk,
            num_local_experts=handle.num_experts // num_ranks, expert_alignment=handle.expert_alignment,
            num_max_tokens_per_rank=handle.num_max_tokens_per_rank, metadata=handle.recv_src_metadata.data.ptr,
            psum=handle.psum_num_recv_tokens_per_expert.data.ptr, expanded_rows=expanded_rows,
            dest=dest.data.ptr, lane_tag=lane_tag.data.ptr, lane_rows=lane_rows.data.ptr,
            num_lanes=num_tokens * num_topk), self._device_sms)
        regions, nbytes = _layout_outputs(num_ranks, 1, num_ranks, expanded_rows)
        per_rank, per_expert, in_rank = front.readable_views(front.storage(nbytes, regions[0].dtype), regions)
        self._resources.layout.launch(stream, dest, num_ranks, per_expert, per_rank, None, in_rank)
        # Each of this rank's (token, lane) comes back at most once: that bounds the rows, with no CPU wait.
        back_x, _, back_idx, back_tag, _, back = intranode.dispatch(
            ctx, stream, xs, None, dest, lane_tag, in_rank, per_expert, num_ranks, None, 1,
            max(1, num_tokens * num_topk), num_sms)
        combined_x = front.empty((num_tokens, hidden), xs.dtype)
        kernels.sum_lanes(self._library, stream, kernels.LanesArgs(
            recv_topk_idx=back_idx.data.ptr, recv_lane_tag=back_tag.data.ptr, x=back_x.data.ptr,
            capacity=back.num_rows, row_bytes=hidden * xs.itemsize, topk_idx=topk_idx.data.ptr, num_tokens=num_tokens,
            num_topk=num_topk, num_experts=handle.num_experts, lane_rows=lane_rows.data.ptr,
            bias0=_ptr(biases[0]), bias1=_ptr(biases[1]), out_x=combined_x.data.ptr), self._device_sms)
        # What the stream still reads after this call returns: the inputs, the handle's arrays and the rows sent
        # and received back.
        return (combined_x, None), (xs, *biases, topk_idx, dispatch, handle.recv_src_metadata,
                                    handle.psum_num_recv_tokens_per_expert, dest, lane_tag, per_rank, in_rank, back_x,
                                    back_idx, back_tag, back, lane_rows)

    # ----------------------------------------------------------------------------------------------
    # The layouts
    def _describe_rows(self, stream, dispatch: intranode.Handle, recv_topk_idx, num_topk: int, num_local_experts: int,
                       num_max_tokens_per_rank: int, expert_alignment: int, do_expand: bool, stats, do_cpu_sync: bool,
                       per_expert_list: list[int], num_experts: int, num_sms: int, topk_idx) -> tuple[EPHandle, Any]:
        """The rows' metadata and per-expert counts (count_rows, scan_counts): returns the handle of a non-cached
        dispatch and each chunk's first row per expert (for :meth:`_expand`)."""
        front, num_ranks = self._front, self.num_ranks
        capacity = dispatch.num_rows
        chunks = kernels.num_chunks(capacity)
        metadata = front.empty((capacity, num_topk + 2), np.int32)
        chunk_counts = front.empty((chunks, num_local_experts), np.int32)
        num_unaligned = front.empty((num_local_experts,), np.int32)
        psum = front.empty((num_local_experts,), np.int32)
        num_rows, rank_prefix = _received(dispatch)
        per_local_psum = front.empty((self.num_scaleup_ranks,), np.int32)
        args = kernels.RowsArgs(recv_topk_idx=recv_topk_idx.data.ptr, recv_src_idx=dispatch.recv_src_idx.data.ptr,
                                num_rows=num_rows, rank_prefix=rank_prefix, capacity=capacity, num_topk=num_topk,
                                num_local_experts=num_local_experts, num_ranks=num_ranks,
                                ranks_per_node=self.num_scaleup_ranks, num_max_tokens_per_rank=num_max_tokens_per_rank,
                                expert_alignment=expert_alignment, num_chunks=chunks, expand=int(do_expand),
                                chunk_counts=chunk_counts.data.ptr, metadata=metadata.data.ptr,
                                num_unaligned=num_unaligned.data.ptr, psum=psum.data.ptr,
                                psum_local=per_local_psum.data.ptr, stats=_ptr(stats))
        kernels.count_and_scan(self._library, stream, args)
        if do_cpu_sync:
            expanded_rows = sum(per_expert_list)
            num_recv, num_expanded = dispatch.num_recv_tokens, expanded_rows
        else:
            expanded_rows = _worst_expanded_rows(capacity, num_topk, num_local_experts, expert_alignment)
            num_recv, num_expanded, per_expert_list = capacity, expanded_rows, []
        handle = EPHandle(self, dispatch, do_expand, num_experts, expert_alignment, num_max_tokens_per_rank, num_sms,
                          topk_idx, num_recv, num_expanded if do_expand else num_recv, per_expert_list, per_local_psum,
                          psum, num_unaligned, metadata)
        handle._expanded_rows = expanded_rows
        return handle, chunk_counts

    def _expand(self, stream, handle: EPHandle, recv_x, recv_scales, recv_topk_idx, recv_topk_weights, capacity: int,
                zero_padding: bool, column_major_scales: bool, chunk_starts):
        """The expanded layout of a dispatch's compact rows (place_rows); returns ``(x, scales, weights)``."""
        front = self._front
        rows, hidden = handle._expanded_rows, recv_x.shape[1]
        num_topk = handle.topk_idx.shape[1]
        out_x = front.empty((rows, hidden), recv_x.dtype)
        out_weights = front.empty((rows,), np.float32) if recv_topk_weights is not None else None
        out_scales, scale_ptr, strides = None, 0, (0, 0)
        if recv_scales is not None:
            num_scales = recv_scales.shape[1]
            if column_major_scales:
                stride = align_up(rows, 4)
                storage = front.storage(max(1, num_scales * stride) * 4, recv_scales.dtype)
                out_scales = front.view(storage, (rows, num_scales), recv_scales.dtype, 0, (4, stride * 4))
                scale_ptr, strides = storage.ptr, (1, stride)
            else:
                out_scales = front.empty((rows, num_scales), recv_scales.dtype)
                scale_ptr, strides = out_scales.data.ptr, (num_scales, 1)
        dispatch = handle._dispatch
        args = kernels.PlaceArgs(num_rows=_received(dispatch)[0], capacity=capacity, num_topk=num_topk,
                                 num_local_experts=handle.num_experts // self.num_ranks,
                                 expert_alignment=handle.expert_alignment, num_chunks=kernels.num_chunks(capacity),
                                 chunk_starts=_ptr(chunk_starts), num_unaligned=_ptr(handle.num_unaligned_recv_tokens_per_expert),
                                 psum=_ptr(handle.psum_num_recv_tokens_per_expert), recv_topk_idx=_ptr(recv_topk_idx),
                                 metadata=handle.recv_src_metadata.data.ptr, x=recv_x.data.ptr,
                                 row_bytes=hidden * recv_x.itemsize, scales=_ptr(recv_scales),
                                 num_scales=recv_scales.shape[1] if recv_scales is not None else 0,
                                 weights=_ptr(recv_topk_weights), out_x=out_x.data.ptr, out_scales=scale_ptr,
                                 scale_row_stride=strides[0], scale_col_stride=strides[1],
                                 out_weights=_ptr(out_weights), out_rows=rows, zero_padding=int(zero_padding))
        kernels.place(self._library, stream, args)
        return out_x, out_scales, out_weights

    def _column_major(self, stream, scales):
        """``scales`` copied column-major, the column stride its rows rounded up to 4 (V2's TMA layout)."""
        cupy, front = _deps.cupy(), self._front
        rows, cols = scales.shape
        stride = align_up(rows, 4)
        storage = front.storage(max(1, cols * stride) * 4, scales.dtype)
        out = front.view(storage, (rows, cols), scales.dtype, 0, (4, stride * 4))
        with cupy.cuda.ExternalStream(stream.ptr):
            _interop.as_cupy(out)[...] = _interop.as_cupy(scales)
        return out

    def _slot_rows(self, handle: EPHandle):
        """``handle.dst_buffer_slot_idx``, made on the current stream (slot_rows) once the dispatch is done."""
        dispatch, front = handle._dispatch, self._front
        stream = front.current_stream()
        stream.wait_event(handle._dispatched.event)
        topk_idx = _checks.as_device_array("EPHandle.dst_buffer_slot_idx", "handle.topk_idx", handle.topk_idx)
        num_tokens, num_topk = topk_idx.shape
        slots = front.empty((num_tokens, num_topk), np.int32)
        args = kernels.SlotArgs(topk_idx=topk_idx.data.ptr, send_pos=dispatch.send_pos.data.ptr,
                                rank_prefix_matrix=dispatch.rank_prefix_matrix.data.ptr, num_tokens=num_tokens,
                                num_topk=num_topk, num_ranks=self.num_ranks, rank=self.rank_idx,
                                experts_per_rank=handle.num_experts // self.num_ranks, slots=slots.data.ptr)
        kernels.slots(self._library, stream, args, self._device_sms)
        return slots

    def _check_qps(self, call: str, num_qps: int) -> None:
        if num_qps > self.num_allocated_qps:
            raise ValueError(f"{call}: num_qps={num_qps} exceeds the {self.num_allocated_qps} allocated "
                             f"(num_allocated_qps)")


def split_bytes(num_bytes: int, ranks_per_node: int, num_nodes: int, hidden: int = 0,
                num_topk: int = MAX_TOPK_HINT) -> tuple[int, int]:
    """``(num_nvl_bytes, num_rdma_bytes)`` of an ElasticBuffer of ``num_bytes``: all NVLink on one node. Across
    nodes, the RDMA buffer of the largest round of ``hidden``-element rows (0: DeepSeek's 7168) that both buffers
    then hold (a receive partition per node and a send partition per other node; the combine's copies from every
    other rank of the node for each source node), the NVL buffer the rest; when not one round fits, the RDMA
    buffer takes ``2 / (ranks_per_node + 2)`` of it."""
    if num_nodes <= 1:
        return num_bytes, 0
    unit = internode.ROUND_UNIT_TOKENS

    def needs(units: int) -> tuple[int, int]:
        return internode.round_bytes(units * unit, hidden or SPLIT_HIDDEN, num_topk, ranks_per_node, num_nodes)

    low, high = 0, num_bytes // (unit * ranks_per_node * num_nodes) + 1  # the bytes grow with the units: bisect
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if sum(needs(middle)) <= num_bytes else (low, middle)
    rdma = needs(low)[1] if low else num_bytes * 2 // (ranks_per_node + 2) // REGION_ALIGN * REGION_ALIGN
    return num_bytes - rdma, rdma


def _group_size(group) -> int:
    """Ranks of an ``mpi4py`` communicator (``None``: ``MPI.COMM_WORLD``) or a ``torch.distributed`` group."""
    if group is None:
        group = _deps.mpi().COMM_WORLD
    return group.Get_size() if hasattr(group, "Get_size") else group.size()


def _received(dispatch: intranode.Handle | internode.Handle) -> tuple[int, int]:
    """Device addresses of a dispatch's received row count (int32) and its rows' prefix over source ranks
    (int32 `[num_ranks + 1]`), written by the dispatch."""
    if isinstance(dispatch, internode.Handle):
        plan = dispatch.plan.data.ptr
        layout = internode.PlanLayout.create(dispatch.num_ranks, dispatch.node_pos.shape[1], dispatch.num_local_experts)
        return plan + layout.NUM_RECV * 4, plan + layout.recv_prefix * 4
    recv_info = dispatch.recv_info.data.ptr
    return recv_info, recv_info + intranode.RECV_INFO_RANK_PREFIX * 4


def _ptr(array: Any) -> int:
    return array.data.ptr if array is not None else 0


def _worst_expanded_rows(capacity: int, num_topk: int, num_local_experts: int, expert_alignment: int) -> int:
    """The most expanded rows ``capacity`` compact rows can make: each row's lanes on distinct local experts,
    and each expert's rows padded to ``expert_alignment``."""
    return align_up(capacity * min(num_topk, num_local_experts) + (expert_alignment - 1) * num_local_experts,
                    expert_alignment)


def _copy(dst, src, stream) -> None:
    """Device-to-device copy of ``src``'s bytes into ``dst`` (same shape and dtype) on ``stream``."""
    runtime = _deps.cupy().cuda.runtime
    runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.size * src.itemsize, runtime.memcpyDeviceToDevice, stream.ptr)


__all__ = ["BUFFER_ALIGNMENT", "EPHandle", "ElasticBuffer", "split_bytes"]
