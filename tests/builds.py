"""Kernel families compiled once per test session, for the tests that read the compiled code: the real
NVRTC (+ nvJitLink with libnvshmem_device.a for NVSHMEM families), no cache, no GPU."""

from __future__ import annotations

import functools

from cuep.jit import KernelSpec, compiler, toolchain
from cuep.jit.cache import Artifact
from cuep.kernels import FAMILIES

VARIANTS = {
    "default": dict(force_fallback=False, aggressive_ptx=False),
    "fallback": dict(force_fallback=True, aggressive_ptx=False),
    "aggressive_ptx": dict(force_fallback=False, aggressive_ptx=True),
}


def compiled(family: str, arch: str = "sm_90", variant: str = "default", keep_ptx: bool = False,
             **options) -> tuple[KernelSpec, Artifact]:
    """``family``'s spec for ``arch`` and ``variant`` (as the environment resolves it now; ``options``:
    the family's own, e.g. ``across_hosts``) and its compile, made once per spec."""
    spec = FAMILIES[family].spec(arch, **VARIANTS[variant], **options)
    return spec, compile_spec(spec, keep_ptx)


@functools.cache
def compile_spec(spec: KernelSpec, keep_ptx: bool = False) -> Artifact:
    nvshmem = toolchain.nvshmem() if spec.uses_nvshmem else None
    return compiler.compile_spec(compiler.compile_options(spec, nvshmem), nvshmem, keep_ptx=keep_ptx)
