"""What the examples share: deterministic expert weights and a top-k gate (CuPy only).

Both are the same on every rank, so each rank can recompute the whole layer on one GPU to check itself.
"""

from __future__ import annotations

import cupy


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
