"""One eager call of ``python -m cuep.bench --mode host``, repeated for a while, for a sampling profiler to read.

    mpirun --bind-to none -np 1 py-spy record --rate 250 --format raw -o calls.txt -- \
        python benchmarks/sample_calls.py --api torch --call "low-latency dispatch FP8" --seconds 8   # PYTHONPATH=.
    python benchmarks/fold_samples.py calls.txt

cProfile (``benchmarks/host_profile.py``) adds its own cost to every Python call, which at a few
microseconds a call hides where the time goes. A sampler adds nothing per call: py-spy pauses the process
for each sample instead (at 250 samples a second, calls ran about 1.5x slower, evenly), and with
``--native`` it would see into torch's, CuPy's and the driver's C code too, at a cost that kept it from
keeping up here. Under mpirun's default binding the sampler shares the rank's one core: use ``--bind-to
none``. This runs the call in bursts of :data:`cuep.bench_host.BURST` with a sync between bursts, as
``--mode host`` times it, for ``--seconds``, and prints its host time per call. ``benchmarks/fold_samples.py``
sums the samples by function, under the frame ``timed_call`` that wraps each call.
"""

from __future__ import annotations

import argparse
import time

import cupy
from mpi4py import MPI

from cuep import bench_host
from cuep.bench import _workload

HIDDEN, EXPERTS, TOPK = 7168, 256, 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--api", choices=["CuPy", "torch"], default="CuPy")
    parser.add_argument("--call", required=True, help="a row name of --mode host (a hook row runs send and receive)")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--low-latency-tokens", type=int, default=128)
    args = parser.parse_args()
    args.hidden, args.experts, args.topk = HIDDEN, EXPERTS, TOPK
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    workload = bench_host.workload_arrays(rank, args, lambda r, tokens: _workload(r, tokens, HIDDEN, EXPERTS, TOPK))
    whole, split = bench_host.cuep_calls(args.api, comm, args, workload, bench_host.WaitTimer())
    calls = dict(whole)
    for part in split:  # a split call runs its second part at once (a hook's receive), as --mode host runs it
        calls[part.name] = calls[part.part_name] = lambda call=part.call: call()()
    call = calls[args.call]

    def timed_call():  # the frame fold_samples.py sums under
        return call()

    device = cupy.cuda.Device()
    done, bursts, started = time.perf_counter() + args.seconds, 0, time.perf_counter()
    timed = 0.0
    while time.perf_counter() < done:
        burst_start = time.perf_counter()
        for _ in range(bench_host.BURST):
            timed_call()
        timed += time.perf_counter() - burst_start
        bursts += 1
        device.synchronize()
    elapsed = time.perf_counter() - started
    print(f"[rank {rank}] {args.api} {args.call!r}: {bursts * bench_host.BURST} calls in {elapsed:.1f} s, "
          f"{timed / (bursts * bench_host.BURST) * 1e6:.1f} us per call inside bursts "
          f"({timed / elapsed:.0%} of the run)")


if __name__ == "__main__":
    main()
