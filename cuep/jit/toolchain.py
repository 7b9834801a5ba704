"""Find the compiler pieces: NVRTC, nvJitLink, the CUDA and CCCL headers, and one NVSHMEM release.

Everything comes from pip wheels through ``cuda.pathfinder``; no CUDA toolkit or compiler is needed.
Versions are tuples, never strings. NVSHMEM's headers, ``libnvshmem_device.a`` and the loaded
``libnvshmem_host.so.3`` must be one release: all three are derived from the directory of the host
library that is (or will be) loaded, and a mismatch is refused.
"""

from __future__ import annotations

import ctypes
import functools
import re
from dataclasses import dataclass
from pathlib import Path

from .. import _deps
from ..errors import MissingDependencyError

# NVRTC cannot compile the NVSHMEM headers of releases before this one.
MIN_NVSHMEM_VERSION = (3, 5, 21)
# NVSHMEM's collective device API (reductions, fcollect, broadcast, alltoall): each header and the
# include guard it is wrapped in. nvshmem.h and nvshmemx.h pull all of it in, and NVRTC then spends most
# of an NVSHMEM family's front-end time instantiating collectives that cuep never calls.
COLLECTIVE_HEADER_GUARDS = (
    ("device/nvshmem_coll_defines.cuh", "_NVSHMEM_COLL_DEFINES_CUH_"),
    ("device/nvshmemx_coll_defines.cuh", "_NVSHMEMX_COLL_DEFINES_CUH_"),
    ("non_abi/device/coll/defines.cuh", "_NVSHMEMI_DEVICE_COLL_DEFINES_H_"),
)
_NVSHMEM_PIP = "pip install 'nvidia-nvshmem-cu13>=3.5.21' (or nvidia-nvshmem-cu12 on CUDA 12)"


def _read_define(header: Path, macro: str) -> int:
    match = re.search(rf"#\s*define\s+{macro}\s+\(?(\d+)", header.read_text(errors="replace"))
    if match is None:
        raise MissingDependencyError(f"could not read {macro} from {header}; reinstall that package")
    return int(match.group(1))


@dataclass(frozen=True)
class Nvshmem:
    """One NVSHMEM installation, checked to be a single release."""

    root: Path
    version: tuple[int, int, int]

    @property
    def include_dir(self) -> Path:
        return self.root / "include"

    @property
    def device_library(self) -> Path:
        return self.root / "lib" / "libnvshmem_device.a"

    def collective_guards(self) -> tuple[str, ...]:
        """The include guards that, defined up front, leave NVSHMEM's collective headers out.

        Empty unless every header in :data:`COLLECTIVE_HEADER_GUARDS` is guarded by its macro: leaving
        out only some of them would break the compile, so a release that renamed one gets the full
        headers (slower, still correct)."""
        return _collective_guards(self.include_dir)


def _guarded_by(header: Path, guard: str) -> bool:
    try:
        text = header.read_text(errors="replace")
    except OSError:
        return False
    return re.search(rf"^#\s*ifndef\s+{guard}\s*\n#\s*define\s+{guard}\b", text, re.MULTILINE) is not None


@functools.cache
def _collective_guards(include_dir: Path) -> tuple[str, ...]:
    if all(_guarded_by(include_dir / header, guard) for header, guard in COLLECTIVE_HEADER_GUARDS):
        return tuple(guard for _, guard in COLLECTIVE_HEADER_GUARDS)
    return ()


@dataclass(frozen=True)
class Toolchain:
    """Versions and include directories of the compile pipeline."""

    nvrtc_version: tuple[int, int]
    nvjitlink_version: tuple[int, int]
    cudart_include: Path
    cccl_include: Path
    cudart_header_version: int
    cccl_header_version: int


@functools.cache
def toolchain() -> Toolchain:
    """The NVRTC/nvJitLink pipeline of this process (cached: it cannot change while running)."""
    pathfinder = _deps.pathfinder()
    from cuda.bindings import nvjitlink, nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise MissingDependencyError("NVRTC could not be loaded: pip install 'cuep[cu13]' (nvidia-cuda-nvrtc)")
    try:
        link_major, link_minor = nvjitlink.version()
    except Exception as exc:  # the binding raises its own error type when the library is absent
        raise MissingDependencyError(
            f"nvJitLink could not be loaded ({exc}): pip install 'cuep[cu13]' (nvidia-nvjitlink)") from exc
    headers = {}
    for name, package in (("cudart", "nvidia-cuda-runtime"), ("cccl", "nvidia-cuda-cccl")):
        found = pathfinder.find_nvidia_header_directory(name)
        if found is None:
            raise MissingDependencyError(f"the CUDA {name} headers were not found: pip install {package}")
        headers[name] = Path(found)
    return Toolchain(
        nvrtc_version=(major, minor), nvjitlink_version=(link_major, link_minor),
        cudart_include=headers["cudart"], cccl_include=headers["cccl"],
        cudart_header_version=_read_define(headers["cudart"] / "cuda_runtime_api.h", "CUDART_VERSION"),
        cccl_header_version=_read_define(headers["cccl"] / "cuda/std/__cccl/version.h", "CCCL_VERSION"),
    )


def host_library_version(library: Path) -> tuple[int, int, int]:
    """The release a ``libnvshmem_host.so`` reports through ``nvshmemx_vendor_get_version_info``."""
    lib = ctypes.CDLL(str(library))
    major, minor, patch = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    lib.nvshmemx_vendor_get_version_info(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(patch))
    return major.value, minor.value, patch.value


def check_nvshmem(root: Path, host_version: tuple[int, int, int]) -> Nvshmem:
    """Refuse an NVSHMEM root whose headers, device library and host library disagree or are too old."""
    version_header = root / "include" / "non_abi" / "nvshmem_version.h"
    if not version_header.is_file():
        raise MissingDependencyError(f"NVSHMEM headers are missing under {root / 'include'}: {_NVSHMEM_PIP}")
    header_version = tuple(_read_define(version_header, f"NVSHMEM_VENDOR_{part}_VERSION")
                           for part in ("MAJOR", "MINOR", "PATCH"))
    if header_version != host_version:
        raise MissingDependencyError(
            f"NVSHMEM headers ({'.'.join(map(str, header_version))}, {root / 'include'}) and the loaded host "
            f"library ({'.'.join(map(str, host_version))}) are different releases; install one NVSHMEM: "
            f"{_NVSHMEM_PIP}")
    if header_version < MIN_NVSHMEM_VERSION:
        raise MissingDependencyError(
            f"NVSHMEM {'.'.join(map(str, header_version))} at {root} is too old (NVRTC compiles NVSHMEM >= "
            f"3.5.21): {_NVSHMEM_PIP}")
    nvshmem = Nvshmem(root=root, version=header_version)
    if not nvshmem.device_library.is_file():
        raise MissingDependencyError(f"{nvshmem.device_library} is missing: {_NVSHMEM_PIP}")
    return nvshmem


@functools.cache
def nvshmem() -> Nvshmem:
    """The NVSHMEM release whose host library this process loads (loading it if nothing has yet)."""
    pathfinder = _deps.pathfinder()
    try:
        loaded = pathfinder.load_nvidia_dynamic_lib("nvshmem_host")
    except Exception as exc:
        raise MissingDependencyError(f"the NVSHMEM host library could not be loaded ({exc}): {_NVSHMEM_PIP}") from exc
    library = Path(loaded.abs_path).resolve()
    return check_nvshmem(library.parent.parent, host_library_version(library))
