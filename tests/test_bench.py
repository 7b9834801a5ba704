"""The benchmark's host-side decisions (no GPU)."""

import types

import pytest

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


def test_host_time_reports_the_gpu_time_of_the_same_bursts(monkeypatch):
    """Each burst's GPU span (its events, here a fake of 40 us a burst) gives the GPU us per call."""
    from cuep import bench_host
    spans = []

    class FakeSpan:
        def __init__(self):
            self.ended = False
            spans.append(self)

        def end(self):
            self.ended = True

        def elapsed_us(self):
            assert self.ended
            return 40.0

    monkeypatch.setattr(bench_host, "_GpuSpan", FakeSpan)
    gpu: dict[str, float] = {}
    bench_host.interleaved_us({"CuPy": lambda: None}, lambda: None, bursts=3, burst=2, gpu_us=gpu)
    assert gpu == {"CuPy": 20.0} and len(spans) == 3
    bench_host.interleaved_us({"CuPy": lambda: None}, lambda: None, bursts=3, burst=2)
    assert len(spans) == 3  # no GPU span unless asked for


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


class FakeArray:
    """Stands in for an array: only its shape is read while the calls are set up."""

    def __init__(self, *shape: int):
        self.shape = shape


class RecordingBuffer:
    """Stands in for a Buffer of one API: each call is bound to the real method's signature (a wrong
    argument raises TypeError) and answers a tuple of the real call's length; a hook records its run."""

    RETURNS = {"get_dispatch_layout": 5, "dispatch": 6, "combine": 3, "low_latency_dispatch": 5,
               "low_latency_combine": 3}

    def __init__(self, api, calls: list):
        self.api, self.calls = api, calls

    def __getattr__(self, name: str):
        import inspect
        signature = inspect.signature(getattr(self.api, name))

        def call(*args, **kwargs):
            signature.bind(self, *args, **kwargs)
            self.calls.append(name)
            answer = [FakeArray(1)] * self.RETURNS[name]
            if kwargs.get("return_recv_hook"):
                answer[-1] = lambda: self.calls.append(f"{name} hook")
            return tuple(answer)
        return call


def _bench_calls_on(api, as_fp8):
    """Every call of ``--mode host`` made once, on RecordingBuffers of ``api``; the names of the calls made."""
    from types import SimpleNamespace

    from cuep import bench_host
    calls = []
    args = SimpleNamespace(hidden=7168, tokens=4096, experts=256, topk=8)
    workload = (FakeArray(4096, 7168), FakeArray(4096, 8), FakeArray(4096, 8), FakeArray(4096, 7168),
                FakeArray(4096, 56), FakeArray(128, 7168), FakeArray(128, 8), FakeArray(128, 8))
    with bench_host.WaitTimer() as wait:
        whole, split = bench_host._calls(lambda nvl, rdma, ll: RecordingBuffer(api, calls),
                                         lambda shape: FakeArray(*shape), as_fp8, wait, args, 2, workload)
        for call in whole.values():
            call()
        for entry in split:
            assert entry.call()() >= 0
    return whole, split, calls


def test_the_calls_of_an_api_timed_in_part():
    """DeepEP at one process times the layout and the low-latency calls only, with no wait of cuep's: no
    dispatch is made while the calls are set up, and none is timed; without the low-latency calls, the layout
    alone."""
    from types import SimpleNamespace

    import cuep
    from cuep import bench_host
    args = SimpleNamespace(hidden=7168, tokens=4096, experts=256, topk=8)
    workload = (FakeArray(4096, 7168), FakeArray(4096, 8), FakeArray(4096, 8), FakeArray(4096, 7168),
                FakeArray(4096, 56), FakeArray(128, 7168), FakeArray(128, 8), FakeArray(128, 8))
    for with_low_latency in (True, False):
        calls = []
        whole, split = bench_host._calls(lambda nvl, rdma, ll: RecordingBuffer(cuep.Buffer, calls),
                                         lambda shape: FakeArray(*shape), lambda data: data, None, args, 1, workload,
                                         with_low_latency=with_low_latency, with_dispatch=False)
        for call in whole.values():
            call()
        for entry in split:
            entry.call()()
        assert "dispatch" not in calls and "combine" not in calls
        low_latency = {"low-latency dispatch FP8", "low-latency combine LogFMT"}
        assert set(whole) >= {"get_dispatch_layout"} | low_latency if with_low_latency else \
            set(whole) == {"get_dispatch_layout"}
        assert [entry.part_inside for entry in split] == ([False, False] if with_low_latency else [])


def test_host_bench_calls_fit_both_apis():
    """The calls ``--mode host`` makes bind to the real signatures of cuep.Buffer and of cuep.torch.Buffer
    (DeepEP's), and each hook-mode call's receive runs its hook."""
    import cuep
    apis = [(cuep.Buffer, lambda data: data)]
    try:
        import cuep.torch as deep_ep
        apis.append((deep_ep.Buffer, lambda data: data))
    except ImportError:
        pass
    for api, as_fp8 in apis:
        whole, split, calls = _bench_calls_on(api, as_fp8)
        assert {"cached dispatch FP8", "combine, top-k weights and bias", "low-latency dispatch BF16",
                "low-latency combine LogFMT"} <= set(whole), api
        assert [entry.part_inside for entry in split] == [True, False, False], api
        assert calls.count("low_latency_dispatch hook") == 1 and calls.count("low_latency_combine hook") == 1, api


def test_the_rows_of_several_apis_and_a_wait_that_is_not_cuep_s(monkeypatch, capsys):
    """time_apis gives each call a row per API; a dispatch with a layout whose wait cuep cannot time (DeepEP's,
    inside its C++) gets one row, the whole call, under its own name; print_table prints each API's column
    and the ratio of two."""
    from cuep import bench_host
    clock = FakeClock()
    monkeypatch.setattr(bench_host.time, "perf_counter", clock)
    monkeypatch.setattr(bench_host, "_GpuSpan", lambda: types.SimpleNamespace(end=lambda: None, elapsed_us=lambda: 0.0))

    def costing(us: float):
        def call():
            clock.now += us * 1e-6
            return lambda: 1e-6  # a part of 1 us
        return call

    def apis(scale: float):
        split = bench_host.Split("with a layout, without its wait", "with a layout: its wait", costing(5 * scale),
                                 part_inside=True, whole_name="with a layout, its wait included")
        return {"layout": costing(2 * scale)}, [split]

    rows = bench_host.time_apis({"CuPy": apis(1), "torch": apis(2)}, lambda: None, bench_host.WaitTimer(), set())
    assert {name: {api: round(us, 6) for api, us in row.items()} for name, row in rows.items()} == {
        "layout": {"CuPy": 2.0, "torch": 4.0}, "with a layout, without its wait": {"CuPy": 4.0, "torch": 9.0},
        "with a layout: its wait": {"CuPy": 1.0, "torch": 1.0}}
    rows = bench_host.time_apis({"DeepEP": apis(3)}, lambda: None, None, set())
    assert {name: {api: round(us, 6) for api, us in row.items()} for name, row in rows.items()} == {
        "layout": {"DeepEP": 6.0}, "with a layout, its wait included": {"DeepEP": 15.0}}
    every_rank = [{"floor: empty kernel launch": {"CuPy": 2.0}, "layout": {"CuPy": 4.0, "torch": 6.0}}]
    bench_host.print_table(every_rank, {"layout"}, {"CuPy": "CuPy API", "torch": "cuep.torch"}, ratio=("torch", "CuPy"))
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].split() == ["layout", "*", "4.0", "(2.0x)", "6.0", "(3.0x)", "1.50"]


def test_a_sampled_profile_counts_only_the_samples_inside_the_calls():
    """benchmarks/fold_samples.py sums py-spy's raw stacks under the outermost ``timed_call`` frame: the syncs
    between bursts and the set-up (a lambda of its own) count nowhere; shares are inclusive, leaves keep their
    line, and the call's children are its direct callees."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "fold_samples.py"
    spec = importlib.util.spec_from_file_location("fold_samples", path)
    fold_samples = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fold_samples)
    root = "<module> (sample_calls.py:90);main (benchmarks/sample_calls.py:80)"
    call = f"{root};main.<locals>.timed_call (benchmarks/sample_calls.py:70);_calls.<locals>.<lambda> (cuep/x.py:1)"
    lines = [f"{call};Buffer.dispatch (cuep/buffer.py:10);TorchFront.views (cuep/torch/front.py:73) 6\n",
             f"{call};Buffer.dispatch (cuep/buffer.py:12);timed_call (cuep/inner.py:5) 2\n",
             f"{root};synchronize (cupy/cuda/device.pyx:1) 50\n",
             f"{root};main.<locals>.<lambda> (benchmarks/sample_calls.py:40);Buffer.__init__ (cuep/buffer.py:3) 9\n",
             "not a stack line\n"]
    total, inclusive, leaves, children = fold_samples.fold(lines, "timed_call")
    assert total == 8
    assert inclusive["Buffer.dispatch (cuep/buffer.py)"] == 8 and inclusive["TorchFront.views (torch/front.py)"] == 6
    assert leaves == {"TorchFront.views (torch/front.py:73)": 6, "timed_call (cuep/inner.py:5)": 2}
    assert children == {"_calls.<locals>.<lambda> (cuep/x.py)": 8}


def test_a_trace_prints_the_points_some_rank_reached_and_leaves_out_the_rest(capsys):
    import warnings

    import numpy as np
    points = {0: "start", 1: "send done", 2: "end"}
    nan = np.nan
    per_rank = [np.array([[0.5, 0.75, 1.0], [nan, nan, nan], [4.0, 5.0, 6.0]]),
                np.array([[1.5, 1.25, 2.0], [nan, nan, nan], [nan, nan, nan]])]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "mean of empty slice" for the point nobody reached
        bench._print_trace("dispatch fp8 hook receive", points, per_rank)
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in lines[2:]}
    assert rows == {"start": [1.0, 1.0, 1.5], "end": [4.0, 5.0, 6.0]}  # end: only the rank that reached it


def test_round_tokens_reaches_the_normal_bench_and_refuses_what_contradicts_it(monkeypatch, capsys):
    taken = []
    monkeypatch.setattr(bench, "bench_normal", lambda args: taken.append((args.round_tokens, args.fixed_buffer)))
    assert bench.main(["--mode", "normal", "--round-tokens", "512"]) == 0
    assert taken == [(512, False)]
    for argv in (["--round-tokens", "512", "--fixed-buffer"], ["--round-tokens", "0"]):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert "--round-tokens" in capsys.readouterr().err


def test_the_decode_step_refuses_a_pace_of_no_steps():
    """benchmarks/decode_step.py's paced rows synchronise every --sync-every steps: 0 or less is refused by name,
    before any rank starts."""
    pytest.importorskip("torch")
    import pathlib
    import subprocess
    import sys
    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "decode_step.py"
    done = subprocess.run([sys.executable, str(script), "--sync-every", "0"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "--sync-every must be at least 1, got 0" in done.stderr


def test_the_decode_step_beside_deepep_runs_both_in_turn_and_prints_each_least(monkeypatch, capsys):
    """benchmarks/decode_step.py --beside-deepep: the script again per backend and process, alternating, DeepEP's
    with its tree first on PYTHONPATH and the named variables gone; then each row's least per backend, beside every
    process's mean."""
    pytest.importorskip("torch")
    import os
    import pathlib
    import subprocess
    import sys
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import decode_step
    import torch_ranks
    monkeypatch.setenv("CUEP_TEST_PRELOAD", "other-nvshmem.so")
    monkeypatch.setenv("PYTHONPATH", "/kit")
    started = []
    # Each run's table as a run prints it at 2 ranks (name, mean, max, a value per rank); mean = 10 x the run's turn.

    def run(argv, env, cwd, capture_output, text):
        backend = argv[argv.index("--backend") + 1]
        assert cwd is None
        started.append((backend, env))
        mean = 10.0 * len(started)
        table = (f"decode step on {backend}: 2 ranks, 128 tokens, hidden 7168, top-8 of 288; us per step, 50 steps\n"
                 f"{'':18} {'mean':>8} {'max':>8}   per rank\n"
                 f"events             {mean:8.1f} {mean + 1:8.1f}   {mean - 1:7.1f} {mean + 1:7.1f}\n"
                 f"dispatch, paced    {mean / 2:8.1f} {mean:8.1f}   {0.0:7.1f} {mean:7.1f}\n")
        return subprocess.CompletedProcess(argv, 0, table, "")

    monkeypatch.setattr(torch_ranks.subprocess, "run", run)
    monkeypatch.setattr(sys, "argv", ["decode_step.py", "--num-ranks", "2", "--beside-deepep", "/src/DeepEP",
                                      "--processes", "2", "--deepep-unset", "CUEP_TEST_PRELOAD"])
    decode_step.main()
    assert [backend for backend, _ in started] == ["cuep", "deepep", "cuep", "deepep"]
    assert all(env is None for backend, env in started if backend == "cuep")
    deepep_env = started[1][1]
    assert deepep_env["PYTHONPATH"] == os.path.abspath("/src/DeepEP") + os.pathsep + "/kit"
    assert "CUEP_TEST_PRELOAD" not in deepep_env
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split() == ["events", "10.0", "20.0", "10.0", "30.0", "|", "20.0", "40.0"]
    assert lines[3].split() == ["dispatch,", "paced", "5.0", "10.0", "5.0", "15.0", "|", "10.0", "20.0"]
    assert len(lines) == 4


def test_deepep_s_own_test_beside_deepep_runs_both_in_turn_and_compares_each_rank(monkeypatch, tmp_path, capsys):
    """benchmarks/deepep_test_beside.py: DeepEP's test_low_latency.py through tests/gpu/deepep_v1.py for cuep and
    from the tests' folder for DeepEP (its tree first on PYTHONPATH, the named variables gone), alternating, the
    arguments after -- passed to both; then each printed figure per rank, each run's value, the means, and whether
    cuep's are at or below DeepEP's on every rank."""
    import os
    import pathlib
    import subprocess
    import sys
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import deepep_test_beside
    import torch_ranks
    (tmp_path / "test_low_latency.py").write_text("")
    monkeypatch.setenv("CUEP_TEST_PRELOAD", "other-nvshmem.so")
    monkeypatch.setenv("PYTHONPATH", "/kit")
    started = []

    def run(argv, env, cwd, capture_output, text):
        backend = "cuep" if argv[1].endswith("deepep_v1.py") else "deepep"
        started.append((backend, argv, env, cwd))
        turn = len(started)  # 1, 2, 3, 4: cuep's runs are 1 and 3, DeepEP's 2 and 4
        lines = []
        for rank in range(2):
            step = 50.0 + turn + rank  # avg_t: cuep's means 52 / 53 against DeepEP's 53 / 54
            send = 10.0 if backend == "cuep" and rank == 1 else 5.0  # dispatch send: cuep above on rank 1
            lines += [f"[rank {rank}] Dispatch + combine bandwidth: 300.00 GB/s, avg_t={step:.2f} us, "
                      f"min_t=40.00 us, max_t=60.00 us",
                      f"[rank {rank}] Dispatch send/recv time: {send:.2f} + 8.00 us | Combine send/recv time: "
                      f"13.00 + 6.00 us"]
        return subprocess.CompletedProcess(argv, 0, "\n".join(["Allocating buffer size: 93.4 MB ...", *lines]), "")

    monkeypatch.setattr(torch_ranks.subprocess, "run", run)
    deepep_test_beside.main(["--deepep", "/src/DeepEP", "--tests", str(tmp_path), "--num-processes", "2",
                             "--deepep-unset", "CUEP_TEST_PRELOAD", "--", "--num-tokens", "64"])
    assert [backend for backend, *_ in started] == ["cuep", "deepep", "cuep", "deepep"]
    _, cuep_argv, cuep_env, cuep_cwd = started[0]
    assert cuep_argv[2:] == [str(tmp_path), "test_low_latency.py", "--num-processes", "2", "--num-tokens", "64"]
    assert cuep_env is None and cuep_cwd is None
    _, deepep_argv, deepep_env, deepep_cwd = started[1]
    assert deepep_argv[1:] == [str(tmp_path / "test_low_latency.py"), "--num-processes", "2", "--num-tokens", "64"]
    assert deepep_cwd == str(tmp_path)
    assert deepep_env["PYTHONPATH"] == os.path.abspath("/src/DeepEP") + os.pathsep + "/kit"
    assert "CUEP_TEST_PRELOAD" not in deepep_env
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[2:]]
    assert rows[0] == ["dispatch", "+", "combine", "avg_t", "0", "51.00", "53.00", "52.00", "54.00", "52.00", "53.00"]
    assert rows[1] == ["dispatch", "+", "combine", "avg_t", "1", "52.00", "54.00", "53.00", "55.00", "53.00", "54.00"]
    assert rows[2] == ["cuep's", "mean", "at", "or", "below", "DeepEP's", "on", "every", "rank"]
    assert rows[3] == ["dispatch", "send", "(hook)", "0", "5.00", "5.00", "5.00", "5.00", "5.00", "5.00"]
    assert rows[4] == ["dispatch", "send", "(hook)", "1", "10.00", "10.00", "5.00", "5.00", "10.00", "5.00"]
    assert rows[5] == ["cuep's", "mean", "ABOVE", "DeepEP's", "on", "some", "rank"]
    assert [row[:3] for row in rows[6::3]] == [["dispatch", "receive", "(hook)"], ["combine", "send", "(hook)"],
                                               ["combine", "receive", "(hook)"]]
    assert len(rows) == 15  # the whole kernels' line was not printed: no rows for it


def test_deepep_s_own_test_beside_deepep_refuses_a_folder_without_the_test(monkeypatch, tmp_path, capsys):
    """A --tests folder without DeepEP's test is refused by name, with how to fetch it, before anything runs."""
    import pathlib
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import deepep_test_beside
    with pytest.raises(SystemExit):
        deepep_test_beside.main(["--deepep", "/src/DeepEP", "--tests", str(tmp_path)])
    assert "holds no test_low_latency.py" in capsys.readouterr().err
