"""Import the heavy dependencies on first use, turning their absence into one actionable sentence.

``import cuep`` must work on a machine with none of them (CI compiles kernels without a GPU, and
``python -m cuep info`` reports what is missing), so every module imports them through here.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

from .errors import MissingDependencyError

_CUDA_EXTRA = "pip install 'cuep[cu13]' (or 'cuep[cu12]' on a CUDA 12 driver)"

_INSTALL_HINTS = {
    "cupy": f"cuep needs CuPy: {_CUDA_EXTRA}.",
    "cuda.core": f"cuep needs cuda.core >= 1.2 (cuda-python): {_CUDA_EXTRA}.",
    "cuda.bindings.driver": f"cuep needs cuda-bindings (cuda-python): {_CUDA_EXTRA}.",
    "cuda.pathfinder": f"cuep needs cuda-pathfinder to find NVRTC and the CUDA headers: {_CUDA_EXTRA}.",
    "nvshmem.core": f"cuep needs nvshmem4py and NVSHMEM >= 3.5.21: {_CUDA_EXTRA}.",
    "mpi4py.MPI": "cuep needs mpi4py and an MPI library: pip install mpi4py mpich (or use your cluster's MPI).",
    "ml_dtypes": "cuep needs ml_dtypes for bfloat16 arrays: pip install ml_dtypes.",
}


@functools.cache
def require(module: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingDependencyError` saying what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(f"{_INSTALL_HINTS[module]} (import failed: {exc})") from exc
    except RuntimeError as exc:  # mpi4py raises this when no MPI library can be loaded
        raise MissingDependencyError(f"{_INSTALL_HINTS[module]} (loading failed: {exc})") from exc


def cupy() -> ModuleType:
    return require("cupy")


def cuda_core() -> ModuleType:
    return require("cuda.core")


def cuda_driver() -> ModuleType:
    return require("cuda.bindings.driver")


def pathfinder() -> ModuleType:
    return require("cuda.pathfinder")


def nvshmem() -> ModuleType:
    return require("nvshmem.core")


def mpi() -> ModuleType:
    return require("mpi4py.MPI")
