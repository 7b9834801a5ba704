"""Launch module of ``cuda_src/layout.cu`` (the dispatch layout).

C++ entries, one per ``topk_idx`` dtype::

    cuep_dispatch_layout_i32 / cuep_dispatch_layout_i64(
        const TopkIdx* topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks,
        int num_nodes, int* num_tokens_per_expert, int* num_tokens_per_rank,
        int* num_tokens_per_node, bool* is_token_in_rank)
"""

from __future__ import annotations

import numpy as np

from .. import _deps
from ..jit import KernelSpec, Library

NUM_THREADS = 256
# Counters per block live in registers; 8 keeps the block count near the SM count for 256 experts.
EXPERTS_PER_BLOCK = 8
GROUPS_PER_BLOCK = 8
_ENTRIES = {np.dtype(np.int32): "cuep_dispatch_layout_i32", np.dtype(np.int64): "cuep_dispatch_layout_i64"}


def spec(arch: str, **features) -> KernelSpec:
    return KernelSpec.create("layout", arch, {"num_threads": NUM_THREADS, "experts_per_block": EXPERTS_PER_BLOCK,
                                              "groups_per_block": GROUPS_PER_BLOCK}, **features)


def num_blocks(num_experts: int, num_ranks: int, num_nodes: int) -> int:
    blocks = -(-num_experts // EXPERTS_PER_BLOCK) + -(-num_ranks // GROUPS_PER_BLOCK)
    return blocks + (-(-num_nodes // GROUPS_PER_BLOCK) if num_nodes > 1 else 0)


def launch(library: Library, stream, topk_idx, num_experts: int, num_ranks: int, num_nodes: int,
           num_tokens_per_expert, num_tokens_per_rank, num_tokens_per_node, is_token_in_rank) -> None:
    """Enqueue the layout kernel on ``stream`` (a cuda.core Stream); every output is overwritten."""
    core = _deps.cuda_core()
    num_tokens, num_topk = topk_idx.shape
    config = core.LaunchConfig(grid=num_blocks(num_experts, num_ranks, num_nodes), block=NUM_THREADS)
    per_node_ptr = num_tokens_per_node.data.ptr if num_tokens_per_node is not None else 0
    core.launch(stream, config, library.kernel(_ENTRIES[topk_idx.dtype]),
                topk_idx.data.ptr, np.int32(num_tokens), np.int32(num_topk), np.int32(num_experts),
                np.int32(num_ranks), np.int32(num_nodes), num_tokens_per_expert.data.ptr,
                num_tokens_per_rank.data.ptr, np.uint64(per_node_ptr), is_token_in_rank.data.ptr)
