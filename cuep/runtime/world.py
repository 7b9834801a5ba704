"""The process's NVSHMEM world: bootstrap over a group of ranks, symmetric memory, teardown.

One world per process, shared by every Buffer. Bootstrap uses a unique id broadcast over the group
(an mpi4py communicator or a torch process group, :mod:`cuep.runtime.group`; any MPI works, and no MPI
is needed: NVSHMEM's own MPI plugin needs Open MPI). The symmetric heap is
sized from what the first Buffer asks for, through ``NVSHMEM_SYMMETRIC_SIZE`` set before init unless
the user set it; a later, larger Buffer grows it (NVSHMEM maps more memory through CUDA VMM, on by
default on x86), and a destroyed Buffer's memory stays in the heap for the next one (NVSHMEM does not
give it back to the GPU). :data:`NVSHMEM_DEFAULTS` are set the same way: they turn off what NVSHMEM prepares
for its own collectives and teams, which cuep never uses, and which took most of every start.

Teardown order: every loaded NVSHMEM library is finalized (``library_finalize``), the symmetric
memory that no ``Buffer.destroy()`` freed is freed, then ``nvshmem.core.finalize()``. Finalize is
collective, so at interpreter exit it runs only after a bounded check that every rank is exiting
too; if a peer is gone it is skipped with a warning instead of hanging the exit.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .. import _deps, env
from ..errors import CuepError, NoGPUError, PeerTimeoutError
from .._math import align_up
from . import affinity
from .group import Group
from .topology import Topology

logger = logging.getLogger("cuep.runtime")

# Room for NVSHMEM's own symmetric allocations beyond the Buffers' data (which include cuep's control
# words). Small: with CUDA VMM the heap grows when a Buffer needs more (see NVSHMEM_DEFAULTS).
HEAP_RESERVE_BYTES = 8 << 20
_HEAP_ALIGN_BYTES = 2 << 20
# At exit, how long to wait for the other ranks before skipping the collective finalize.
_EXIT_TIMEOUT_S = 30.0
_SIZE_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# NVSHMEM variables cuep sets before init where the user has not. cuep's kernels use puts, signals,
# quiet and peer pointers, never an NVSHMEM collective or team, and its host side calls none either.
#  - NVSHMEM_DISABLE_NCCL: NVSHMEM's NCCL backend serves host-side collectives; creating its NCCL
#    communicators took about half of ``nvshmem.core.init``.
#  - NVSHMEM_MAX_TEAMS: NVSHMEM sizes a synchronisation pool for every team it may ever create (256 by
#    default in 3.8), each slot scaled by the rank count for its collectives; NVSHMEM raises any value below
#    the number of its predefined teams to that number, so 1 means "the predefined teams only".
#  - NVSHMEM_DISABLE_LOCAL_ONLY_PROXY: where no transport needs NVSHMEM's proxy (NVLink alone, or IBGDA ringing
#    the NIC from the GPU, its default), NVSHMEM still starts a thread that spins on a CPU core for the whole
#    run, only to serve a device-side nvshmem_global_exit; cuep never calls it, and its waits time out on
#    their own clocks. A transport that needs the proxy (IBRC, UCX, IBGDA ringing from the CPU) still gets it.
NVSHMEM_DEFAULTS = {"NVSHMEM_DISABLE_NCCL": "1", "NVSHMEM_MAX_TEAMS": "1", "NVSHMEM_DISABLE_LOCAL_ONLY_PROXY": "1"}
# With CUDA VMM, NVSHMEM maps the heap in pieces of NVSHMEM_CUMEM_GRANULARITY (512 MiB by default), so a heap
# of any smaller size took a whole piece of GPU memory. On one host cuep sets 2 MiB, the GPU's own granularity:
# the heap takes what was asked. Across hosts NVSHMEM's default stays, as DeepEP keeps it: IBGDA keeps a memory
# key per piece and peer, and only the first 64 sit in constant memory.
ONE_HOST_GRANULARITY = {"NVSHMEM_CUMEM_GRANULARITY": str(2 << 20)}
# DeepEP's default queue pairs per peer; as in DeepEP, a Buffer's num_qps_per_rank becomes IBGDA's
# reliable connections per peer (the first Buffer's, since NVSHMEM starts once per process).
DEFAULT_QPS_PER_RANK = 24
IBGDA_QPS_VARIABLE = "NVSHMEM_IBGDA_NUM_RC_PER_PE"


def parse_heap_size(text: str) -> int | None:
    """``NVSHMEM_SYMMETRIC_SIZE`` in bytes (``1G``, ``512M``, ``1073741824``), ``None`` if unreadable."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)B?\s*", text.upper())
    return int(match.group(1)) * _SIZE_SUFFIXES[match.group(2)] if match else None


def heap_size_for(data_bytes: int) -> int:
    """Symmetric heap for ``data_bytes`` of Buffer data plus the reserve, rounded up to 2 MiB."""
    needed = data_bytes + HEAP_RESERVE_BYTES
    return align_up(needed, _HEAP_ALIGN_BYTES)


def visible_gpu_count() -> int:
    """GPUs this process sees, through the driver API (which creates no context); 0 without a driver."""
    try:
        driver = _deps.cuda_driver()
        (err,) = driver.cuInit(0)
        if err == driver.CUresult.CUDA_SUCCESS:
            err, count = driver.cuDeviceGetCount()
            if err == driver.CUresult.CUDA_SUCCESS:
                return count
    except Exception:  # no cuda-bindings, or no driver library (libcuda) on this machine
        pass
    return 0


def pick_device(local_rank: int, num_devices: int) -> int:
    """The GPU of a host's ``local_rank``: its own when the host shows a GPU per rank, else round-robin
    (whether ranks may then share one is :func:`check_gpu_sharing`'s decision)."""
    if num_devices == 0:
        raise NoGPUError("cuep found no CUDA GPU: run on a machine with an NVIDIA GPU and its driver")
    return local_rank % num_devices


def check_gpu_sharing(gpu_of_rank: list, share: bool) -> int:
    """Refuse ranks that share a GPU unless ``share`` (``CUEP_SHARE_GPUS``); returns the most ranks on one GPU.

    ``gpu_of_rank[r]``: the UUID (or PCI bus id) of rank ``r``'s GPU. They tell physical GPUs apart even
    where each rank sees only its own through ``CUDA_VISIBLE_DEVICES``, so a production job never shares
    a GPU by accident."""
    ranks_of_gpu: dict[object, list[int]] = {}
    for rank, gpu in enumerate(gpu_of_rank):
        ranks_of_gpu.setdefault(gpu, []).append(rank)
    crowded = max(ranks_of_gpu.values(), key=len)
    if len(crowded) > 1 and not share:
        raise CuepError(f"ranks {crowded} would share one GPU ({len(gpu_of_rank)} ranks, {len(ranks_of_gpu)} GPUs): "
                        f"run one rank per GPU, or set CUEP_SHARE_GPUS=1 to let ranks share GPUs on purpose "
                        f"(for correctness tests: kernels of ranks on one GPU are time-sliced)")
    return len(crowded)


@dataclass
class World:
    """The initialised NVSHMEM world of this process."""

    group: Group
    topology: Topology
    device_id: int
    heap_bytes: int
    _libraries: list[tuple[Any, Callable[[], None]]] = field(default_factory=list)
    # Symmetric memory not yet freed, in allocation order (the same on every rank): teardown frees it,
    # so a job that ends without Buffer.destroy() (after an exception, say) leaves nothing to NVSHMEM.
    _allocations: list[Any] = field(default_factory=list)
    finalized: bool = False


_world: World | None = None


def current() -> World | None:
    return _world


def gpu_identity(device_id: int) -> bytes:
    """What tells GPU ``device_id`` apart from every other: its UUID, else its PCI bus id."""
    runtime = _deps.cupy().cuda.runtime
    return bytes(runtime.getDeviceProperties(device_id).get("uuid") or runtime.deviceGetPCIBusId(device_id).encode())


def choose_device(group: Group, topology: Topology, device_id: int | None = None) -> int:
    """Collective: this rank's GPU (``device_id`` if the caller chose one, else :func:`pick_device`), after
    :func:`check_gpu_sharing` over ``group``."""
    if _world is not None and not _world.finalized:
        return _world.device_id
    if device_id is None:
        device_id = pick_device(topology.local_rank, visible_gpu_count())
    ranks_per_gpu = check_gpu_sharing(group.allgather(gpu_identity(device_id), "GPU choice"),
                                      env.get("CUEP_SHARE_GPUS"))
    if ranks_per_gpu > 1 and topology.rank == 0:
        logger.warning("cuep: up to %d ranks share each GPU (CUEP_SHARE_GPUS=1): results are tested, speed is not",
                       ranks_per_gpu)
    return device_id


def check_group(group: Group) -> None:
    """Raises ``ValueError`` unless ``group`` may use this process's NVSHMEM world: there is none yet, or it
    was made over the same ranks, in the same order (NVSHMEM allows one world per process)."""
    if _world is not None and not _world.finalized and not group.same_ranks(_world.group):
        raise ValueError("Buffer(): the group must contain the same ranks as the first Buffer's, in the same "
                         "order: NVSHMEM allows one world per process")


def init_world(group: Group, topology: Topology, data_bytes: int, device_id: int,
               num_qps_per_rank: int = DEFAULT_QPS_PER_RANK) -> World:
    """Collective: bootstrap NVSHMEM over ``group`` on ``device_id`` (from :func:`choose_device`) once per
    process; later calls return the world. ``num_qps_per_rank`` sets IBGDA's connections per peer unless
    ``NVSHMEM_IBGDA_NUM_RC_PER_PE`` is set. A failed start raises :class:`CuepError` naming the transport
    asked for and what :mod:`cuep.doctor` finds against it, and so does, on every rank before NVSHMEM
    starts, a transport asked for that some rank's host cannot give."""
    global _world
    if _world is not None and not _world.finalized:
        check_group(group)
        return _world
    if _world is not None:
        raise CuepError("NVSHMEM was finalized in this process and cannot be initialised again")
    cupy, core, nvshmem = _deps.cupy(), _deps.cuda_core(), _deps.nvshmem()
    heap_bytes = _size_heap(data_bytes)
    apply_nvshmem_defaults(os.environ, num_qps_per_rank, one_host=topology.num_local_ranks == topology.num_ranks)
    device = core.Device(device_id)
    device.set_current()
    cupy.cuda.Device(device_id).use()
    _refuse_an_absent_transport(group, topology.rank)
    uid = nvshmem.get_unique_id(empty=topology.rank != 0)
    uid_bytes = uid._data.view(np.int8)
    uid_bytes[:] = np.frombuffer(group.broadcast(uid_bytes.tobytes(), "NVSHMEM bootstrap"), dtype=np.int8)
    threads_before = affinity.thread_ids()
    try:
        nvshmem.init(device=device, uid=uid, rank=topology.rank, nranks=topology.num_ranks,
                     initializer_method="uid")
    except Exception as exc:  # nvshmem4py raises NvshmemError; a transport plugin may fail otherwise
        from .. import doctor
        raise CuepError(doctor.start_error_message(topology.rank, exc, os.environ)) from exc
    # Its proxy thread inherited this thread's binding: off the ranks' cores, its polling stalls no rank.
    affinity.keep_off_rank_cores(affinity.thread_ids() - threads_before, topology.host_cpus)
    _world = World(group=group, topology=topology, device_id=device_id, heap_bytes=heap_bytes)
    atexit.register(_finalize_at_exit)
    return _world


def _refuse_an_absent_transport(group: Group, rank: int) -> None:
    """Collective: raise :class:`CuepError` on every rank when the environment names a network transport
    that some rank's host cannot give at all (no plugin for it, no NIC it can use). NVSHMEM would start
    anyway where every rank reaches every other over P2P, silently without the transport asked for, and
    fail or hang where one does not."""
    from .. import doctor
    asked = doctor.explicit_transport(os.environ)
    causes = ""
    if asked in doctor.TRANSPORTS:
        causes = doctor.describe(doctor.absent_transport_causes(doctor.read_host(environ=os.environ), asked))
    causes_by_rank = {other: text for other, text in enumerate(group.allgather(causes, "transport check")) if text}
    if causes_by_rank:
        raise CuepError(doctor.absent_transport_message(rank, os.environ, causes_by_rank))


def apply_nvshmem_defaults(environ, num_qps_per_rank: int = DEFAULT_QPS_PER_RANK, one_host: bool = False) -> None:
    """Set each of :data:`NVSHMEM_DEFAULTS`, IBGDA's connections per peer (``num_qps_per_rank``) and, when every
    rank is on ``one_host``, :data:`ONE_HOST_GRANULARITY`, in ``environ`` where the user has not set them."""
    defaults = {**NVSHMEM_DEFAULTS, IBGDA_QPS_VARIABLE: str(num_qps_per_rank),
                **(ONE_HOST_GRANULARITY if one_host else {})}
    for name, value in defaults.items():
        environ.setdefault(name, value)


def _size_heap(data_bytes: int) -> int:
    wanted = heap_size_for(data_bytes)
    given = os.environ.get("NVSHMEM_SYMMETRIC_SIZE")
    if given is None:
        os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(wanted)
        return wanted
    size = parse_heap_size(given)
    if size is not None and size < wanted:
        raise ValueError(f"NVSHMEM_SYMMETRIC_SIZE={given} is smaller than the {wanted} bytes this Buffer needs "
                         f"({data_bytes} of data plus {HEAP_RESERVE_BYTES} reserved); raise it or unset it")
    return size if size is not None else wanted


def _require_world() -> World:
    if _world is None or _world.finalized:
        raise CuepError("NVSHMEM is not initialised: create a cuep.Buffer first")
    return _world


def register_library(obj, forget: Callable[[], None]) -> None:
    """``library_init`` a loaded cuda.core ObjectCode; teardown finalizes it, then calls ``forget``."""
    world = _require_world()
    nvshmem = _deps.nvshmem()
    kernel_object = nvshmem.NvshmemKernelObject.from_obj(obj)
    nvshmem.library_init(kernel_object)
    world._libraries.append((kernel_object, forget))


def allocate(nbytes: int):
    """Collective: ``nbytes`` of symmetric memory (a cuda.core Buffer)."""
    world = _require_world()
    nvshmem = _deps.nvshmem()
    try:
        buffer = nvshmem.buffer(nbytes)
    except nvshmem.NvshmemError as exc:
        raise CuepError(f"NVSHMEM could not allocate {nbytes} bytes of symmetric memory: its heap started at "
                        f"{world.heap_bytes} bytes, sized for the first Buffer, and grows beyond that only through "
                        f"CUDA VMM (off with NVSHMEM_DISABLE_CUDA_VMM=1, and where the driver lacks it) up to "
                        f"NVSHMEM_MAX_MEMORY_PER_GPU, and only while the GPU has the memory; create the largest "
                        f"Buffer first, or set NVSHMEM_SYMMETRIC_SIZE to what all of them need") from exc
    world._allocations.append(buffer)
    return buffer


def free(buffer) -> None:
    """Collective: return symmetric memory from :func:`allocate`."""
    if _world is not None and not _world.finalized:
        _world._allocations.remove(buffer)
        _deps.nvshmem().free(buffer)


def finalize_world() -> None:
    """Collective: finalize every registered library, free the symmetric memory still held, then
    finalize NVSHMEM. Idempotent."""
    world = _world
    if world is None or world.finalized:
        return
    nvshmem = _deps.nvshmem()
    _deps.cuda_core().Device(world.device_id).set_current()
    _deps.cupy().cuda.Device(world.device_id).synchronize()
    for kernel_object, forget in reversed(world._libraries):
        nvshmem.library_finalize(kernel_object)
        forget()
    world._libraries.clear()
    while world._allocations:
        nvshmem.free(world._allocations.pop())
    nvshmem.finalize()
    world.finalized = True


def _finalize_at_exit() -> None:
    world = _world
    if world is None or world.finalized:
        return
    try:
        if not world.group.usable():
            # Every Buffer destroyed, then the process group (DeepEP's own tests end so): nothing is left
            # to release but the world, which the process's exit takes down.
            log = logger.debug if not world._allocations else logger.warning
            log("cuep: the ranks' MPI or torch.distributed runtime ended before NVSHMEM; skipping NVSHMEM teardown")
            return
        world.group.wait_for_all("exit", min(env.get("CUEP_TIMEOUT_S"), _EXIT_TIMEOUT_S))
        finalize_world()
    except PeerTimeoutError as exc:
        logger.warning("cuep: skipping NVSHMEM teardown at exit: %s", exc)
    except Exception as exc:  # an exit handler must not raise
        logger.warning("cuep: NVSHMEM teardown at exit failed: %s", exc)
