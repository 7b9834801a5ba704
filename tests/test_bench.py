"""The benchmark's host-side decisions (no GPU)."""

import socket
from types import SimpleNamespace

from cuep import _deps, bench


class FakeComm:
    """``allgather`` answers this rank's value followed by the other ranks' given ones."""

    def __init__(self, others):
        self.others = others

    def allgather(self, mine):
        return [mine] + self.others


def test_ranks_on_one_gpu_of_one_host_share_it(monkeypatch):
    runtime = SimpleNamespace(deviceGetPCIBusId=lambda device: f"0000:{device:02x}:00.0")
    monkeypatch.setattr(_deps, "cupy", lambda: SimpleNamespace(cuda=SimpleNamespace(runtime=runtime)))
    host = socket.gethostname()
    assert bench._ranks_share_gpus(FakeComm([(host, "0000:00:00.0")]), 0)
    assert not bench._ranks_share_gpus(FakeComm([(host, "0000:01:00.0")]), 0)
    assert not bench._ranks_share_gpus(FakeComm([("another-host", "0000:00:00.0")]), 0)
