"""get_libraries(specs): memory -> disk cache -> (collective) compile; then load, and register with NVSHMEM.

The one place where a :class:`KernelSpec` becomes something launchable. The specs of one call compile
concurrently, on threads: NVRTC and nvJitLink release the GIL while they work. Collective mode (a
:class:`CompileGroup` given) keeps a job's ranks from stalling each other: every rank computes the
cache keys and the ranks compare them; local rank 0 of each node compiles what is not on disk while
its node waits with a timeout; then every rank loads the cubins from disk.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence, TypeVar

from .. import _deps, env
from .._log import jit_logger
from ..errors import CompileError
from ..runtime import world as nvshmem_world
from . import cache
from .compiler import CompileOptions, compile_options, compile_spec, source_root
from .spec import KernelSpec
from .toolchain import Nvshmem, nvshmem, toolchain

_OK = "ok"
_Result = TypeVar("_Result")


class CompileGroup(Protocol):
    """The ranks that compile together; cuep.runtime.NodeGroup provides it over any group, with timeouts."""

    rank: int
    local_rank: int
    num_ranks: int

    def allgather(self, value: Any, phase: str) -> list[Any]: ...

    def node_broadcast(self, value: Any, phase: str) -> Any: ...


class Library:
    """A loaded cubin and its kernels, registered with NVSHMEM when the family uses it."""

    def __init__(self, spec: KernelSpec, binary: cache.Binary):
        core = _deps.cuda_core()
        self.spec = spec
        self.symbols = dict(binary.symbols)  # entry -> its symbol in the cubin (see cache.Binary)
        self._object = core.ObjectCode.from_cubin(binary.cubin, name=spec.name)
        self._kernels: dict[str, Any] = {}
        self._functions: dict[str, int] = {}
        if spec.uses_nvshmem:
            nvshmem_world.register_library(self._object, forget=lambda: _loaded.pop(spec, None))

    def kernel(self, name: str):
        """The entry ``name`` (one of ``spec.entries``, e.g. ``cuep::low_latency::dispatch``) as a
        cuda.core ``Kernel``; looked up once."""
        kernel = self._kernels.get(name)
        if kernel is None:
            symbol = self.symbols.get(name)
            if symbol is None:
                raise KeyError(f"{self.spec.name} has no entry {name!r}; its entries are {sorted(self.symbols)}")
            kernel = self._kernels[name] = self._object.get_kernel(symbol)
        return kernel

    def function(self, name: str) -> int:
        """The driver handle of entry ``name`` as an integer (a ``CUkernel``, which launches as a
        ``CUfunction``), for :class:`cuep.kernels.launcher.Launch`; looked up once."""
        function = self._functions.get(name)
        if function is None:
            function = self._functions[name] = int(self.kernel(name).handle)
        return function


_loaded: dict[KernelSpec, Library] = {}
_warned: set[str] = set()


@dataclass(frozen=True)
class _Job:
    """Everything one spec needs on its way to a cubin; ``keyed`` is ``None`` when it cannot be cached."""

    spec: KernelSpec
    nv: Nvshmem | None
    options: CompileOptions
    keyed: tuple[str, dict[str, str]] | None
    root: Path

    @property
    def key(self) -> str | None:
        return self.keyed[0] if self.keyed else None

    @property
    def entry(self) -> Path:
        assert self.keyed is not None
        return cache.entry_dir(self.root, self.spec, self.keyed[0])


def _toolchain_fields(spec: KernelSpec, nv: Nvshmem | None) -> dict[str, str]:
    tc = toolchain()
    fields = {"nvrtc": "%d.%d" % tc.nvrtc_version, "nvjitlink": "%d.%d" % tc.nvjitlink_version,
              "cudart_headers": str(tc.cudart_header_version), "cccl_headers": str(tc.cccl_header_version)}
    if nv is None:
        fields["nvshmem"] = "unused"
    else:
        fields["nvshmem"] = "%d.%d.%d" % nv.version
        fields["nvshmem_device_library"] = cache.digest_file(nv.device_library)
    return fields


def _key(spec: KernelSpec, options: CompileOptions, nv: Nvshmem | None) -> tuple[str, dict[str, str]] | None:
    """The cache key and its fields, or ``None`` (after one warning) when the cache cannot be used."""
    if env.get("CUEP_JIT_DISABLE_CACHE"):
        return None
    try:
        fields = cache.key_fields(spec, source_root(), options.describe_program(), options.describe_linker(),
                                  _toolchain_fields(spec, nv))
    except cache.UncacheableError as exc:
        if spec.name not in _warned:
            _warned.add(spec.name)
            jit_logger().warning("cuep: compiling %s without the cache: %s", spec.name, exc)
        return None
    return cache.cache_key(fields), fields


def _prepare(spec: KernelSpec) -> _Job:
    """What every path to a cubin needs: NVSHMEM (if used), the options, the key (or None), the cache root."""
    nv = nvshmem() if spec.uses_nvshmem else None
    options = compile_options(spec, nv)
    return _Job(spec, nv, options, _key(spec, options, nv), env.get("CUEP_CACHE_DIR"))


def _compile(job: _Job, announce: bool) -> cache.Artifact:
    """Compile ``job``; with ``announce``, its one progress line (at INFO) once it is done."""
    log, spec = jit_logger(), job.spec
    log.debug("cuep: %s options %s linker %s", spec.name, job.options.describe_program(),
              job.options.describe_linker())
    try:
        artifact = compile_spec(job.options, job.nv, keep_ptx=env.get("CUEP_JIT_DUMP"))
    except CompileError as exc:
        kept = job.root / cache.STORE_LAYOUT / "failed" / spec.name / "source.cu"
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text((source_root() / f"{spec.family}.cu").read_text())
        raise CompileError(f"{exc}\nsource kept at {kept} (headers under {source_root()}); "
                           f"options: {job.options.describe_program()}") from exc
    if announce:
        log.info("cuep: compiling %s (first use, cached in %s) ... %.1f s", spec.name, job.root, artifact.seconds)
    if artifact.log.strip():
        log.debug("cuep: NVRTC log for %s:\n%s", spec.name, artifact.log)
    return artifact


def _produce(job: _Job, announce: bool) -> cache.Binary:
    """The cubin of ``job``: from the disk cache, else compiled (and stored when it can be cached)."""
    if job.keyed is None:
        return _compile(job, announce).binary
    key, fields = job.keyed
    binary = cache.load(job.root, job.spec, key)
    if binary is not None:
        jit_logger().debug("cuep: cache hit %s", job.entry)
        return binary
    artifact = _compile(job, announce)
    cache.store(job.root, job.spec, key, fields, artifact)
    return artifact.binary


def available_cores() -> int:
    """Processors a compile thread may run on: every one of the host's where the OS lets a thread widen
    its affinity (:func:`widen_thread_affinity`), else this process's affinity mask."""
    if hasattr(os, "sched_setaffinity"):
        return os.cpu_count() or 1
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def widen_thread_affinity() -> None:
    """Let the calling thread run on every processor of the host (Linux: the affinity of pid 0 is the
    calling thread's). mpirun binds each rank to a core by default, which left the one rank per host
    that compiles building its families one after another on that core; its compile threads now spread
    over the host while its own thread keeps the binding. Where the OS refuses (a cpuset narrower
    than the host), the thread keeps the process's mask."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (AttributeError, OSError):
        pass


def _costliest_first(jobs: Sequence[_Job]) -> list[int]:
    """Indices of ``jobs``, the likely longest compile first, so that with fewer threads than jobs the
    short ones fill in beside it. NVSHMEM families cost most (their headers alone take seconds), then
    longer sources."""
    def cost(index: int) -> tuple[bool, int]:
        spec = jobs[index].spec
        return spec.uses_nvshmem, len((source_root() / f"{spec.family}.cu").read_bytes())
    return sorted(range(len(jobs)), key=cost, reverse=True)


def _run_concurrently(work: Callable[[_Job], _Result], jobs: Sequence[_Job]) -> list[_Result]:
    """``work`` on every job, one thread per available core; results in the order of ``jobs``. Every job
    runs to its end before the first failure (in job order) is raised, so nothing writes afterwards."""
    if len(jobs) <= 1:
        return [work(job) for job in jobs]
    jit_logger()  # its first use attaches the handler: done here, not by two threads at once (two lines each)
    with ThreadPoolExecutor(max_workers=min(len(jobs), available_cores()), thread_name_prefix="cuep-jit",
                            initializer=widen_thread_affinity) as pool:
        futures = {index: pool.submit(work, jobs[index]) for index in _costliest_first(jobs)}
    return [futures[index].result() for index in range(len(jobs))]


def _check_same_keys(group: CompileGroup, jobs: Sequence[_Job]) -> None:
    """Raise, naming two ranks and the first field that differs, unless every rank builds the same kernels."""
    phase = "compile of " + ", ".join(job.spec.name for job in jobs)
    keys = group.allgather([(job.spec.name, job.key) for job in jobs], phase)
    names = [[name for name, _ in theirs] for theirs in keys]
    if any(theirs != names[group.rank] for theirs in names):
        other = next(r for r, theirs in enumerate(names) if theirs != names[group.rank])
        raise CompileError(f"ranks {group.rank} and {other} ask for different kernels ({names[group.rank]} vs "
                           f"{names[other]}); every rank must create the same Buffers in the same order")
    if all(theirs == keys[group.rank] for theirs in keys):
        return
    # Every rank holds the same gathered keys, so every rank picks the same spec to explain.
    index = next(i for i in range(len(jobs)) if len({theirs[i] for theirs in keys}) > 1)
    other = next(r for r, theirs in enumerate(keys) if theirs[index] != keys[group.rank][index])
    all_fields = group.allgather(jobs[index].keyed[1] if jobs[index].keyed else None, phase)
    ours, theirs = all_fields[group.rank] or {}, all_fields[other] or {}
    in_order = [*ours, *(f for f in theirs if f not in ours)]
    differing = next((f for f in in_order if ours.get(f) != theirs.get(f)), "cache use")
    name = jobs[index].spec.name
    raise CompileError(
        f"ranks {group.rank} and {other} would build different {name} kernels: their '{differing}' "
        f"differs ({ours.get(differing)!r} vs {theirs.get(differing)!r}); give every rank the same "
        f"cuep, CUDA and NVSHMEM installation and the same CUEP_* settings")


def _load_built(job: _Job, rank: int) -> cache.Binary:
    binary = cache.load(job.root, job.spec, job.keyed[0])
    if binary is None:
        raise CompileError(f"local rank 0 built {job.spec.name} into {job.entry}, but rank {rank} cannot read it "
                           f"there: CUEP_CACHE_DIR must be visible to every rank of a node")
    return binary


def _start_cubins(specs: Sequence[KernelSpec], group: CompileGroup | None) -> Callable[[], list[cache.Binary]]:
    """Collective: compare the keys, start building what this rank builds on a background thread, and
    return ``finish()``, which (collectively) waits for the node's builds and returns the cubins.

    Between the two the caller may do other work, even collective work over MPI: the background
    thread only compiles and writes the cache."""
    jobs = [_prepare(spec) for spec in specs]
    announce = group is None or group.rank == 0
    if group is not None and group.num_ranks > 1:
        _check_same_keys(group, jobs)
    # Local rank 0 builds every kernel; the others compile only what cannot be cached, then load.
    leads = group is None or group.local_rank == 0
    mine = [i for i, job in enumerate(jobs) if leads or job.keyed is None]
    shared = group is not None and any(job.keyed is not None for job in jobs)
    starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cuep-jit-start")
    building = starter.submit(_run_concurrently, lambda job: _produce(job, announce), [jobs[i] for i in mine])
    starter.shutdown(wait=False)  # returns at once; the thread ends with the builds

    def finish() -> list[cache.Binary]:
        phase = "compile of " + ", ".join(spec.name for spec in specs)
        try:
            built = dict(zip(mine, building.result()))
        except Exception as exc:
            if leads and shared:
                group.node_broadcast(f"{type(exc).__name__}: {exc}", phase)
            raise
        if shared:
            status = group.node_broadcast(_OK, phase)
            if status != _OK:
                names = ", ".join(job.spec.name for job in jobs if job.keyed is not None)
                raise CompileError(f"local rank 0 of this node failed to build {names}:\n{status}")
        return [built[i] if i in built else _load_built(job, group.rank) for i, job in enumerate(jobs)]
    return finish


def _obtain_cubins(specs: Sequence[KernelSpec], group: CompileGroup | None) -> list[cache.Binary]:
    return _start_cubins(specs, group)()


def start_libraries(specs: Sequence[KernelSpec], group: CompileGroup | None = None) -> Callable[[], list[Library]]:
    """Start :func:`get_libraries` and return the call that completes it (collective, like it).

    The compile runs in the background meanwhile, so a caller can bootstrap NVSHMEM at the same time;
    the returned call loads the libraries, which registers the NVSHMEM ones, so it must come after."""
    missing = [spec for spec in dict.fromkeys(specs) if spec not in _loaded]
    finish_cubins = _start_cubins(missing, group) if missing else list

    def finish() -> list[Library]:
        for spec, binary in zip(missing, finish_cubins()):
            _loaded[spec] = Library(spec, binary)
        return [_loaded[spec] for spec in specs]
    return finish


def get_libraries(specs: Sequence[KernelSpec], group: CompileGroup | None = None) -> list[Library]:
    """Load every spec from memory, the disk cache, or a fresh compile (the missing ones concurrently).

    With ``group``, every rank of the group must call this with the same specs in the same order (it
    is collective); without it, this process compiles on its own (tests, one-process tools).
    """
    return start_libraries(specs, group)()


def _build_timed(job: _Job) -> tuple[Path | None, float]:
    started = time.perf_counter()
    if job.keyed is None:
        _compile(job, announce=False)
        return None, time.perf_counter() - started
    if cache.load(job.root, job.spec, job.keyed[0]) is not None:
        return job.entry, 0.0
    _produce(job, announce=False)
    return job.entry, time.perf_counter() - started


def build_all(specs: Sequence[KernelSpec]) -> list[tuple[Path | None, float]]:
    """Compile every spec into the disk cache, concurrently, without loading anything (no GPU needed).

    Returns, per spec, its cache entry (``None`` when the cache is disabled) and the seconds spent
    compiling it (0 when it was already cached)."""
    return _run_concurrently(_build_timed, [_prepare(spec) for spec in specs])


def build(spec: KernelSpec) -> tuple[Path | None, float]:
    """:func:`build_all` for one spec."""
    return build_all([spec])[0]
