"""Buffer: the user-facing communication buffer (DeepEP V1's ``deep_ep.Buffer`` API on CuPy arrays)."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import numpy as np

from . import _checks, _deps, env
from .errors import CuepError
from .event import EventOverlap, record_event
from .jit import start_libraries
from .config import Config, get_combine_config, get_dispatch_config
from .kernels import barrier as barrier_kernel
from .kernels import buffer_specs
from .kernels import intranode as intranode_kernel
from .kernels import layout as layout_kernel
from .kernels import low_latency as low_latency_kernel
from .kernels import status as kernel_status
from .runtime import MpiGroup, discover_topology, wait_for_all
from .runtime import world as nvshmem_world

# The low-latency region starts on this boundary after the NVL region in the symmetric allocation.
LOW_LATENCY_ALIGN = 4096
_CLEAR_STATUS = bytes(kernel_status.STATUS_WORDS * 4)  # the status words' host mirror while nothing failed


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

    #: SMs for the high-throughput kernels when no Config is given; ``None`` uses the tuned defaults.
    num_sms: int | None = None

    def __init__(self, comm=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 explicitly_destroy: bool = False):
        call = "Buffer()"
        self.num_nvl_bytes = _checks.check_nonnegative_int(call, "num_nvl_bytes", num_nvl_bytes)
        if 0 < self.num_nvl_bytes < intranode_kernel.META_BYTES:
            raise ValueError(f"{call}: num_nvl_bytes must be 0 or at least {intranode_kernel.META_BYTES} (the "
                             f"dispatch metadata region), got {self.num_nvl_bytes}")
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
        sizes = sorted(set(self.comm.allgather((self.num_nvl_bytes, self.num_rdma_bytes))))
        if len(sizes) > 1:  # symmetric memory; the kernels also derive offsets from the size
            raise ValueError(f"{call}: num_nvl_bytes and num_rdma_bytes must be the same on every rank, got "
                             f"(num_nvl_bytes, num_rdma_bytes) pairs {sizes}")
        self.topology = discover_topology(self.comm)
        self.rank, self.group_size = self.topology.rank, self.topology.num_ranks
        control_bytes = barrier_kernel.signal_bytes(self.group_size)
        self._low_latency_offset = -(-self.num_nvl_bytes // LOW_LATENCY_ALIGN) * LOW_LATENCY_ALIGN
        data_bytes = self._low_latency_offset + self.num_rdma_bytes if self.num_rdma_bytes else self.num_nvl_bytes
        self.device_id = nvshmem_world.choose_device(self.comm, self.topology)
        load_kernels = self._start_kernels()  # they compile while NVSHMEM boots
        self._world = nvshmem_world.init_world(self.comm, self.topology, data_bytes + control_bytes, self.device_id)
        self._device = cupy.cuda.Device(self.device_id)
        self._device.use()
        self._comm_stream = cupy.cuda.Stream(non_blocking=True)
        self._core_streams: dict[int, Any] = {}
        self._in_flight: list[tuple[Any, tuple]] = []
        # (stream pointer, EventOverlap after it) of the last layout, dispatch or combine
        self._last_call: tuple[int, Any] | None = None

        self._control = nvshmem_world.allocate(control_bytes)
        self._data = nvshmem_world.allocate(data_bytes) if data_bytes else None
        self._destroyed = False
        self._status = cupy.zeros(kernel_status.STATUS_WORDS, dtype=cupy.int32)
        self._status_host = self._pinned_status_words()
        self._status_host_ptr = self._device_address_of_pinned(self._status_host.ctypes.data)
        self._barrier_epoch = cupy.zeros(1, dtype=cupy.uint64)
        load_kernels()
        self._intranode = self._intranode_context() if self.num_nvl_bytes else None
        self._low_latency = self._low_latency_context() if self.num_rdma_bytes else None
        self._low_latency_half = 0  # DeepEP's buffer index: every low-latency call flips it
        self._combine_buffers: dict[tuple, Any] = {}
        cupy.cuda.runtime.memset(int(self._control.handle), 0, control_bytes)
        self._device.synchronize()
        _deps.nvshmem().barrier_all(self._core_stream(self._comm_stream))
        self._comm_stream.synchronize()
        self.barrier()

    # ----------------------------------------------------------------------------------------------
    # Internals
    def _start_kernels(self) -> Callable[[], None]:
        """Collective: start compiling (one rank per node, the families at once, in the background) or
        loading the families this Buffer uses; the returned call, once NVSHMEM is up, loads them."""
        mpi = _deps.mpi()
        arch = f"sm_{_deps.cuda_core().Device(self.device_id).arch}"
        specs = buffer_specs(arch, self.num_nvl_bytes, self.num_rdma_bytes)
        local_comm = self.comm.Split_type(mpi.COMM_TYPE_SHARED)
        try:
            finish = start_libraries(list(specs.values()),
                                     MpiGroup(self.comm, local_comm, env.get("CUEP_COMPILE_TIMEOUT_S")))
        except BaseException:
            local_comm.Free()
            raise

        def load() -> None:
            try:
                libraries = dict(zip(specs, finish()))
            finally:
                local_comm.Free()
            self._layout_library = libraries["layout"]
            self._barrier_library = libraries["barrier"]
            self._intranode_library = libraries.get("intranode")
            self._low_latency_library = libraries.get("low_latency")
        return load

    def _intranode_context(self) -> intranode_kernel.Context:
        cupy, nvshmem = _deps.cupy(), _deps.nvshmem()
        bases = [int(self._data.handle) if pe == self.rank else int(nvshmem.get_peer_buffer(self._data, pe).handle)
                 for pe in range(self.group_size)]
        timeout_s = env.get("CUEP_TIMEOUT_S")
        cupy.cuda.runtime.memset(int(self._data.handle), 0, intranode_kernel.META_BYTES)  # epoch 0 everywhere
        return intranode_kernel.Context(
            library=self._intranode_library, rank=self.rank, num_ranks=self.group_size,
            buffer_ptr=int(self._data.handle), buffer_bytes=self.num_nvl_bytes,
            peer_bases=cupy.asarray(np.array(bases, dtype=np.uint64)), status=self._status,
            status_host_ptr=self._status_host_ptr,
            next_row=cupy.zeros(self.group_size + 1, dtype=cupy.int32),
            dispatch_state=cupy.zeros(intranode_kernel.STATE_WORDS, dtype=cupy.uint64),
            device_sms=self._device.attributes["MultiProcessorCount"],
            timeout_ns=int(timeout_s * 1e9),
            barrier=lambda stream: self._enqueue_barrier(stream, timeout_s),
            core_stream=self._core_stream, raise_if_failed=self._raise_if_failed)

    def _low_latency_context(self) -> low_latency_kernel.Context:
        cupy = _deps.cupy()
        region = int(self._data.handle) + self._low_latency_offset
        cupy.cuda.runtime.memset(region, 0, self.num_rdma_bytes)  # flags start below every call number
        status_host = self._low_latency_status_host = self._pinned_status_words()
        num_sms = self._device.attributes["MultiProcessorCount"]
        return low_latency_kernel.Context(
            library=self._low_latency_library, rank=self.rank, num_ranks=self.group_size, region_ptr=region,
            region_bytes=self.num_rdma_bytes,
            num_sms=num_sms,
            force_put=not self.allow_nvlink_for_low_latency_mode,
            timeout_ns=int(env.get("CUEP_TIMEOUT_S") * 1e9),
            seq_state=cupy.zeros(low_latency_kernel.SEQ_WORDS, dtype=cupy.uint64),
            status=cupy.zeros(kernel_status.STATUS_WORDS, dtype=cupy.int32),
            status_host_ptr=self._device_address_of_pinned(status_host.ctypes.data),
            trace=(cupy.zeros((num_sms, low_latency_kernel.TRACE_POINTS), dtype=cupy.uint64)
                   if env.get("CUEP_TRACE") else None))

    @staticmethod
    def _pinned_status_words() -> np.ndarray:
        """Zeroed status words in pinned host memory (kernels' status lands there without a host wait)."""
        words = np.frombuffer(_deps.cupy().cuda.alloc_pinned_memory(kernel_status.STATUS_WORDS * 4), np.int32,
                              kernel_status.STATUS_WORDS)
        words[:] = 0
        return words

    @staticmethod
    def _device_address_of_pinned(host_ptr: int) -> int:
        driver = _deps.cuda_driver()
        err, address = driver.cuMemHostGetDevicePointer(host_ptr, 0)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise CuepError(f"cuep: pinned host memory is not visible to the GPU ({err})")
        return int(address)

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
        self._raise_if_failed()

    def _raise_if_failed(self, timeout_s: float | None = None) -> None:
        """Raise what a finished kernel recorded (peer timeout, num_worst_tokens overflow, bad expert
        ids), once.

        ``timeout_s``: the bound the waits ran with, for the message (default ``CUEP_TIMEOUT_S``)."""
        if self._low_latency is not None:
            self._raise_recorded(self._low_latency_status_host, self._low_latency.status,
                                 self._low_latency.timeout_ns / 1e9)
        self._raise_recorded(self._status_host, self._status, timeout_s)

    def _raise_recorded(self, status_host, status, timeout_s: float | None) -> None:
        """Clear one set of status words (host mirror and device) and raise what they recorded."""
        # Every call checks both sets: comparing bytes costs ~0.2 us where ndarray.any() costs ~2.
        if memoryview(status_host).cast("B") != _CLEAR_STATUS:
            recorded = status_host.copy()
            timeout_s = env.get("CUEP_TIMEOUT_S") if timeout_s is None else timeout_s
            status.fill(0)
            status_host[:] = 0
            kernel_status.raise_if_failed(recorded, self.rank, timeout_s)

    def _enqueue_barrier(self, stream, timeout_s: float) -> None:
        """Barrier kernel on ``stream``; its status lands in pinned memory without a host wait."""
        barrier_kernel.launch(self._barrier_library, self._core_stream(stream), int(self._control.handle),
                              self.rank, self.group_size, self._barrier_epoch, timeout_s, self._status,
                              self._status_host_ptr)

    def _keep_alive(self, event, arrays: tuple) -> None:
        """Hold ``arrays`` until ``event`` completes: the comm stream may still read or write them after
        the caller drops its references (CuPy has no ``record_stream``)."""
        self._in_flight = [(e, a) for e, a in self._in_flight if not e.done]
        self._in_flight.append((event, arrays))

    def _on_comm_stream(self, previous_event: EventOverlap | None, async_finish: bool, allocate_on_comm_stream: bool,
                        enqueue: Callable[[Any], tuple[tuple, tuple]]) -> tuple[tuple, EventOverlap]:
        """Run ``enqueue(stream)`` after ``previous_event`` (default: the current stream's work) and after
        this Buffer's previous call.

        A call that the current stream waits for anyway (no ``previous_event``, ``async_finish`` or
        ``allocate_on_comm_stream``) runs on the current stream itself, unless it is being captured:
        going through the comm stream would only add two cross-stream hops, which cost 12-14 us per
        call on 4 x H200. Other calls run on the comm stream, allocating there or on the current
        stream. ``enqueue`` returns ``(outputs, inputs)``; with ``async_finish`` both are kept alive
        until the comm stream is done with them.
        """
        cupy = _deps.cupy()
        compute_stream = cupy.cuda.get_current_stream()
        capturing = compute_stream.is_capturing()
        if previous_event is None and not async_finish and not allocate_on_comm_stream and not capturing:
            self._wait_for_last_call(compute_stream)
            outputs, inputs = enqueue(compute_stream)
            # No event is recorded unless someone waits on this call from another stream (DeepEP returns
            # none here): back-to-back calls then have nothing but kernels between them on the GPU.
            self._last_call = (compute_stream.ptr, EventOverlap.after_work_on(compute_stream))
            return outputs, EventOverlap.after_work_on(compute_stream, extra_arrays=tuple(inputs))
        comm_stream = self._comm_stream
        if not capturing:
            self._wait_for_last_call(comm_stream)
        comm_stream.wait_event(previous_event.event if previous_event is not None else record_event(compute_stream))
        with comm_stream if allocate_on_comm_stream else compute_stream:
            outputs, inputs = enqueue(comm_stream)
        done = record_event(comm_stream)
        if async_finish:
            self._keep_alive(done, (*inputs, *outputs))
        else:
            compute_stream.wait_event(done)
        if not capturing:  # a captured call runs when its graph is replayed, ordered by the replay's stream
            self._last_call = (comm_stream.ptr, EventOverlap(done))
        return outputs, EventOverlap(done, extra_arrays=tuple(inputs))

    def _wait_for_last_call(self, stream) -> None:
        """Order ``stream`` after this Buffer's previous call if that ran on another stream: calls share
        the buffer's flags and epochs, so they must not overlap."""
        if self._last_call is not None and self._last_call[0] != stream.ptr:
            stream.wait_event(self._last_call[1].event)

    # ----------------------------------------------------------------------------------------------
    # Public API
    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether this process builds the kernels' Hopper (sm_90) path for its current GPU: ``False`` on
        other GPUs and with ``CUEP_FORCE_FALLBACK=1`` (the Ampere fallback path).

        Differs from DeepEP: DeepEP answers for its build; cuep compiles for the GPU it runs on."""
        arch = f"sm_{_deps.cuda_core().Device().arch}"
        return layout_kernel.spec(arch).sm90_features

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
        cupy = _deps.cupy()
        dtype = _checks.numpy_dtype(call, dtype)
        start, total = (self._low_latency_offset, self.num_rdma_bytes) if use_rdma_buffer else (0, self.num_nvl_bytes)
        offset = _checks.check_nonnegative_int(call, "offset", offset)
        available = (total - offset) // dtype.itemsize if offset <= total else 0
        shape = (available,) if size is None else tuple(int(n) for n in np.atleast_1d(size))
        count = int(np.prod(shape))
        if min(shape, default=0) < 0 or count > available:
            raise ValueError(f"{call}: a {shape} {dtype} view from byte {offset} needs "
                             f"{offset + count * dtype.itemsize} bytes, but the "
                             f"{'RDMA' if use_rdma_buffer else 'NVL'} buffer has {total}")
        if count == 0:
            return cupy.empty(shape, dtype=dtype)
        address = int(self._data.handle) + start + offset
        memory = cupy.cuda.UnownedMemory(address, count * dtype.itemsize, self, self.device_id)
        return cupy.ndarray(shape, dtype=dtype, memptr=cupy.cuda.MemoryPointer(memory, 0))

    def get_comm_stream(self):
        """The CuPy stream on which this Buffer's communication kernels run when a call passes
        ``previous_event``, ``async_finish`` or ``allocate_on_comm_stream``, or is captured into a CUDA
        graph. Other calls, which the current stream waits for anyway, run on the current stream.

        Differs from DeepEP: DeepEP runs every call on its comm stream.
        """
        return self._comm_stream

    @staticmethod
    def capture() -> EventOverlap:
        """An :class:`EventOverlap` recorded on the current CuPy stream now (for ``previous_event``)."""
        cupy = _deps.cupy()
        return EventOverlap(record_event(cupy.cuda.get_current_stream()))

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
        stream = cupy.cuda.get_current_stream()
        self._enqueue_barrier(stream, timeout_s)
        stream.synchronize()
        self._raise_if_failed(timeout_s)

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
            event: an :class:`EventOverlap` for the kernel. Without ``previous_event``, ``async_finish``
                and ``allocate_on_comm_stream`` the kernel runs on the current stream and the event is
                recorded only when first used (DeepEP returns none then).

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
        num_tokens, num_nodes = topk_idx.shape[0], self.topology.num_nodes

        def enqueue(comm_stream):
            per_rank = cupy.empty(self.group_size, dtype=cupy.int32)
            per_node = cupy.empty(num_nodes, dtype=cupy.int32) if num_nodes > 1 else None
            per_expert = cupy.empty(int(num_experts), dtype=cupy.int32)
            in_rank = cupy.empty((num_tokens, self.group_size), dtype=cupy.bool_)
            layout_kernel.launch(self._layout_library, self._core_stream(comm_stream), topk_idx, int(num_experts),
                                 self.group_size, num_nodes, per_expert, per_rank, per_node, in_rank)
            return (per_rank, per_node, per_expert, in_rank), (topk_idx,)

        outputs, event = self._on_comm_stream(previous_event, async_finish, allocate_on_comm_stream, enqueue)
        return (*outputs, event)

    @classmethod
    def set_num_sms(cls, new_num_sms: int) -> None:
        """Set the SMs the high-throughput kernels use when no Config is passed (every Buffer)."""
        if isinstance(new_num_sms, bool) or not isinstance(new_num_sms, int) or new_num_sms <= 0:
            raise ValueError(f"Buffer.set_num_sms(): new_num_sms must be a positive int, got {new_num_sms!r}")
        cls.num_sms = new_num_sms

    @classmethod
    def get_dispatch_config(cls, num_ranks: int) -> Config:
        """The tuned dispatch Config for ``num_ranks`` ranks, with ``set_num_sms``'s count if set."""
        return get_dispatch_config(num_ranks, cls.num_sms)

    @classmethod
    def get_combine_config(cls, num_ranks: int) -> Config:
        """The tuned combine Config for ``num_ranks`` ranks, with ``set_num_sms``'s count if set."""
        return get_combine_config(num_ranks, cls.num_sms)

    def _intranode_ready(self, call: str) -> intranode_kernel.Context:
        self._check_alive(call)
        if self._intranode is None:
            raise ValueError(f"{call}: this Buffer has no NVL buffer (num_nvl_bytes=0); create it with "
                             f"num_nvl_bytes >= Config().get_nvl_buffer_size_hint(hidden_bytes, num_ranks)")
        if self.topology.num_nodes > 1 or self.group_size > intranode_kernel.MAX_RANKS:
            raise ValueError(f"{call}: the internode mode is not built yet; dispatch and combine need all "
                             f"{self.group_size} ranks on one node (at most {intranode_kernel.MAX_RANKS})")
        return self._intranode

    def dispatch(self, x, handle: intranode_kernel.Handle | None = None, num_tokens_per_rank=None,
                 num_tokens_per_rdma_rank=None, is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                 previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Send each token to every rank that holds one of its experts (NVLink, one node).

        Requirements:
            every rank calls it; non-cached calls need the layout from :meth:`get_dispatch_layout`.
            A non-cached call without ``num_worst_tokens`` waits on the CPU for the received count,
            to size the outputs. The NVL buffer must hold this call's staged tokens, and for a
            cached call the rows each rank receives (the error says how much when it does not).

        Arguments:
            x: `[num_tokens, hidden]` with `bfloat16` (``ml_dtypes.bfloat16``), or a tuple of
                `[num_tokens, hidden]` `uint8` holding FP8 e4m3 bytes and `[num_tokens, hidden // 128]`
                `float32` scales (any strides, e.g. column-major).
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
            recv_x: `[num_recv_tokens, hidden]` like ``x`` (a tuple with `[num_recv_tokens, hidden // 128]`
                `float32` scales for FP8), rows ordered by source rank, then source token.
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
        ctx = self._intranode_ready(call)
        cupy, bf16 = _deps.cupy(), _checks.bf16_dtype()
        fp8 = isinstance(x, tuple)
        if fp8:
            if len(x) != 2:
                raise ValueError(f"{call}: FP8 x must be a tuple (x_fp8, scales), got {len(x)} items")
            x, scales = (_checks.as_device_array(call, name, a) for name, a in zip(("x", "x scales"), x))
        else:
            x, scales = _checks.as_device_array(call, "x", x), None
        _checks.check_matrix(call, "x", x, [np.uint8] if fp8 else [bf16])
        num_tokens, hidden = x.shape
        _checks.check_hidden(call, hidden, fp8)
        if fp8:
            _checks.check_matrix(call, "x scales", scales, [np.float32], num_tokens, hidden // 128, contiguous=False)
        expert_alignment = _checks.check_nonnegative_int(call, "expert_alignment", expert_alignment)
        num_worst_tokens = _checks.check_nonnegative_int(call, "num_worst_tokens", num_worst_tokens)
        if expert_alignment < 1:
            raise ValueError(f"{call}: expert_alignment must be >= 1, got {expert_alignment}")
        _checks.check_event_options(call, previous_event, async_finish, allocate_on_comm_stream)
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError(f"{call}: a cached dispatch (handle given) takes no topk_idx or topk_weights")
            handle = _checks.intranode_handle(call, handle, self.group_size)
            if handle.num_tokens != num_tokens:
                raise ValueError(f"{call}: handle must come from a dispatch of {num_tokens} tokens, got one of "
                                 f"{handle.num_tokens}")
            num_experts = 0
        else:
            if is_token_in_rank is None or num_tokens_per_expert is None or num_tokens_per_rank is None:
                raise ValueError(f"{call}: without a handle, pass num_tokens_per_rank, is_token_in_rank and "
                                 f"num_tokens_per_expert from get_dispatch_layout()")
            if (topk_idx is None) != (topk_weights is None):
                raise ValueError(f"{call}: pass topk_idx and topk_weights together, or neither (got only "
                                 f"{'topk_idx' if topk_weights is None else 'topk_weights'})")
            num_tokens_per_rank = _checks.as_device_array(call, "num_tokens_per_rank", num_tokens_per_rank)
            _checks.check_vector(call, "num_tokens_per_rank", num_tokens_per_rank, np.int32, self.group_size)
            if num_tokens_per_rdma_rank is not None:
                num_tokens_per_rdma_rank = _checks.as_device_array(call, "num_tokens_per_rdma_rank",
                                                                   num_tokens_per_rdma_rank)
                _checks.check_vector(call, "num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, np.int32,
                                     self.topology.num_nodes)
            is_token_in_rank = _checks.as_device_array(call, "is_token_in_rank", is_token_in_rank)
            _checks.check_matrix(call, "is_token_in_rank", is_token_in_rank, [np.bool_], num_tokens, self.group_size)
            num_tokens_per_expert = _checks.as_device_array(call, "num_tokens_per_expert", num_tokens_per_expert)
            num_experts = num_tokens_per_expert.size
            if num_tokens_per_expert.dtype != np.int32 or num_tokens_per_expert.ndim != 1:
                raise TypeError(f"{call}: num_tokens_per_expert must be [num_experts] int32, got "
                                f"{num_tokens_per_expert.dtype} {tuple(num_tokens_per_expert.shape)}")
            _checks.check_num_experts(call, num_experts, self.group_size)
            if num_experts > intranode_kernel.MAX_EXPERTS:
                raise ValueError(f"{call}: at most {intranode_kernel.MAX_EXPERTS} experts, got {num_experts}")
            if topk_idx is not None:
                topk_idx = _checks.as_device_array(call, "topk_idx", topk_idx)
                _checks.check_topk_idx(call, topk_idx, num_experts, num_tokens)
                topk_idx = topk_idx.astype(cupy.int64, copy=False)
            if topk_weights is not None:
                topk_weights = _checks.as_device_array(call, "topk_weights", topk_weights)
                _checks.check_matrix(call, "topk_weights", topk_weights, [np.float32], num_tokens, topk_idx.shape[1])
        num_sms = (config or self.get_dispatch_config(self.group_size)).num_sms

        def enqueue(comm_stream):
            recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert, new_handle = intranode_kernel.dispatch(
                ctx, comm_stream, x, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert,
                num_experts, handle, expert_alignment, num_worst_tokens, num_sms)
            outputs = ((recv_x, recv_scales) if fp8 else recv_x, recv_topk_idx, recv_topk_weights, per_expert,
                       new_handle)
            return outputs, (x, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert)

        outputs, event = self._on_comm_stream(previous_event, async_finish, allocate_on_comm_stream, enqueue)
        self._raise_if_failed()
        return (*outputs, event)

    def combine(self, x, handle: intranode_kernel.Handle, topk_weights=None, bias=None, config: Config | None = None,
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
        ctx = self._intranode_ready(call)
        bf16 = _checks.bf16_dtype()
        handle = _checks.intranode_handle(call, handle, self.group_size)
        x = _checks.as_device_array(call, "x", x)
        _checks.check_matrix(call, "x", x, [bf16], handle.num_rows)
        _checks.check_hidden(call, x.shape[1], fp8=False)
        if topk_weights is not None:
            topk_weights = _checks.as_device_array(call, "topk_weights", topk_weights)
            _checks.check_matrix(call, "topk_weights", topk_weights, [np.float32], handle.num_rows)
        biases = bias if isinstance(bias, tuple) else (bias,)
        if len(biases) > 2:
            raise ValueError(f"{call}: bias must be one array or a tuple of two, got {len(biases)}")
        biases = [_checks.as_device_array(call, "bias", b) if b is not None else None for b in biases]
        biases += [None] * (2 - len(biases))
        for b in biases:
            if b is not None:
                _checks.check_matrix(call, "bias", b, [bf16], handle.num_tokens, x.shape[1])
        _checks.check_event_options(call, previous_event, async_finish, allocate_on_comm_stream)
        num_sms = (config or self.get_combine_config(self.group_size)).num_sms

        def enqueue(comm_stream):
            combined_x, combined_weights = intranode_kernel.combine(ctx, comm_stream, x, handle, topk_weights,
                                                                    biases[0], biases[1], num_sms)
            return (combined_x, combined_weights), (x, topk_weights, biases[0], biases[1], handle.send_pos)

        outputs, event = self._on_comm_stream(previous_event, async_finish, allocate_on_comm_stream, enqueue)
        return (*outputs, event)

    # ----------------------------------------------------------------------------------------------
    # Low-latency mode
    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of ``num_rdma_bytes`` that low-latency calls of up to this many tokens per rank need.

        Differs from DeepEP: each token crosses once per destination rank (not per expert), so the
        buffer holds ``num_ranks`` slots per token instead of ``num_experts``; ``num_experts`` is
        accepted for the same signature. Up to 32 experts per token.
        """
        call = "get_low_latency_rdma_size_hint()"
        for name, value in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                            ("hidden", hidden), ("num_ranks", num_ranks), ("num_experts", num_experts)):
            if _checks.check_nonnegative_int(call, name, value) == 0:
                raise ValueError(f"{call}: {name} must be positive")
        return low_latency_kernel.size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks)

    def _low_latency_ready(self, call: str) -> low_latency_kernel.Context:
        self._check_alive(call)
        if not self.low_latency_mode or self._low_latency is None:
            raise ValueError(f"{call}: create the Buffer with low_latency_mode=True and num_rdma_bytes >= "
                             f"Buffer.get_low_latency_rdma_size_hint(...)")
        return self._low_latency

    def _next_half(self) -> int:
        half = self._low_latency_half
        self._low_latency_half ^= 1
        return half

    def _run_low_latency(self, launch: low_latency_kernel.Launch, async_finish: bool, return_recv_hook: bool,
                         keep: tuple) -> tuple[EventOverlap, Callable[[], None] | None]:
        """Launch on the current stream (or, with ``async_finish``, on the comm stream after it); with
        ``return_recv_hook`` only the send phase runs now and the hook runs the receive. ``keep``: the
        call's arrays, held until the kernels that use them are done."""
        cupy = _deps.cupy()
        phases = low_latency_kernel.SEND_PHASE
        if not return_recv_hook:
            phases |= low_latency_kernel.RECV_PHASE
        event = EventOverlap()
        if async_finish:
            comm_stream = self._comm_stream
            comm_stream.wait_event(record_event(cupy.cuda.get_current_stream()))
            launch(comm_stream, phases)
            done = record_event(comm_stream)
            self._keep_alive(done, keep)
            event = EventOverlap(done, extra_arrays=keep)
        else:
            launch(cupy.cuda.get_current_stream(), phases)
        if not return_recv_hook:
            return event, None
        pending = [launch]

        def hook() -> None:
            """Receive this call's data (on the current stream). Call it once."""
            if not pending:
                raise CuepError("low-latency receive hook: this hook already ran; each hook runs once")
            self._check_alive("low-latency receive hook")
            stream = cupy.cuda.get_current_stream()
            pending.pop()(stream, low_latency_kernel.RECV_PHASE)
            # The receive reads the call's arrays (top-k ids, handle) now, long after the call returned.
            self._keep_alive(record_event(stream), keep)
        return event, hook

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats=None, use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False, return_recv_hook: bool = False):
        """Send each token to the ranks holding its experts, laid out per local expert (decode, low latency).

        Each token crosses to each destination rank once, quantised to FP8 by its sender (or as BF16);
        the receiver fans it out into the rows of its local experts. Capturable in a CUDA graph.

        Requirements:
            a Buffer made with ``low_latency_mode=True`` and ``num_rdma_bytes >=``
            :meth:`get_low_latency_rdma_size_hint`; every rank calls it with the same
            ``num_max_dispatch_tokens_per_rank``, hidden size and ``num_experts``. Calls alternate between
            two buffer halves: every rank must finish (hook included) call ``n`` before any rank sends call
            ``n + 2``, so at most two calls' data are in flight.

        Arguments:
            x: `[num_tokens, hidden]` `bfloat16`, ``num_tokens <= num_max_dispatch_tokens_per_rank``, hidden a
                multiple of 128 (of 512 with ``use_ue8m0``).
            topk_idx: `[num_tokens, num_topk]` `int64` (or `int32`), up to 32 experts per token, `-1` for none.
                Ids outside `[-1, num_experts)` are treated as `-1` and the next call raises ``ValueError``
                (checking them here would cost a host sync per call).
            num_max_dispatch_tokens_per_rank: the most tokens any rank sends in one call (at most 1024).
            num_experts: experts across all ranks, a multiple of the number of ranks.
            cumulative_local_expert_recv_stats: `[num_local_experts]` `int32`; each call adds the tokens each
                local expert received.
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
        per token; `int32` ids accepted; FP8 is `uint8` (CuPy has no FP8 dtype).
        """
        call = "low_latency_dispatch()"
        ctx = self._low_latency_ready(call)
        x = _checks.as_device_array(call, "x", x)
        topk_idx = _checks.as_device_array(call, "topk_idx", topk_idx)
        _checks.check_low_latency_dispatch(call, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                           self.group_size, low_latency_kernel.MAX_TOPK,
                                           low_latency_kernel.MAX_TOKENS_PER_RANK, use_fp8, round_scale, use_ue8m0)
        stats = cumulative_local_expert_recv_stats
        if stats is not None:
            stats = _checks.as_device_array(call, "cumulative_local_expert_recv_stats", stats)
            _checks.check_vector(call, "cumulative_local_expert_recv_stats", stats, np.int32,
                                 num_experts // self.group_size)
        _checks.check_hook_options(call, async_finish, return_recv_hook)
        recv_x, recv_scales, recv_count, handle, launch = low_latency_kernel.dispatch(
            ctx, self._next_half(), x, topk_idx, int(num_max_dispatch_tokens_per_rank), int(num_experts), stats,
            use_fp8, round_scale, use_ue8m0)
        received = (recv_x, recv_scales) if use_fp8 else recv_x
        event, hook = self._run_low_latency(launch, async_finish, return_recv_hook,
                                            (x, topk_idx, stats, recv_x, recv_scales, recv_count, handle))
        return received, recv_count, handle, event, hook

    def low_latency_combine(self, x, topk_idx, topk_weights, handle: low_latency_kernel.Handle, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False, out=None):
        """Send the expert outputs back to their tokens' ranks and reduce them with the top-k weights.

        Each rank first sums, in FP32, the weighted outputs of its local experts for each token it
        received, and sends that one BF16 partial back; the token's rank adds the partials in FP32.

        Arguments:
            x: `[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]` `bfloat16`, the
                expert outputs in the dispatch's row layout.
            topk_idx: `[num_tokens, num_topk]`, the dispatch's routing; entries set to `-1` since then are skipped.
            topk_weights: `[num_tokens, num_topk]` `float32`.
            handle: the handle of the matching :meth:`low_latency_dispatch`.
            zero_copy: accepted for DeepEP compatibility: cuep reads ``x`` in place whatever it is, so this
                costs nothing either way (:meth:`get_next_low_latency_combine_buffer` gives a ready buffer).
            async_finish, return_recv_hook: as in :meth:`low_latency_dispatch`.
            out: `[num_tokens, hidden]` `bfloat16` to write into, else a new array.

        Returns:
            combined_x: `[num_tokens, hidden]` `bfloat16`, ``sum_k topk_weights[t, k] * x[row of (t, k)]``.
            event: an :class:`EventOverlap`.
            hook: the receive hook with ``return_recv_hook``, else ``None``.

        Differs from DeepEP: a token's partial sum from each rank is rounded to BF16 once before it
        travels (DeepEP rounds each expert's output); the result differs from DeepEP's by BF16 rounding.
        """
        call = "low_latency_combine()"
        ctx = self._low_latency_ready(call)
        if not isinstance(handle, low_latency_kernel.Handle):
            raise TypeError(f"{call}: handle must be the handle a low_latency_dispatch() on this Buffer returned")
        bf16 = _checks.bf16_dtype()
        rows = self.group_size * handle.num_max_dispatch_tokens_per_rank
        shape = (handle.num_experts // self.group_size, rows, handle.hidden)
        x = _checks.as_device_array(call, "x", x)
        if x.dtype != bf16 or x.shape != shape or not x.flags.c_contiguous:
            raise ValueError(f"{call}: x must be a C-contiguous {list(shape)} bfloat16 array, got {x.dtype} "
                             f"{tuple(x.shape)}")
        topk_idx = _checks.as_device_array(call, "topk_idx", topk_idx)
        _checks.check_topk_idx(call, topk_idx, handle.num_experts, handle.num_tokens)
        if topk_idx.shape[1] != handle.num_topk:
            raise ValueError(f"{call}: topk_idx must be the dispatch's [{handle.num_tokens}, {handle.num_topk}], got "
                             f"{tuple(topk_idx.shape)}")
        topk_weights = _checks.as_device_array(call, "topk_weights", topk_weights)
        _checks.check_matrix(call, "topk_weights", topk_weights, [np.float32], handle.num_tokens, handle.num_topk)
        if out is None:
            out = _deps.cupy().empty((handle.num_tokens, handle.hidden), dtype=bf16)
        else:
            out = _checks.as_device_array(call, "out", out)
            _checks.check_matrix(call, "out", out, [bf16], handle.num_tokens, handle.hidden)
        _checks.check_hook_options(call, async_finish, return_recv_hook)
        launch = low_latency_kernel.combine(ctx, self._next_half(), x, topk_idx, topk_weights, handle, out)
        event, hook = self._run_low_latency(launch, async_finish, return_recv_hook,
                                            (x, topk_idx, topk_weights, handle, out))
        return out, event, hook

    def get_next_low_latency_combine_buffer(self, handle: low_latency_kernel.Handle):
        """A `[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]` `bfloat16` array for
        the next :meth:`low_latency_combine`'s expert outputs (one per buffer half, reused).

        cuep's combine reads its ``x`` in place wherever it lives, so writing here saves nothing over any
        other array; it exists so code written for DeepEP's zero-copy path runs unchanged.
        """
        call = "get_next_low_latency_combine_buffer()"
        self._low_latency_ready(call)
        if not isinstance(handle, low_latency_kernel.Handle):
            raise TypeError(f"{call}: handle must come from low_latency_dispatch()")
        shape = (handle.num_experts // self.group_size, self.group_size * handle.num_max_dispatch_tokens_per_rank,
                 handle.hidden)
        key = (self._low_latency_half, shape)
        if key not in self._combine_buffers:
            self._combine_buffers = {k: v for k, v in self._combine_buffers.items() if k[1] == shape}
            self._combine_buffers[key] = _deps.cupy().empty(shape, dtype=_checks.bf16_dtype())
        return self._combine_buffers[key]

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Collective: zero the low-latency buffer (every rank, with nothing in flight).

        cuep's flags and table words carry call numbers that only grow, at offsets that do not move with
        the shapes, so its kernels never need this, even when the shapes change between calls; it exists
        for DeepEP compatibility and to start from a clean state.
        The arguments are checked against the buffer's capacity.
        """
        call = "clean_low_latency_buffer()"
        ctx = self._low_latency_ready(call)
        low_latency_kernel.check_fits(call, ctx, num_max_dispatch_tokens_per_rank, hidden, num_experts)
        cupy = _deps.cupy()
        self._device.synchronize()
        wait_for_all(self.comm, call)
        cupy.cuda.runtime.memset(ctx.region_ptr, 0, ctx.region_bytes)
        self._device.synchronize()
        wait_for_all(self.comm, call)

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
