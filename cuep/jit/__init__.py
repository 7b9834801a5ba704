"""Runtime compilation of ``cuda_src/`` kernels: spec -> NVRTC (+ nvJitLink) -> disk cache -> loaded library."""

from .library import CompileGroup, Library, build, build_all, get_libraries, start_libraries
from .spec import KernelSpec, parse_arch

__all__ = ["CompileGroup", "KernelSpec", "Library", "build", "build_all", "get_libraries", "parse_arch",
           "start_libraries"]
