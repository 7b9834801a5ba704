"""The doctor's verdicts: what each NVSHMEM remote transport needs, checked against :class:`HostFacts`.

Each check gives one :class:`Check`: ok, warn (works, but slower or fragile), fail (the transport cannot
work) or unchecked (the fact could not be read here), what it found, and what to change. A transport
can work on this host when none of its checks fails.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePath

from .host import Gpu, HostFacts, RdmaDevice

OK, WARN, FAIL, UNCHECKED = "ok", "warn", "fail", "unchecked"
TRANSPORTS = ("ibgda", "ibrc", "ucx", "libfabric")
DEFAULT_TRANSPORT = "ibrc"  # NVSHMEM's, when NVSHMEM_REMOTE_TRANSPORT is unset
_VERBS_TRANSPORTS = ("ibgda", "ibrc", "ucx")
_MIN_DMABUF_KERNEL = (5, 12)  # dma-buf import of GPU memory by RDMA drivers
_IBGDA_DRIVER_FIX = ('add `options nvidia NVreg_EnableStreamMemOPs=1 NVreg_RegistryDwords="PeerMappingOverride=1;"` '
                     'to /etc/modprobe.d/nvidia.conf, rebuild the initramfs and reboot')
_TRUE = ("1", "true", "yes", "on", "y", "t")  # what NVSHMEM reads as true in a boolean variable


@dataclass(frozen=True)
class Check:
    """One line of the doctor's report."""

    name: str
    verdict: str
    found: str
    change: str = ""


def _ibgda_enabled(environ: Mapping[str, str]) -> bool:
    return environ.get("NVSHMEM_IB_ENABLE_IBGDA", "").strip().lower() in _TRUE


def requested_transport(environ: Mapping[str, str]) -> str:
    """The remote transport NVSHMEM will try: ``ibgda`` with ``NVSHMEM_IB_ENABLE_IBGDA`` set, else
    ``NVSHMEM_REMOTE_TRANSPORT`` (``none`` for one host), else NVSHMEM's default, ``ibrc``."""
    if _ibgda_enabled(environ):
        return "ibgda"
    chosen = environ.get("NVSHMEM_REMOTE_TRANSPORT", "").strip().lower()
    return chosen or DEFAULT_TRANSPORT


def explicit_transport(environ: Mapping[str, str]) -> str | None:
    """:func:`requested_transport` where the environment names one, ``None`` where NVSHMEM would fall back
    to its default (which, with no NIC, leaves a single host working over P2P)."""
    named = "NVSHMEM_REMOTE_TRANSPORT" in environ or _ibgda_enabled(environ)
    return requested_transport(environ) if named else None


def transport_settings(environ: Mapping[str, str]) -> str:
    """How the environment asks for a transport, in words, e.g. ``NVSHMEM_REMOTE_TRANSPORT=ibgda
    (NVSHMEM_IB_ENABLE_IBGDA unset)``."""
    parts = [f"{name}={environ[name]}" if name in environ else f"{name} unset"
             for name in ("NVSHMEM_REMOTE_TRANSPORT", "NVSHMEM_IB_ENABLE_IBGDA")]
    return f"{parts[0]} ({parts[1]})"


# ------------------------------------------------------------------------------------------------
# Host checks: what every job needs, one host or many.
def _driver(f: HostFacts) -> Check:
    if f.driver_version is None:
        return Check("NVIDIA driver", FAIL, "no driver loaded (/proc/driver/nvidia is missing)",
                     "install the NVIDIA driver (and run on a machine with an NVIDIA GPU)")
    return Check("NVIDIA driver", OK, f.driver_version)


def _nvshmem(f: HostFacts) -> Check:
    if f.nvshmem_version is None:
        return Check("NVSHMEM", FAIL, f"not usable: {f.nvshmem_error}", "pip install 'cuep[cu13]' (or cu12)")
    shipped = " ".join(sorted(f.nvshmem_transports)) or "none"
    return Check("NVSHMEM", OK, f"{f.nvshmem_version}; remote transports shipped: {shipped}")


def _gpus(f: HostFacts) -> Check:
    if not f.gpus:
        return Check("GPUs", FAIL, "no NVIDIA GPU on the PCI bus (/sys/bus/pci/devices)",
                     "run on a machine with an NVIDIA GPU")
    listed = ", ".join(f"{g.address} (NUMA {'?' if g.numa_node is None else g.numa_node})" for g in f.gpus)
    return Check("GPUs", OK, f"{len(f.gpus)}: {listed}")


def _peer_access(f: HostFacts) -> Check:
    if f.peer_access is None:
        return Check("GPU peer access", UNCHECKED, "no GPU visible to this process (needs CuPy and the driver)")
    blocked = [(i, j) for i, row in enumerate(f.peer_access) for j, can in enumerate(row) if i < j and not can]
    count = len(f.peer_access)
    if blocked:
        pairs = ", ".join(f"{i}-{j}" for i, j in blocked)
        return Check("GPU peer access", WARN, f"GPUs {pairs} cannot map each other's memory",
                     "enable NVLink or PCIe peer-to-peer between them (IOMMU/ACS settings); until then NVSHMEM "
                     "reaches those ranks through its remote transport")
    return Check("GPU peer access", OK, f"every pair of the {count} visible GPUs (NVLink or PCIe P2P)")


def _one_host(f: HostFacts) -> Check:
    if f.driver_version is None or f.nvshmem_version is None:
        return Check("one host", FAIL, "ranks cannot start: see the driver and NVSHMEM lines")
    return Check("one host", OK, "ranks on this host reach each other directly (NVLink or PCIe); a single-host "
                 "job needs no NIC (NVSHMEM_REMOTE_TRANSPORT=none)")


def _variables(f: HostFacts) -> Check:
    if not f.variables:
        return Check("variables", OK, "no NVSHMEM_* or CUEP_* variable set (NVSHMEM's defaults: remote transport "
                     f"{DEFAULT_TRANSPORT})")
    return Check("variables", OK, ", ".join(f"{name}={value}" for name, value in f.variables.items()))


def host_checks(f: HostFacts) -> list[Check]:
    """What every job on this host needs, whatever the transport."""
    return [_driver(f), _nvshmem(f), _gpus(f), _peer_access(f), _one_host(f), _variables(f)]


# ------------------------------------------------------------------------------------------------
# Transport checks.
def usable_nics(f: HostFacts, transport: str) -> list[str]:
    """The NICs (with an active port) that ``transport`` can use here."""
    if transport == "libfabric":
        return [d.name for d in f.rdma_devices if d.kind == "efa" and any(p.active for p in d.ports)] \
            + list(f.cxi_devices)
    wanted = (lambda d: d.kind == "mlx5") if transport == "ibgda" else (lambda d: d.kind != "efa")
    return [d.name for d in f.rdma_devices if wanted(d) and any(p.active for p in d.ports)]


def _describe_devices(f: HostFacts) -> str:
    if not f.rdma_devices and not f.cxi_devices:
        return "no RDMA device in /sys/class/infiniband"
    described = []
    for d in f.rdma_devices:
        ports = ", ".join(f"port {p.number} {p.state} {'RoCE' if p.is_roce else p.link_layer}" for p in d.ports)
        described.append(f"{d.name} ({d.kind}{'; ' + ports if ports else ''})")
    return "; ".join(described + [f"{name} (cxi)" for name in f.cxi_devices])


def _nics(f: HostFacts, transport: str) -> Check:
    found = _describe_devices(f)
    if usable_nics(f, transport):
        return Check("NICs", OK, found)
    need = {"ibgda": "an NVIDIA (Mellanox) ConnectX NIC, mlx5, with an ACTIVE port",
            "ibrc": "an InfiniBand or RoCE NIC with an ACTIVE port",
            "ucx": "an InfiniBand or RoCE NIC with an ACTIVE port (over TCP NVSHMEM's remote atomics fail)",
            "libfabric": "an EFA or Slingshot (cxi) NIC with an ACTIVE port"}[transport]
    fix = f"{transport} needs {need}; bring the port up (ibstat, the subnet manager, cabling) or pick another transport"
    if not f.rdma_devices and not f.cxi_devices:
        fix += "; on a single host set NVSHMEM_REMOTE_TRANSPORT=none"
    return Check("NICs", FAIL, found, fix)


def _roce_gids(f: HostFacts, transport: str) -> Check | None:
    names = set(usable_nics(f, transport))
    ports = [(d.name, p) for d in f.rdma_devices if d.name in names for p in d.ports if p.active and p.is_roce]
    if not ports:
        return None
    found, missing, only_v1 = [], [], []
    for name, port in ports:
        v2 = [index for index, kind in port.gids if kind == "RoCE v2"]
        if v2:
            found.append(f"{name}:{port.number} RoCE v2 GID index {v2[0]}")
        elif port.gids:
            only_v1.append(f"{name}:{port.number}")
        else:
            missing.append(f"{name}:{port.number}")
    if missing and not found and not only_v1:
        return Check("RoCE GIDs", FAIL, f"no GID on {', '.join(missing)}",
                     "give the port's network interface an IP address (RoCE addresses peers by GID)")
    if missing or only_v1:
        return Check("RoCE GIDs", WARN, "; ".join(found + [f"{p}: RoCE v1 GIDs only" for p in only_v1]
                                                  + [f"{p}: no GID" for p in missing]),
                     "give every port an IPv4/IPv6 address for a RoCE v2 GID, and set NVSHMEM_IB_GID_INDEX "
                     "to it where NVSHMEM picks another")
    return Check("RoCE GIDs", OK, "; ".join(found))


def _kernel_at_least(release: str | None, wanted: tuple[int, int]) -> bool:
    try:
        major, minor = (int(part) for part in (release or "").split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= wanted


def _gpudirect(f: HostFacts) -> Check:
    if "nvidia_peermem" in f.modules:
        return Check("GPUDirect RDMA", OK, "nvidia_peermem is loaded")
    if f.open_kernel_module and _kernel_at_least(f.kernel_release, _MIN_DMABUF_KERNEL):
        return Check("GPUDirect RDMA", OK, f"dma-buf: the open kernel module on Linux {f.kernel_release} "
                     "(nvidia_peermem not loaded)")
    found = "nvidia_peermem is not loaded"
    if f.driver_version is None:
        found += " (no NVIDIA driver)"
    elif not f.open_kernel_module:
        found += ", and the proprietary kernel module has no dma-buf export"
    else:
        found += f", and Linux {f.kernel_release or '(version unknown)'} is older than 5.12 (no dma-buf)"
    return Check("GPUDirect RDMA", FAIL, found,
                 "modprobe nvidia_peermem (ships with the driver), or use the open kernel module on Linux >= 5.12 "
                 "for dma-buf, so that the NIC can read and write GPU memory")


def _driver_params(f: HostFacts) -> Check:
    if f.driver_version is None:
        return Check("driver parameters", UNCHECKED, "no NVIDIA driver loaded", _IBGDA_DRIVER_FIX)
    stream_mem_ops = f.driver_params.get("EnableStreamMemOPs")
    registry = f.driver_params.get("RegistryDwords", "")
    peer_mapping = "PeerMappingOverride=1" in registry.replace(" ", "")
    found = f"EnableStreamMemOPs={stream_mem_ops}, RegistryDwords=\"{registry}\""
    if stream_mem_ops == "1" and peer_mapping:
        return Check("driver parameters", OK, found)
    return Check("driver parameters", FAIL, found, _IBGDA_DRIVER_FIX)


def _libraries(f: HostFacts, transport: str) -> Check:
    needed = {"ibgda": ("ibverbs", "mlx5"), "ibrc": ("ibverbs",), "ucx": ("ucp",), "libfabric": ("fabric",)}[transport]
    missing = [name for name in needed if not f.libraries.get(name)]
    names = ", ".join(f"lib{name}" for name in needed)
    if missing:
        package = {"ibverbs": "rdma-core (libibverbs1)", "mlx5": "rdma-core (libmlx5-1)", "ucp": "UCX (libucx0)",
                   "fabric": "libfabric (libfabric1, or the EFA installer)"}
        return Check("user-space libraries", FAIL, f"not found by the loader: {', '.join('lib' + m for m in missing)}",
                     "install " + ", ".join(package[m] for m in missing))
    return Check("user-space libraries", OK, f"{names} found")


def _gdrcopy(f: HostFacts, transport: str) -> Check:
    if f.gdrcopy_device:
        return Check("GDRCopy", OK, "/dev/gdrdrv present")
    if transport == "ucx":
        return Check("GDRCopy", FAIL, "/dev/gdrdrv missing: UCX cannot serve NVSHMEM's remote atomics without it",
                     "install GDRCopy (its gdrdrv kernel module)")
    return Check("GDRCopy", WARN, "/dev/gdrdrv missing: NVSHMEM's proxy thread reads GPU memory the slow way",
                 "install GDRCopy (its gdrdrv kernel module)")


def _memlock(f: HostFacts) -> Check:
    if f.memlock_bytes is None:
        return Check("memlock limit", UNCHECKED, "the limit could not be read")
    if f.memlock_bytes < 0:
        return Check("memlock limit", OK, "unlimited")
    return Check("memlock limit", WARN, f"{f.memlock_bytes // 1024} KiB: registering memory with the NIC may fail",
                 "raise it: `ulimit -l unlimited` (memlock in /etc/security/limits.conf, `--ulimit memlock=-1` "
                 "for containers)")


def _plugin(f: HostFacts, transport: str) -> Check:
    if f.nvshmem_version is None:
        return Check("NVSHMEM plugin", UNCHECKED, "NVSHMEM not found", "see the NVSHMEM line")
    if transport in f.nvshmem_transports:
        return Check("NVSHMEM plugin", OK, f"nvshmem_transport_{transport} shipped with NVSHMEM {f.nvshmem_version}")
    return Check("NVSHMEM plugin", FAIL, f"NVSHMEM {f.nvshmem_version} ships no {transport} transport",
                 "install an NVSHMEM build with it (the nvidia-nvshmem wheels ship ibgda, ibrc, ucx and libfabric)")


def pcie_relation(gpu: Gpu, nic: RdmaDevice) -> str:
    """``"PCIe switch"`` (behind one switch), ``"host bridge"`` (one root complex), ``"NUMA node"`` (other
    root complex, same node), ``"across NUMA nodes"``, or ``"unknown"``."""
    if nic.pci_path is None:
        return "unknown"
    a, b = PurePath(gpu.pci_path).parts, PurePath(nic.pci_path).parts
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    root = next((i for i, part in enumerate(a) if part.startswith("pci")), None)
    if root is not None and common > root:
        return "PCIe switch" if common - root - 1 >= 2 else "host bridge"
    if gpu.numa_node is None or nic.numa_node is None:
        return "unknown"
    return "NUMA node" if gpu.numa_node == nic.numa_node else "across NUMA nodes"


_CLOSENESS = ("PCIe switch", "host bridge", "NUMA node", "unknown", "across NUMA nodes")


def _affinity(f: HostFacts, transport: str) -> Check | None:
    names = set(usable_nics(f, transport))
    nics = [d for d in f.rdma_devices if d.name in names]
    if not nics:
        return None
    if not f.gpus:
        return Check("GPU-NIC affinity", UNCHECKED, "no GPU found on the PCI bus")
    lines, far = [], []
    for gpu in f.gpus:
        relation, nic = min(((pcie_relation(gpu, nic), nic) for nic in nics), key=lambda rn: _CLOSENESS.index(rn[0]))
        lines.append(f"{gpu.address} -> {nic.name} ({relation})")
        if relation == "across NUMA nodes":
            far.append(gpu.address)
    if far:
        return Check("GPU-NIC affinity", WARN, "; ".join(lines),
                     f"GPUs {', '.join(far)} reach a NIC only across the CPUs' interconnect: pin those ranks to "
                     "the NIC's NUMA node, or list the NICs per rank with NVSHMEM_ENABLE_NIC_PE_MAPPING=1 and "
                     "NVSHMEM_HCA_LIST")
    return Check("GPU-NIC affinity", OK, "; ".join(lines))


def transport_checks(f: HostFacts, transport: str) -> list[Check]:
    """What ``transport`` (one of :data:`TRANSPORTS`) needs on this host, in order."""
    checks: list[Check | None] = [_plugin(f, transport), _nics(f, transport), _libraries(f, transport)]
    if transport in _VERBS_TRANSPORTS:
        checks.append(_roce_gids(f, transport))
    checks.append(_gpudirect(f))
    if transport == "ibgda":
        checks.append(_driver_params(f))
    else:
        checks.append(_gdrcopy(f, transport))
    checks += [_memlock(f), _affinity(f, transport)]
    return [check for check in checks if check is not None]


def can_work(checks: list[Check]) -> bool:
    return all(check.verdict != FAIL for check in checks)
