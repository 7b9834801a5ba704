"""The status words a kernel fills when a bounded wait gives up (mirror of cuda_src/cuep/common.cuh)."""

from __future__ import annotations

from ..errors import PeerTimeoutError

STATUS_WORDS = 6
TIMED_OUT, PEER, PHASE, OVERFLOW, BAD_EXPERT_IDS, LANDING_ROWS = 0, 1, 2, 3, 4, 5
PHASE_NAMES = {1: "device barrier", 2: "low-latency dispatch (routing table)", 3: "low-latency dispatch (token data)",
               4: "low-latency combine (top-k weights)", 5: "low-latency combine (partial sums)",
               6: "intranode dispatch (staged tokens)", 7: "intranode dispatch (previous dispatch's pulls)",
               8: "intranode dispatch or combine (a peer starting the same call)",
               9: "intranode combine (row arrivals)", 11: "intranode dispatch (pushed rows)"}


def raise_if_failed(status_host, rank: int, timeout_s: float) -> None:
    """``status_host``: the status words as of the last completed copy from the device."""
    if int(status_host[OVERFLOW]):
        raise ValueError(f"dispatch(): rank {rank} had {int(status_host[OVERFLOW])} tokens to receive, more than "
                         f"num_worst_tokens; its received arrays were cut short. Pass num_worst_tokens >= "
                         f"num_ranks * num_tokens")
    if int(status_host[LANDING_ROWS]):
        raise ValueError(f"dispatch()/combine(): a cached dispatch or a combine seen by rank {rank} had to land "
                         f"{int(status_host[LANDING_ROWS])} rows on one rank, more than its NVL buffer holds, so it "
                         f"moved nothing; create the Buffer with a larger num_nvl_bytes "
                         f"(Config.get_nvl_buffer_size_hint gives a size for a batch)")
    if int(status_host[BAD_EXPERT_IDS]):
        raise ValueError(f"low_latency_dispatch()/low_latency_combine() on rank {rank}: topk_idx held expert ids "
                         f"outside [-1, num_experts); the kernel treated them as -1, so that call's result is wrong")
    if int(status_host[TIMED_OUT]):
        phase = PHASE_NAMES.get(int(status_host[PHASE]), f"phase {int(status_host[PHASE])}")
        raise PeerTimeoutError(rank, int(status_host[PEER]), phase, timeout_s)
