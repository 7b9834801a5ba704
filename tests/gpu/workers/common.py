"""Shared by the MPI workers: run named cases on every rank, abort the whole job on the first failure."""

from __future__ import annotations

import sys
import traceback

import numpy as np


def random_topk(rng: np.random.Generator, num_tokens: int, num_experts: int, num_topk: int,
                masked_fraction: float = 0.0, dtype=np.int64) -> np.ndarray:
    """Top-k routing like a gate's: distinct experts per token, some entries masked to -1."""
    scores = rng.random((num_tokens, num_experts))
    topk = np.argsort(scores, axis=1)[:, :num_topk].astype(dtype)
    topk[rng.random(topk.shape) < masked_fraction] = -1
    return topk


def assert_no_memory_growth(step, calls: int = 1000, warmup: int = 20, slack_bytes: int = 1 << 20) -> None:
    """Run ``step`` ``calls`` times after ``warmup``; the memory pool may not grow by more than ``slack_bytes``."""
    import cupy
    pool = cupy.get_default_memory_pool()
    for _ in range(warmup):
        step()
    cupy.cuda.Device().synchronize()
    before = pool.used_bytes()
    for _ in range(calls):
        step()
    cupy.cuda.Device().synchronize()
    assert pool.used_bytes() <= before + slack_bytes, (before, pool.used_bytes())


def run_cases(comm, cases) -> None:
    """Run ``(name, fn)`` pairs in order; on any failure print it and abort every rank.

    Ranks meet between cases: checking a case against the reference takes each rank a different time
    on the host (tens of seconds apart at 8 ranks), which must not count against the next case's
    bounded waits on the device."""
    rank = comm.Get_rank()
    for name, case in cases:
        comm.Barrier()
        try:
            case()
        except BaseException:
            print(f"[rank {rank}] FAILED {name}\n{traceback.format_exc()}", flush=True)
            sys.stderr.flush()
            comm.Abort(1)
        if rank == 0:
            print(f"[rank 0] ok {name}", flush=True)
