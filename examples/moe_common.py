"""What the examples share: deterministic tokens and expert weights, a top-k gate, the one-GPU check and
where the ranks run (CuPy only).

Weights and gate are the same on every rank, so each rank can recompute the whole layer on one GPU to
check itself; any rank can regenerate any rank's tokens.
"""

from __future__ import annotations

from typing import Callable

import cupy
import ml_dtypes
import numpy as np
from mpi4py import MPI

BF16 = np.dtype(ml_dtypes.bfloat16)


def tokens_of_rank(rank: int, num_tokens: int, hidden: int) -> cupy.ndarray:
    """Rank ``rank``'s `[num_tokens, hidden]` bfloat16 hidden states; every rank can regenerate every rank's."""
    x = cupy.random.default_rng(rank).standard_normal((num_tokens, hidden), dtype=cupy.float32)
    return x.astype(BF16)


def expert_weight(expert: int, hidden: int) -> cupy.ndarray:
    """Expert ``expert``'s `[hidden, hidden]` float32 matrix, the same on every rank."""
    return cupy.random.default_rng(10_000 + expert).standard_normal((hidden, hidden), dtype=cupy.float32) / hidden ** 0.5


def gate(x: cupy.ndarray, experts: int, topk: int, seed: int):
    """Top-k experts per token and their softmax weights, from a random linear router."""
    router = cupy.random.default_rng(seed).standard_normal((x.shape[1], experts), dtype=cupy.float32)
    logits = x.astype(cupy.float32) @ router
    topk_idx = cupy.argsort(-logits, axis=1)[:, :topk]
    chosen = cupy.take_along_axis(logits, topk_idx, axis=1)
    weights = cupy.exp(chosen - chosen.max(axis=1, keepdims=True))
    return topk_idx.astype(cupy.int64), (weights / weights.sum(axis=1, keepdims=True)).astype(cupy.float32)


def one_gpu_layer(tokens: cupy.ndarray, topk_idx: cupy.ndarray, topk_weights: cupy.ndarray, experts: int,
                  expert_output: Callable[[cupy.ndarray], cupy.ndarray] = lambda out: out) -> cupy.ndarray:
    """The whole layer for ``tokens`` (float32) on one GPU: per token, the sum over its chosen experts
    of weight * expert_output(token @ W_e); ``expert_output`` applies the rounding the distributed
    layer's expert outputs go through."""
    expected = cupy.zeros(tokens.shape, dtype=cupy.float32)
    for expert in range(experts):
        rows, slots = cupy.nonzero(topk_idx == expert)
        if rows.size:
            out = expert_output(tokens[rows] @ expert_weight(expert, tokens.shape[1]))
            expected[rows] += topk_weights[rows, slots][:, None] * out
    return expected


def worst_relative_error(comm, output: cupy.ndarray, expected: cupy.ndarray) -> float:
    """The largest, over the ranks, of ||output - expected|| / ||expected||."""
    error = float(cupy.linalg.norm(output.astype(cupy.float32) - expected) / cupy.linalg.norm(expected))
    return comm.allreduce(error, op=MPI.MAX)


def gpus_in_use(comm, device_id: int) -> tuple[int, int]:
    """``(GPUs, hosts)`` that the ranks of ``comm`` run on: physical GPUs told apart by host and PCI bus id,
    so ranks sharing a GPU (``CUEP_SHARE_GPUS=1``) count it once."""
    where = comm.allgather((MPI.Get_processor_name(), cupy.cuda.runtime.deviceGetPCIBusId(device_id)))
    return len(set(where)), len({host for host, _ in where})
