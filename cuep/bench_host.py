"""``python -m cuep.bench --mode host`` (under mpirun): the host time of each eager call, through the CuPy
API (``cuep.Buffer``) and through ``cuep.torch`` (when torch is installed), beside the floors measured in the
same run: an empty kernel launched from Python, and a one-element torch op.

Each call runs in bursts of :data:`BURST` with no synchronisation inside a burst; its host time is the
burst's wall time over :data:`BURST`, the median of :data:`BURSTS` bursts, the two APIs' bursts taken in
turn. A burst queues at most :data:`BURST` calls' kernels, far below the driver's launch queue; the device
is synchronised between bursts, outside the timing. Each burst's GPU span is taken too, and a row where
it outran the host's time (:data:`GPU_BOUND_SPAN`) is marked: the GPU set the pace there. Every rank
reports; rank 0 prints each rank's figure.

Two kinds of call are timed in two parts (:func:`split_us`): a dispatch with a layout, whose one CPU wait
(:func:`cuep._interop.read_on_host`, timed by :class:`WaitTimer`) gets a row of its own, and each hook-mode
call, whose send and receive get a row each.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, NamedTuple

import numpy as np

from . import _deps

BURST = 20
BURSTS = 7
# A burst's GPU span (first kernel's start to last one's end) is about the larger of the host's time and the
# GPU's work, plus the last call's kernels: a span this much longer than the host's time means the GPU set
# the pace (its queue grew during the burst).
GPU_BOUND_SPAN = 1.1
_EMPTY_KERNEL = 'extern "C" __global__ void cuep_bench_empty() {}'


def host_us(call: Callable[[], object], synchronize: Callable[[], None], bursts: int = BURSTS,
            burst: int = BURST) -> float:
    """Median over ``bursts`` of the host microseconds per call of ``call`` in a burst of ``burst`` calls."""
    return interleaved_us({"": call}, synchronize, bursts, burst)[""]


def interleaved_us(calls: dict[str, Callable[[], object]], synchronize: Callable[[], None], bursts: int = BURSTS,
                   burst: int = BURST, gpu_us: dict[str, float] | None = None) -> dict[str, float]:
    """:func:`host_us` of each of ``calls``, their bursts taken in turn (so a slow spell of the host weighs
    on every one alike, not on whichever ran then). ``gpu_us``, when given, receives each call's median
    GPU span per call over the same bursts (:class:`_GpuSpan`)."""
    for call in calls.values():
        call()  # warm: plans, compiled kernels and pools are ready before timing
    synchronize()
    samples: dict[str, list[float]] = {key: [] for key in calls}
    gpu_samples: dict[str, list[float]] = {key: [] for key in calls}
    for _ in range(bursts):
        for key, call in calls.items():
            span = _GpuSpan() if gpu_us is not None else None
            started = time.perf_counter()
            for _ in range(burst):
                call()
            samples[key].append((time.perf_counter() - started) / burst * 1e6)
            if span is not None:
                span.end()
            synchronize()
            if span is not None:
                gpu_samples[key].append(span.elapsed_us() / burst)
    if gpu_us is not None:
        gpu_us.update({key: float(np.median(values)) for key, values in gpu_samples.items()})
    return {key: float(np.median(values)) for key, values in samples.items()}


class _GpuSpan:
    """The GPU's span from now to :meth:`end` on the current CuPy stream (the legacy default stream, which
    torch's calls use too): with the host's time over the same burst, it tells whether the GPU kept up."""

    def __init__(self):
        cupy = _deps.cupy()
        self._start, self._end = cupy.cuda.Event(), cupy.cuda.Event()
        self._start.record()

    def end(self) -> None:
        self._end.record()

    def elapsed_us(self) -> float:
        """After a synchronisation."""
        return _deps.cupy().cuda.get_elapsed_time(self._start, self._end) * 1e3


def split_us(call: Callable[[], Callable[[], float]], synchronize: Callable[[], None], bursts: int = BURSTS,
             burst: int = BURST) -> tuple[float, float]:
    """Medians over ``bursts`` of the host microseconds per call of ``call`` and of a part reported apart:
    ``call`` returns a callable, run at once after it, that returns that part's seconds (a wait inside the
    call, or a second phase that it runs then)."""
    call()()
    synchronize()
    whole, part = [], []
    for _ in range(bursts):
        whole_s = part_s = 0.0
        for _ in range(burst):
            started = time.perf_counter()
            rest = call()
            whole_s += time.perf_counter() - started
            part_s += rest()
        whole.append(whole_s / burst * 1e6)
        part.append(part_s / burst * 1e6)
        synchronize()
    return float(np.median(whole)), float(np.median(part))


class WaitTimer:
    """While active, adds the seconds spent in :func:`cuep._interop.read_on_host` (the one CPU wait of a
    non-cached dispatch) to :attr:`seconds`."""

    def __init__(self):
        from . import _interop
        self._interop, self._read = _interop, _interop.read_on_host
        self.seconds = 0.0

    def _timed(self, array, stream):
        started = time.perf_counter()
        try:
            return self._read(array, stream)
        finally:
            self.seconds += time.perf_counter() - started

    def __enter__(self) -> "WaitTimer":
        self._interop.read_on_host = self._timed
        return self

    def __exit__(self, *exc) -> None:
        self._interop.read_on_host = self._read


class Split(NamedTuple):
    """A call timed in two parts (:func:`split_us`): its row, the part's row, and whether the part happened
    inside the call (then the call's row shows the call without it, and ``whole_name`` names the row of the
    whole call where the part cannot be timed apart)."""

    name: str
    part_name: str
    call: Callable[[], Callable[[], float]]
    part_inside: bool
    whole_name: str = ""


def _calls(make_buffer: Callable[..., object], zeros: Callable[[tuple], object], as_fp8: Callable[[object], object],
           wait: WaitTimer | None, args, num_ranks: int, workload: tuple, with_low_latency: bool = True,
           with_dispatch: bool = True) -> tuple[dict[str, Callable[[], object]], list[Split]]:
    """The eager calls timed, on Buffers of one API: ``make_buffer(num_nvl_bytes, num_rdma_bytes,
    low_latency_mode)`` makes one, ``zeros(shape)`` a `bfloat16` array of it, ``as_fp8`` turns FP8 bytes into
    what the API takes; ``wait`` times a non-cached dispatch's CPU wait (``None``: it is not cuep's);
    ``with_low_latency=False`` leaves the low-latency calls out, and
    ``with_dispatch=False`` the normal mode's calls but the layout (DeepEP runs them on 2, 4 or 8 ranks only).
    Returns the calls timed whole, and those timed in two parts: a dispatch with a layout apart from its CPU
    wait, and each hook-mode call's send apart from its receive. ``workload``: ``(x, topk_idx, topk_weights,
    x_fp8, scales)`` of the normal mode, then ``(x, topk_idx, topk_weights)`` of the low-latency calls."""
    from .config import Config
    topk_idx = workload[1]
    normal = make_buffer(Config().get_nvl_buffer_size_hint(args.hidden * 2, num_ranks, args.tokens), 0, False)
    per_rank, _, per_expert, in_rank, _ = normal.get_dispatch_layout(topk_idx, args.experts)
    whole: dict[str, Callable[[], object]] = {
        "get_dispatch_layout": lambda: normal.get_dispatch_layout(topk_idx, args.experts)}
    split: list[Split] = []
    if with_dispatch:
        _add_dispatch_calls(normal, whole, split, zeros, as_fp8, wait, args, workload, (per_rank, per_expert, in_rank))
    if with_low_latency:
        _add_low_latency_calls(make_buffer, whole, split, zeros, args, num_ranks, workload)
    return whole, split


def _add_dispatch_calls(normal, whole: dict, split: list, zeros, as_fp8, wait: WaitTimer | None, args,
                        workload: tuple, counts: tuple) -> None:
    """The normal mode's dispatch and combine calls of :func:`_calls`, on the Buffer ``normal``."""
    x, topk_idx, weights, x_fp8, scales = workload[:5]
    per_rank, per_expert, in_rank = counts
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=topk_idx, topk_weights=weights)
    recv_x, _, recv_weights, _, handle, _ = normal.dispatch(x, **layout)
    bias = zeros((x.shape[0], args.hidden))
    fp8_x = (as_fp8(x_fp8), scales)

    def dispatch_with_layout() -> Callable[[], float]:
        before = wait.seconds if wait is not None else 0.0
        normal.dispatch(x, **layout)
        waited = wait.seconds - before if wait is not None else 0.0
        return lambda: waited

    whole.update({
        "cached dispatch BF16": lambda: normal.dispatch(x, handle=handle),
        "cached dispatch FP8": lambda: normal.dispatch(fp8_x, handle=handle),
        "combine": lambda: normal.combine(recv_x, handle),
        "combine, top-k weights and bias": lambda: normal.combine(recv_x, handle, topk_weights=recv_weights, bias=bias),
    })
    split.append(Split("dispatch with a layout, without its wait", "dispatch with a layout: its CPU wait",
                       dispatch_with_layout, part_inside=True, whole_name="dispatch with a layout, its wait included"))


def _add_low_latency_calls(make_buffer, whole: dict, split: list, zeros, args, num_ranks: int,
                           workload: tuple) -> None:
    """The low-latency calls of :func:`_calls`, on a low-latency Buffer of their own."""
    from .buffer import Buffer
    ll_x, ll_topk_idx, ll_weights = workload[5:]

    def send_then_receive(send: Callable[[], tuple]) -> Callable[[], Callable[[], float]]:
        def call() -> Callable[[], float]:
            hook = send()[-1]

            def receive() -> float:
                started = time.perf_counter()
                hook()
                return time.perf_counter() - started
            return receive
        return call

    ll_tokens = ll_x.shape[0]
    low_latency = make_buffer(0, Buffer.get_low_latency_rdma_size_hint(ll_tokens, args.hidden, num_ranks,
                                                                       args.experts), True)
    ll_handle = low_latency.low_latency_dispatch(ll_x, ll_topk_idx, ll_tokens, args.experts)[2]
    expert_out = zeros((args.experts // num_ranks, num_ranks * ll_tokens, args.hidden))
    whole.update({
        "low-latency dispatch FP8": lambda: low_latency.low_latency_dispatch(ll_x, ll_topk_idx, ll_tokens,
                                                                             args.experts),
        "low-latency dispatch BF16": lambda: low_latency.low_latency_dispatch(ll_x, ll_topk_idx, ll_tokens,
                                                                              args.experts, use_fp8=False),
        "low-latency combine BF16": lambda: low_latency.low_latency_combine(expert_out, ll_topk_idx, ll_weights,
                                                                            ll_handle),
        "low-latency combine LogFMT": lambda: low_latency.low_latency_combine(expert_out, ll_topk_idx, ll_weights,
                                                                              ll_handle, use_logfmt=True),
    })
    split += [
        Split("low-latency dispatch FP8, hook: send", "low-latency dispatch FP8, hook: receive", send_then_receive(
            lambda: low_latency.low_latency_dispatch(ll_x, ll_topk_idx, ll_tokens, args.experts,
                                                     return_recv_hook=True)), part_inside=False),
        Split("low-latency combine BF16, hook: send", "low-latency combine BF16, hook: receive", send_then_receive(
            lambda: low_latency.low_latency_combine(expert_out, ll_topk_idx, ll_weights, ll_handle,
                                                    return_recv_hook=True)), part_inside=False),
    ]


def bench_host(args, workload_of: Callable[[int, int], tuple]) -> None:
    """``workload_of(rank, tokens)``: ``(x, topk_idx, topk_weights)`` CuPy arrays of this rank."""
    cupy, mpi = _deps.cupy(), _deps.mpi()
    comm = mpi.COMM_WORLD
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    workload = workload_arrays(rank, args, workload_of)
    device = cupy.cuda.Device()

    def barrier_and_sync() -> None:
        device.synchronize()
        comm.Barrier()

    rows: dict[str, dict[str, float]] = {"floor: empty kernel launch": {"CuPy": empty_launch_us()}}
    wait = WaitTimer()
    apis = {"CuPy": cuep_calls("CuPy", comm, args, workload, wait)}
    try:
        _deps.torch()
    except ImportError:
        pass
    else:
        apis["torch"] = cuep_calls("torch", comm, args, workload, wait)
        rows["floor: one-element torch op"] = {"torch": torch_op_us()}
    gpu_bound: set[str] = set()
    rows.update(time_apis(apis, barrier_and_sync, wait, gpu_bound))
    every_rank = comm.gather(rows, root=0)
    bound_anywhere = set().union(*comm.gather(gpu_bound, root=0) or [set()])
    if rank != 0:
        return
    print(f"cuep host time per eager call: {num_ranks} ranks, bursts of {BURST} calls without a sync, median of "
          f"{BURSTS} bursts; normal mode {args.tokens} tokens x {args.hidden}, low latency {args.low_latency_tokens} "
          f"tokens, {args.experts} experts, top-{args.topk}; us per rank (ratio to the empty launch, mean over ranks). "
          f"A burst queues at most {BURST} calls' kernels (a few each), far below the driver's launch queue; a "
          f"dispatch with a layout waits for its counts (its CPU wait, shown apart). '*': on some rank the GPU's "
          f"span over a burst exceeded the host's time by more than {GPU_BOUND_SPAN - 1:.0%}, so the GPU set the "
          f"pace there (its queue grew; the host's figure is still the host's)")
    print_table(every_rank, bound_anywhere, {"CuPy": "CuPy API", "torch": "cuep.torch"}, ratio=("torch", "CuPy"))


def workload_arrays(rank: int, args, workload_of: Callable[[int, int], tuple]) -> tuple:
    """The arrays the calls of :func:`_calls` take, CuPy arrays of ``rank``: ``(x, topk_idx, topk_weights,
    x_fp8, scales)`` of ``args.tokens`` tokens, then ``(x, topk_idx, topk_weights)`` of
    ``args.low_latency_tokens``; ``workload_of(rank, tokens)`` makes each ``(x, topk_idx, topk_weights)``."""
    from . import fp8
    x, topk_idx, weights = workload_of(rank, args.tokens)
    return (x, topk_idx, weights, *fp8.quantize(x), *workload_of(rank, args.low_latency_tokens))


def empty_launch_us() -> float:
    """The floor: :func:`host_us` of an empty kernel launched through CuPy on the current device."""
    cupy = _deps.cupy()
    empty = cupy.RawKernel(_EMPTY_KERNEL, "cuep_bench_empty")
    return host_us(lambda: empty((1,), (1,), ()), cupy.cuda.Device().synchronize)


def torch_op_us() -> float:
    """The torch floor: :func:`host_us` of a one-element in-place torch op on the current CUDA device."""
    torch = _deps.torch()
    one = torch.zeros(1, device="cuda")
    return host_us(lambda: one.add_(1), torch.cuda.synchronize)


def cuep_calls(api: str, comm, args, workload: tuple,
               wait: WaitTimer) -> tuple[dict[str, Callable[[], object]], list[Split]]:
    """:func:`_calls` through one of cuep's APIs, on Buffers of ``comm``: ``"CuPy"`` (``cuep.Buffer`` on the
    CuPy arrays of ``workload``, from :func:`workload_arrays`) or ``"torch"`` (``cuep.torch.Buffer`` on torch
    tensors over the same memory, torch's device set to CuPy's)."""
    num_ranks = comm.Get_size()
    if api == "CuPy":
        import cuep
        cupy = _deps.cupy()
        return _calls(lambda nvl, rdma, ll: cuep.Buffer(comm, nvl, rdma, low_latency_mode=ll),
                      lambda shape: cupy.zeros(shape, dtype=workload[0].dtype), lambda data: data, wait, args,
                      num_ranks, workload)
    torch = _deps.torch()
    import cuep.torch as deep_ep
    torch.cuda.set_device(_deps.cupy().cuda.Device().id)
    return _calls(lambda nvl, rdma, ll: deep_ep.Buffer(None, nvl, rdma, low_latency_mode=ll, comm=comm),
                  lambda shape: torch.zeros(shape, dtype=torch.bfloat16, device="cuda"),
                  lambda data: data.view(torch.float8_e4m3fn), wait, args, num_ranks,
                  tuple(torch.from_dlpack(a) for a in workload))


def time_apis(apis: dict[str, tuple[dict[str, Callable[[], object]], list[Split]]],
              synchronize: Callable[[], None], wait: WaitTimer | None, gpu_bound: set[str]) -> dict:
    """Rows ``call -> {api: us}`` of every call of ``apis`` (each API's calls from :func:`_calls`), the APIs'
    bursts of one call taken in turn; names of the calls whose GPU set the pace go into ``gpu_bound``.
    ``wait`` times a dispatch with a layout's CPU wait apart (``None``: the API's wait is not cuep's, and that
    call's row holds it)."""
    rows: dict[str, dict[str, float]] = {}
    first = next(iter(apis.values()))
    for name in first[0]:
        synchronize()
        gpu: dict[str, float] = {}
        rows[name] = interleaved_us({api: calls[name] for api, (calls, _) in apis.items()}, synchronize, gpu_us=gpu)
        if any(gpu[api] > GPU_BOUND_SPAN * rows[name][api] for api in gpu):
            gpu_bound.add(name)
    with wait or contextlib.nullcontext():
        for index, split in enumerate(first[1]):
            for api, (_, splits) in apis.items():
                synchronize()
                whole, part = split_us(splits[index].call, synchronize)
                if split.part_inside and wait is None:  # the wait is in the call's row, and has none of its own
                    rows.setdefault(split.whole_name, {})[api] = whole
                    continue
                rows.setdefault(split.name, {})[api] = whole - part if split.part_inside else whole
                rows.setdefault(split.part_name, {})[api] = part
    return rows


def print_table(every_rank: list[dict], bound_anywhere: set[str], columns: dict[str, str],
                ratio: tuple[str, str] | None = None) -> None:
    """The rows of every rank (from :func:`time_apis`, with the floors), one column per API of ``columns``
    (``api -> heading``): each rank's figure, and its mean's ratio to the mean empty launch of the same run;
    ``ratio``: a last column, the first API's mean over the second's."""
    floor = np.mean([r["floor: empty kernel launch"][api] for r in every_rank
                     for api in r["floor: empty kernel launch"]])
    heading = f"{'call':45s} " + " ".join(f"{title:>24s}" for title in columns.values())
    print(heading + (f" {'/'.join(columns[api] for api in ratio):>22s}" if ratio else ""))
    names = list(dict.fromkeys(name for r in every_rank for name in r))
    for name in names:
        cells, means = [], {}
        for api in columns:
            values = [r[name][api] for r in every_rank if api in r.get(name, {})]
            if values:
                means[api] = float(np.mean(values))
                cells.append(f"{' / '.join(f'{v:.1f}' for v in values)} ({means[api] / floor:.1f}x)")
            else:
                cells.append("-")
        line = f"{name + (' *' if name in bound_anywhere else ''):45s} " + " ".join(f"{cell:>24s}" for cell in cells)
        if ratio:
            line += f" {means[ratio[0]] / means[ratio[1]]:>22.2f}" if all(api in means for api in ratio) else \
                f" {'-':>22s}"
        print(line)
