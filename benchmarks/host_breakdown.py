"""Where a normal-mode dispatch with a layout spends its host time: the median microseconds of each piece it
calls, per call (GPU, mpirun, one rank is enough).

    mpirun -np 1 python benchmarks/host_breakdown.py [--calls 200] [--no-gc]     # PYTHONPATH=.

Each piece (a function of the modes, checks and launcher) is wrapped with a timer for the run; a figure is
the median over ``--calls`` calls of the microseconds that piece took within one call (summed when it
runs several times in it), so a rare stall (a garbage collection, a preemption) does not count, as it
would in a profiler's totals. Pieces nest (a launch inside the dispatch), so they do not add up. The
whole call's mean and tail, and its mean by place in the burst, show what the medians leave out (the bench's
figure is a burst's mean); ``--no-gc`` turns the garbage collector off while timing.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections import defaultdict

import cupy
import numpy as np
from mpi4py import MPI

import cuep
from cuep import _checks, _front, _interop, _streams
from cuep.bench import _workload
from cuep.config import Config
from cuep.kernels import barrier as barrier_kernel
from cuep.kernels import launcher
from cuep.modes import intranode, resources

TOKENS, HIDDEN, EXPERTS, TOPK = 4096, 7168, 256, 8

PIECES = [
    (cuep.Buffer, "dispatch"), (_checks, "dispatch_arguments"), (_checks, "widened_ids"),
    (_streams.CallStreams, "run"), (intranode, "dispatch"), (intranode, "need_round_tokens"),
    (intranode, "need_region_bytes"), (intranode, "_sender_tokens"), (intranode.Context, "status_mirror"),
    (_front.CupyFront, "empty"), (intranode, "launch"), (launcher.Launch, "__init__"), (launcher.Launch, "__call__"),
    (barrier_kernel, "launch"), (_interop, "read_on_host"), (resources.Resources, "raise_if_failed"),
    (intranode.Handle, "__init__"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--no-gc", action="store_true", help="garbage collector off while timing")
    args = parser.parse_args()
    if args.calls < 20:
        parser.error("--calls must be at least 20 (one burst)")
    comm = MPI.COMM_WORLD
    num_ranks = comm.Get_size()
    x, topk_idx, weights = _workload(comm.Get_rank(), TOKENS, HIDDEN, EXPERTS, TOPK)
    buffer = cuep.Buffer(comm, Config().get_nvl_buffer_size_hint(HIDDEN * 2, num_ranks, TOKENS), 0)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, EXPERTS)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=topk_idx, topk_weights=weights)
    buffer.dispatch(x, **layout)
    cupy.cuda.Device().synchronize()

    spent: dict[str, float] = defaultdict(float)

    def timed(owner, name: str):
        original = getattr(owner, name)
        label = f"{getattr(owner, '__name__', owner)}.{name}"

        def wrapper(*a, **k):
            started = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                spent[label] += time.perf_counter() - started
        setattr(owner, name, wrapper)
        return label

    labels = [timed(owner, name) for owner, name in PIECES]
    if args.no_gc:
        gc.disable()
    per_call: dict[str, list[float]] = defaultdict(list)
    for index in range(args.calls):
        spent.clear()
        started = time.perf_counter()
        buffer.dispatch(x, **layout)
        whole = time.perf_counter() - started
        for label in labels:
            per_call[label].append(spent.get(label, 0.0))
        per_call["whole call"].append(whole)
        if index % 20 == 19:
            cupy.cuda.Device().synchronize()
    if comm.Get_rank() == 0:
        print(f"dispatch with a layout, {TOKENS} tokens x {HIDDEN}, {num_ranks} rank(s), {args.calls} calls "
              f"(a sync every 20): median us per call of each piece")
        for label in ["whole call", *labels]:
            values = np.array(per_call[label]) * 1e6
            print(f"  {label:44s} median {np.median(values):8.1f}  p90 {np.percentile(values, 90):8.1f}  "
                  f"mean {values.mean():8.1f}  max {values.max():8.1f}")
        whole = np.array(per_call["whole call"]) * 1e6
        wait = np.array(per_call[f"{_interop.__name__}.read_on_host"]) * 1e6
        print("  whole call less its wait, mean by place in the burst: " + " ".join(
            f"{np.mean((whole - wait)[place::20]):.0f}" for place in range(20)))


if __name__ == "__main__":
    main()
