"""``python -m cuep.bench --mode host`` (under mpirun): the host time of each eager call, through the CuPy
API (``cuep.Buffer``) and through ``cuep.torch`` (when torch is installed), beside the floors measured in the
same run: an empty kernel launched from Python, and a one-element torch op.

Each call runs in bursts of :data:`BURST` with no synchronisation inside a burst; its host time is the
burst's wall time over :data:`BURST`, the median of :data:`BURSTS` bursts, the two APIs' bursts taken in turn. A burst queues at most
:data:`BURST` calls' kernels, far below the driver's launch queue, so a launch never waits for the GPU to
drain (the GPU finishing late does not count: the device is synchronised between bursts, outside the
timing). Every rank reports; rank 0 prints each rank's figure.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from . import _deps

BURST = 20
BURSTS = 7
_EMPTY_KERNEL = 'extern "C" __global__ void cuep_bench_empty() {}'


def host_us(call: Callable[[], object], synchronize: Callable[[], None], bursts: int = BURSTS,
            burst: int = BURST) -> float:
    """Median over ``bursts`` of the host microseconds per call of ``call`` in a burst of ``burst`` calls."""
    return interleaved_us({"": call}, synchronize, bursts, burst)[""]


def interleaved_us(calls: dict[str, Callable[[], object]], synchronize: Callable[[], None], bursts: int = BURSTS,
                   burst: int = BURST) -> dict[str, float]:
    """:func:`host_us` of each of ``calls``, their bursts taken in turn (so a slow spell of the host weighs
    on every one alike, not on whichever ran then)."""
    for call in calls.values():
        call()  # warm: plans, compiled kernels and pools are ready before timing
    synchronize()
    samples: dict[str, list[float]] = {key: [] for key in calls}
    for _ in range(bursts):
        for key, call in calls.items():
            started = time.perf_counter()
            for _ in range(burst):
                call()
            samples[key].append((time.perf_counter() - started) / burst * 1e6)
            synchronize()
    return {key: float(np.median(values)) for key, values in samples.items()}


def _calls(make_buffer: Callable[..., object], zeros: Callable[[tuple], object], args, num_ranks: int,
           workload: tuple) -> dict[str, Callable[[], object]]:
    """The eager calls timed, on Buffers of one API: ``make_buffer(num_nvl_bytes, num_rdma_bytes,
    low_latency_mode)`` makes one, ``zeros(shape)`` a `bfloat16` array of it; ``workload`` holds its arrays."""
    from .buffer import Buffer
    from .config import Config
    x, topk_idx, weights, ll_x, ll_topk_idx, ll_weights = workload
    normal = make_buffer(Config().get_nvl_buffer_size_hint(args.hidden * 2, num_ranks, args.tokens), 0, False)
    layout = normal.get_dispatch_layout(topk_idx, args.experts)
    recv_x, _, _, _, handle, _ = normal.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                                 num_tokens_per_expert=layout[2])
    ll_tokens = ll_x.shape[0]
    low_latency = make_buffer(0, Buffer.get_low_latency_rdma_size_hint(ll_tokens, args.hidden, num_ranks,
                                                                       args.experts), True)
    ll_handle = low_latency.low_latency_dispatch(ll_x, ll_topk_idx, ll_tokens, args.experts)[2]
    expert_out = zeros((args.experts // num_ranks, num_ranks * ll_tokens, args.hidden))
    return {
        "get_dispatch_layout": lambda: normal.get_dispatch_layout(topk_idx, args.experts),
        "cached dispatch BF16": lambda: normal.dispatch(x, handle=handle),
        "combine": lambda: normal.combine(recv_x, handle),
        "low-latency dispatch FP8": lambda: low_latency.low_latency_dispatch(ll_x, ll_topk_idx, ll_tokens,
                                                                             args.experts),
        "low-latency combine BF16": lambda: low_latency.low_latency_combine(expert_out, ll_topk_idx, ll_weights,
                                                                            ll_handle),
    }


def bench_host(args, workload_of: Callable[[int, int], tuple]) -> None:
    """``workload_of(rank, tokens)``: ``(x, topk_idx, topk_weights)`` CuPy arrays of this rank."""
    cupy, mpi = _deps.cupy(), _deps.mpi()
    comm = mpi.COMM_WORLD
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    workload = (*workload_of(rank, args.tokens), *workload_of(rank, args.low_latency_tokens))
    device = cupy.cuda.Device()
    rows: dict[str, dict[str, float]] = {}

    def barrier_and_sync() -> None:
        device.synchronize()
        comm.Barrier()

    empty = cupy.RawKernel(_EMPTY_KERNEL, "cuep_bench_empty")
    rows["floor: empty kernel launch"] = {"CuPy": host_us(lambda: empty((1,), (1,), ()), device.synchronize)}
    import cuep
    apis = {"CuPy": _calls(lambda nvl, rdma, ll: cuep.Buffer(comm, nvl, rdma, low_latency_mode=ll),
                           lambda shape: cupy.zeros(shape, dtype=workload[0].dtype), args, num_ranks, workload)}
    try:
        torch = _deps.torch()
    except ImportError:
        torch = None
    if torch is not None:
        import cuep.torch as deep_ep
        torch.cuda.set_device(device.id)
        one = torch.zeros(1, device="cuda")
        rows["floor: one-element torch op"] = {"torch": host_us(lambda: one.add_(1), torch.cuda.synchronize)}
        apis["torch"] = _calls(lambda nvl, rdma, ll: deep_ep.Buffer(None, nvl, rdma, low_latency_mode=ll, comm=comm),
                               lambda shape: torch.zeros(shape, dtype=torch.bfloat16, device="cuda"), args,
                               num_ranks, tuple(torch.from_dlpack(a) for a in workload))
    for name in apis["CuPy"]:
        barrier_and_sync()
        rows[name] = interleaved_us({api: calls[name] for api, calls in apis.items()}, barrier_and_sync)
    every_rank = comm.gather(rows, root=0)
    if rank != 0:
        return
    floor = np.mean([r["floor: empty kernel launch"]["CuPy"] for r in every_rank])
    print(f"cuep host time per eager call: {num_ranks} ranks, bursts of {BURST} calls without a sync, median of "
          f"{BURSTS} bursts; normal mode {args.tokens} tokens x {args.hidden}, low latency {args.low_latency_tokens} "
          f"tokens, {args.experts} experts, top-{args.topk}; us per rank (ratio to the empty launch, mean over ranks)")
    print(f"{'call':32s} {'CuPy API':>24s} {'cuep.torch':>24s} {'torch/CuPy':>10s}")
    for name in rows:
        cells, means = [], {}
        for api in ("CuPy", "torch"):
            values = [r[name][api] for r in every_rank if api in r.get(name, {})]
            if values:
                means[api] = float(np.mean(values))
                cells.append(f"{' / '.join(f'{v:.1f}' for v in values)} ({means[api] / floor:.1f}x)")
            else:
                cells.append("-")
        ratio = f"{means['torch'] / means['CuPy']:.2f}" if len(means) == 2 else "-"
        print(f"{name:32s} {cells[0]:>24s} {cells[1]:>24s} {ratio:>10s}")
