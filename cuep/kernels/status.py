"""The status words a kernel fills when a bounded wait gives up (mirror of cuda_src/cuep/common.cuh)."""

from __future__ import annotations

from ..errors import PeerTimeoutError

STATUS_WORDS = 4
TIMED_OUT, PEER, PHASE, OVERFLOW = 0, 1, 2, 3
PHASE_NAMES = {1: "device barrier"}


def raise_if_failed(status_host, rank: int, timeout_s: float) -> None:
    """``status_host``: the status words as of the last completed copy from the device."""
    if int(status_host[OVERFLOW]):
        raise ValueError(f"dispatch(): rank {rank} had {int(status_host[OVERFLOW])} tokens to receive, more than "
                         f"num_worst_tokens; its received arrays were cut short. Pass num_worst_tokens >= "
                         f"num_ranks * num_tokens")
    if int(status_host[TIMED_OUT]):
        phase = PHASE_NAMES.get(int(status_host[PHASE]), f"phase {int(status_host[PHASE])}")
        raise PeerTimeoutError(rank, int(status_host[PEER]), phase, timeout_s)
