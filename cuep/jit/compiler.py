"""KernelSpec -> cubin bytes: NVRTC through cuda.core ``Program``, then nvJitLink through ``Linker``
when the family uses NVSHMEM. Nothing else: no cache, no loading, no GPU needed.

Entries are C++ kernels in namespaces (``cuep::low_latency::dispatch``), so that a profiler shows
qualified names. NVRTC lowers each of the spec's entries, given as a name expression, to its
mangled symbol at compile time; the link keeps the symbols but cuda.core's ``Linker`` drops that
mapping, so the compile reads it from the unlinked object and returns it with the cubin
(:attr:`~cuep.jit.cache.Artifact.symbols`), for the cache to store beside it.

NVSHMEM families compile with NVSHMEM's collective headers left out (see
:meth:`~cuep.jit.toolchain.Nvshmem.collective_guards`): cuep calls point-to-point functions only, the
generated code of every kernel stays the same, and NVRTC skips seconds of template instantiation.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from pathlib import Path

from .. import _deps, env
from ..errors import CompileError
from .cache import Artifact
from .spec import KernelSpec
from .toolchain import Nvshmem, toolchain

SOURCE_ROOT = Path(__file__).resolve().parent.parent.parent / "cuda_src"
CXX_STANDARD = "c++17"


def source_root() -> Path:
    """``cuda_src/``: beside the package in a checkout, inside it when installed as a wheel."""
    packaged = Path(__file__).resolve().parent.parent / "cuda_src"
    return packaged if packaged.is_dir() else SOURCE_ROOT


@dataclass(frozen=True)
class CompileOptions:
    """The rendered options of one compile; ``describe_*()`` feed the cache key."""

    spec: KernelSpec
    lineinfo: bool
    include_dirs: tuple[Path, ...]
    header_guards: tuple[str, ...] = ()  # defined up front, so the headers they guard are left out

    def program_kwargs(self) -> dict:
        macros = self.spec.macros() + [(guard, "1") for guard in self.header_guards]
        return dict(name=f"{self.spec.family}.cu", arch=self.spec.arch, std=CXX_STANDARD,
                    relocatable_device_code=self.spec.uses_nvshmem, lineinfo=self.lineinfo,
                    define_macro=macros, include_path=[str(p) for p in self.include_dirs])

    def nvrtc_flags(self) -> list[bytes]:
        return _deps.cuda_core().ProgramOptions(**self.program_kwargs()).as_bytes("nvrtc")

    def describe_program(self) -> str:
        """The flags NVRTC receives. Include directories are left out: what they hold is keyed by
        version and digest instead, so moving a virtual environment keeps the cache valid."""
        return " ".join(f.decode() for f in self.nvrtc_flags() if not f.startswith(b"--include-path="))

    def describe_linker(self) -> str:
        return repr([("arch", self.spec.arch), ("lineinfo", self.lineinfo)]) if self.spec.uses_nvshmem else "none"


def compile_options(spec: KernelSpec, nvshmem: Nvshmem | None) -> CompileOptions:
    tc = toolchain()
    include_dirs = [source_root(), tc.cudart_include, tc.cccl_include]
    guards: tuple[str, ...] = ()
    if spec.uses_nvshmem:
        assert nvshmem is not None, "an NVSHMEM family needs its NVSHMEM installation"
        include_dirs.append(nvshmem.include_dir)
        guards = nvshmem.collective_guards()
    return CompileOptions(spec=spec, lineinfo=env.get("CUEP_JIT_LINEINFO"), include_dirs=tuple(include_dirs),
                          header_guards=guards)


def _ptx(source: str, options: CompileOptions) -> str:
    """The PTX of a compile, straight from NVRTC (cuda.core's PTX target needs a driver; this does not)."""
    from cuda.bindings import nvrtc

    def check(result):
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"NVRTC failed producing PTX for {options.spec.name}: {err}")
        return values[0] if values else None

    flags = options.nvrtc_flags()
    program = check(nvrtc.nvrtcCreateProgram(source.encode(), f"{options.spec.family}.cu".encode(), 0, [], []))
    try:
        check(nvrtc.nvrtcCompileProgram(program, len(flags), flags))
        buffer = b" " * check(nvrtc.nvrtcGetPTXSize(program))
        check(nvrtc.nvrtcGetPTX(program, buffer))
        return buffer.rstrip(b"\0 ").decode()
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def _link_with_nvshmem(obj, options: CompileOptions, nvshmem: Nvshmem):
    """``obj`` (relocatable device code) linked with the NVSHMEM device library."""
    core = _deps.cuda_core()
    device_library = core.ObjectCode.from_library(str(nvshmem.device_library))
    linker = core.Linker(obj, device_library,
                         options=core.LinkerOptions(arch=options.spec.arch, lineinfo=options.lineinfo))
    try:
        return linker.link("cubin")
    except Exception as exc:
        raise CompileError(f"nvJitLink failed on {options.spec.name} with {nvshmem.device_library}:\n{exc}") from exc


def compile_spec(options: CompileOptions, nvshmem: Nvshmem | None, *, keep_ptx: bool = False) -> Artifact:
    """Compile (and link) one kernel family. Raises :class:`CompileError` with the NVRTC log."""
    core = _deps.cuda_core()
    spec = options.spec
    source = (source_root() / f"{spec.family}.cu").read_text()
    started = time.perf_counter()
    program = core.Program(source, "c++", options=core.ProgramOptions(**options.program_kwargs()))
    log = io.StringIO()
    ptx = _ptx(source, options) if keep_ptx else None
    try:
        obj = program.compile("cubin", name_expressions=spec.entries, logs=log)
    except Exception as exc:  # cuda.core raises a generic error carrying the NVRTC log
        raise CompileError(f"NVRTC failed on {spec.name}:\n{exc}") from exc
    symbols = _lowered_names(obj, spec)
    if spec.uses_nvshmem:
        assert nvshmem is not None, "an NVSHMEM family needs its NVSHMEM installation"
        obj = _link_with_nvshmem(obj, options, nvshmem)
    cubin = bytes(obj.code)
    return Artifact(cubin=cubin, source=source, log=log.getvalue(), seconds=time.perf_counter() - started, ptx=ptx,
                    symbols=symbols)


def _lowered_names(obj, spec: KernelSpec) -> dict[str, str]:
    """Each entry of ``spec`` -> the symbol NVRTC lowered it to in ``obj`` (compiled with the entries as
    its name expressions)."""
    lowered = obj.symbol_mapping
    missing = [entry for entry in spec.entries if entry not in lowered]
    if missing:  # NVRTC fails the compile for an expression naming nothing; this is a broken invariant
        raise CompileError(f"NVRTC gave no symbol for {missing} in {spec.name}")
    return {entry: _text(lowered[entry]) for entry in spec.entries}


def _text(symbol: str | bytes) -> str:
    return symbol.decode() if isinstance(symbol, bytes) else symbol


def check_compiles(options: CompileOptions, appendix: str) -> None:
    """Compile the family's source with ``appendix`` after it (e.g. ``static_assert``\\ s about its
    structs), NVRTC only: no link, no cache. Raises :class:`CompileError` with the NVRTC log."""
    core = _deps.cuda_core()
    source = (source_root() / f"{options.spec.family}.cu").read_text() + "\n" + appendix
    program = core.Program(source, "c++", options=core.ProgramOptions(**options.program_kwargs()))
    try:
        program.compile("cubin")
    except Exception as exc:
        raise CompileError(f"NVRTC failed on {options.spec.name} with its checks appended:\n{exc}") from exc

