"""cuep: expert-parallel dispatch and combine for Mixture-of-Experts models, on CuPy arrays.

DeepEP's ``Buffer`` API without PyTorch or a compiler: kernels ship as CUDA source in ``cuda_src/``,
are compiled at first use with NVRTC for the GPU found, and run across MPI ranks bootstrapped into
NVSHMEM. Importing cuep touches no GPU, MPI, disk or environment.
"""

__version__ = "0.18.0"  # the one place the version is set: pyproject.toml and the docs read it here

from .buffer import Buffer  # noqa: E402
from .config import Config  # noqa: E402
from .elastic import ElasticBuffer, EPHandle  # noqa: E402
from .errors import (CallOrderError, CompileError, CuepError, MaskedRankError, MissingDependencyError,  # noqa: E402
                     NoGPUError, PeerTimeoutError)
from .event import EventOverlap  # noqa: E402

__all__ = ["Buffer", "CallOrderError", "CompileError", "Config", "CuepError", "EPHandle", "ElasticBuffer", "EventOverlap",
           "MaskedRankError", "MissingDependencyError", "NoGPUError", "PeerTimeoutError", "__version__"]
