"""Runtime compilation of ``cuda_src/`` kernels: spec -> NVRTC (+ nvJitLink) -> disk cache -> loaded library."""

from .library import CompileGroup, Library, build, get_library
from .spec import KernelSpec, parse_arch

__all__ = ["CompileGroup", "KernelSpec", "Library", "build", "get_library", "parse_arch"]
