"""The status words a kernel fills when something goes wrong on the device, and how the host reads them.

Every value here is defined once: :data:`CONSTANTS` reaches the kernels as ``CUEP_STATUS_*`` and
``CUEP_PHASE_*`` macros (through ``cuep.kernels.common.CONSTANTS``), which ``cuda_src/cuep/common.cuh``
turns into ``kStatus*`` and ``kPhase*``. A kernel writes the words on the device and into their pinned
host mirror; the host reads the mirror after the stream completes and raises here.
"""

from __future__ import annotations

import ctypes
import enum

from ..errors import CallOrderError, MaskedRankError, PeerTimeoutError
from .launcher import KernelArgs

# Index of each int32 status word.
TIMED_OUT = 0       # 0 = fine, 1 = a bounded wait gave up
PEER = 1            # the rank that never arrived
PHASE = 2           # which wait (a Phase)
OVERFLOW = 3        # rows a dispatch needed beyond the num_worst_tokens it was given
BAD_EXPERT_IDS = 4  # the call (a BadIdsCall) that met a top-k id outside [-1, num_experts) and treated it as -1
ROUND_TOKENS = 5    # across nodes: the largest batch of a num_worst_tokens dispatch, beyond the one round it moves
SELF_MASKED = 6     # shrink mode: this rank's peers masked it, so its low-latency kernels did nothing
BAD_EXPERT_ID_LOW = 7   # the first such id, its low 32 bits
BAD_EXPERT_ID_HIGH = 8  # and its high 32 bits (ids may be int64)
BAD_EXPERT_LIMIT = 9    # that call's num_experts
CALL_ORDER = 10     # low latency: the rule of the call order a call broke (a CallOrderRule)
CALL_ORDER_CALL = 11    # the number of that call, its low 31 bits
CALL_ORDER_PEER = 12    # the peer whose newer call arrived (OVERTAKEN), else -1
STATUS_WORDS = 13
# The words that say a record is complete: a kernel writes a record's details (PEER and PHASE, the bad id
# and its limit) first and its flag last, behind a fence, so a host that sees only details waits.
FLAG_WORDS = (TIMED_OUT, OVERFLOW, BAD_EXPERT_IDS, ROUND_TOKENS, SELF_MASKED, CALL_ORDER)


class BadIdsCall(enum.IntEnum):
    """Which call met an out-of-range expert id (status word :data:`BAD_EXPERT_IDS`); the kernels name
    each ``kBadIds<Name>``. Checking the ids on the host would cost a sync per call, so the kernels
    check them, count such an id nowhere (as -1), and a later call raises (the next one once the kernel has
    finished)."""

    LOW_LATENCY = 1
    LAYOUT = 2


BAD_IDS_CALL_NAMES = {BadIdsCall.LOW_LATENCY: "low_latency_dispatch()/low_latency_combine()",
                      BadIdsCall.LAYOUT: "get_dispatch_layout()"}


class CallOrderRule(enum.IntEnum):
    """Which rule of the low-latency call order a call broke (status word :data:`CALL_ORDER`); the kernels
    name each ``kCallOrder<Name>``. docs/low-latency.md ("Low-latency call order") states the rules."""

    IN_FLIGHT = 1    # a send while two earlier calls of this rank were not received yet
    UNSENT = 2       # a receive (a hook) of a call whose send never ran, or is not one of the two newest
    RECEIVED = 3     # a receive of a call already received (a receive graph replayed without its send)
    OVERTAKEN = 4    # a peer's newer call reached the buffer this receive reads: the ranks' calls differ
    HANDLE_BUSY = 5  # a combine sent while another combine of the same dispatch's handle was not received


CALL_ORDER_RULES = {
    CallOrderRule.IN_FLIGHT: "a send while two earlier low-latency calls of this rank were not received yet "
                             "(at most two results may be in flight: call each hook, or replay each receive graph, "
                             "before the second send after its own)",
    CallOrderRule.UNSENT: "a receive hook (or a replayed receive graph) of a call whose send never ran, or is not "
                          "one of this rank's two newest sends",
    CallOrderRule.RECEIVED: "a receive hook (or a replayed receive graph) of a call that was already received; "
                            "replay a hook's send graph before each replay of its receive graph",
    CallOrderRule.OVERTAKEN: "a newer call of the peer reached the buffer this receive reads before this rank read it: "
                             "every rank must make the same low-latency calls in the same order, each within the "
                             "two-in-flight rule",
    CallOrderRule.HANDLE_BUSY: "a combine sent while another combine of the same dispatch's handle was not received "
                               "yet: the combines of one handle run one at a time (call the first one's hook first)"}
"""What each rule says, as CallOrderError words it."""


class Phase(enum.IntEnum):
    """Which bounded wait gave up (status word :data:`PHASE`); the kernels name each ``kPhase<Name>``."""

    BARRIER = 1
    LOW_LATENCY_ROUTING = 2    # a source's routing table (low-latency dispatch)
    LOW_LATENCY_TOKEN = 3      # a dispatched token
    LOW_LATENCY_WEIGHTS = 4    # a source's top-k weights (low-latency combine)
    LOW_LATENCY_PARTIAL = 5    # a combined partial sum
    INTRANODE_STAGED = 6       # a sender's staged tokens (intranode dispatch)
    INTRANODE_REUSE = 7        # receivers done with the previous dispatch (intranode)
    INTRANODE_STARTED = 8      # a peer starting the same call (intranode dispatch or combine)
    INTRANODE_ARRIVAL = 9      # a combined row's arrival (intranode combine)
    INTRANODE_PUSHED = 10      # a pushed row's arrival (intranode cached dispatch)
    INTERNODE_COUNTS = 11      # a source's count message (internode dispatch)
    INTERNODE_ROWS = 12        # a chunk of dispatched rows at a forwarder of this node
    INTERNODE_PUSHED = 13      # a local rank's pushed rows (internode combine, at the forwarder)
    INTERNODE_PARTIALS = 14    # a node's partial sums (internode combine, at the source)
    INTERNODE_RELEASED = 15    # a peer done with the previous round's rows (internode, before a round reuses them)


PHASE_NAMES = {Phase.BARRIER: "device barrier",
               Phase.LOW_LATENCY_ROUTING: "low-latency dispatch (routing table)",
               Phase.LOW_LATENCY_TOKEN: "low-latency dispatch (token data)",
               Phase.LOW_LATENCY_WEIGHTS: "low-latency combine (top-k weights)",
               Phase.LOW_LATENCY_PARTIAL: "low-latency combine (partial sums)",
               Phase.INTRANODE_STAGED: "intranode dispatch (staged tokens)",
               Phase.INTRANODE_REUSE: "intranode dispatch (previous dispatch's pulls)",
               Phase.INTRANODE_STARTED: "intranode dispatch or combine (a peer starting the same call)",
               Phase.INTRANODE_ARRIVAL: "intranode combine (row arrivals)",
               Phase.INTRANODE_PUSHED: "intranode dispatch (pushed rows)",
               Phase.INTERNODE_COUNTS: "internode dispatch (count messages)",
               Phase.INTERNODE_ROWS: "internode dispatch (rows at this node's forwarder)",
               Phase.INTERNODE_PUSHED: "internode combine (a local rank's pushed rows)",
               Phase.INTERNODE_PARTIALS: "internode combine (a node's partial sums)",
               Phase.INTERNODE_RELEASED: "internode dispatch or combine (a peer done with the previous round)"}
"""What a timed-out wait of each phase was waiting for, as PeerTimeoutError words it."""

CONSTANTS = {"status_timed_out": TIMED_OUT, "status_peer": PEER, "status_phase": PHASE, "status_overflow": OVERFLOW,
             "status_bad_expert_ids": BAD_EXPERT_IDS, "status_round_tokens": ROUND_TOKENS,
             "status_self_masked": SELF_MASKED, "status_bad_expert_id_low": BAD_EXPERT_ID_LOW,
             "status_bad_expert_id_high": BAD_EXPERT_ID_HIGH, "status_bad_expert_limit": BAD_EXPERT_LIMIT,
             "status_call_order": CALL_ORDER, "status_call_order_call": CALL_ORDER_CALL,
             "status_call_order_peer": CALL_ORDER_PEER, "status_words": STATUS_WORDS,
             **{f"call_order_{rule.name.lower()}": int(rule) for rule in CallOrderRule},
             **{f"phase_{phase.name.lower()}": int(phase) for phase in Phase},
             **{f"bad_ids_{call.name.lower()}": int(call) for call in BadIdsCall}}
"""The status layout, phase codes and bad-id call codes as the kernels see them (``CUEP_<NAME>``)."""


class Status(KernelArgs):
    """Mirror of ``cuep::Status`` (``cuda_src/cuep/sync.cuh``), a member of every argument struct whose
    kernels wait on peers: where a launch records what went wrong."""

    cxx_name = "Status"
    _fields_ = [("device", ctypes.c_void_p),  # [STATUS_WORDS] int32 device array, updated atomically
                ("host", ctypes.c_void_p)]    # device address of its pinned host mirror, read without a copy


class MaskedStatus(KernelArgs):
    """Mirror of ``cuep::MaskedStatus`` (``cuda_src/low_latency.cu``), the low-latency kernels' :class:`Status`
    with shrink mode's mask."""

    cxx_name = "MaskedStatus"
    _fields_ = [*Status._fields_,
                ("masked", ctypes.c_void_p),  # shrink mode: this rank's [num_ranks] int32 mask in the region; else 0
                ("rank", ctypes.c_int), ("num_ranks", ctypes.c_int)]


def holds_a_record(status_host) -> bool:
    """Whether the words hold a complete record: one of :data:`FLAG_WORDS` is set."""
    return any(int(status_host[word]) for word in FLAG_WORDS)


def bad_expert_id(status_host) -> int:
    """The out-of-range expert id recorded in words :data:`BAD_EXPERT_ID_LOW` and ``_HIGH``, as an int64."""
    low, high = int(status_host[BAD_EXPERT_ID_LOW]) & 0xFFFFFFFF, int(status_host[BAD_EXPERT_ID_HIGH])
    return (high << 32) | low


def raise_if_failed(status_host, rank: int, timeout_s: float) -> None:
    """Raise what the status words recorded, if anything: ``ValueError`` for a caller's error the
    kernel could only see on the device, :class:`~cuep.errors.PeerTimeoutError` for a wait that gave up.

    Arguments:
        status_host: the ``[STATUS_WORDS]`` words as of the last completed copy from the device.
        rank: this process's rank, for the message.
        timeout_s: the bound the waits ran with, for the message.
    """
    if int(status_host[OVERFLOW]):
        raise ValueError(f"dispatch(): rank {rank} had {int(status_host[OVERFLOW])} tokens to receive, more than "
                         f"num_worst_tokens; its received arrays were cut short. Pass num_worst_tokens >= "
                         f"num_ranks * num_tokens")
    if int(status_host[ROUND_TOKENS]):
        raise ValueError(f"dispatch(): across nodes a dispatch with num_worst_tokens waits for no count on the CPU, so "
                         f"it moves its batch in one round, but a rank had {int(status_host[ROUND_TOKENS])} tokens, more "
                         f"than a round of this Buffer takes: the tokens past the round were not sent (seen by rank "
                         f"{rank}). Pass num_worst_tokens=0 for such batches, or a Buffer with larger num_rdma_bytes "
                         f"and num_nvl_bytes (Config hints with num_tokens)")
    if int(status_host[BAD_EXPERT_IDS]):
        code, limit = int(status_host[BAD_EXPERT_IDS]), int(status_host[BAD_EXPERT_LIMIT])
        call = BAD_IDS_CALL_NAMES.get(code, f"a kernel of call code {code}")  # BadIdsCall members hash as codes
        raise ValueError(f"{call} on rank {rank}: topk_idx held expert id {bad_expert_id(status_host)}, but "
                         f"num_experts={limit} (valid ids: -1 for none, 0..{limit - 1}); the kernel treated it as -1, "
                         f"so that call's result is wrong")
    if int(status_host[CALL_ORDER]):
        code = int(status_host[CALL_ORDER])
        rule = CALL_ORDER_RULES.get(code, f"rule {code}")  # CallOrderRule members hash as their codes
        raise CallOrderError(rank, rule, int(status_host[CALL_ORDER_CALL]), int(status_host[CALL_ORDER_PEER]))
    if int(status_host[SELF_MASKED]):
        raise MaskedRankError(f"low_latency_dispatch()/low_latency_combine() on rank {rank}: the other ranks masked "
                              f"this rank (shrink mode: it did not answer within {timeout_s:g} s), so its "
                              f"low-latency kernels did nothing; call Buffer.low_latency_clean_mask_buffer() on "
                              f"every rank to rejoin")
    if int(status_host[TIMED_OUT]):
        code = int(status_host[PHASE])
        phase = PHASE_NAMES.get(code, f"phase {code}")  # Phase members hash as their codes
        raise PeerTimeoutError(rank, int(status_host[PEER]), phase, timeout_s)
