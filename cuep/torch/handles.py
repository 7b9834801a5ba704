"""The handles ``cuep.torch.Buffer`` hands out: tuples of tensors, as DeepEP's, that remember their core handle."""

from __future__ import annotations

from typing import Any


class DispatchHandle(tuple):
    """A normal-mode dispatch's handle: a tuple of tensors, as DeepEP's, that torch can save and hand back.

    Item 0 is the rank prefix matrix, `[num_ranks, num_ranks]` `int32` (entry `[i][j]`: the tokens that
    ranks `0..i` send to rank `j`); across nodes, item -4 is `recv_gbl_rank_prefix_sum`, `[num_ranks]`
    `int32` (the rows received from ranks `0..i`). The other items are cuep's own; a tuple of the same items
    (rebuilt after saving, say) is taken back too."""

    core: Any
    buffer: Any


class LowLatencyHandle(tuple):
    """A low-latency dispatch's handle, DeepEP's five items: `recv_src_info` `[num_local_experts, num_ranks *
    num_max_dispatch_tokens_per_rank]` `int32` (each received row's token index on its source rank),
    `layout_range` `[num_local_experts, num_ranks]` `int64` (``(first row << 32) | rows`` from each source
    rank), ``num_max_dispatch_tokens_per_rank``, ``hidden``, ``num_experts``.

    The two tensors are views of the dispatch's outputs. A decode loop gets the same handle object back, with
    the same tensors, on a later dispatch once it has let go of this one (outputs are pooled: see
    ``cuep._front.OutputPool``). Only the handle a dispatch returned (or a copy of it) goes back to the combine
    of the Buffer that made it; a tuple rebuilt from its items does not."""

    core: Any = None     # the core's low_latency.Handle
    front: Any = None    # the TorchFront of the Buffer whose dispatch made it

    @classmethod
    def of(cls, core_handle: Any, front: Any) -> LowLatencyHandle:
        """The handle of ``core_handle`` (whose ``items`` are its two tensors), made by ``front``'s Buffer."""
        src_info, layout_range = core_handle.items
        handle = cls((src_info, layout_range, core_handle.num_max_dispatch_tokens_per_rank, core_handle.hidden,
                      core_handle.num_experts))
        handle.core, handle.front = core_handle, front
        return handle
