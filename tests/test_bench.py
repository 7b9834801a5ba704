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


class FakeClock:
    """``time.perf_counter`` that moves only when told."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_host_time_reports_a_part_apart(monkeypatch):
    """A call whose part (a wait inside it, or a hook run after it) is timed apart: 3 us whole, of which
    the part is 1 us."""
    from cuep import bench_host
    clock = FakeClock()
    monkeypatch.setattr(bench_host.time, "perf_counter", clock)
    syncs = []

    def call():
        clock.now += 3e-6
        return lambda: 1e-6

    whole, part = bench_host.split_us(call, lambda: syncs.append(True), bursts=3, burst=4)
    assert (round(whole, 6), round(part, 6)) == (3.0, 1.0) and len(syncs) == 4


def test_the_wait_timer_times_only_the_wait_and_puts_it_back():
    from cuep import _interop, bench_host
    read = _interop.read_on_host
    seen = []

    def fake_read(array, stream):
        seen.append((array, stream))
        return "counts"

    _interop.read_on_host = fake_read
    try:
        with bench_host.WaitTimer() as wait:
            assert _interop.read_on_host is not fake_read
            assert _interop.read_on_host("plan", "stream") == "counts" and seen == [("plan", "stream")]
            assert wait.seconds >= 0
        assert _interop.read_on_host is fake_read
    finally:
        _interop.read_on_host = read
