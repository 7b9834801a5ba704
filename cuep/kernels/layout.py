"""Launch module of ``cuda_src/layout.cu``: the dispatch layout (per-expert, per-rank and per-node
counts from the top-k ids), no communication.

C++ entries, one per ``topk_idx`` dtype, each taking the fields of ``LayoutArgs`` as scalar
parameters (``args_topk_idx, args_num_tokens, ...``; as one struct parameter the counting loops
compiled to other code). :class:`LayoutArgs` mirrors them; the launcher passes its bytes as the
entry's parameters::

    cuep::layout::get_dispatch_layout_i32(LayoutArgs fields)
    cuep::layout::get_dispatch_layout_i64(LayoutArgs fields)
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import numpy as np

from .._math import ceil_div
from ..jit import KernelSpec, Library
from . import launcher
from .common import family_constants
from .launcher import KernelArgs, entries_of

if TYPE_CHECKING:  # the status words' owner imports this package
    from .._status import StatusWords

NUM_THREADS = 256
# Counters per block live in registers; 8 keeps the block count near the SM count for 256 experts.
EXPERTS_PER_BLOCK = 8
GROUPS_PER_BLOCK = 8
CONSTANTS = {"num_threads": NUM_THREADS, "experts_per_block": EXPERTS_PER_BLOCK, "groups_per_block": GROUPS_PER_BLOCK}
_MAX_LAUNCHES = 16  # per Buffer (LayoutLaunches): a model routes over one or two expert counts


class LayoutArgs(KernelArgs):
    """Mirror of ``cuep::LayoutArgs``, whose fields both entries take as their parameters."""

    cxx_name = "LayoutArgs"
    scalar_parameters = True
    entries = ("cuep::layout::get_dispatch_layout_i32", "cuep::layout::get_dispatch_layout_i64")
    _fields_ = [("topk_idx", ctypes.c_void_p),
                ("num_tokens", ctypes.c_int), ("num_topk", ctypes.c_int), ("num_experts", ctypes.c_int),
                ("num_ranks", ctypes.c_int), ("num_nodes", ctypes.c_int),
                ("num_tokens_per_expert", ctypes.c_void_p), ("num_tokens_per_rank", ctypes.c_void_p),
                ("num_tokens_per_node", ctypes.c_void_p), ("is_token_in_rank", ctypes.c_void_p),
                ("status_device", ctypes.c_void_p), ("status_host", ctypes.c_void_p)]


ARGUMENT_STRUCTS = (LayoutArgs,)
ENTRIES = entries_of(ARGUMENT_STRUCTS)
_ENTRY_BY_DTYPE = dict(zip((np.dtype(np.int32), np.dtype(np.int64)), LayoutArgs.entries))  # by topk_idx dtype


def spec(arch: str, **features) -> KernelSpec:
    """The family's spec: its block shape is a constant (kept out of the spec's name)."""
    return KernelSpec.create("layout", arch, constants=family_constants(CONSTANTS), entries=ENTRIES, **features)


def num_blocks(num_experts: int, num_ranks: int, num_nodes: int) -> int:
    """Blocks of the layout kernel: experts, then ranks, then (with several nodes) nodes, a block per
    EXPERTS_PER_BLOCK or GROUPS_PER_BLOCK of them."""
    blocks = ceil_div(num_experts, EXPERTS_PER_BLOCK) + ceil_div(num_ranks, GROUPS_PER_BLOCK)
    return blocks + (ceil_div(num_nodes, GROUPS_PER_BLOCK) if num_nodes > 1 else 0)


class LayoutLaunches:
    """The layout kernel as one Buffer launches it: a filled :class:`LayoutArgs` and its
    :class:`~cuep.kernels.launcher.Launch` per ``topk_idx`` dtype and expert count, made on first use; each
    call sets the routing's address and shape and the outputs' addresses (a struct and a launch built per
    call would cost host time on every eager layout).

    Arguments:
        library: the layout family's compiled library.
        num_ranks, num_nodes: the Buffer's ranks and nodes.
        status: the Buffer's status words.
    """

    def __init__(self, library: Library, num_ranks: int, num_nodes: int, status: StatusWords):
        self._library, self._num_ranks, self._num_nodes, self._status = library, num_ranks, num_nodes, status
        self._launches: dict[tuple, launcher.Launch] = {}

    def launch(self, stream, topk_idx, num_experts: int, num_tokens_per_expert, num_tokens_per_rank,
               num_tokens_per_node, is_token_in_rank) -> None:
        """Enqueue the layout kernel on ``stream`` (a CuPy stream); every output is overwritten.

        Arguments:
            topk_idx: `[num_tokens, num_topk]` `int32` or `int64`, `-1` for no expert; an id outside
                `[-1, num_experts)` counts nowhere and is recorded in the status words (a later call raises it).
            num_tokens_per_expert: `[num_experts]` `int32` out.
            num_tokens_per_rank: `[num_ranks]` `int32` out.
            num_tokens_per_node: `[num_nodes]` `int32` out, or ``None`` with one node.
            is_token_in_rank: `[num_tokens, num_ranks]` `bool` out.
        """
        key = (topk_idx.dtype, num_experts)
        launch = self._launches.get(key)
        if launch is None:
            launch = self._launches[key] = self._new_launch(topk_idx.dtype, num_experts)
        args = launch.args
        args.topk_idx, (args.num_tokens, args.num_topk) = topk_idx.data.ptr, topk_idx.shape
        args.num_tokens_per_expert = num_tokens_per_expert.data.ptr
        args.num_tokens_per_rank = num_tokens_per_rank.data.ptr
        args.num_tokens_per_node = num_tokens_per_node.data.ptr if num_tokens_per_node is not None else 0
        args.is_token_in_rank = is_token_in_rank.data.ptr
        launch(stream)

    def _new_launch(self, dtype, num_experts: int) -> launcher.Launch:
        if len(self._launches) >= _MAX_LAUNCHES:
            self._launches.clear()
        num_ranks, num_nodes, status = self._num_ranks, self._num_nodes, self._status
        args = LayoutArgs(num_experts=num_experts, num_ranks=num_ranks, num_nodes=num_nodes,
                          status_device=status.device.data.ptr, status_host=status.host_ptr)
        return launcher.Launch(self._library, _ENTRY_BY_DTYPE[dtype], num_blocks(num_experts, num_ranks, num_nodes),
                               NUM_THREADS, args)
