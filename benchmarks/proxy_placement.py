"""Where NVSHMEM's proxy thread runs, against the host time of eager calls (GPU, mpirun, one rank).

    mpirun -np 1 python benchmarks/proxy_placement.py [--rounds 200]    # from the repository root, PYTHONPATH=.

NVSHMEM's start leaves a thread that polls without sleeping. This finds it (the thread that used the most
processor time while the rank slept; its processor time and where cuep let it run are printed), then
times a low-latency dispatch and a normal-mode dispatch with a layout (its CPU wait included) with that
thread placed in turn: on the rank's own core (where it starts when mpirun binds the rank to a core), on
that core's SMT siblings, and where :mod:`cuep.runtime.affinity` let it run. The placements take turns,
burst by burst, so a slow spell of the host weighs on each alike. Figures: the host microseconds per call
of bursts of 20 without a sync (the bench's unit), as the mean, the median and the 90th percentile of the
bursts.
"""

from __future__ import annotations

import argparse
import os
import time

import cupy
import numpy as np
from mpi4py import MPI

import cuep
from cuep.bench import _workload
from cuep.runtime import affinity
from cuep.config import Config

TOKENS, LOW_LATENCY_TOKENS, HIDDEN, EXPERTS, TOPK = 4096, 128, 7168, 256, 8
BURST = 20


def _busiest_thread(seconds: float = 1.0) -> tuple[int, float]:
    """The thread of this process that used the most processor time while this thread slept ``seconds``,
    and the processor seconds it used."""
    def ticks() -> dict[int, int]:
        used = {}
        for name in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{name}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:  # the thread ended since the listing
                continue
            used[int(name)] = int(fields[11]) + int(fields[12])
        return used
    before = ticks()
    time.sleep(seconds)
    after = ticks()
    busiest = max(after, key=lambda tid: after[tid] - before.get(tid, 0))
    return busiest, (after[busiest] - before.get(busiest, 0)) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200, help="bursts per call and placement")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    num_ranks = comm.Get_size()
    x, topk_idx, weights = _workload(comm.Get_rank(), TOKENS, HIDDEN, EXPERTS, TOPK)
    ll_x, ll_topk_idx, _ = _workload(comm.Get_rank(), LOW_LATENCY_TOKENS, HIDDEN, EXPERTS, TOPK)
    normal = cuep.Buffer(comm, Config().get_nvl_buffer_size_hint(HIDDEN * 2, num_ranks, TOKENS), 0)
    hint = cuep.Buffer.get_low_latency_rdma_size_hint(LOW_LATENCY_TOKENS, HIDDEN, num_ranks, EXPERTS)
    low_latency = cuep.Buffer(comm, 0, hint, low_latency_mode=True)
    per_rank, _, per_expert, in_rank, _ = normal.get_dispatch_layout(topk_idx, EXPERTS)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=topk_idx, topk_weights=weights)
    calls = {
        "low-latency dispatch FP8": lambda: low_latency.low_latency_dispatch(ll_x, ll_topk_idx, LOW_LATENCY_TOKENS,
                                                                             EXPERTS),
        "dispatch with a layout (its wait included)": lambda: normal.dispatch(x, **layout),
    }
    proxy, busy_seconds = _busiest_thread()
    placed_by_cuep = sorted(os.sched_getaffinity(proxy))
    own = os.sched_getaffinity(0)
    siblings = affinity.smt_siblings(own) - own
    placements = {"rank's own core": own, "its SMT siblings": siblings, "where cuep put it": set(placed_by_cuep)}
    placements = {name: cpus for name, cpus in placements.items() if cpus}
    device = cupy.cuda.Device()
    samples = {(place, call): [] for place in placements for call in calls}
    for call in calls.values():
        call()
    for _ in range(args.rounds):
        for place, cpus in placements.items():
            os.sched_setaffinity(proxy, cpus)
            time.sleep(0.01)  # the thread moves at its next scheduling
            for name, call in calls.items():
                device.synchronize()
                started = time.perf_counter()
                for _ in range(BURST):
                    call()
                samples[(place, name)].append((time.perf_counter() - started) / BURST * 1e6)
    device.synchronize()
    if comm.Get_rank() == 0:
        print(f"rank's cpus {sorted(own)}, SMT siblings {sorted(siblings)}, {os.cpu_count()} processors; proxy "
              f"thread {proxy}; {args.rounds} rounds of bursts of {BURST}: mean / median / p90 of the bursts, "
              f"us per call")
        print(f"  the proxy used {busy_seconds:.2f} s of processor time in 1 s while the rank slept; cuep had let it "
              f"run on processors {placed_by_cuep[0]}..{placed_by_cuep[-1]} ({len(placed_by_cuep)} of them)")
        for (place, name), values in samples.items():
            print(f"  {place:18s} {name:44s} {np.mean(values):8.1f} / {np.median(values):8.1f} / "
                  f"{np.percentile(values, 90):8.1f}")


if __name__ == "__main__":
    main()
