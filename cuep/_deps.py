"""Import the heavy dependencies on first use, turning their absence into one actionable sentence.

``import cuep`` must work on a machine with none of them (CI compiles kernels without a GPU, and
``python -m cuep info`` reports what is missing), so every module imports them through here.
"""

from __future__ import annotations

import functools
import importlib
import sys
from types import ModuleType

from .errors import MissingDependencyError

_CUDA_EXTRA = "pip install 'cuep[cu13]' (or 'cuep[cu12]' on a CUDA 12 driver)"

_NVSHMEM_HINT = f"cuep needs nvshmem4py and NVSHMEM >= 3.5.21: {_CUDA_EXTRA}."  # both of nvshmem4py's modules

_INSTALL_HINTS = {
    "cupy": f"cuep needs CuPy: {_CUDA_EXTRA}.",
    "cuda.core": f"cuep needs cuda.core >= 1.2 (cuda-python): {_CUDA_EXTRA}.",
    "cuda.bindings.driver": f"cuep needs cuda-bindings (cuda-python): {_CUDA_EXTRA}.",
    "cuda.pathfinder": f"cuep needs cuda-pathfinder to find NVRTC and the CUDA headers: {_CUDA_EXTRA}.",
    "nvshmem.core": _NVSHMEM_HINT,
    "nvshmem.bindings": _NVSHMEM_HINT,
    "mpi4py.MPI": "cuep needs mpi4py and an MPI library: pip install mpi4py mpich (or use your cluster's MPI).",
    "ml_dtypes": "cuep needs ml_dtypes for bfloat16 arrays: pip install ml_dtypes.",
    "torch": "cuep.torch needs PyTorch with CUDA: pip install torch.",
    "torch.distributed": "cuep.torch needs PyTorch with torch.distributed: pip install torch.",
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


@functools.cache
def nvshmem() -> ModuleType:
    """``nvshmem.core``; a torch installed beside it is not imported on its behalf.

    nvshmem4py imports torch, when it finds it, for tensor interop that cuep never uses; that import
    alone cost 4-5 s of a first Buffer on the GPU image. So unless the program has imported torch
    already, torch is hidden while ``nvshmem.core`` loads (its torch interop then stays off; torch
    itself imports normally afterwards)."""
    if "torch" in sys.modules:
        return require("nvshmem.core")
    sys.modules["torch"] = None  # makes `import torch` fail inside nvshmem4py's guarded imports
    try:
        return require("nvshmem.core")
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]


def mpi() -> ModuleType:
    return require("mpi4py.MPI")


def torch() -> ModuleType:
    return require("torch")


def torch_distributed() -> ModuleType:
    return require("torch.distributed")
