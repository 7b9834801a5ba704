"""Command line: ``python -m cuep info``, ``python -m cuep compile --arch sm_80,sm_90``,
``python -m cuep gpus --at-least 2`` (a rank count for ``mpirun -np``) and
``python -m cuep doctor [--transport ibgda]`` (can NVSHMEM's network transports work on this host)."""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys
import time

from . import __version__, env
from .doctor.checks import TRANSPORTS
from .errors import MissingDependencyError

_DISTRIBUTIONS = ("cupy-cuda13x", "cupy-cuda12x", "cuda-core", "cuda-bindings", "nvshmem4py-cu13",
                  "nvshmem4py-cu12", "nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12", "mpi4py", "numpy")


def _distribution_versions() -> list[tuple[str, str]]:
    found = []
    for name in _DISTRIBUTIONS:
        try:
            found.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def _try(what, describe):
    try:
        return describe(what())
    except (MissingDependencyError, ImportError, OSError, RuntimeError, ValueError) as exc:
        return f"unavailable ({exc})"


def _mpi_library() -> str:
    from . import _deps
    return _deps.mpi().Get_library_version().replace("\0", "").splitlines()[0].strip()


def _gpus() -> str:
    from . import _deps
    cupy = _deps.cupy()
    count = cupy.cuda.runtime.getDeviceCount()
    names = []
    for index in range(count):
        props = cupy.cuda.runtime.getDeviceProperties(index)
        names.append(f"{index}: {props['name'].decode()} (sm_{props['major']}{props['minor']})")
    return "; ".join(names) if names else "none"


def info() -> int:
    from .jit import toolchain
    print(f"cuep {__version__} on Python {platform.python_version()} ({sys.executable})")
    for name, version in _distribution_versions():
        print(f"  {name:22s} {version}")
    print("  NVRTC                  " + _try(toolchain.toolchain, lambda t: "%d.%d" % t.nvrtc_version))
    print("  nvJitLink              " + _try(toolchain.toolchain, lambda t: "%d.%d" % t.nvjitlink_version))
    print("  CUDA / CCCL headers    " + _try(toolchain.toolchain,
                                             lambda t: f"{t.cudart_header_version} / {t.cccl_header_version}"))
    print("  NVSHMEM                " + _try(toolchain.nvshmem, lambda n: "%d.%d.%d at %s" % (*n.version, n.root)))
    print("  MPI                    " + _try(lambda: None, lambda _: _mpi_library()))
    print("  GPUs                   " + _try(lambda: None, lambda _: _gpus()))
    print("environment:")
    for var in env.table():
        print(f"  {var.name:24s} = {_try(lambda name=var.name: env.get(name), str):28s} {var.doc}")
    return 0


def _variants(fallback: bool, aggressive_ptx: bool) -> list[dict[str, bool]]:
    variants = [dict(force_fallback=False, aggressive_ptx=False)]
    if fallback:
        variants.append(dict(force_fallback=True, aggressive_ptx=False))
    if aggressive_ptx:
        variants.append(dict(force_fallback=False, aggressive_ptx=True))
    return variants


def compile_all(archs: list[str], fallback: bool, aggressive_ptx: bool, across_hosts: bool = False) -> int:
    """Build every family for every arch and variant into the cache, the kernels at once (and the network
    families' builds for ranks across hosts with ``across_hosts``)."""
    from .jit import build_all
    from .kernels import FAMILIES, NETWORK_FAMILIES, family_builds
    variants = _variants(fallback, aggressive_ptx)
    specs = [spec for arch in archs for family in FAMILIES for features in variants
             for spec in family_builds(family, arch, **features).values()]
    if across_hosts:
        specs += [spec for arch in archs for family in NETWORK_FAMILIES for features in variants
                  for spec in family_builds(family, arch, across_hosts=True, **features).values()]
    started = time.perf_counter()
    for spec, (path, seconds) in zip(specs, build_all(specs)):
        state = f"compiled in {seconds:.1f} s" if seconds else "already cached"
        print(f"{spec.name:64s} {state}  {path or '(cache disabled)'}")
    print(f"{len(specs)} kernels ready in {time.perf_counter() - started:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cuep", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="versions, GPUs, cache directory and CUEP_* settings")
    build = commands.add_parser("compile", help="build every kernel into the cache (no GPU needed)")
    build.add_argument("--arch", default="sm_90", help="comma-separated targets, e.g. sm_80,sm_90")
    build.add_argument("--fallback", action="store_true", help="also build the Ampere fallback path")
    build.add_argument("--aggressive-ptx", action="store_true", help="also build the aggressive-PTX variant")
    build.add_argument("--across-hosts", action="store_true",
                       help="also build the network families for ranks on several hosts (IBGDA)")
    gpus = commands.add_parser("gpus", help="print how many GPUs this machine shows (for mpirun -np)")
    gpus.add_argument("--at-least", type=int, default=0, help="print at least this many (ranks then share GPUs)")
    doctor = commands.add_parser("doctor", help="check this host for what NVSHMEM's network transports need")
    doctor.add_argument("--transport", choices=TRANSPORTS, help="check this transport only (default: every one)")
    args = parser.parse_args(argv)
    if args.command == "info":
        return info()
    if args.command == "doctor":
        from . import doctor
        return doctor.main(args.transport)
    if args.command == "gpus":
        from .runtime.world import visible_gpu_count
        print(max(visible_gpu_count(), args.at_least))
        return 0
    try:
        return compile_all([a for a in args.arch.split(",") if a], args.fallback, args.aggressive_ptx,
                           args.across_hosts)
    except ValueError as exc:
        parser.error(str(exc))
    return 2
