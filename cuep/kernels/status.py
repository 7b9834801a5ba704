"""The status words a kernel fills when a bounded wait gives up (mirror of cuda_src/cuep/common.cuh)."""

from __future__ import annotations

from ..errors import PeerTimeoutError

STATUS_WORDS = 4
TIMED_OUT, PEER, PHASE = 0, 1, 2
PHASE_NAMES = {1: "device barrier"}


def raise_if_timed_out(status_host, rank: int, timeout_s: float) -> None:
    """``status_host``: the status words copied to the host after the kernel's stream finished."""
    if int(status_host[TIMED_OUT]):
        phase = PHASE_NAMES.get(int(status_host[PHASE]), f"phase {int(status_host[PHASE])}")
        raise PeerTimeoutError(rank, int(status_host[PEER]), phase, timeout_s)
