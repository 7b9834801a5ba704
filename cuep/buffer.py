"""Buffer: the user-facing communication buffer (DeepEP V1's ``deep_ep.Buffer`` API on CuPy arrays).

Each call checks its arguments (:mod:`cuep._checks`), picks its stream (:mod:`cuep._streams`) and
hands the work to its mode (:mod:`cuep.modes`); what the modes share (GPU, kernels, symmetric
memory, status words, barrier, streams) is a :class:`cuep.modes.resources.Resources`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import numpy as np

from . import _checks, _deps, env
from ._front import CupyFront, Front, carve
from .config import DEFAULT_NUM_SMS, Config, get_combine_config, get_dispatch_config
from .event import EventOverlap, record_event
from .kernels import layout as layout_kernel
from .kernels.status import SELF_MASKED
from .modes import internode, intranode, low_latency
from .modes.resources import Resources
from .runtime import Topology, as_group


class Buffer:
    """The communication buffers of one rank for expert-parallel dispatch and combine.

    Creating a Buffer is collective over ``comm``: it finds each rank's host and GPU, bootstraps the
    process's NVSHMEM world (once per process; later Buffers share it), allocates the buffers in
    NVSHMEM symmetric memory, compiles or loads its kernels (one rank per node compiles, the others
    load from the disk cache), and checks on the device that every peer is reachable.

    Requirements:
        one rank per GPU, ranks placed host by host (mpirun's default); every rank creates its
        Buffers in the same order with the same sizes.

    Warning:
        with ``explicitly_destroy=True`` you must call :meth:`destroy` on every rank; otherwise the
        memory is released when the process exits (NVSHMEM teardown is collective, so it never runs
        from a garbage-collector callback).

    Arguments:
        comm: the expert-parallel group: an ``mpi4py`` communicator (default ``MPI.COMM_WORLD``), or a
            ``torch.distributed`` process group of any backend (no MPI needed then).
        num_nvl_bytes: bytes of the intranode (NVLink) buffer, used by normal-mode dispatch/combine.
        num_rdma_bytes: bytes of the internode buffer, used by the internode and low-latency modes.
        low_latency_mode: whether this Buffer serves the low-latency (decode) kernels.
        num_qps_per_rank: IBGDA's queue pairs (reliable connections) per peer, as in DeepEP: it sets
            ``NVSHMEM_IBGDA_NUM_RC_PER_PE`` unless that is set; only the process's first Buffer's counts
            (NVSHMEM starts once per process).
        allow_nvlink_for_low_latency_mode: let low-latency kernels store over NVLink to peers
            NVSHMEM can reach directly.
        explicitly_destroy: resources are released only by :meth:`destroy` (or at exit).
        enable_shrink: low-latency shrink mode: a peer that does not answer within ``CUEP_TIMEOUT_S`` is
            masked instead of failing the call (:meth:`low_latency_query_mask_buffer`); the call completes
            on every live rank without it, and later calls skip it without waiting.
        front: for a front over this core (``cuep.torch``): where outputs come from and which stream is
            current (:mod:`cuep._front`); default CuPy's.
        device_id: the GPU, chosen by such a front; default the host's local rank's.
        elastic: also load the kernels of DeepEP V2's layouts (:class:`cuep.ElasticBuffer` sets it).
        topology: where the ranks sit, when the caller already found it over ``comm`` (:class:`cuep.ElasticBuffer`
            does, to size the buffers), saving that collective.

    Differs from DeepEP: takes an mpi4py communicator as well as a torch process group (``cuep.torch``
    is DeepEP's own module, on torch tensors); intranode and internode memory are one NVSHMEM mechanism;
    adds :meth:`barrier`.
    """

    #: SMs of the normal-mode kernels when a call passes no Config (every Buffer of the process), DeepEP's 20
    #: unless :meth:`set_num_sms` changed it. Frameworks read it to leave the other SMs to overlapped GEMMs.
    num_sms: int = DEFAULT_NUM_SMS

    def __init__(self, comm=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, *, front: Front | None = None,
                 device_id: int | None = None, elastic: bool = False, topology: Topology | None = None):
        call = "Buffer()"
        self.num_nvl_bytes, self.num_rdma_bytes = _checks.buffer_sizes(call, num_nvl_bytes, num_rdma_bytes,
                                                                       num_qps_per_rank, intranode.META_BYTES)
        _deps.cupy()  # a missing CuPy is named before any collective
        self.group = as_group(call, comm)
        self.comm = comm if comm is not None else getattr(self.group, "comm", None)
        self.low_latency_mode = bool(low_latency_mode)
        self.num_qps_per_rank = int(num_qps_per_rank)
        self.allow_nvlink_for_low_latency_mode = bool(allow_nvlink_for_low_latency_mode)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.enable_shrink = bool(enable_shrink)
        _checks.same_on_every_rank(call, self.group, num_nvl_bytes=self.num_nvl_bytes,
                                   num_rdma_bytes=self.num_rdma_bytes)
        self._front = front = front or CupyFront()
        self._resources = r = Resources(self.group, front, self.num_nvl_bytes, self.num_rdma_bytes,
                                        self.low_latency_mode, force_put=not self.allow_nvlink_for_low_latency_mode,
                                        shrink=self.enable_shrink, device_id=device_id,
                                        num_qps_per_rank=self.num_qps_per_rank, elastic=elastic, topology=topology)
        self.topology, self.rank, self.group_size, self.device_id = r.topology, r.rank, r.num_ranks, r.device_id
        self._streams, self._check_alive = r.streams, r.check_alive
        self.barrier()

    # ----------------------------------------------------------------------------------------------
    # Public API
    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether this process builds the kernels' Hopper (sm_90) path for its current GPU: ``False`` on
        other GPUs and with ``CUEP_FORCE_FALLBACK=1`` (the Ampere fallback path).

        Differs from DeepEP: DeepEP answers for its build; cuep compiles for the GPU it runs on."""
        return layout_kernel.spec(f"sm_{_deps.cuda_core().Device().arch}").sm90_features

    def get_local_buffer_tensor(self, dtype, size=None, offset: int = 0, use_rdma_buffer: bool = False):
        """A view of this rank's own buffer memory (NVSHMEM symmetric memory, so peers can reach it).

        Arguments:
            dtype: the view's element type (anything ``numpy.dtype`` takes, ``ml_dtypes.bfloat16``, or a
                torch dtype; FP8 types give ``uint8``).
            size: the view's shape (an int or a tuple); default: every whole element from ``offset`` on.
            offset: where the view starts, in bytes from the buffer's start.
            use_rdma_buffer: view the ``num_rdma_bytes`` buffer instead of the ``num_nvl_bytes`` one.

        Returns:
            a CuPy array (export it with DLPack, e.g. ``torch.from_dlpack``) that stays valid until
            :meth:`destroy`. The kernels keep their protocol state in these buffers: what is written
            there between calls may break the next call.
        """
        call = "get_local_buffer_tensor()"
        self._check_alive(call)
        return self._resources.memory.view(call, "rdma" if use_rdma_buffer else "nvl", _checks.numpy_dtype(call, dtype),
                                           size, _checks.check_nonnegative_int(call, "offset", offset), self,
                                           self.device_id)

    def get_comm_stream(self):
        """The CuPy stream on which this Buffer's communication kernels run when a call passes
        ``previous_event``, ``async_finish`` or ``allocate_on_comm_stream``, or is captured into a CUDA
        graph. Other calls, which the current stream waits for anyway, run on the current stream.

        Differs from DeepEP: DeepEP runs every call on its comm stream.
        """
        return self._streams.comm_stream

    @staticmethod
    def capture() -> EventOverlap:
        """An :class:`EventOverlap` recorded on the current CuPy stream now (for ``previous_event``)."""
        return EventOverlap(record_event(_deps.cupy().cuda.get_current_stream()))

    def barrier(self, timeout_s: float | None = None) -> None:
        """Block until every rank reaches this barrier, on the device, through NVSHMEM.

        Collective. Ordered after the work already on the current stream. Every rank must call it
        the same number of times.

        Arguments:
            timeout_s: how long to wait for the slowest peer (default ``CUEP_TIMEOUT_S``).

        Raises:
            PeerTimeoutError: a peer did not arrive in time; it names this rank and the missing peer.

        Differs from DeepEP: DeepEP has no public barrier.
        """
        self._check_alive("Buffer.barrier()")
        timeout_s = env.get("CUEP_TIMEOUT_S") if timeout_s is None else float(timeout_s)
        if not timeout_s > 0:
            raise ValueError(f"Buffer.barrier(): timeout_s must be positive, got {timeout_s}")
        stream = self._front.current_stream()
        self._resources.enqueue_barrier(stream, timeout_s)
        stream.synchronize()
        self._resources.raise_if_failed(timeout_s)

    def get_internode_traffic(self) -> dict[str, int]:
        """What this rank has sent to ranks of other nodes since the Buffer was made.

        Rows are put over the network, or written straight into a peer's buffer where NVSHMEM maps it (unless
        ``CUEP_INTERNODE_PUTS``); both count. Waits for the work already on this GPU. Each internode dispatch
        sends every token once per destination node other than its own (a row of hidden bytes, FP8 scales, top-k
        ids and weights, source token, and a position per rank of that node), and each combine one
        partial per (token, node) back; rows within a node move over NVLink and are not counted.

        Returns:
            ``{"dispatch_rows", "dispatch_bytes", "combine_rows", "combine_bytes"}``: running totals
            (all 0 when every rank is on one node).

        Differs from DeepEP: DeepEP has no such counter.
        """
        self._check_alive("Buffer.get_internode_traffic()")
        ctx = self._resources.internode
        if ctx is None:
            return dict.fromkeys(("dispatch_rows", "dispatch_bytes", "combine_rows", "combine_bytes"), 0)
        return ctx.traffic_counts()

    def get_dispatch_layout(self, topk_idx, num_experts: int, previous_event: EventOverlap | None = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Count, from the top-k routing, what each rank, node and expert will receive.

        Requirements:
            ``num_experts`` divisible by the number of ranks; rank ``r`` holds experts
            ``[r * E / R, (r + 1) * E / R)``.

        Arguments:
            topk_idx: `[num_tokens, num_topk]` with `int64` (or `int32`), the experts each token is
                routed to; `-1` means no expert. Any GPU array (CuPy, DLPack, CUDA array interface).
            num_experts: the number of experts across all ranks.
            previous_event: wait for this event before the kernel runs, instead of for the current stream.
            async_finish: leave the current stream free: the result is ready once the returned event is.
            allocate_on_comm_stream: allocate the outputs on the communication stream (needs
                ``previous_event`` and ``async_finish``).

        Returns:
            num_tokens_per_rank: `[num_ranks]` with `int32`, tokens sent to each rank.
            num_tokens_per_rdma_rank: `[num_nodes]` with `int32`, tokens sent to each node; `None`
                when all ranks share one node.
            num_tokens_per_expert: `[num_experts]` with `int32`, entries routed to each expert.
            is_token_in_rank: `[num_tokens, num_ranks]` with `bool`, whether a token goes to a rank.
            event: an :class:`EventOverlap` for the kernel. Without ``previous_event``, ``async_finish``
                and ``allocate_on_comm_stream`` the kernel runs on the current stream and the event is
                recorded only when first used (DeepEP returns none then).

        Differs from DeepEP: `int32` ``topk_idx`` is accepted too; ids outside `[-1, num_experts)` count
        nowhere (as `-1`) instead of corrupting memory, and a later call of this Buffer (the next one once the
        kernel has finished, e.g. after a sync) raises ``ValueError`` naming the id: the kernel checks them,
        since a check on the host would cost a sync per call.
        """
        call = "get_dispatch_layout()"
        self._check_alive(call)
        front = self._front
        topk_idx = _checks.as_device_array(call, "topk_idx", topk_idx)
        _checks.check_topk_idx(call, topk_idx, num_experts)
        _checks.check_num_experts(call, num_experts, self.group_size)
        _checks.check_event_options(call, previous_event, async_finish, allocate_on_comm_stream)
        num_tokens, num_nodes = topk_idx.shape[0], self.topology.num_nodes

        def enqueue(stream):
            regions, nbytes = _layout_outputs(self.group_size, num_nodes, int(num_experts), num_tokens)
            storage = front.storage(nbytes, regions[0].dtype)
            per_rank, per_expert, in_rank, *per_node = front.readable_views(storage, regions)
            per_node = per_node[0] if per_node else None
            self._resources.layout.launch(stream, topk_idx, int(num_experts), per_expert, per_rank, per_node, in_rank)
            return (per_rank, per_node, per_expert, in_rank), (topk_idx,)

        outputs, event = self._streams.run(previous_event, async_finish, allocate_on_comm_stream, enqueue)
        return (*outputs, event)

    @classmethod
    def set_num_sms(cls, new_num_sms: int) -> None:
        """Set the SMs the high-throughput kernels use when no Config is passed (every Buffer; default 20, as
        DeepEP's). Where no computation overlaps the calls, more SMs move more bytes (up to 128 on H100/H200,
        ``python -m cuep.bench --mode normal --tune``)."""
        if isinstance(new_num_sms, bool) or not isinstance(new_num_sms, int) or new_num_sms <= 0:
            raise ValueError(f"Buffer.set_num_sms(): new_num_sms must be a positive int, got {new_num_sms!r}")
        cls.num_sms = new_num_sms

    @classmethod
    def get_dispatch_config(cls, num_ranks: int) -> Config:
        """The dispatch Config for ``num_ranks`` ranks, with :attr:`num_sms` SMs."""
        return get_dispatch_config(num_ranks, cls.num_sms)

    @classmethod
    def get_combine_config(cls, num_ranks: int) -> Config:
        """The combine Config for ``num_ranks`` ranks, with :attr:`num_sms` SMs."""
        return get_combine_config(num_ranks, cls.num_sms)

    def dispatch(self, x, handle: intranode.Handle | None = None, num_tokens_per_rank=None,
                 num_tokens_per_rdma_rank=None, is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                 previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Send each token to every rank that holds one of its experts (over NVLink on one node; across nodes,
        once per destination node over the network, then over NVLink there).

        Requirements:
            every rank calls it; non-cached calls need the layout from :meth:`get_dispatch_layout`.
            A non-cached call without ``num_worst_tokens`` waits on the CPU for the received count,
            to size the outputs. Any batch goes through the Buffer, in rounds of the tokens its buffers
            hold; on one node the NVL buffer must also hold a non-cached call's staged routing (the error
            says how much when it does not). Across nodes a call with ``num_worst_tokens`` moves one round:
            a larger batch on any rank is reported by every rank's next call (docs/internode.md).

        Arguments:
            x: `[num_tokens, hidden]` with `bfloat16` (``ml_dtypes.bfloat16``), or a tuple of
                `[num_tokens, hidden]` `uint8` holding FP8 e4m3 bytes and its scales (any strides, e.g.
                column-major): `[num_tokens, hidden // 128]` `float32`, or DeepGEMM's packed UE8M0 exponents
                `[num_tokens, hidden // 512]` `int32` (four per word).
            handle: a previous dispatch's handle (or the flat tuple of arrays it iterates as, e.g. saved
                as torch tensors): cached mode, reusing its layout (no CPU wait);
                ``topk_idx``/``topk_weights`` must then be ``None``.
            num_tokens_per_rank: `[num_ranks]` `int32` from the layout.
            num_tokens_per_rdma_rank: `[num_nodes]` from the layout, `None` on one node.
            is_token_in_rank: `[num_tokens, num_ranks]` `bool` from the layout.
            num_tokens_per_expert: `[num_experts]` `int32` from the layout.
            topk_idx: `[num_tokens, num_topk]` `int64`/`int32`, or `None` to send no routing.
            topk_weights: `[num_tokens, num_topk]` `float32`, or `None`.
            expert_alignment: round each received per-expert count up to a multiple of this.
            num_worst_tokens: when > 0, allocate this many received rows and skip the CPU wait
                (CUDA-graph capturable); rows past the real count have top-k ids `-1`.
            config: performance config (default :meth:`get_dispatch_config`).
            previous_event, async_finish, allocate_on_comm_stream: as in :meth:`get_dispatch_layout`.

        Returns:
            recv_x: `[num_recv_tokens, hidden]` like ``x`` (for FP8 a tuple with the received scales, of the
                dtype and columns given), rows ordered by source rank, then source token.
            recv_topk_idx: `[num_recv_tokens, num_topk]` `int64`, local expert ids, `-1` where the expert
                is elsewhere (or `None`).
            recv_topk_weights: `[num_recv_tokens, num_topk]` `float32`, zero where the id is `-1` (or `None`).
            num_recv_tokens_per_expert_list: per local expert, tokens received (aligned); empty with
                ``num_worst_tokens`` or a handle.
            handle: for :meth:`combine` and cached dispatch.
            event: an :class:`EventOverlap` for the communication.

        Differs from DeepEP: any hidden size (multiple of 8 for BF16, of 128 for FP8); `int32` ids
        accepted; FP8 data is `uint8` (CuPy has no FP8 dtype).
        """
        call = "dispatch()"
        ctx = self._resources.normal_ready(call)
        across_nodes = isinstance(ctx, internode.Context)
        max_experts = internode.MAX_LOCAL_EXPERTS * self.group_size if across_nodes else intranode.MAX_EXPERTS
        a = _checks.dispatch_arguments(call, self.group_size, self.topology.num_nodes, max_experts, x,
                                       handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                       num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                       num_worst_tokens, previous_event, async_finish, allocate_on_comm_stream,
                                       internode.Handle if across_nodes else intranode.Handle)
        config = config or _tuned_config(get_dispatch_config, self.group_size, type(self).num_sms)

        def enqueue(stream):
            topk_idx = _checks.widened_ids(a.topk_idx, stream)
            if across_nodes:
                recv_x, recv_scales, *received = internode.dispatch(
                    ctx, stream, a.x, a.scales, topk_idx, a.topk_weights, a.is_token_in_rank,
                    a.num_tokens_per_expert, a.num_experts, a.handle, a.expert_alignment, a.num_worst_tokens,
                    config.num_sms, config.num_max_rdma_chunked_send_tokens)
            else:
                recv_x, recv_scales, *received = intranode.dispatch(
                    ctx, stream, a.x, a.scales, topk_idx, a.topk_weights, a.is_token_in_rank,
                    a.num_tokens_per_expert, a.num_experts, a.handle, a.expert_alignment, a.num_worst_tokens,
                    config.num_sms)
            recv_x = (recv_x, recv_scales) if a.scales is not None else recv_x
            # The caller's int32 ids too: the widening copy on `stream` reads them after this call returns.
            return (recv_x, *received), (a.x, a.scales, topk_idx, a.topk_idx, a.topk_weights, a.is_token_in_rank,
                                         a.num_tokens_per_expert, a.handle)

        outputs, event = self._streams.run(previous_event, async_finish, allocate_on_comm_stream, enqueue)
        self._resources.raise_if_failed()
        return (*outputs, event)

    def combine(self, x, handle: intranode.Handle, topk_weights=None, bias=None, config: Config | None = None,
                previous_event: EventOverlap | None = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Send each received token back to its source rank and sum the copies there (no weights applied).

        Arguments:
            x: `[num_recv_tokens, hidden]` `bfloat16`, one row per row ``dispatch`` returned.
            handle: the dispatch's handle, or the flat tuple of arrays it iterates as.
            topk_weights: `[num_recv_tokens, num_topk]` `float32` to sum back too, or `None`.
            bias: `[num_tokens, hidden]` `bfloat16`, or a tuple of two, added to each result.
            config, previous_event, async_finish, allocate_on_comm_stream: as in :meth:`dispatch`.

        Returns:
            combined_x: `[num_tokens, hidden]` `bfloat16`: for each original token, the FP32 sum of its
                copies' rows plus the biases (just the biases when it went nowhere).
            combined_topk_weights: `[num_tokens, num_topk]` `float32`, the summed weights (or `None`).
            event: an :class:`EventOverlap` for the communication.
        """
        call = "combine()"
        ctx = self._resources.normal_ready(call)
        across_nodes = isinstance(ctx, internode.Context)
        x, handle, topk_weights, bias0, bias1 = _checks.combine_inputs(
            call, x, handle, topk_weights, bias, self.group_size,
            internode.Handle if across_nodes else intranode.Handle)
        _checks.check_event_options(call, previous_event, async_finish, allocate_on_comm_stream)
        config = config or _tuned_config(get_combine_config, self.group_size, type(self).num_sms)

        def enqueue(stream):
            if across_nodes:
                outputs = internode.combine(ctx, stream, x, handle, topk_weights, bias0, bias1, config.num_sms,
                                            config.num_max_rdma_chunked_send_tokens)
            else:
                outputs = intranode.combine(ctx, stream, x, handle, topk_weights, bias0, bias1, config.num_sms)
            return outputs, (x, topk_weights, bias0, bias1, handle)

        outputs, event = self._streams.run(previous_event, async_finish, allocate_on_comm_stream, enqueue)
        return (*outputs, event)

    # ----------------------------------------------------------------------------------------------
    # Low-latency mode
    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of ``num_rdma_bytes`` that low-latency calls of up to this many tokens per rank need.

        Differs from DeepEP: each token crosses once per destination rank (not per expert), so the
        buffer holds ``num_ranks`` slots per token instead of ``num_experts``; ``num_experts`` sizes only
        the copies of routing tables sent by put (their counts of each local expert). Up to 32 experts per
        token.
        """
        call = "get_low_latency_rdma_size_hint()"
        _checks.check_positive_ints(call, num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
                                    hidden=hidden, num_ranks=num_ranks, num_experts=num_experts)
        return low_latency.size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False):
        """Send each token to the ranks holding its experts, laid out per local expert (decode, low latency).

        Each token crosses to each destination rank once, quantised to FP8 by its sender (or as BF16);
        the receiver fans it out into the rows of its local experts. Capturable in a CUDA graph.

        Requirements:
            a Buffer made with ``low_latency_mode=True`` and ``num_rdma_bytes >=``
            :meth:`get_low_latency_rdma_size_hint`; every rank calls it with the same
            ``num_max_dispatch_tokens_per_rank``, hidden size and ``num_experts``. The call order (docs/low-latency.md,
            "Low-latency call order"): every rank makes the same low-latency calls in the same order, and
            sends call ``n`` only after receiving every call up to ``n - 2`` (at most two results in
            flight). Which buffer a call uses is decided on the GPU, so hooks and CUDA graphs may split
            and group the calls freely within those rules.

        Warning:
            a call that breaks the order moves nothing, and the rank's next call raises
            :class:`~cuep.CallOrderError` naming the rule; the other ranks' receives of that call wait for
            it until ``CUEP_TIMEOUT_S`` (:class:`~cuep.PeerTimeoutError`; shrink mode masks the rank).

        Arguments:
            x: `[num_tokens, hidden]` `bfloat16`, ``num_tokens <= num_max_dispatch_tokens_per_rank``, hidden a
                multiple of 128 (of 512 with ``use_ue8m0``).
            topk_idx: `[num_tokens, num_topk]` `int64` (or `int32`), up to 32 experts per token, `-1` for none.
                Ids outside `[-1, num_experts)` are treated as `-1` and a later call (the next one once the
                kernel has finished) raises ``ValueError`` naming the id (checking them here would cost a host
                sync per call).
            num_max_dispatch_tokens_per_rank: the most tokens any rank sends in one call (at most 1024).
            num_experts: experts across all ranks, a multiple of the number of ranks.
            cumulative_local_expert_recv_stats: `[num_local_experts]` `int32`; each call adds the tokens each
                local expert received.
            dispatch_wait_recv_cost_stats: `[num_ranks]` `int64`; each call adds, per source rank, the
                nanoseconds this rank's receive waited for that source's messages (its routing table, then
                each row of its tokens). A straggler shows as one large entry. Waits of different warps
                overlap, so the entries compare sources rather than add up to wall time.
            use_fp8: send e4m3 with one float32 scale per 128 channels (else BF16).
            round_scale: round each scale up to a power of two.
            use_ue8m0: return the (power-of-two) scales as packed UE8M0 exponents.
            async_finish: run on the communication stream and return an event to wait on.
            return_recv_hook: run only the send phase now; calling the returned hook runs the receive (on
                the current stream, then). No SM is used in between.

        Returns:
            recv_x: `[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]`: `uint8` e4m3
                bytes with `float32` scales `[..., hidden // 128]` (column-major in the last two dims) as a
                tuple ``(recv_x, scales)`` for FP8 (`int32` `[..., hidden // 512]` with ``use_ue8m0``), or
                `bfloat16`. Rows ``0 .. recv_count[e] - 1`` of expert ``e`` hold its tokens ordered by
                source rank, then source token.
            recv_count: `[num_local_experts]` `int32`, tokens each local expert received.
            handle: for :meth:`low_latency_combine`.
            event: an :class:`EventOverlap` (holding an event with ``async_finish``).
            hook: the receive hook with ``return_recv_hook``, else ``None``.

        Differs from DeepEP: rows are deterministic (DeepEP's order depends on timing); up to 32 experts
        per token; `int32` ids accepted; FP8 is `uint8` (CuPy has no FP8 dtype); wait statistics count
        nanoseconds (DeepEP counts clock cycles).
        """
        arguments = (x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
                     dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook)
        done = self._eager_low_latency_dispatch(*arguments)  # the decode loop's call, once known: one step
        if done is not None:
            return (*done, EventOverlap(), None)
        return self._full_low_latency_dispatch(*arguments)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle: low_latency.Handle, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False,
                            out=None, combine_wait_recv_cost_stats=None):
        """Send the expert outputs back to their tokens' ranks and reduce them with the top-k weights.

        Each rank first sums, in FP32, the weighted outputs of its local experts for each token it
        received, and sends that one BF16 partial back; the token's rank adds the partials in FP32.

        Arguments:
            x: `[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]` `bfloat16`, the
                expert outputs in the dispatch's row layout.
            topk_idx: `[num_tokens, num_topk]`, the dispatch's routing; entries set to `-1` since then are skipped.
            topk_weights: `[num_tokens, num_topk]` `float32`.
            handle: the handle of the matching :meth:`low_latency_dispatch`.
            use_logfmt: send each partial as LogFMT (:mod:`cuep.logfmt`): per 128 channels, 10-bit
                logarithmic codes with the block's range, or BF16 where the block's nonzero values span more
                than 16 octaves; about 1.31 bytes per channel instead of 2, each element within 1.1% (BF16
                blocks: 2^-8) of the FP32 partial. A rank's partials for its own tokens, which never leave its
                GPU, and rows a send could not weigh yet (docs/low-latency.md) go as BF16 either way. Every rank
                passes the same value.
            zero_copy: accepted for DeepEP compatibility: cuep reads ``x`` in place whatever it is, so this
                costs nothing either way (:meth:`get_next_low_latency_combine_buffer` gives a ready buffer).
            async_finish, return_recv_hook: as in :meth:`low_latency_dispatch`.
            out: `[num_tokens, hidden]` `bfloat16` to write into, else a new array.
            combine_wait_recv_cost_stats: `[num_ranks]` `int64`; each call adds, per rank, the nanoseconds
                this rank's receive waited for that rank's partials.

        Returns:
            combined_x: `[num_tokens, hidden]` `bfloat16`, ``sum_k topk_weights[t, k] * x[row of (t, k)]``.
            event: an :class:`EventOverlap`.
            hook: the receive hook with ``return_recv_hook``, else ``None``.

        Differs from DeepEP: a token's partial sum from each rank is rounded to BF16 once before it
        travels (DeepEP rounds each expert's output); the result differs from DeepEP's by BF16 rounding.
        LogFMT is cuep's own format (DeepEP's LogFMT-10 inspired it; the bytes differ) and works with
        ``zero_copy``.
        """
        arguments = (x, topk_idx, topk_weights, handle, use_logfmt, async_finish, return_recv_hook, out,
                     combine_wait_recv_cost_stats)
        combined = self._eager_low_latency_combine(*arguments)  # the decode loop's call, once known: one step
        if combined is not None:
            return combined, EventOverlap(), None
        return self._full_low_latency_combine(*arguments)

    # Both fronts' low-latency calls: the one step where it serves, else the full path.
    def _eager_low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                                    cumulative_stats, wait_stats, use_fp8, round_scale, use_ue8m0, async_finish,
                                    return_recv_hook) -> tuple | None:
        """The decode loop's dispatch (no hook, no ``async_finish``) in one step, once a call of its signature was
        checked (:func:`cuep.modes.low_latency.eager_dispatch`): ``(recv_x, recv_count, handle)`` as
        :meth:`low_latency_dispatch` returns them, its kernel launched on the current stream; ``None``, having done
        nothing, for any other call (:meth:`_full_low_latency_dispatch` serves it)."""
        if async_finish or return_recv_hook:
            return None
        done = low_latency.eager_dispatch(self._resources.low_latency_ready("low_latency_dispatch()"),
                                          self._front.current_stream(), x, topk_idx, num_max_dispatch_tokens_per_rank,
                                          num_experts, cumulative_stats, wait_stats, use_fp8, round_scale, use_ue8m0)
        if done is None:
            return None
        recv_x, recv_scales, recv_count, handle = done
        return (recv_x, recv_scales) if use_fp8 else recv_x, recv_count, handle

    def _full_low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                                   cumulative_stats, wait_stats, use_fp8, round_scale, use_ue8m0, async_finish,
                                   return_recv_hook):
        """:meth:`low_latency_dispatch` through the checks, the plan, and the launch with its event or hook."""
        call = "low_latency_dispatch()"
        ctx = self._resources.low_latency_ready(call)
        _checks.check_hook_options(call, async_finish, return_recv_hook)
        shape, *addresses = low_latency.checked_dispatch(call, ctx, x, topk_idx, num_max_dispatch_tokens_per_rank,
                                                         num_experts, cumulative_stats, wait_stats, use_fp8,
                                                         round_scale, use_ue8m0)
        recv_x, recv_scales, recv_count, _, handle, run = low_latency.dispatch(ctx, shape, *addresses)
        event, hook = self._streams.run_with_hook(
            run, low_latency.SEND_PHASE, low_latency.RECV_PHASE, async_finish, return_recv_hook,
            (x, topk_idx, cumulative_stats, wait_stats, recv_x, recv_scales, recv_count, handle), self._check_alive)
        return (recv_x, recv_scales) if use_fp8 else recv_x, recv_count, handle, event, hook

    def _eager_low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt, async_finish,
                                   return_recv_hook, out, wait_stats):
        """The decode loop's combine (no ``out``, no hook, no ``async_finish``, a ``bool`` ``use_logfmt``) in one
        step, once a call of its signature was checked (:func:`cuep.modes.low_latency.eager_combine`): the combined
        output as :meth:`low_latency_combine` returns it, its kernel launched on the current stream; ``None``,
        having done nothing, for any other call (:meth:`_full_low_latency_combine` serves it; an option of another
        type goes where the checks read it)."""
        if async_finish or return_recv_hook or out is not None or type(use_logfmt) is not bool:
            return None
        combined = low_latency.eager_combine(self._resources.low_latency_ready("low_latency_combine()"),
                                             self._front.current_stream(), x, topk_idx, topk_weights, handle,
                                             wait_stats, use_logfmt)
        return None if combined is None else self._front.export(combined)

    def _full_low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt, async_finish,
                                  return_recv_hook, out, wait_stats):
        """:meth:`low_latency_combine` through the checks, the plan, and the launch with its event or hook."""
        call = "low_latency_combine()"
        ctx = self._resources.low_latency_ready(call)
        _checks.check_hook_options(call, async_finish, return_recv_hook)
        shape, x_address, ids_address, weights_address, out_array, wait_address = low_latency.checked_combine(
            call, ctx, x, topk_idx, topk_weights, handle, out, wait_stats)
        out_array, run = low_latency.combine(ctx, shape, handle, x_address, ids_address, weights_address, out_array,
                                             wait_address, bool(use_logfmt))
        event, hook = self._streams.run_with_hook(
            run, low_latency.SEND_PHASE, low_latency.RECV_PHASE, async_finish, return_recv_hook,
            (x, topk_idx, topk_weights, handle, out_array, wait_stats), self._check_alive)
        return self._front.export(out_array), event, hook

    def get_next_low_latency_combine_buffer(self, handle: low_latency.Handle):
        """A `[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]` `bfloat16` array for
        the next :meth:`low_latency_combine`'s expert outputs (two per shape, handed out in turn: at most two
        results are in flight; reused).

        cuep's combine reads its ``x`` in place wherever it lives, so writing here saves nothing over any
        other array; it exists so code written for DeepEP's zero-copy path runs unchanged.
        """
        call = "get_next_low_latency_combine_buffer()"
        ctx = self._resources.low_latency_ready(call, hand_over=False)
        if not isinstance(handle, low_latency.Handle):
            raise TypeError(f"{call}: handle must come from low_latency_dispatch()")
        return ctx.combine_buffer(handle)

    def get_low_latency_trace(self):
        """In a ``CUEP_TRACE=1`` build, `[num_sms, trace points]` `uint64`: when each block of the last
        low-latency kernel passed each phase (``cuep.bench --trace`` reads it); otherwise ``None``."""
        return self._resources.low_latency_ready("get_low_latency_trace()", hand_over=False).trace

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Collective: bring the low-latency buffer to a clean state (every live rank, nothing in flight).

        cuep's flags and table words carry call numbers that only grow, at offsets that do not move with
        the shapes, so its kernels never need this, even when the shapes change between calls; it exists
        for DeepEP compatibility, and to start over after a :class:`~cuep.CallOrderError` (results left in
        flight are dropped: their hooks are refused). Without shrink mode it zeroes the buffer and the
        call order's state, collectively over every rank.
        In shrink mode, as DeepEP's, only the live ranks take part: they run one empty low-latency round
        (a dispatch and a combine of no tokens) on the device, which masks any rank that does not arrive
        within ``CUEP_TIMEOUT_S``, and the masks stay (:meth:`low_latency_clean_mask_buffer` lifts them).
        The arguments are checked against the buffer's capacity.
        """
        call = "clean_low_latency_buffer()"
        ctx = self._resources.low_latency_ready(call)
        low_latency.check_fits(call, ctx, num_max_dispatch_tokens_per_rank, hidden, num_experts)
        if ctx.shrink:
            self._empty_low_latency_round(ctx, num_max_dispatch_tokens_per_rank, hidden, num_experts)
            return
        self._resources.device.synchronize()
        self.group.wait_for_all(call)
        _deps.cupy().cuda.runtime.memset(ctx.region_ptr, 0, ctx.region_bytes)
        ctx.restart(max(self.group.allgather(ctx.newest_call(), call)))
        self._resources.device.synchronize()
        self.group.wait_for_all(call)

    def _empty_low_latency_round(self, ctx: low_latency.Context, max_tokens: int, hidden: int,
                                 num_experts: int) -> None:
        """A dispatch and a combine of no tokens, waited for: the live ranks meet on the device, and the
        waits mask the ranks that do not come. No row is read or written, so no array needs its full shape
        and the calls' checks are not run (their shapes are stated here)."""
        front, bf16 = self._front, _checks.bf16_dtype()
        x, out = front.empty((0, hidden), bf16), front.empty((0, hidden), bf16)
        topk_idx, weights = front.empty((0, 1), np.int64), front.empty((0, 1), np.float32)
        pointer = front.pointer
        stream, both = front.current_stream(), low_latency.SEND_PHASE | low_latency.RECV_PHASE
        no_tokens = low_latency.DispatchCall.of(max_tokens, hidden, num_experts, 0, 1, True, False, False, False, bf16)
        *_, handle, _, dispatch = low_latency.dispatch(ctx, no_tokens, pointer(x), pointer(topk_idx), 0, 0,
                                                       reuse_outputs=False)
        dispatch(stream, both)
        no_tokens_back = low_latency.CombineCall.of(max_tokens, hidden, num_experts, 0, 1, True)
        _, combine = low_latency.combine(ctx, no_tokens_back, handle, pointer(x), pointer(topk_idx), pointer(weights),
                                         out, 0)
        combine(stream, both)
        stream.synchronize()
        self._resources.raise_if_failed()

    # ----------------------------------------------------------------------------------------------
    # Shrink mode (low latency)
    def _shrink_ready(self, call: str) -> low_latency.Context:
        """The low-latency context of a shrink-mode Buffer. These calls are how a masked rank learns of and
        ends its state, so a masked rank's pending :class:`~cuep.errors.MaskedRankError` is not raised here."""
        ctx = self._resources.low_latency
        if ctx is not None and ctx.shrink:
            ctx.status_words.clear(SELF_MASKED)
        ctx = self._resources.low_latency_ready(call)
        if not ctx.shrink:
            raise ValueError(f"{call}: create the Buffer with enable_shrink=True (and low_latency_mode=True)")
        return ctx

    def _resume_together(self, call: str, ctx: low_latency.Context) -> None:
        """Collective, nothing in flight: every rank unmasks every rank and goes on from the newest call any
        rank sent (a rank that sat calls out is behind the others)."""
        self._resources.device.synchronize()
        self.group.wait_for_all(call)
        newest = max(self.group.allgather(ctx.newest_call(), call))
        ctx.restart(newest)
        self._resources.device.synchronize()
        self.group.wait_for_all(call)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask=True``) or unmask a rank in this rank's mask, in stream order (shrink mode).

        A masked rank is sent nothing and waited for by no low-latency call; its experts' tokens add
        nothing to a combine. A rank masked here reaches every other live rank by the end of this rank's
        next low-latency kernel, as a mask set by a timeout does. Unmasking is local: it undoes a mask
        no call has used yet; a rank that its peers masked rejoins through
        :meth:`low_latency_clean_mask_buffer`.
        """
        call = "low_latency_update_mask_buffer()"
        ctx = self._shrink_ready(call)
        if isinstance(rank_to_mask, bool) or not isinstance(rank_to_mask, (int, np.integer)) \
                or not 0 <= rank_to_mask < self.group_size:
            raise ValueError(f"{call}: rank_to_mask must be a rank in [0, {self.group_size}), got {rank_to_mask!r}")
        if mask and rank_to_mask == self.rank:
            raise ValueError(f"{call}: rank {self.rank} cannot mask itself; leave the calls instead, and the others "
                             f"mask it when they time out")
        with self._front.current_stream():  # in the callers' stream order
            ctx.set_mask(int(rank_to_mask), bool(mask))

    def low_latency_query_mask_buffer(self, mask_status) -> None:
        """Write this rank's mask into ``mask_status``, `[num_ranks]` `int32` (1: masked), in stream order
        (shrink mode). Once a call that masked a rank has finished on every live rank, every live rank
        shows the same mask; a rank its peers masked shows itself masked (it is told over NVLink)."""
        call = "low_latency_query_mask_buffer()"
        ctx = self._shrink_ready(call)
        out = _checks.optional_vector(call, "mask_status", mask_status, np.int32, self.group_size)
        if out is None:
            raise ValueError(f"{call}: mask_status must be a [{self.group_size}] int32 device array")
        with self._front.current_stream():
            ctx.query_mask(out)

    def low_latency_clean_mask_buffer(self) -> None:
        """Collective over every rank of the Buffer, a masked rank that is back included: unmask every
        rank and resume together (shrink mode).

        A rank that sat calls out is behind the others' call numbers; every rank goes on from the newest
        call any rank sent. Nothing may be in flight (no pending hook). A rank that never comes makes it
        raise :class:`~cuep.errors.PeerTimeoutError` after ``CUEP_TIMEOUT_S``, and the masks stay.
        """
        call = "low_latency_clean_mask_buffer()"
        self._resume_together(call, self._shrink_ready(call))

    def destroy(self) -> None:
        """Collective: release this Buffer's symmetric memory now. Idempotent; the Buffer is unusable after."""
        if not self._resources.destroyed:
            self.group.wait_for_all("Buffer.destroy()")  # freeing symmetric memory is collective
            self._resources.free()

    def __del__(self) -> None:
        try:
            if self.explicitly_destroy and not self._resources.destroyed:
                warnings.warn("cuep.Buffer(explicitly_destroy=True) was garbage-collected without destroy(); "
                              "its memory is released at exit", ResourceWarning, stacklevel=2)
        except Exception:  # a destructor never raises
            pass


@functools.lru_cache(maxsize=64)
def _layout_outputs(num_ranks: int, num_nodes: int, num_experts: int, num_tokens: int) -> tuple[tuple, int]:
    """Where :meth:`Buffer.get_dispatch_layout`'s outputs sit in its one allocation (per rank, per expert, token
    in rank, then per node across nodes), and its bytes."""
    per_node = [("per_node", (num_nodes,), np.int32, None)] if num_nodes > 1 else []
    regions, nbytes = carve([("per_rank", (num_ranks,), np.int32, None), ("per_expert", (num_experts,), np.int32, None),
                             ("in_rank", (num_tokens, num_ranks), np.bool_, None), *per_node])
    return tuple(regions.values()), nbytes


@functools.lru_cache(maxsize=64)
def _tuned_config(tuned: Callable[[int, int], Config], num_ranks: int, num_sms: int) -> Config:
    """``tuned(num_ranks, num_sms)`` (:func:`get_dispatch_config` or :func:`get_combine_config`), the Config a
    call without one uses: made once per (operation, ranks, ``Buffer.num_sms``), and never handed out, so
    no caller can change it."""
    return tuned(num_ranks, num_sms)
