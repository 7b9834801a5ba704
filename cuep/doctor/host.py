"""What this host offers NVSHMEM's transports, read from ``/proc``, ``/sys``, ``/dev`` and the process.

Everything is read under a root directory (``/`` on a real host, a fixture tree in tests), and nothing
here needs a GPU, a CUDA context or root. What cannot be read is recorded as unknown (``None``), so that
the checks can say what they could not check instead of guessing.
"""

from __future__ import annotations

import ctypes.util
import os
import re
import resource
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

NVIDIA_VENDOR = "0x10de"
_GPU_CLASSES = ("0x0300", "0x0302")  # VGA and 3D controllers; the class file holds 0x030200 for a data-centre GPU
_EMPTY_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
# Shared libraries the transport plugins load: rdma-core's libibverbs (IBRC, UCX, IBGDA) and libmlx5 (IBGDA),
# UCX's libucp, libfabric's libfabric.
RDMA_LIBRARIES = ("ibverbs", "mlx5", "ucp", "fabric")
# The variables that decide NVSHMEM's transport and cuep's behaviour, listed by the doctor.
VARIABLE_PREFIXES = ("NVSHMEM_", "CUEP_")


@dataclass(frozen=True)
class Port:
    """One port of an RDMA device (``/sys/class/infiniband/<device>/ports/<number>``)."""

    number: int
    state: str                  # "ACTIVE", "DOWN", "INIT", ... (the text after "4: ")
    link_layer: str             # "InfiniBand" or "Ethernet" (RoCE)
    gids: tuple[tuple[int, str], ...] = ()  # (index, type) of each non-empty GID; type "IB", "RoCE v1", "RoCE v2"

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"

    @property
    def is_roce(self) -> bool:
        return self.link_layer == "Ethernet"


@dataclass(frozen=True)
class RdmaDevice:
    """An RDMA device: its name (``mlx5_0``), its kernel driver (``mlx5_core``, ``efa``, ...), its PCI
    function's path under ``/sys/devices`` and NUMA node (``None`` when unknown), and its ports."""

    name: str
    driver: str
    pci_path: str | None
    numa_node: int | None
    ports: tuple[Port, ...]

    @property
    def kind(self) -> str:
        """``mlx5``, ``efa``, ``bnxt_re``, ``irdma``, ...: the driver family, which decides the transports."""
        if self.driver.startswith("mlx5") or self.name.startswith("mlx5"):
            return "mlx5"
        if self.driver == "efa" or self.name.startswith(("efa", "rdmap")):
            return "efa"
        return self.driver or re.sub(r"_?\d+$", "", self.name)


@dataclass(frozen=True)
class Gpu:
    """An NVIDIA GPU on the PCI bus: its address (``0000:18:00.0``), path under ``/sys/devices`` and NUMA node."""

    address: str
    pci_path: str
    numa_node: int | None


@dataclass
class HostFacts:
    """Everything the checks look at. ``None`` means "could not be read here"."""

    driver_version: str | None = None          # /proc/driver/nvidia/version's first line; None: no driver
    driver_params: dict[str, str] = field(default_factory=dict)  # /proc/driver/nvidia/params
    kernel_release: str | None = None
    modules: frozenset[str] = frozenset()      # loaded kernel modules
    rdma_devices: tuple[RdmaDevice, ...] = ()
    cxi_devices: tuple[str, ...] = ()          # HPE Slingshot NICs (libfabric's cxi provider)
    gdrcopy_device: bool = False               # /dev/gdrdrv
    libraries: dict[str, bool] = field(default_factory=dict)  # RDMA_LIBRARIES -> found by the loader
    memlock_bytes: int | None = None           # the soft RLIMIT_MEMLOCK; -1 unlimited
    gpus: tuple[Gpu, ...] = ()
    peer_access: list[list[bool]] | None = None  # [i][j]: GPU i can map GPU j's memory; None: not checked
    nvshmem_version: str | None = None
    nvshmem_transports: frozenset[str] = frozenset()  # the remote transport plugins NVSHMEM ships
    nvshmem_error: str | None = None           # why NVSHMEM was not found
    variables: dict[str, str] = field(default_factory=dict)  # NVSHMEM_* and CUEP_* in force

    @property
    def open_kernel_module(self) -> bool:
        return self.driver_version is not None and "Open Kernel Module" in self.driver_version


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return None


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _numa(text: str | None) -> int | None:
    node = _int_or_none(text)
    return node if node is not None and node >= 0 else None  # the kernel writes -1 on one-node hosts


def _driver_params(text: str | None) -> dict[str, str]:
    """``Name: value`` lines of ``/proc/driver/nvidia/params``; RegistryDwords keeps its quotes off."""
    params = {}
    for line in (text or "").splitlines():
        name, sep, value = line.partition(":")
        if sep:
            params[name.strip()] = value.strip().strip('"')
    return params


def _ports(device: Path) -> tuple[Port, ...]:
    ports = []
    for port in sorted((device / "ports").glob("*"), key=lambda p: _int_or_none(p.name) or 0):
        number = _int_or_none(port.name)
        if number is None:
            continue
        state = (_read(port / "state") or "unknown").split(":")[-1].strip()
        gids = []
        for gid in sorted((port / "gids").glob("*"), key=lambda p: _int_or_none(p.name) or 0):
            value, index = _read(gid), _int_or_none(gid.name)
            if index is None or not value or value == _EMPTY_GID:
                continue
            kind = _read(port / "gid_attrs" / "types" / gid.name) or "IB"
            gids.append((index, "RoCE v2" if "v2" in kind.lower() else kind))
        ports.append(Port(number, state, _read(port / "link_layer") or "unknown", tuple(gids)))
    return tuple(ports)


def _pci_function(path: Path) -> tuple[str | None, int | None]:
    """The resolved ``/sys/devices/...`` path of a device link and its NUMA node."""
    if not path.exists():
        return None, None
    return str(path.resolve()), _numa(_read(path / "numa_node"))


def _rdma_devices(root: Path) -> tuple[RdmaDevice, ...]:
    devices = []
    for device in sorted((root / "sys/class/infiniband").glob("*")):
        driver_link = device / "device" / "driver"
        driver = driver_link.resolve().name if driver_link.exists() else ""
        pci_path, numa_node = _pci_function(device / "device")
        devices.append(RdmaDevice(device.name, driver, pci_path, numa_node, _ports(device)))
    return tuple(devices)


def _gpus(root: Path) -> tuple[Gpu, ...]:
    gpus = []
    for function in sorted((root / "sys/bus/pci/devices").glob("*")):
        if _read(function / "vendor") != NVIDIA_VENDOR:
            continue
        if not (_read(function / "class") or "").startswith(_GPU_CLASSES):
            continue
        pci_path, numa_node = _pci_function(function)
        gpus.append(Gpu(function.name, pci_path or str(function), numa_node))
    return tuple(gpus)


def _modules(root: Path) -> frozenset[str]:
    names = {line.split()[0] for line in (_read(root / "proc/modules") or "").splitlines() if line.strip()}
    names |= {path.name for path in (root / "sys/module").glob("*")}
    return frozenset(names)


def _memlock_bytes() -> int | None:
    try:
        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (OSError, ValueError):
        return None
    return -1 if soft == resource.RLIM_INFINITY else soft


def _find_library(name: str) -> bool:
    return ctypes.util.find_library(name) is not None


def nvshmem_installation() -> tuple[str | None, frozenset[str], str | None]:
    """The installed NVSHMEM's version, the remote transport plugins it ships, and why it was not
    found (``None`` when it was), through the same lookup the compiler uses."""
    from ..jit import toolchain
    try:
        found = toolchain.nvshmem()
    except Exception as exc:  # missing package, or headers and library of different releases
        return None, frozenset(), str(exc)
    plugins = {match.group(1) for path in (found.root / "lib").glob("nvshmem_transport_*.so*")
               if (match := re.match(r"nvshmem_transport_(\w+?)\.so", path.name))}
    return "%d.%d.%d" % found.version, frozenset(plugins), None


def gpu_peer_access() -> list[list[bool]] | None:
    """Whether each visible GPU can map each other's memory (NVLink or PCIe P2P), through CuPy; ``None``
    where no GPU is visible or CuPy is absent."""
    try:
        from .. import _deps
        runtime = _deps.cupy().cuda.runtime
        count = runtime.getDeviceCount()
    except Exception:  # no CuPy, no driver, or no GPU: the check says it could not look
        return None
    if count == 0:
        return None
    return [[i == j or bool(runtime.deviceCanAccessPeer(i, j)) for j in range(count)] for i in range(count)]


def read_host(root: Path | str = "/", environ: Mapping[str, str] | None = None, *,
              memlock_bytes: Callable[[], int | None] = _memlock_bytes,
              find_library: Callable[[str], bool] = _find_library,
              nvshmem: Callable[[], tuple[str | None, frozenset[str], str | None]] = nvshmem_installation,
              peer_access: Callable[[], list[list[bool]] | None] = gpu_peer_access) -> HostFacts:
    """The facts of the host whose ``/proc``, ``/sys`` and ``/dev`` lie under ``root``. The process-wide
    facts (memlock limit, loader, NVSHMEM, GPU peer access) come from the callables, which tests replace."""
    root = Path(root)
    environ = os.environ if environ is None else environ
    version_text = _read(root / "proc/driver/nvidia/version")
    nvshmem_version, transports, nvshmem_error = nvshmem()
    return HostFacts(
        driver_version=version_text.splitlines()[0] if version_text else None,
        driver_params=_driver_params(_read(root / "proc/driver/nvidia/params")),
        kernel_release=_read(root / "proc/sys/kernel/osrelease"),
        modules=_modules(root),
        rdma_devices=_rdma_devices(root),
        cxi_devices=tuple(sorted(path.name for path in (root / "sys/class/cxi").glob("*"))),
        gdrcopy_device=(root / "dev/gdrdrv").exists(),
        libraries={name: find_library(name) for name in RDMA_LIBRARIES},
        memlock_bytes=memlock_bytes(),
        gpus=_gpus(root),
        peer_access=peer_access(),
        nvshmem_version=nvshmem_version,
        nvshmem_transports=transports,
        nvshmem_error=nvshmem_error,
        variables={name: value for name, value in sorted(environ.items()) if name.startswith(VARIABLE_PREFIXES)},
    )
