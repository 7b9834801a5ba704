"""get_library(spec): memory -> disk cache -> (collective) compile; then load, and register with NVSHMEM.

The one place where a :class:`KernelSpec` becomes something launchable. Collective mode (a
:class:`CompileGroup` given) keeps a job's ranks from stalling each other: every rank computes the
cache key and the ranks compare them; local rank 0 of each node compiles (or finds the entry on
disk) while its node waits with a timeout; then every rank loads the cubin from disk.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

from .. import _deps, env
from .._log import jit_logger
from ..errors import CompileError
from ..runtime import world as nvshmem_world
from . import cache
from .compiler import CompileOptions, compile_options, compile_spec, source_root
from .spec import KernelSpec
from .toolchain import Nvshmem, nvshmem, toolchain

_OK = "ok"


class CompileGroup(Protocol):
    """The ranks that compile together; cuep.runtime provides it over MPI, with timeouts."""

    rank: int
    local_rank: int
    num_ranks: int

    def allgather(self, value: Any, phase: str) -> list[Any]: ...

    def node_broadcast(self, value: Any, phase: str) -> Any: ...


class Library:
    """A loaded cubin and its kernels, registered with NVSHMEM when the family uses it."""

    def __init__(self, spec: KernelSpec, cubin: bytes):
        core = _deps.cuda_core()
        self.spec = spec
        self._object = core.ObjectCode.from_cubin(cubin, name=spec.name)
        self._kernels: dict[str, Any] = {}
        if spec.uses_nvshmem:
            nvshmem_world.register_library(self._object, forget=lambda: _loaded.pop(spec, None))

    def kernel(self, name: str):
        """The ``extern "C"`` entry ``name`` of this library, as a cuda.core ``Kernel``."""
        if name not in self._kernels:
            self._kernels[name] = self._object.get_kernel(name)
        return self._kernels[name]


_loaded: dict[KernelSpec, Library] = {}
_warned: set[str] = set()


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


def _compile(spec: KernelSpec, options: CompileOptions, nv: Nvshmem | None, root: Path, announce: bool):
    log = jit_logger()
    log.debug("cuep: %s options %s linker %s", spec.name, options.describe_program(), options.describe_linker())
    try:
        artifact = compile_spec(options, nv, keep_ptx=env.get("CUEP_JIT_DUMP"))
    except CompileError as exc:
        kept = root / cache.STORE_LAYOUT / "failed" / spec.name / "source.cu"
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text((source_root() / f"{spec.family}.cu").read_text())
        raise CompileError(f"{exc}\nsource kept at {kept} (headers under {source_root()}); "
                           f"options: {options.describe_program()}") from exc
    if announce:
        log.info("cuep: compiling %s (first use, cached in %s) ... %.1f s", spec.name, root, artifact.seconds)
    if artifact.log.strip():
        log.debug("cuep: NVRTC log for %s:\n%s", spec.name, artifact.log)
    return artifact


def _build_into_cache(spec, options, nv, root, key, fields, announce) -> bytes:
    cubin = cache.load(root, spec, key)
    if cubin is not None:
        jit_logger().debug("cuep: cache hit %s", cache.entry_dir(root, spec, key))
        return cubin
    artifact = _compile(spec, options, nv, root, announce)
    cache.store(root, spec, key, fields, artifact)
    return artifact.cubin


def _check_same_key(group: CompileGroup, spec: KernelSpec, keyed) -> None:
    keys = group.allgather(keyed[0] if keyed else None, f"compile of {spec.name}")
    if len(set(keys)) == 1:
        return
    other = next(r for r, k in enumerate(keys) if k != keys[group.rank])
    all_fields = group.allgather(keyed[1] if keyed else None, f"compile of {spec.name}")
    mine, theirs = all_fields[group.rank] or {}, all_fields[other] or {}
    in_order = [*mine, *(f for f in theirs if f not in mine)]
    differing = next((f for f in in_order if mine.get(f) != theirs.get(f)), "cache use")
    raise CompileError(
        f"ranks {group.rank} and {other} would build different {spec.name} kernels: their '{differing}' "
        f"differs ({mine.get(differing)!r} vs {theirs.get(differing)!r}); give every rank the same "
        f"cuep, CUDA and NVSHMEM installation and the same CUEP_* settings")


def _prepare(spec: KernelSpec):
    """What every path to a cubin needs: NVSHMEM (if used), the options, the key (or None), the cache root."""
    nv = nvshmem() if spec.uses_nvshmem else None
    options = compile_options(spec, nv)
    return nv, options, _key(spec, options, nv), env.get("CUEP_CACHE_DIR")


def _obtain_cubin(spec: KernelSpec, group: CompileGroup | None) -> bytes:
    nv, options, keyed, root = _prepare(spec)
    announce = group is None or group.rank == 0
    if group is not None and group.num_ranks > 1:
        _check_same_key(group, spec, keyed)
    if keyed is None:
        return _compile(spec, options, nv, root, announce).cubin
    key, fields = keyed
    if group is None:
        return _build_into_cache(spec, options, nv, root, key, fields, announce)
    phase = f"compile of {spec.name}"
    cubin = None
    if group.local_rank == 0:
        try:
            cubin = _build_into_cache(spec, options, nv, root, key, fields, announce)
        except Exception as exc:
            group.node_broadcast(f"{type(exc).__name__}: {exc}", phase)
            raise
    status = group.node_broadcast(_OK, phase)
    if status != _OK:
        raise CompileError(f"local rank 0 of this node failed to build {spec.name}:\n{status}")
    if cubin is None:
        cubin = cache.load(root, spec, key)
    if cubin is None:
        raise CompileError(f"local rank 0 built {spec.name} into {cache.entry_dir(root, spec, key)}, but rank "
                           f"{group.rank} cannot read it there: CUEP_CACHE_DIR must be visible to every rank "
                           f"of a node")
    return cubin


def get_library(spec: KernelSpec, group: CompileGroup | None = None) -> Library:
    """Load ``spec`` from memory, the disk cache, or a fresh compile.

    With ``group``, every rank of the group must call this for the same spec (it is collective);
    without it, this process compiles on its own (``python -m cuep compile``, tests).
    """
    library = _loaded.get(spec)
    if library is None:
        library = Library(spec, _obtain_cubin(spec, group))
        _loaded[spec] = library
    return library


def build(spec: KernelSpec) -> tuple[Path | None, float]:
    """Compile ``spec`` into the disk cache without loading it (no GPU needed).

    Returns the cache entry (``None`` when the cache is disabled) and the seconds spent compiling
    (0 when it was already cached)."""
    nv, options, keyed, root = _prepare(spec)
    started = time.perf_counter()
    if keyed is None:
        _compile(spec, options, nv, root, announce=False)
        return None, time.perf_counter() - started
    key, fields = keyed
    if cache.load(root, spec, key) is not None:
        return cache.entry_dir(root, spec, key), 0.0
    _build_into_cache(spec, options, nv, root, key, fields, announce=False)
    return cache.entry_dir(root, spec, key), time.perf_counter() - started
