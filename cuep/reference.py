"""NumPy oracle of every cuep operation's semantics. Tests use it; Buffer never does.

Functions take plain NumPy arrays (every rank's inputs where an operation spans ranks) and need no
communicator, no GPU and no MPI.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class DispatchLayout(NamedTuple):
    """What ``Buffer.get_dispatch_layout`` returns, minus the event."""

    num_tokens_per_rank: np.ndarray          # [num_ranks] int32
    num_tokens_per_rdma_rank: np.ndarray | None  # [num_nodes] int32, None on one node
    num_tokens_per_expert: np.ndarray        # [num_experts] int32
    is_token_in_rank: np.ndarray             # [num_tokens, num_ranks] bool


def get_dispatch_layout(topk_idx: np.ndarray, num_experts: int, num_ranks: int,
                        num_ranks_per_node: int | None = None) -> DispatchLayout:
    """Layout of one rank's tokens.

    Rank ``r`` holds experts ``[r * E / R, (r + 1) * E / R)``; node ``n`` holds ranks
    ``[n * ranks_per_node, (n + 1) * ranks_per_node)``. A ``-1`` entry routes nowhere. An expert
    counts every entry naming it; a rank (node) counts each token once if any of its top-k experts
    lives there.
    """
    topk_idx = np.asarray(topk_idx)
    if topk_idx.ndim != 2:
        raise ValueError(f"topk_idx must be [num_tokens, num_topk], got shape {topk_idx.shape}")
    if num_experts % num_ranks:
        raise ValueError(f"num_experts={num_experts} must be a multiple of num_ranks={num_ranks}")
    ranks_per_node = num_ranks if num_ranks_per_node is None else num_ranks_per_node
    if num_ranks % ranks_per_node:
        raise ValueError(f"num_ranks={num_ranks} must be a multiple of num_ranks_per_node={ranks_per_node}")
    if ((topk_idx < -1) | (topk_idx >= num_experts)).any():
        raise ValueError(f"topk_idx entries must be -1 or in [0, {num_experts})")
    num_tokens = topk_idx.shape[0]
    routed = topk_idx >= 0
    experts = topk_idx[routed]
    per_expert = np.bincount(experts, minlength=num_experts).astype(np.int32)

    rank_of = np.where(routed, topk_idx // (num_experts // num_ranks), -1)
    is_token_in_rank = np.zeros((num_tokens, num_ranks), dtype=bool)
    rows = np.broadcast_to(np.arange(num_tokens)[:, None], topk_idx.shape)
    is_token_in_rank[rows[routed], rank_of[routed]] = True
    per_rank = is_token_in_rank.sum(axis=0).astype(np.int32)

    per_node = None
    num_nodes = num_ranks // ranks_per_node
    if num_nodes > 1:
        in_node = is_token_in_rank.reshape(num_tokens, num_nodes, ranks_per_node).any(axis=2)
        per_node = in_node.sum(axis=0).astype(np.int32)
    return DispatchLayout(per_rank, per_node, per_expert, is_token_in_rank)
