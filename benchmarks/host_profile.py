"""Where each eager call's host time goes: a cProfile of every call of ``python -m cuep.bench --mode host``,
through the CuPy API and through cuep.torch (GPU, mpirun, rank 0's profile).

    mpirun -np 1 python benchmarks/host_profile.py [--calls 400] [--top 25] [--only NAME]  # PYTHONPATH=.

For each call (the same calls, on the same workload, as ``--mode host``), runs ``--calls`` of it in
bursts of 20 with a sync between bursts under cProfile, and prints the functions with the most own time,
per call in microseconds. cProfile slows Python calls down several times over, so read the shares, not the
totals; the totals are ``--mode host``'s.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import cupy
from mpi4py import MPI

from cuep import bench_host
from cuep.bench import _workload


def run_whole(call) -> None:
    """One call; a split call's second part (a hook's receive) runs at once, as ``--mode host`` runs it."""
    result = call()
    if callable(result):
        result()


def profile(call, synchronize, calls: int, top: int) -> str:
    run_whole(call)  # a hook's send left without its receive would break the call order of the next one
    synchronize()
    profiler = cProfile.Profile()
    for start in range(0, calls, bench_host.BURST):
        profiler.enable()
        for _ in range(min(bench_host.BURST, calls - start)):
            run_whole(call)
        profiler.disable()
        synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    total_us = stats.total_tt / calls * 1e6
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:top]
    lines = [f"  total under cProfile: {total_us:.1f} us per call"]
    for (filename, line, function), (_, ncalls, tottime, cumtime, _) in rows:
        where = filename.rsplit("/cuep/", 1)[-1] if "/cuep/" in filename else filename.rsplit("/", 1)[-1]
        lines.append(f"  {tottime / calls * 1e6:7.2f} own {cumtime / calls * 1e6:8.2f} cum  "
                     f"{ncalls / calls:5.1f}x  {where}:{line} {function}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--only", help="profile only the calls whose name contains this")
    args = parser.parse_args()
    args.tokens, args.low_latency_tokens, args.hidden, args.experts, args.topk = 4096, 128, 7168, 256, 8
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    workload = bench_host.workload_arrays(
        rank, args, lambda r, tokens: _workload(r, tokens, args.hidden, args.experts, args.topk))
    device = cupy.cuda.Device()

    def synchronize() -> None:
        device.synchronize()
        comm.Barrier()

    wait = bench_host.WaitTimer()
    apis = {api: bench_host.cuep_calls(api, comm, args, workload, wait) for api in ("CuPy", "torch")}
    for api, (whole, splits) in apis.items():
        calls = {**whole, **{split.name: split.call for split in splits}}
        for name, call in calls.items():
            if args.only and args.only not in name:
                continue
            report = profile(call, synchronize, args.calls, args.top)
            if rank == 0:
                print(f"== {api}: {name}\n{report}", flush=True)


if __name__ == "__main__":
    main()
