"""Exceptions cuep raises on purpose; every other failure is a bug."""

from __future__ import annotations


class CuepError(RuntimeError):
    """Base class of cuep's runtime errors."""


class NoGPUError(CuepError):
    """The machine shows no CUDA GPU (none visible to this process, or no driver)."""


class MissingDependencyError(ImportError):
    """A package cuep needs is absent or unusable; the message says what to install."""


class CompileError(CuepError):
    """NVRTC or nvJitLink rejected a kernel; the message holds the log and the kept source."""


class PeerTimeoutError(CuepError, TimeoutError):
    """A peer rank did not arrive within ``CUEP_TIMEOUT_S``.

    Attributes:
        rank: the rank that waited.
        peer: the rank it waited for (``-1`` when unknown).
        phase: what it was waiting for (e.g. ``"barrier"``, ``"compile"``).
    """

    def __init__(self, rank: int, peer: int, phase: str, timeout_s: float):
        self.rank, self.peer, self.phase, self.timeout_s = rank, peer, phase, timeout_s
        who = f"rank {peer}" if peer >= 0 else "a peer"
        super().__init__(
            f"rank {rank} waited {timeout_s:g} s for {who} in {phase} and gave up; "
            f"check that every rank makes the same cuep calls in the same order "
            f"(raise CUEP_TIMEOUT_S if the peer is merely slow)")


class MaskedRankError(CuepError):
    """This rank's peers masked it in shrink mode (``Buffer(..., enable_shrink=True)``): it did not
    answer within ``CUEP_TIMEOUT_S``, and its low-latency calls do nothing until every rank calls
    ``Buffer.low_latency_clean_mask_buffer()``."""


class CallOrderError(CuepError):
    """Low-latency calls broke a rule of their order (docs/low-latency.md, "Low-latency call order"), found on the
    device: too many results in flight on this rank, two combines of one dispatch's handle in flight, a
    receive run for a call whose send never ran or that was already received, or a peer whose newer call
    reached this rank's buffer before this rank read the call it waits for (the ranks' calls differ). The
    call that broke the rule moved nothing; the calls after it until this error is raised gave up their
    waits at once, so their results are incomplete. ``Buffer.clean_low_latency_buffer(...)`` (shrink mode:
    ``low_latency_clean_mask_buffer()``) starts over, collectively.

    Attributes:
        rank: the rank that found it.
        rule: which rule (a sentence).
        call: the number of the low-latency call (counted from 1 on every rank) that met it.
        peer: the peer whose newer call arrived (``-1`` when the rule is this rank's own).
    """

    def __init__(self, rank: int, rule: str, call: int, peer: int = -1):
        self.rank, self.rule, self.call, self.peer = rank, rule, call, peer
        super().__init__(f"low-latency call {call} on rank {rank}: {rule}")
