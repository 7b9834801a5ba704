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


def test_host_time_takes_the_apis_bursts_in_turn():
    from cuep import bench_host
    order, syncs = [], []
    calls = {"CuPy": lambda: order.append("CuPy"), "torch": lambda: order.append("torch")}
    times = bench_host.interleaved_us(calls, lambda: syncs.append(len(order)), bursts=3, burst=2)
    assert set(times) == {"CuPy", "torch"} and all(t >= 0 for t in times.values())
    # One warm call each, then bursts of two calls, each API in turn, synchronised after every burst.
    assert order == ["CuPy", "torch"] + ["CuPy", "CuPy", "torch", "torch"] * 3
    assert syncs == [2, 4, 6, 8, 10, 12, 14]
