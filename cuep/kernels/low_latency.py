"""Launch module of ``cuda_src/low_latency.cu``, the low-latency (decode) dispatch and combine: its
spec, the values it shares with the kernels, its argument structs and its launch shape.

C++ entries, each taking one argument struct by value (mirrored below, field for field)::

    cuep::low_latency::dispatch(const DispatchArgs)   phases: SEND_PHASE, RECV_PHASE or both
    cuep::low_latency::combine(const CombineArgs)

One kernel each, launched once per call or, with a receive hook, twice (send, then receive phase). The
receive alone launches the same kernel of the family's receive-only build (``spec(receive_only=True)``, the
same symbols, RECV_PHASE only; ``kReceiveOnly`` in low_latency.cu says why): a profile shows one kernel
whose name holds ``dispatch`` and one with ``combine``, and a trace tells the two launches of a hooked call
apart by time, as DeepEP's tests expect.

The host side of the protocol (the buffer's layout, the call plans, the Handle) is
:mod:`cuep.modes.low_latency`.
"""

from __future__ import annotations

import ctypes

from .. import env, logfmt
from .._math import ceil_div
from ..jit import KernelSpec
from .common import UE8M0_SCALES_PER_WORD, WARP_SIZE, family_constants, network_defines
from .launcher import KernelArgs, entries_of
from .status import MaskedStatus

NUM_THREADS = 512               # threads per block; the kernels' registers are budgeted for it
MAX_TOPK = 32                   # experts per token (a warp's lanes hold one each)
MAX_TOKENS_PER_RANK = 1024      # the largest num_max_dispatch_tokens_per_rank (flags per buffer and source)
# Rows of one token a combine can send one by one (choice slots, low_latency.cu's send_partial), where a rank
# holding several of its experts has not received the token's weights yet: calls of up to this many experts
# per token never wait for a peer in the send. Eight, the top-k of the models DeepEP serves.
CHOICE_SLOTS = 8
SEND_PHASE, RECV_PHASE = 1, 2   # a launch's phases (bits): both for a whole call, one each for a hook
# The low-latency region holds NUM_BUFFERS buffers; call n uses buffer n % NUM_BUFFERS, decided on the device. Four,
# because with at most two results in flight per rank a peer can be at most three calls ahead of a buffer's
# reader (low_latency.cu, "Call order").
NUM_BUFFERS = 4
SEQ_WORDS = 18                  # uint64 words of the device's sequence state (their meaning: low_latency.cu)
SEQ_LATEST, SEQ_RECEIVED = 0, 1  # in it: the newest call number sent, then the newest received on each buffer
# A shrink-mode mask entry (cuep::MaskedStatus::masked): 0 for a live peer, else masked, and whether this
# rank still has to tell the other ranks (masked by hand) or has told them (or was told).
MASKED_TO_TELL, MASKED_TOLD = 1, 2
ROUTING_HEADER_WORDS = 4        # routing table: [num_tokens, 0, 0, 0, then expert counts, then each token's choices]
MAX_COUNT_WORDS = 512           # a routing table's room for its expert counts beyond the most tokens' choices
# A routed word (a choice as its sender laid it out) holds the expert id in its low EXPERT_ID_BITS bits and the
# token's row among the sender's tokens of that expert above them. The dispatch's shared memory, a bit per (expert,
# token), bounds the experts of a call far below 2**EXPERT_ID_BITS (check_dispatch_shared_bytes).
EXPERT_ID_BITS = 20
DISPATCH_STATIC_SHARED_BYTES = 2048  # a bound on the dispatch's own (tests/test_low_latency_layout.py checks the build)

TRACE_POINTS = 16               # uint64 stamps per block in CUEP_TRACE builds (trace[num_sms, TRACE_POINTS])
# Trace points, in the order a block passes them: name -> (index in a block's stamps, what cuep.bench
# prints). The kernels read each index as kTrace<Name> (CUEP_TRACE_<NAME>); the combine reuses
# indices of dispatch points it never passes, and shares entry, start, table_published, end and exit.
DISPATCH_TRACE = {"entry": (11, "kernel entered"),
                  "start": (0, "start"),
                  "tokens_mapped": (10, "own tokens laid out"),
                  "table_published": (1, "routing rows published"),
                  "tokens_stored": (2, "token stores issued"),
                  "send_done": (3, "send done"),
                  "tables_read": (4, "token and expert counts arrived"),
                  "laid_out": (5, "call laid out"),
                  "flags_released": (6, "token flag releases returned"),
                  "last_row_flag": (7, "last token flag seen"),
                  "rows_copied": (8, "tokens copied"),
                  "end": (9, "end"),
                  "exit": (12, "thread 0 left, the block counted done")}
COMBINE_TRACE = {"entry": (11, "kernel entered"),
                 "start": (0, "start"),
                 "table_published": (1, "weight tables published"),
                 "weights_ready": (2, "pair rows and weights ready"),
                 "partial_stored": (3, "partial stored"),
                 "partial_flagged": (4, "partial flag raised"),
                 "partials_arrived": (5, "token's partials arrived"),
                 "tokens_summed": (6, "tokens summed"),
                 "end": (9, "end"),
                 "exit": (12, "thread 0 left, the block counted done")}


def _trace_constants() -> dict[str, int]:
    """``trace_<name>: index`` of every point, each name once (a point both calls pass has one index)."""
    points = {name: index for name, (index, _) in (*DISPATCH_TRACE.items(), *COMBINE_TRACE.items())}
    for name, (index, _) in (*DISPATCH_TRACE.items(), *COMBINE_TRACE.items()):
        assert points[name] == index, f"trace point {name} has two indices"
        assert 0 <= index < TRACE_POINTS, f"trace point {name} outside a block's {TRACE_POINTS} stamps"
    return {f"trace_{name}": index for name, index in points.items()}


CONSTANTS = {"num_threads": NUM_THREADS, "max_topk": MAX_TOPK, "max_tokens_per_rank": MAX_TOKENS_PER_RANK,
             "choice_slots": CHOICE_SLOTS,
             "send_phase": SEND_PHASE, "recv_phase": RECV_PHASE,
             "num_buffers": NUM_BUFFERS, "seq_words": SEQ_WORDS, "seq_latest": SEQ_LATEST,
             "seq_received": SEQ_RECEIVED,
             "masked_to_tell": MASKED_TO_TELL, "masked_told": MASKED_TOLD,
             "routing_header_words": ROUTING_HEADER_WORDS, "expert_id_bits": EXPERT_ID_BITS, **logfmt.CONSTANTS,
             "ue8m0_scales_per_word": UE8M0_SCALES_PER_WORD, "trace_points": TRACE_POINTS, **_trace_constants()}
"""What ``low_latency.cu`` reads as ``CUEP_<NAME>`` besides the shared constants."""


def spec(arch: str, across_hosts: bool = False, receive_only: bool = False, **features) -> KernelSpec:
    """The family's spec; ``CUEP_TRACE`` builds the variant that stamps phase times (cuep.bench --trace);
    ``across_hosts`` the build that links NVSHMEM's transfer code (cuda_src/cuep/network.cuh);
    ``receive_only`` the hooks' build: the same entries, which only receive (``kReceiveOnly`` in
    low_latency.cu says why a hook's receive launches from a build of its own)."""
    defines = {**({"trace": 1} if env.get("CUEP_TRACE") else {}), **network_defines(across_hosts),
               **({"receive_only": 1} if receive_only else {})}
    return KernelSpec.create("low_latency", arch, defines, constants=family_constants(CONSTANTS), uses_nvshmem=True,
                             entries=ENTRIES, **features)


class DispatchArgs(KernelArgs):
    """Mirror of ``cuep::DispatchArgs``, the one argument of ``cuep::low_latency::dispatch``; the C++
    struct says what each field holds."""

    cxx_name = "DispatchArgs"
    entry = "cuep::low_latency::dispatch"
    _fields_ = [
        ("phases", ctypes.c_int), ("buffer", ctypes.c_int), ("buffer_bytes", ctypes.c_int64),
        ("call_record", ctypes.c_void_p),
        ("x", ctypes.c_void_p),
        ("num_tokens", ctypes.c_int), ("hidden", ctypes.c_int), ("use_fp8", ctypes.c_int),
        ("round_scale", ctypes.c_int), ("use_ue8m0", ctypes.c_int),
        ("topk_idx", ctypes.c_void_p),
        ("ids_are_int64", ctypes.c_int), ("num_topk", ctypes.c_int), ("num_experts", ctypes.c_int),
        ("rank", ctypes.c_int), ("num_ranks", ctypes.c_int), ("max_tokens", ctypes.c_int), ("force_put", ctypes.c_int),
        ("all_direct", ctypes.c_int),
        ("routing_flags", ctypes.c_void_p), ("token_flags", ctypes.c_void_p), ("flag_stride", ctypes.c_int),
        ("routing", ctypes.c_void_p), ("routing_words", ctypes.c_int),
        ("slots", ctypes.c_void_p), ("slot_bytes", ctypes.c_int64),
        ("routing_staging", ctypes.c_void_p), ("staging_words", ctypes.c_int), ("slot_staging", ctypes.c_void_p),
        ("staged_tokens", ctypes.c_int), ("stage_bytes", ctypes.c_int),
        ("recv_x", ctypes.c_void_p), ("recv_scales", ctypes.c_void_p), ("recv_count", ctypes.c_void_p),
        ("recv_src_info", ctypes.c_void_p), ("layout_range", ctypes.c_void_p), ("combine_rows", ctypes.c_void_p),
        ("source_tokens", ctypes.c_void_p), ("cumulative_stats", ctypes.c_void_p),
        ("source_decisions", ctypes.c_void_p), ("wait_stats", ctypes.c_void_p),
        ("seq_state", ctypes.c_void_p), ("timeout_ns", ctypes.c_uint64), ("status", MaskedStatus),
        ("trace", ctypes.c_void_p),
    ]


class CombineArgs(KernelArgs):
    """Mirror of ``cuep::CombineArgs``, the one argument of ``cuep::low_latency::combine``."""

    cxx_name = "CombineArgs"
    entry = "cuep::low_latency::combine"
    _fields_ = [
        ("phases", ctypes.c_int), ("buffer", ctypes.c_int), ("buffer_bytes", ctypes.c_int64),
        ("call_record", ctypes.c_void_p),
        ("x", ctypes.c_void_p), ("topk_idx", ctypes.c_void_p), ("ids_are_int64", ctypes.c_int),
        ("topk_weights", ctypes.c_void_p),
        ("num_tokens", ctypes.c_int), ("num_topk", ctypes.c_int), ("hidden", ctypes.c_int),
        ("num_experts", ctypes.c_int), ("rank", ctypes.c_int), ("num_ranks", ctypes.c_int),
        ("max_tokens", ctypes.c_int), ("force_put", ctypes.c_int), ("all_direct", ctypes.c_int),
        ("combine_rows", ctypes.c_void_p), ("source_tokens", ctypes.c_void_p),
        ("weight_flags", ctypes.c_void_p), ("token_flags", ctypes.c_void_p), ("flag_stride", ctypes.c_int),
        ("weights", ctypes.c_void_p), ("weight_words", ctypes.c_int),
        ("slots", ctypes.c_void_p), ("slot_bytes", ctypes.c_int64),
        ("choice_flags", ctypes.c_void_p), ("choice_slots", ctypes.c_void_p), ("split_after_ns", ctypes.c_uint64),
        ("hook_split_after_ns", ctypes.c_uint64),
        ("weight_staging", ctypes.c_void_p), ("staging_words", ctypes.c_int), ("slot_staging", ctypes.c_void_p),
        ("combined_x", ctypes.c_void_p), ("use_logfmt", ctypes.c_int), ("wait_stats", ctypes.c_void_p),
        ("seq_state", ctypes.c_void_p), ("timeout_ns", ctypes.c_uint64), ("status", MaskedStatus),
        ("trace", ctypes.c_void_p),
    ]


ARGUMENT_STRUCTS = (MaskedStatus, DispatchArgs, CombineArgs)
"""Every struct the entries take, with the ones nested in them (tests/test_kernel_args.py checks each)."""

ENTRIES = entries_of(ARGUMENT_STRUCTS)
DISPATCH_ENTRY, COMBINE_ENTRY = DispatchArgs.entry, CombineArgs.entry


def grid(num_sms: int) -> int:
    """Blocks of either launch: one per SM, all resident at once (receivers wait on senders)."""
    return num_sms


_SHARED_WORD_BYTES = 4  # int32 counts and first rows, uint32 bitmap words


def dispatch_shared_bytes(max_tokens: int, num_ranks: int, num_experts: int) -> int:
    """Dynamic shared memory of the dispatch's layouts (``DispatchShared`` in low_latency.cu), before any staged
    token: the receive's (each source's token count; each local expert's first row from each source and its
    row count) and the send's (a bit per (expert, token of this rank), from which each choice's row follows)."""
    num_local = num_experts // num_ranks
    return (num_ranks + num_local * (num_ranks + 1) + num_experts * ceil_div(max_tokens, WARP_SIZE)) * \
        _SHARED_WORD_BYTES


STAGED_TOKENS_MAX = NUM_THREADS // WARP_SIZE // 2 - 1
"""Receiving warps of a dispatch block that may stage their first token: every warp of the receiving half of a
block that also sends (the fewest receivers a launch has) but the first, which reads the routing tables' headers.
(A receive-only block has more receiving warps than this: those after them in turn receive unstaged.)"""

_VECTOR_BYTES = 16  # a staged token's slot is a whole number of the 16-byte copies that fill it


def dispatch_staging(max_tokens: int, num_ranks: int, num_blocks: int, message_bytes: int, layout_bytes: int,
                     block_bytes: int) -> tuple[int, int, int]:
    """Shared memory for the tokens a dispatch receive stages (``stage_first_token`` in low_latency.cu: a warp
    whose first token arrived before the receive started loads it while the routing tables are read).

    Args:
        max_tokens, num_ranks: the call's ``num_max_dispatch_tokens_per_rank`` and ranks (its pairs).
        num_blocks: the launch's grid (pair ``i`` goes to block ``i % num_blocks``).
        message_bytes: one token's message (FP8 rows and their scales, or BF16 rows).
        layout_bytes: :func:`dispatch_shared_bytes`, which comes first.
        block_bytes: the block's opt-in limit of shared memory.

    Returns:
        ``(staged_tokens, stage_bytes, shared_bytes)``: warps per block that may stage (each with a pair, up to
        :data:`STAGED_TOKENS_MAX`, as many as fit), the bytes of each slot, and the launch's dynamic shared memory.
    """
    stage_bytes = ceil_div(message_bytes, _VECTOR_BYTES) * _VECTOR_BYTES
    start = ceil_div(layout_bytes, _VECTOR_BYTES) * _VECTOR_BYTES
    room = max(0, block_bytes - DISPATCH_STATIC_SHARED_BYTES - start) // stage_bytes
    staged = min(STAGED_TOKENS_MAX, ceil_div(num_ranks * max_tokens, num_blocks), room)
    return staged, stage_bytes, start + staged * stage_bytes


def check_dispatch_shared_bytes(call: str, max_tokens: int, num_ranks: int, num_experts: int,
                                block_bytes: int) -> int:
    """The dispatch's shared memory, or ValueError when ``max_tokens`` from each of ``num_ranks`` ranks to
    ``num_experts`` experts would need more than a block of this GPU may take (``block_bytes``, the opt-in
    limit; the launch would fail with a bare CUDA error)."""
    needed = dispatch_shared_bytes(max_tokens, num_ranks, num_experts)
    limit = block_bytes - DISPATCH_STATIC_SHARED_BYTES
    if needed > limit:
        num_local = num_experts // num_ranks
        spare_words = limit // _SHARED_WORD_BYTES - num_ranks - num_local * (num_ranks + 1)
        most = max(0, spare_words // num_experts) * WARP_SIZE
        fix = (f"use num_max_dispatch_tokens_per_rank <= {most} with these experts" if most > 0 else
               "use fewer experts (num_experts): the layout grows with them")
        raise ValueError(f"{call}: num_max_dispatch_tokens_per_rank={max_tokens} from {num_ranks} ranks to "
                         f"num_experts={num_experts} needs {needed} bytes of shared memory per block for the dispatch's "
                         f"layouts (this GPU allows {limit}); {fix}")
    return needed
