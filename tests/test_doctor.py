"""``python -m cuep doctor`` against fixture hosts (a fake ``/proc``, ``/sys`` and ``/dev`` under a temporary
root), and the error every rank raises when NVSHMEM cannot start. No GPU, NIC or driver needed."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest

from cuep import doctor
from cuep.doctor import checks
from cuep.doctor.host import read_host
from cuep.errors import CuepError

GPU_ADDRESS = "0000:1a:00.0"
ROOT_COMPLEX = "devices/pci0000:17"
SWITCH = f"{ROOT_COMPLEX}/0000:17:01.0/0000:18:00.0"  # a root port, then a PCIe switch's upstream port
GPU_PATH = f"{SWITCH}/0000:19:08.0/{GPU_ADDRESS}"
OPEN_DRIVER = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build"
PROPRIETARY_DRIVER = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Release Build"
IBGDA_PARAMS = 'EnableStreamMemOPs: 1\nRegistryDwords: "PeerMappingOverride=1;"\n'
ROCE_V2_GID = "0000:0000:0000:0000:0000:ffff:0a00:0001"
EVERY_LIBRARY = dict.fromkeys(("ibverbs", "mlx5", "ucp", "fabric"), True)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)


class FakeHost:
    """A host tree under ``root``: a GPU behind a PCIe switch on NUMA node 0, an NVIDIA driver, and what
    each test adds (NICs, kernel modules, GDRCopy)."""

    def __init__(self, root: Path, driver: str | None = OPEN_DRIVER, params: str = IBGDA_PARAMS,
                 kernel: str = "6.8.0-45-generic"):
        self.root = root
        self.libraries = dict(EVERY_LIBRARY)
        self.memlock = -1
        if driver is not None:
            _write(root / "proc/driver/nvidia/version", driver + "\nGCC version: gcc 12\n")
            _write(root / "proc/driver/nvidia/params", params)
        _write(root / "proc/sys/kernel/osrelease", kernel)
        _write(root / "proc/modules", "nvidia 1 0 - Live 0x0\n")
        gpu = root / "sys" / GPU_PATH
        _write(gpu / "vendor", "0x10de")
        _write(gpu / "class", "0x030200")
        _write(gpu / "numa_node", "0")
        _link(root / "sys/bus/pci/devices" / GPU_ADDRESS, gpu)

    def load_module(self, name: str) -> None:
        (self.root / "sys/module" / name).mkdir(parents=True)

    def add_gdrcopy(self) -> None:
        _write(self.root / "dev/gdrdrv", "")

    def add_nic(self, name: str, driver: str, pci_path: str = f"{SWITCH}/0000:19:10.0/0000:1c:00.0",
                numa_node: int = 0, state: str = "4: ACTIVE", link_layer: str = "InfiniBand",
                gids: dict[int, tuple[str, str]] | None = None) -> None:
        """An RDMA device with one port; ``gids``: index -> (GID, type)."""
        function = self.root / "sys" / pci_path
        _write(function / "numa_node", str(numa_node))
        (self.root / "sys/bus/pci/drivers" / driver).mkdir(parents=True, exist_ok=True)
        _link(function / "driver", self.root / "sys/bus/pci/drivers" / driver)
        device = self.root / "sys/class/infiniband" / name
        _link(device / "device", function)
        port = device / "ports/1"
        _write(port / "state", state)
        _write(port / "link_layer", link_layer)
        for index, (gid, kind) in (gids or {0: ("fe80:0000:0000:0000:0000:0000:0000:0001", "IB")}).items():
            _write(port / "gids" / str(index), gid)
            _write(port / "gid_attrs/types" / str(index), kind)
        _write(port / "gids/7", "0000:0000:0000:0000:0000:0000:0000:0000")  # an empty slot, as the kernel lists

    def facts(self, environ: dict | None = None):
        return read_host(self.root, environ or {}, memlock_bytes=lambda: self.memlock,
                         find_library=lambda name: self.libraries[name],
                         nvshmem=lambda: ("3.8.0", frozenset(checks.TRANSPORTS), None), peer_access=lambda: None)


def _verdicts(facts, transport: str) -> dict[str, str]:
    return {check.name: check.verdict for check in checks.transport_checks(facts, transport)}


def _report(host: FakeHost, transports=checks.TRANSPORTS, environ: dict | None = None) -> tuple[str, int]:
    environ = environ or {}
    return doctor.report(host.facts(environ), tuple(transports), environ)


@pytest.fixture
def host(tmp_path):
    return FakeHost(tmp_path / "host")


def test_no_nic_fails_every_transport_and_says_one_host_works(host):
    facts = host.facts()
    assert facts.rdma_devices == () and [g.address for g in facts.gpus] == [GPU_ADDRESS]
    for transport in checks.TRANSPORTS:
        assert _verdicts(facts, transport)["NICs"] == checks.FAIL, transport
    text, status = _report(host)
    assert "no RDMA device in /sys/class/infiniband" in text
    assert "one host: can work" in text and "NVSHMEM_REMOTE_TRANSPORT=none" in text
    assert status == 0  # nothing asked for a network transport
    assert _report(host, ("ibgda",))[1] == 1
    assert _report(host, environ={"NVSHMEM_REMOTE_TRANSPORT": "ibgda"})[1] == 1
    assert _report(host, environ={"NVSHMEM_IB_ENABLE_IBGDA": "1"})[1] == 1
    assert _report(host, environ={"NVSHMEM_REMOTE_TRANSPORT": "none"})[1] == 0


def test_mlx5_with_peermem_serves_ibgda(host):
    host.add_nic("mlx5_0", "mlx5_core")
    host.load_module("nvidia_peermem")
    host.add_gdrcopy()
    facts = host.facts()
    verdicts = _verdicts(facts, "ibgda")
    assert set(verdicts.values()) == {checks.OK}, verdicts
    affinity = next(c for c in checks.transport_checks(facts, "ibgda") if c.name == "GPU-NIC affinity")
    assert affinity.found == f"{GPU_ADDRESS} -> mlx5_0 (PCIe switch)"
    text, status = _report(host, ("ibgda",))
    assert status == 0 and "ibgda: can work here" in text and "[FAIL]" not in text
    assert _verdicts(facts, "ibrc")["NICs"] == checks.OK
    assert _verdicts(facts, "libfabric")["NICs"] == checks.FAIL  # libfabric wants EFA or Slingshot


def test_mlx5_without_peermem_needs_dmabuf(tmp_path):
    proprietary = FakeHost(tmp_path / "proprietary", driver=PROPRIETARY_DRIVER)
    proprietary.add_nic("mlx5_0", "mlx5_core")
    gpudirect = next(c for c in checks.transport_checks(proprietary.facts(), "ibgda") if c.name == "GPUDirect RDMA")
    assert gpudirect.verdict == checks.FAIL and "proprietary kernel module" in gpudirect.found
    assert "modprobe nvidia_peermem" in gpudirect.change
    assert _report(proprietary, ("ibgda",))[1] == 1
    open_module = FakeHost(tmp_path / "open", driver=OPEN_DRIVER, kernel="6.8.0-45-generic")
    open_module.add_nic("mlx5_0", "mlx5_core")
    assert _verdicts(open_module.facts(), "ibgda")["GPUDirect RDMA"] == checks.OK  # dma-buf
    old_kernel = FakeHost(tmp_path / "old", driver=OPEN_DRIVER, kernel="5.4.0-150-generic")
    old_kernel.add_nic("mlx5_0", "mlx5_core")
    assert _verdicts(old_kernel.facts(), "ibgda")["GPUDirect RDMA"] == checks.FAIL


def test_ibgda_needs_the_driver_parameters(tmp_path):
    host = FakeHost(tmp_path / "host", params='EnableStreamMemOPs: 0\nRegistryDwords: ""\n')
    host.add_nic("mlx5_0", "mlx5_core")
    host.load_module("nvidia_peermem")
    host.add_gdrcopy()
    facts = host.facts()
    params = next(c for c in checks.transport_checks(facts, "ibgda") if c.name == "driver parameters")
    assert params.verdict == checks.FAIL and "EnableStreamMemOPs=0" in params.found
    assert "NVreg_EnableStreamMemOPs=1" in params.change and "PeerMappingOverride=1" in params.change
    assert checks.can_work(checks.transport_checks(facts, "ibrc"))  # the proxy transports do without them
    assert not checks.can_work(checks.transport_checks(facts, "ibgda"))


def test_roce_port_needs_a_v2_gid(tmp_path):
    cases = {"v2": ({3: (ROCE_V2_GID, "RoCE v2")}, checks.OK),
             "v1": ({0: ("fe80:0000:0000:0000:0000:0000:0000:0002", "IB/RoCE v1")}, checks.WARN),
             "none": ({}, checks.FAIL)}
    for name, (gids, verdict) in cases.items():
        host = FakeHost(tmp_path / name)
        host.add_nic("mlx5_0", "mlx5_core", link_layer="Ethernet", gids=gids)
        if not gids:  # the kernel lists only empty GID slots on a port without an address
            for path in (host.root / "sys/class/infiniband/mlx5_0/ports/1/gids").iterdir():
                path.write_text("0000:0000:0000:0000:0000:0000:0000:0000")
        roce = next(c for c in checks.transport_checks(host.facts(), "ibrc") if c.name == "RoCE GIDs")
        assert roce.verdict == verdict, (name, roce)
    host = FakeHost(tmp_path / "described")
    host.add_nic("mlx5_2", "mlx5_core", link_layer="Ethernet", gids={3: (ROCE_V2_GID, "RoCE v2")})
    nics = next(c for c in checks.transport_checks(host.facts(), "ibrc") if c.name == "NICs")
    assert nics.found == "mlx5_2 (mlx5; port 1 ACTIVE RoCE)"


def test_efa_serves_libfabric_only(host):
    host.add_nic("rdmap16s27", "efa", link_layer="Unknown")
    host.load_module("nvidia_peermem")
    host.add_gdrcopy()
    facts = host.facts()
    assert facts.rdma_devices[0].kind == "efa"
    assert checks.can_work(checks.transport_checks(facts, "libfabric"))
    for transport in ("ibgda", "ibrc", "ucx"):
        assert _verdicts(facts, transport)["NICs"] == checks.FAIL, transport
    host.libraries["fabric"] = False
    assert _verdicts(host.facts(), "libfabric")["user-space libraries"] == checks.FAIL


def test_down_port_missing_gdrcopy_small_memlock_and_far_nic(host):
    host.add_nic("mlx5_0", "mlx5_core", state="1: DOWN")
    assert _verdicts(host.facts(), "ibrc")["NICs"] == checks.FAIL
    host.add_nic("mlx5_1", "mlx5_core", pci_path="devices/pci0000:97/0000:97:01.0/0000:98:00.0", numa_node=1)
    host.memlock = 64 << 10
    facts = host.facts()
    verdicts = _verdicts(facts, "ucx")
    assert verdicts["NICs"] == checks.OK and verdicts["GDRCopy"] == checks.FAIL
    assert _verdicts(facts, "ibrc")["GDRCopy"] == checks.WARN and verdicts["memlock limit"] == checks.WARN
    affinity = next(c for c in checks.transport_checks(facts, "ibrc") if c.name == "GPU-NIC affinity")
    assert affinity.verdict == checks.WARN and "across NUMA nodes" in affinity.found
    assert "NVSHMEM_HCA_LIST" in affinity.change


def test_no_driver_is_a_host_failure(tmp_path):
    host = FakeHost(tmp_path / "host", driver=None)
    text, status = _report(host, environ={"CUEP_TIMEOUT_S": "30"})
    assert status == 1 and "[FAIL] NVIDIA driver" in text and "one host: cannot work" in text
    assert "CUEP_TIMEOUT_S=30" in text
    assert "GPU peer access" in text.splitlines()[-1]  # said as not checked, not guessed


@pytest.mark.parametrize("environ, transport", [
    ({}, "ibrc"), ({"NVSHMEM_REMOTE_TRANSPORT": "UCX"}, "ucx"), ({"NVSHMEM_IB_ENABLE_IBGDA": "1"}, "ibgda"),
    ({"NVSHMEM_REMOTE_TRANSPORT": "ibrc", "NVSHMEM_IB_ENABLE_IBGDA": "true"}, "ibgda"),
    ({"NVSHMEM_REMOTE_TRANSPORT": "none"}, "none")])
def test_requested_transport(environ, transport):
    assert checks.requested_transport(environ) == transport


def test_start_error_names_the_transport_and_the_causes(host):
    environ = {"NVSHMEM_REMOTE_TRANSPORT": "ibgda"}
    message = doctor.start_error_message(3, RuntimeError("Status code 7"), environ, host.facts(environ))
    assert message.startswith("rank 3: NVSHMEM could not start (RuntimeError: Status code 7)")
    assert "NVSHMEM_REMOTE_TRANSPORT=ibgda (NVSHMEM_IB_ENABLE_IBGDA unset)" in message
    assert "NICs: no RDMA device in /sys/class/infiniband" in message
    assert "`python -m cuep doctor --transport ibgda`" in message and "NVSHMEM_REMOTE_TRANSPORT=none" in message
    # With no transport asked for, a missing NIC is no cause: NVSHMEM's defaults work on one host.
    message = doctor.start_error_message(0, RuntimeError("Status code 2"), {}, host.facts())
    assert "NVSHMEM used its defaults" in message and "NICs" not in message
    assert "The doctor finds nothing wrong with this host" in message and "`python -m cuep doctor`" in message


class _FakeStart:
    """init_world's dependencies with a simulated NVSHMEM whose ``init`` fails (or records that it ran),
    and a group of ``num_ranks`` whose other ranks' ``allgather`` values are given."""

    class NvshmemError(Exception):
        pass

    def __init__(self, monkeypatch, host: FakeHost, environ: dict[str, str], others: dict[int, str] | None = None):
        from cuep.runtime import world
        self.world, self.inits, self.others = world, [], others or {}
        device = types.SimpleNamespace(set_current=lambda: None, use=lambda: None)
        unique_id = types.SimpleNamespace(_data=np.zeros(128, np.uint8))
        fake_nvshmem = types.SimpleNamespace(get_unique_id=lambda empty: unique_id, init=self._init)
        monkeypatch.setattr(world._deps, "cupy", lambda: types.SimpleNamespace(cuda=types.SimpleNamespace(
            Device=lambda _: device)))
        monkeypatch.setattr(world._deps, "cuda_core", lambda: types.SimpleNamespace(Device=lambda _: device))
        monkeypatch.setattr(world._deps, "nvshmem", lambda: fake_nvshmem)
        monkeypatch.setattr(world, "_world", None)
        monkeypatch.setattr(doctor, "read_host", lambda environ: host.facts(environ))
        # The transport the test chooses, and every variable cuep sets when the user has not (world's own lists).
        for name in ("NVSHMEM_REMOTE_TRANSPORT", "NVSHMEM_IB_ENABLE_IBGDA", "NVSHMEM_SYMMETRIC_SIZE",
                     world.IBGDA_QPS_VARIABLE, *world.NVSHMEM_DEFAULTS, *world.ONE_HOST_GRANULARITY):
            monkeypatch.delenv(name, raising=False)
        for name, value in environ.items():
            monkeypatch.setenv(name, value)

    def _init(self, **_):
        self.inits.append(True)
        raise self.NvshmemError("Status code 7")

    def _allgather(self, value, phase):
        return [self.others.get(0, ""), value]  # this process is rank 1 of 2

    def start(self) -> CuepError:
        from cuep.runtime.topology import Topology
        group = types.SimpleNamespace(broadcast=lambda data, what: data, allgather=self._allgather)
        with pytest.raises(CuepError) as info:
            self.world.init_world(group, Topology(1, 2, 1, 2, 2), 1 << 20, 0, num_qps_per_rank=8)
        assert self.world._world is None
        return info.value


def test_a_failed_nvshmem_start_raises_cuep_error_on_the_rank(monkeypatch, host):
    """init_world, with a simulated NVSHMEM whose init fails, on a host whose NIC and plugin are there."""
    host.add_nic("mlx5_0", "mlx5_core")
    fake = _FakeStart(monkeypatch, host, {"NVSHMEM_REMOTE_TRANSPORT": "ibgda"})
    error = fake.start()
    message = str(error)
    assert message.startswith("rank 1: NVSHMEM could not start (NvshmemError: Status code 7)"), message
    assert "ibgda" in message and "python -m cuep doctor --transport ibgda" in message
    assert isinstance(error.__cause__, _FakeStart.NvshmemError) and fake.inits == [True]
    import os
    assert os.environ["NVSHMEM_IBGDA_NUM_RC_PER_PE"] == "8"  # the Buffer's num_qps_per_rank, as DeepEP sets it


@pytest.mark.parametrize("environ", [{"NVSHMEM_REMOTE_TRANSPORT": "ibgda"}, {"NVSHMEM_IB_ENABLE_IBGDA": "1"}])
def test_an_absent_transport_asked_for_is_refused_before_nvshmem_starts(monkeypatch, host, environ):
    """No NIC here: NVSHMEM would start over P2P without the transport asked for. Every rank refuses."""
    fake = _FakeStart(monkeypatch, host, environ)
    message = str(fake.start())
    assert fake.inits == []  # refused before NVSHMEM's init
    assert message.startswith("rank 1: NVSHMEM was not started: "), message
    assert checks.transport_settings(environ) + " asks for the ibgda transport, which cannot work here" in message
    assert "rank 1: NICs: no RDMA device in /sys/class/infiniband" in message
    assert "NVSHMEM_REMOTE_TRANSPORT=none" in message and "`python -m cuep doctor --transport ibgda`" in message


def test_a_rank_whose_host_lacks_the_transport_stops_every_rank(monkeypatch, host):
    """This rank's host has the NIC; rank 0's has none: this rank refuses too, naming rank 0's cause."""
    host.add_nic("mlx5_0", "mlx5_core")
    fake = _FakeStart(monkeypatch, host, {"NVSHMEM_REMOTE_TRANSPORT": "ibgda"}, others={0: "NICs: none"})
    message = str(fake.start())
    assert fake.inits == [] and "(rank 0: NICs: none)" in message, message


def test_no_transport_asked_for_starts_as_before(monkeypatch, host):
    """Nothing named: no refusal (NVSHMEM's defaults work on one host), so NVSHMEM's own init runs."""
    fake = _FakeStart(monkeypatch, host, {"NVSHMEM_REMOTE_TRANSPORT": "none"})
    assert str(fake.start()).startswith("rank 1: NVSHMEM could not start") and fake.inits == [True]


def test_cli_doctor(monkeypatch, capsys, host):
    from cuep import cli
    monkeypatch.setattr(doctor, "read_host", lambda environ: host.facts(environ))
    for name in ("NVSHMEM_REMOTE_TRANSPORT", "NVSHMEM_IB_ENABLE_IBGDA"):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["doctor"]) == 0
    assert "ibgda: cannot work here" in capsys.readouterr().out
    assert cli.main(["doctor", "--transport", "ibgda"]) == 1
    with pytest.raises(SystemExit):
        cli.main(["doctor", "--transport", "tcp"])
