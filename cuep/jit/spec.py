"""KernelSpec: everything about a kernel that must be fixed at compile time, and nothing else.

A spec names a kernel family (the stem of a ``cuda_src/*.cu`` file), the target arch, the family's
compile-time constants and the feature set. Token counts, capacities and timeouts are kernel
arguments, never part of a spec, so a new batch size never recompiles.

Features by arch (what each build really uses):
  * ``sm_90``: the Hopper path: hardware FP8 conversion, ``aggressive_ptx`` available, and the
    bulk-copy (TMA) wrappers of ``cuda_src/cuep/ptx.cuh`` compiled in; the intranode combine on few
    SMs (``combine_bulk``) and the benchmark's NVLink ceiling probe use them, every other kernel moves
    data with ordinary loads and stores.
    No kernel uses a cluster's features; the intranode dispatch push and combine are launched in clusters
    (``cuep.kernels.intranode.cluster_blocks``) for where their blocks land.
  * ``sm_80``/``sm_86``/``sm_87``: the fallback path, FP8 conversion in software.
  * ``sm_89`` and archs other than ``sm_90``: the fallback path with hardware FP8.
  * ``force_fallback`` builds the fallback path (with software FP8) for any arch, so the Ampere
    path can be tested on a Hopper GPU.
  * ``aggressive_ptx`` (read-once loads through ``ld.global.nc.L1::no_allocate``) applies to the
    ``sm_90`` path only; elsewhere it is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import env

MIN_COMPUTE_CAPABILITY = 80
_FULL_FEATURE_CC = 90
_HARDWARE_FP8_CC = 89


def parse_arch(arch: str) -> int:
    """``'sm_90'`` -> ``90``; raises ``ValueError`` for anything cuep cannot build."""
    text = arch.strip().lower()
    digits = text[3:] if text.startswith("sm_") else ""
    if not digits.isdigit():
        raise ValueError(f"arch must look like 'sm_90', got {arch!r}")
    cc = int(digits)
    if cc < MIN_COMPUTE_CAPABILITY:
        raise ValueError(f"arch {arch!r} is not supported: cuep needs sm_80 (Ampere) or newer")
    return cc


@dataclass(frozen=True)
class KernelSpec:
    """The only input of the JIT.

    Attributes:
        family: kernel family, the stem of ``cuda_src/<family>.cu``.
        arch: target, e.g. ``"sm_90"``.
        defines: the family's compile-time parameters, sorted ``(name, value)`` pairs; each becomes
            ``-DCUEP_<NAME>=<value>`` and is part of :attr:`name`.
        constants: values that Python and CUDA share (thread counts, region sizes, codes), defined
            once in Python: sorted ``(name, value)`` pairs, each ``-DCUEP_<NAME>=<value>``; they do not
            vary between builds of a family, so they stay out of :attr:`name` (the cache key still
            sees them, through the compile flags).
        sm90_features: build the Hopper path (bulk-copy wrappers compiled in; see above).
        aggressive_ptx: read-once loads through ``ld.global.nc.L1::no_allocate``.
        software_fp8: convert FP8 in software.
        uses_nvshmem: the family calls NVSHMEM device functions, so it is compiled relocatable,
            linked with ``libnvshmem_device.a`` and registered with NVSHMEM when loaded.
        entries: the family's entry kernels (those of this build) by their qualified C++ names, e.g.
            ``cuep::low_latency::dispatch``, a template's with its arguments. Each is an NVRTC name
            expression: the compile records the symbol it lowers to, and a loaded library finds the
            kernel by this name (:meth:`cuep.jit.Library.kernel`).
    """

    family: str
    arch: str
    defines: tuple[tuple[str, str], ...] = ()
    constants: tuple[tuple[str, str], ...] = ()
    sm90_features: bool = False
    aggressive_ptx: bool = False
    software_fp8: bool = False
    uses_nvshmem: bool = False
    entries: tuple[str, ...] = ()

    @classmethod
    def create(cls, family: str, arch: str, defines: dict[str, object] | None = None, *,
               constants: dict[str, object] | None = None, uses_nvshmem: bool = False,
               entries: tuple[str, ...] = (), force_fallback: bool | None = None,
               aggressive_ptx: bool | None = None) -> "KernelSpec":
        """Resolve features for ``arch``; unset options come from ``CUEP_FORCE_FALLBACK`` and
        ``CUEP_AGGRESSIVE_PTX``."""
        cc = parse_arch(arch)
        if force_fallback is None:
            force_fallback = env.get("CUEP_FORCE_FALLBACK")
        if aggressive_ptx is None:
            aggressive_ptx = env.get("CUEP_AGGRESSIVE_PTX")
        full = cc == _FULL_FEATURE_CC and not force_fallback
        return cls(family=family, arch=f"sm_{cc}", defines=_pairs(defines), constants=_pairs(constants),
                   sm90_features=full, aggressive_ptx=full and bool(aggressive_ptx),
                   software_fp8=force_fallback or cc < _HARDWARE_FP8_CC, uses_nvshmem=uses_nvshmem,
                   entries=tuple(entries))

    @property
    def name(self) -> str:
        """Readable identity, e.g. ``layout.experts_per_block8.sm_90.aggressive_ptx``."""
        parts = [self.family, *(f"{k}{v}" for k, v in self.defines), self.arch]
        cc = parse_arch(self.arch)
        if cc == _FULL_FEATURE_CC and not self.sm90_features:
            parts.append("fallback")  # implies software FP8
        elif self.software_fp8 and cc >= _HARDWARE_FP8_CC:
            parts.append("software_fp8")
        if self.aggressive_ptx:
            parts.append("aggressive_ptx")
        return ".".join(parts)

    def macros(self) -> list[tuple[str, str]]:
        """Every ``-D`` the family's source sees: feature switches, then the family's constants."""
        features = [("CUEP_ENABLE_SM90_FEATURES", str(int(self.sm90_features))),
                    ("CUEP_AGGRESSIVE_PTX", str(int(self.aggressive_ptx))),
                    ("CUEP_SOFTWARE_FP8", str(int(self.software_fp8)))]
        return features + [(f"CUEP_{k.upper()}", v) for k, v in (*self.defines, *self.constants)]


def _pairs(values: dict[str, object] | None) -> tuple[tuple[str, str], ...]:
    """``{name: value}`` as sorted ``(lower-case name, text)`` pairs; bools become ``0``/``1``."""
    return tuple(sorted((str(k).lower(), str(int(v)) if isinstance(v, bool) else str(v))
                        for k, v in (values or {}).items()))
