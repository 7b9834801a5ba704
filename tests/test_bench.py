"""The benchmark's host-side decisions (no GPU)."""

from cuep import bench
from cuep.runtime import world


class FakeComm:
    """``allgather`` answers this rank's value followed by the other ranks' given ones."""

    def __init__(self, others):
        self.others = others

    def allgather(self, mine):
        return [mine] + self.others


def test_ranks_on_one_gpu_share_it(monkeypatch):
    monkeypatch.setattr(world, "gpu_identity", lambda device_id: b"GPU-%d" % device_id)
    assert bench._ranks_share_gpus(FakeComm([b"GPU-0"]), 0)
    assert not bench._ranks_share_gpus(FakeComm([b"GPU-1", b"GPU-2"]), 0)
