"""Buffer: the user-facing communication buffer (DeepEP V1's ``deep_ep.Buffer`` API on CuPy arrays)."""

from __future__ import annotations

import warnings
from typing import Any

from . import _checks, _deps, env
from .errors import CuepError
from .event import EventOverlap
from .jit import get_library
from .kernels import barrier as barrier_kernel
from .kernels import layout as layout_kernel
from .kernels import status as kernel_status
from .runtime import MpiGroup, discover_topology, wait_for_all
from .runtime import world as nvshmem_world


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
        comm: the ``mpi4py`` communicator of the expert-parallel group (default ``MPI.COMM_WORLD``).
        num_nvl_bytes: bytes of the intranode (NVLink) buffer, used by normal-mode dispatch/combine.
        num_rdma_bytes: bytes of the internode buffer, used by the internode and low-latency modes.
        low_latency_mode: whether this Buffer serves the low-latency (decode) kernels.
        num_qps_per_rank: accepted for DeepEP compatibility; NVSHMEM manages its own transport.
        allow_nvlink_for_low_latency_mode: let low-latency kernels store over NVLink to peers
            NVSHMEM can reach directly.
        explicitly_destroy: resources are released only by :meth:`destroy` (or at exit).

    Differs from DeepEP: takes an mpi4py communicator instead of a torch process group; intranode
    and internode memory are one NVSHMEM mechanism; adds :meth:`barrier`.
    """

    def __init__(self, comm=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 explicitly_destroy: bool = False):
        call = "Buffer()"
        self.num_nvl_bytes = _checks.check_nonnegative_int(call, "num_nvl_bytes", num_nvl_bytes)
        self.num_rdma_bytes = _checks.check_nonnegative_int(call, "num_rdma_bytes", num_rdma_bytes)
        if _checks.check_nonnegative_int(call, "num_qps_per_rank", num_qps_per_rank) == 0:
            raise ValueError(f"{call}: num_qps_per_rank must be >= 1, got 0")
        mpi, cupy = _deps.mpi(), _deps.cupy()
        self.comm = mpi.COMM_WORLD if comm is None else comm
        if not isinstance(self.comm, mpi.Comm):
            raise TypeError(f"{call}: comm must be an mpi4py communicator, got {type(comm).__name__}")
        self.low_latency_mode = bool(low_latency_mode)
        self.num_qps_per_rank = int(num_qps_per_rank)
        self.allow_nvlink_for_low_latency_mode = bool(allow_nvlink_for_low_latency_mode)
        self.explicitly_destroy = bool(explicitly_destroy)
        self._destroyed = True  # until construction completes

        wait_for_all(self.comm, "Buffer()")  # the collectives below cannot time out themselves
        self.topology = discover_topology(self.comm)
        self.rank, self.group_size = self.topology.rank, self.topology.num_ranks
        control_bytes = barrier_kernel.signal_bytes(self.group_size)
        data_bytes = self.num_nvl_bytes + self.num_rdma_bytes
        self._world = nvshmem_world.init_world(self.comm, self.topology, data_bytes + control_bytes)
        self.device_id = self._world.device_id
        self._device = cupy.cuda.Device(self.device_id)
        self._device.use()
        self._comm_stream = cupy.cuda.Stream(non_blocking=True)
        self._core_streams: dict[int, Any] = {}
        self._in_flight: list[tuple[Any, tuple]] = []

        self._control = nvshmem_world.allocate(control_bytes)
        self._data = nvshmem_world.allocate(data_bytes) if data_bytes else None
        self._destroyed = False
        self._status = cupy.zeros(kernel_status.STATUS_WORDS, dtype=cupy.int32)
        self._barrier_epoch = 0
        self._load_kernels()
        cupy.cuda.runtime.memset(int(self._control.handle), 0, control_bytes)
        self._device.synchronize()
        _deps.nvshmem().barrier_all(self._core_stream(self._comm_stream))
        self._comm_stream.synchronize()
        self.barrier()

    # ----------------------------------------------------------------------------------------------
    # Internals
    def _load_kernels(self) -> None:
        mpi = _deps.mpi()
        arch = f"sm_{_deps.cuda_core().Device(self.device_id).arch}"
        local_comm = self.comm.Split_type(mpi.COMM_TYPE_SHARED)
        try:
            group = MpiGroup(self.comm, local_comm, env.get("CUEP_COMPILE_TIMEOUT_S"))
            self._layout_library = get_library(layout_kernel.spec(arch), group)
            self._barrier_library = get_library(barrier_kernel.spec(arch), group)
        finally:
            local_comm.Free()

    def _core_stream(self, cupy_stream):
        """The cuda.core view of a CuPy stream, made once per stream."""
        core = _deps.cuda_core()
        key = cupy_stream.ptr
        if key == 0:  # CuPy's null stream is the legacy default stream
            return core.LEGACY_DEFAULT_STREAM
        if key not in self._core_streams:
            self._core_streams[key] = core.Device(self.device_id).create_stream(cupy_stream)
        return self._core_streams[key]

    def _check_alive(self, call: str) -> None:
        if self._destroyed:
            raise CuepError(f"{call}: this Buffer was destroyed")

    def _keep_alive(self, event, arrays: tuple) -> None:
        """Hold ``arrays`` until ``event`` completes: the comm stream may still read or write them after
        the caller drops its references (CuPy has no ``record_stream``)."""
        self._in_flight = [(e, a) for e, a in self._in_flight if not e.done]
        self._in_flight.append((event, arrays))

    # ----------------------------------------------------------------------------------------------
    # Public API
    def get_comm_stream(self):
        """The CuPy stream on which this Buffer's communication kernels run."""
        return self._comm_stream

    @staticmethod
    def capture() -> EventOverlap:
        """An :class:`EventOverlap` recorded on the current CuPy stream now (for ``previous_event``)."""
        cupy = _deps.cupy()
        return EventOverlap(cupy.cuda.get_current_stream().record())

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
        cupy = _deps.cupy()
        timeout_s = env.get("CUEP_TIMEOUT_S") if timeout_s is None else float(timeout_s)
        if not timeout_s > 0:
            raise ValueError(f"Buffer.barrier(): timeout_s must be positive, got {timeout_s}")
        self._barrier_epoch += 1
        stream = cupy.cuda.get_current_stream()
        self._status.fill(0)
        barrier_kernel.launch(self._barrier_library, self._core_stream(stream), int(self._control.handle),
                              self.rank, self.group_size, self._barrier_epoch, timeout_s, self._status)
        kernel_status.raise_if_timed_out(self._status.get(), self.rank, timeout_s)

    def get_dispatch_layout(self, topk_idx, num_experts: int, previous_event: EventOverlap | None = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Count, from the top-k routing, what each rank, node and expert will receive.

        Requirements:
            ``num_experts`` divisible by the number of ranks; rank ``r`` holds experts
            ``[r * E / R, (r + 1) * E / R)``. Unless ``CUEP_SKIP_VALUE_CHECKS`` is set or the stream
            is being captured, expert ids are range-checked first (one small GPU reduction and a sync).

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
            event: an :class:`EventOverlap` for the kernel (always recorded, as in DeepEP's
                ``async_finish`` path; meaningful when ``async_finish=True``).

        Differs from DeepEP: `int32` ``topk_idx`` is accepted too; ids outside `[-1, num_experts)`
        raise ``ValueError`` instead of corrupting memory.
        """
        call = "get_dispatch_layout()"
        self._check_alive(call)
        cupy = _deps.cupy()
        topk_idx = _checks.as_device_array(call, "topk_idx", topk_idx)
        _checks.check_topk_idx(call, topk_idx, num_experts)
        _checks.check_num_experts(call, num_experts, self.group_size)
        _checks.check_event_options(call, previous_event, async_finish, allocate_on_comm_stream)
        compute_stream = cupy.cuda.get_current_stream()
        _checks.check_expert_ids(call, topk_idx, int(num_experts), compute_stream)

        comm_stream = self._comm_stream
        comm_stream.wait_event(previous_event.event if previous_event is not None else compute_stream.record())
        num_tokens, num_nodes = topk_idx.shape[0], self.topology.num_nodes
        with comm_stream if allocate_on_comm_stream else compute_stream:
            per_rank = cupy.empty(self.group_size, dtype=cupy.int32)
            per_node = cupy.empty(num_nodes, dtype=cupy.int32) if num_nodes > 1 else None
            per_expert = cupy.empty(int(num_experts), dtype=cupy.int32)
            in_rank = cupy.empty((num_tokens, self.group_size), dtype=cupy.bool_)
        layout_kernel.launch(self._layout_library, self._core_stream(comm_stream), topk_idx, int(num_experts),
                             self.group_size, num_nodes, per_expert, per_rank, per_node, in_rank)

        done = comm_stream.record()
        outputs = (per_rank, per_node, per_expert, in_rank)
        if async_finish:
            self._keep_alive(done, (topk_idx, *outputs))
        else:
            compute_stream.wait_event(done)
        return (*outputs, EventOverlap(done, extra_arrays=(topk_idx,)))

    def destroy(self) -> None:
        """Collective: release this Buffer's symmetric memory now. Idempotent; the Buffer is unusable after."""
        if self._destroyed:
            return
        wait_for_all(self.comm, "Buffer.destroy()")  # freeing symmetric memory is collective
        self._device.synchronize()
        self._in_flight.clear()
        nvshmem_world.free(self._control)
        if self._data is not None:
            nvshmem_world.free(self._data)
        self._control = self._data = None
        self._destroyed = True

    def __del__(self) -> None:
        try:
            if self.explicitly_destroy and not self._destroyed:
                warnings.warn("cuep.Buffer(explicitly_destroy=True) was garbage-collected without destroy(); "
                              "its memory is released at exit", ResourceWarning, stacklevel=2)
        except Exception:  # a destructor never raises
            pass
