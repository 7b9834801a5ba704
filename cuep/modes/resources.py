"""What every mode of one Buffer shares, set up once: its ranks and GPU, its kernels, its symmetric
memory, its status words, its device barrier and its streams."""

from __future__ import annotations

from collections.abc import Callable

from .. import _deps, env
from .._front import Front
from .._status import StatusWords
from .._streams import CallStreams
from ..errors import CuepError
from ..jit import Library, start_libraries
from ..kernels import barrier as barrier_kernel
from ..kernels import LOW_LATENCY_RECEIVE, buffer_specs
from ..kernels import layout as layout_kernel
from ..kernels.launcher import Launch
from ..runtime import Group, NodeGroup, Topology, discover_topology
from ..runtime import world as nvshmem_world
from ..runtime.regions import Regions, SymmetricMemory
from . import internode, intranode, low_latency

_MAX_BARRIER_TIMEOUTS = 8  # prepared barrier launches kept, one per timeout (Buffer.barrier may pass its own)


class Resources:
    """Collective over ``group``: the ranks' hosts and GPUs, the NVSHMEM world (booted while the kernels
    compile), the kernel families these sizes use, the symmetric memory, and each mode's context.

    With an NVL buffer, the normal mode's context: the intranode one when every rank is on one node,
    the internode one (which needs the RDMA buffer too) when they span several; the low-latency
    context exists with ``low_latency_mode`` and an RDMA buffer. Across nodes a ``low_latency_mode``
    Buffer whose sizes serve the internode mode too (SGLang's auto mode makes one) gives its RDMA buffer
    to one mode at a time: the first call of the other mode hands it over (:meth:`normal_ready`,
    :meth:`low_latency_ready`)."""

    def __init__(self, group: Group, front: Front, num_nvl_bytes: int, num_rdma_bytes: int, low_latency_mode: bool,
                 force_put: bool, shrink: bool = False, device_id: int | None = None,
                 num_qps_per_rank: int = nvshmem_world.DEFAULT_QPS_PER_RANK, elastic: bool = False,
                 topology: Topology | None = None):
        nvshmem_world.check_group(group)  # before anything else is collective over a group that cannot work
        self.topology = topology or discover_topology(group)
        self.group = group
        self.rank, self.num_ranks = self.topology.rank, self.topology.num_ranks
        self.low_latency_mode = low_latency_mode
        across_nodes = self.topology.num_nodes > 1 and num_nvl_bytes > 0
        self.internode_refusal: str | None = None  # why a low-latency Buffer across nodes has no normal mode
        if across_nodes and not low_latency_mode:
            check_internode_sizes(self.topology, num_nvl_bytes, num_rdma_bytes)
        elif across_nodes:  # a low-latency Buffer serves the internode mode too only where its sizes do
            self.internode_refusal = internode_sizes_refusal(self.topology, num_nvl_bytes, num_rdma_bytes) or (
                "a Buffer in shrink mode gives its RDMA buffer to the low-latency mode alone" if shrink else None)
            across_nodes = self.internode_refusal is None
        self.regions = Regions.carve(barrier_kernel.signal_bytes(self.num_ranks), num_nvl_bytes, num_rdma_bytes)
        self.device_id = nvshmem_world.choose_device(group, self.topology, device_id)
        # Across nodes a low-latency Buffer has a normal mode only where it can have the internode one.
        normal_nvl_bytes = 0 if self.topology.num_nodes > 1 and not across_nodes else num_nvl_bytes
        load_kernels = start_kernels(NodeGroup(group, self.topology.local_rank, env.get("CUEP_COMPILE_TIMEOUT_S")),
                                     self.device_id, normal_nvl_bytes,
                                     num_rdma_bytes if low_latency_mode else 0, across_nodes,
                                     across_hosts=self.topology.num_local_ranks < self.num_ranks
                                     or env.get("CUEP_NETWORK_BUILD"), elastic=elastic)
        nvshmem_world.init_world(group, self.topology, self.regions.total_bytes, self.device_id, num_qps_per_rank)
        cupy = _deps.cupy()
        self.device = cupy.cuda.Device(self.device_id)
        self.device.use()
        # Loaded before anything is allocated: a failed compile or load leaves no symmetric memory behind.
        libraries = load_kernels()
        self._barrier_library = libraries["barrier"]
        self.front = front
        self.streams = CallStreams(front)
        self.status = StatusWords()
        self.layout = layout_kernel.LayoutLaunches(libraries["layout"], self.num_ranks, self.topology.num_nodes,
                                                   self.status)
        self.elastic_library = libraries.get("elastic")  # an ElasticBuffer's: DeepEP V2's layouts
        self._barrier_epoch = cupy.zeros(1, dtype=cupy.uint64)
        self._barrier_launches: dict[float, Launch] = {}
        self.memory = SymmetricMemory(self.regions)
        self.destroyed = False
        timeout_s = env.get("CUEP_TIMEOUT_S")
        num_sms = self.device.attributes["MultiProcessorCount"]
        self.intranode = intranode.Context.create(
            libraries["intranode"], self.memory, self.status, self.rank, self.num_ranks, num_sms, timeout_s,
            lambda stream: self.enqueue_barrier(stream, timeout_s), self.raise_if_failed, front) \
            if "intranode" in libraries else None
        self.internode = internode.Context.create(
            libraries["internode"], self.memory, self.status, self.topology, num_sms, timeout_s,
            lambda stream: self.enqueue_barrier(stream, timeout_s), self.raise_if_failed, front) \
            if "internode" in libraries else None
        self.low_latency = low_latency.Context.create(
            libraries["low_latency"], libraries[LOW_LATENCY_RECEIVE], front, self.memory.rdma, num_rdma_bytes,
            self.rank, self.num_ranks, num_sms, force_put, timeout_s, env.get("CUEP_TRACE"), shrink,
            all_direct=self.memory.reaches_every_rank(self.num_ranks, self.rank)) \
            if "low_latency" in libraries else None
        # Which mode the RDMA buffer serves where both use it (None: neither yet; it starts zeroed).
        self.rdma_shared = self.internode is not None and self.low_latency is not None
        self.rdma_mode: str | None = None
        # The state above was zeroed on CuPy's stream; the kernels run on the front's, which may not wait for it.
        self.device.synchronize()

    def check_alive(self, call: str) -> None:
        """Raise if the Buffer was destroyed, or what an earlier kernel recorded."""
        if self.destroyed:
            raise CuepError(f"{call}: this Buffer was destroyed")
        self.raise_if_failed()

    def raise_if_failed(self, timeout_s: float | None = None) -> None:
        """Raise what a finished kernel recorded (peer timeout, num_worst_tokens overflow, bad expert
        ids), once. ``timeout_s``: the bound the waits ran with, for the message."""
        if self.low_latency is not None:
            self.low_latency.status_words.raise_recorded(self.rank, self.low_latency.timeout_ns / 1e9)
        self.status.raise_recorded(self.rank, timeout_s)

    def enqueue_barrier(self, stream, timeout_s: float) -> None:
        """Barrier kernel on ``stream``; its status lands in pinned memory without a host wait."""
        launch = self._barrier_launches.get(timeout_s)
        if launch is None:  # its arguments never change: prepared once per timeout
            if len(self._barrier_launches) >= _MAX_BARRIER_TIMEOUTS:
                self._barrier_launches.clear()
            launch = self._barrier_launches[timeout_s] = barrier_kernel.prepare(
                self._barrier_library, self.memory.control, self.rank, self.num_ranks, self._barrier_epoch, timeout_s,
                self.status.device, self.status.host_ptr)
        launch(stream)

    def normal_ready(self, call: str) -> intranode.Context | internode.Context:
        """The normal mode's context: intranode on one node, internode across nodes (handed the RDMA buffer
        first where the low-latency mode shares it: before anything recorded is raised, so that no rank
        raises while the others wait for it in the hand-over)."""
        if self.internode is not None:
            if self.destroyed:
                raise CuepError(f"{call}: this Buffer was destroyed")
            self.hand_rdma_buffer_to("normal", call)
            self.check_alive(call)
            return self.internode
        self.check_alive(call)
        if self.internode_refusal is not None:
            raise ValueError(f"{call}: the normal mode across nodes cannot run on this low_latency_mode Buffer: "
                             f"{self.internode_refusal}")
        if self.intranode is None:
            raise ValueError(f"{call}: this Buffer has no NVL buffer (num_nvl_bytes=0); create it with "
                             f"num_nvl_bytes >= Config().get_nvl_buffer_size_hint(hidden_bytes, num_ranks)")
        if self.num_ranks > intranode.MAX_RANKS:
            raise ValueError(f"{call}: the intranode mode serves at most {intranode.MAX_RANKS} ranks on one node, "
                             f"this Buffer has {self.num_ranks}")
        return self.intranode

    def low_latency_ready(self, call: str, hand_over: bool = True) -> low_latency.Context:
        """The low-latency context, handed the RDMA buffer first where the normal mode shares it (unless
        ``hand_over`` is false: accessors that one rank may call alone must not wait for the others)."""
        if self.low_latency is not None and hand_over and not self.destroyed:
            self.hand_rdma_buffer_to("low_latency", call)
        self.check_alive(call)
        if self.low_latency is None:
            raise ValueError(f"{call}: create the Buffer with low_latency_mode=True and num_rdma_bytes >= "
                             f"Buffer.get_low_latency_rdma_size_hint(...)")
        return self.low_latency

    def hand_rdma_buffer_to(self, mode: str, call: str) -> None:
        """Collective where the two modes share the RDMA buffer and the other one had it: wait until
        nothing is in flight on any rank, zero the buffer and the state of ``mode`` ("normal": the NVL
        buffer and the call count too; "low_latency": as :meth:`cuep.Buffer.clean_low_latency_buffer`
        does), and wait for every rank again, so that no rank writes into a peer's buffer before the peer
        has zeroed it. Every rank makes the same calls, so every rank hands over at the same call. Refused
        during CUDA graph capture, where nothing may wait: make the first call after the other mode's
        eagerly. A graph captured in one mode runs no Python when replayed, so it is replayed only after
        an eager call of its mode (or ``clean_low_latency_buffer``) has taken the buffer back."""
        if not self.rdma_shared or self.rdma_mode == mode:
            return
        if self.rdma_mode is None:  # the buffer is still as made: zeroed
            self.rdma_mode = mode
            return
        if self.front.current_stream().is_capturing():
            raise ValueError(f"{call}: this Buffer's RDMA buffer serves both modes, and the {self.rdma_mode} mode "
                             f"used it last; make the first {mode} call after it outside CUDA graph capture "
                             f"(it hands the buffer over, which waits for every rank)")
        self.device.synchronize()
        self.group.wait_for_all(call)
        memset = _deps.cupy().cuda.runtime.memset
        memset(self.memory.rdma, 0, self.regions.rdma_bytes)
        # Either way the low-latency calls start over: their results still in flight are dropped (their hooks
        # are refused with CallOrderError), so no receive ever reads what the other mode wrote.
        self.low_latency.restart(max(self.group.allgather(self.low_latency.newest_call(), call)))
        if mode == "normal":  # the internode mode starts over: its flags in both buffers and its call count
            memset(self.memory.nvl, 0, self.regions.nvl_bytes)
            self.internode.state.fill(0)
        self.device.synchronize()
        self.group.wait_for_all(call)
        self.rdma_mode = mode

    def free(self) -> None:
        """Collective: release the symmetric memory (every rank, nothing in flight). Idempotent."""
        if not self.destroyed:
            self.device.synchronize()
            self.streams.release()
            self.front.release_outputs()
            self.memory.free()
            self.destroyed = True


def internode_sizes_refusal(topology, num_nvl_bytes: int, num_rdma_bytes: int) -> str | None:
    """Why a Buffer of these sizes cannot serve the internode mode on ``topology``, or ``None`` if it can."""
    t = topology
    shape = f"{t.num_nodes} nodes of {t.ranks_per_node} ranks"
    if t.ranks_per_node > internode.MAX_RANKS_PER_NODE or t.num_ranks > internode.MAX_RANKS:
        return (f"the internode mode serves at most {internode.MAX_RANKS_PER_NODE} ranks per node and "
                f"{internode.MAX_RANKS} in all, this job has {shape}")
    least = internode.rdma_bytes_for(internode.ROW_ALIGN, t.num_ranks, t.num_nodes)
    if num_rdma_bytes < least:
        return (f"the ranks span {shape}, so dispatch and combine run in the internode mode, which needs "
                f"num_rdma_bytes (got {num_rdma_bytes}, less than the {least} its signals alone take); create the "
                f"Buffer with num_rdma_bytes >= Config().get_rdma_buffer_size_hint(hidden_bytes, num_ranks)")
    least_nvl = internode.nvl_bytes_for(0, 0)  # the combine's flags (its landing rows are checked by each call)
    if num_nvl_bytes < least_nvl:
        return (f"the internode mode's combine keeps its flags and lands rows in the NVL buffer, which needs at "
                f"least {least_nvl} bytes, got num_nvl_bytes={num_nvl_bytes}; use "
                f"Config().get_nvl_buffer_size_hint(hidden_bytes, num_ranks)")
    return None


def check_internode_sizes(topology, num_nvl_bytes: int, num_rdma_bytes: int) -> None:
    """Raises ``ValueError`` when a Buffer of these sizes cannot serve the internode mode on ``topology``."""
    refusal = internode_sizes_refusal(topology, num_nvl_bytes, num_rdma_bytes)
    if refusal is not None:
        raise ValueError(f"Buffer(): {refusal}")


def start_kernels(group: NodeGroup, device_id: int, num_nvl_bytes: int, num_low_latency_bytes: int,
                  internode_mode: bool = False, across_hosts: bool = False,
                  elastic: bool = False) -> Callable[[], dict[str, Library]]:
    """Collective over ``group``: start compiling (one rank per host, every family at once, in the
    background) or loading the kernel families a Buffer of these sizes uses (``internode_mode``: its
    ranks span several nodes; ``across_hosts``: several physical hosts, so the network families' build
    that links NVSHMEM's transfer code; ``elastic``: an ``ElasticBuffer``'s); the returned call, once NVSHMEM is up, waits for them and loads
    them, by the names :func:`cuep.kernels.buffer_specs` gives them (a family's, or a build's such as
    ``LOW_LATENCY_RECEIVE``)."""
    arch = f"sm_{_deps.cuda_core().Device(device_id).arch}"
    specs = buffer_specs(arch, num_nvl_bytes, num_low_latency_bytes, internode_mode, across_hosts, elastic)
    finish = start_libraries(list(specs.values()), group)
    return lambda: dict(zip(specs, finish()))
