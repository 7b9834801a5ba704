"""Launch module of ``cuda_src/internode.cu``, the hierarchical (multi-node) dispatch and combine: its
spec, the values it shares with the kernels, and its argument structs.

C++ entries, each taking one argument struct by value (mirrored below, field for field)::

    cuep::internode::scan(const ScanArgs)          grid num_ranks + num_nodes (a block per column)
    cuep::internode::counts(const CountsArgs)      grid 1
    cuep::internode::notify(const NotifyArgs)      grid 1
    cuep::internode::send(const SendArgs)          grid num_sms, once per round
    cuep::internode::dispatch(const PullArgs)      grid num_sms, once per round
    cuep::internode::push(const PushArgs)          grid num_sms, once per round
    cuep::internode::forward(const ForwardArgs)    grid num_sms, once per round
    cuep::internode::combine(const ReduceArgs)     grid num_sms, once per round

all with :data:`NUM_THREADS` threads a block. The call sequences, the buffers' layouts and the Handle
are :mod:`cuep.modes.internode`'s. A profile finds a call's main kernel by name, as with DeepEP's: of
what a dispatch launches (barrier, scan, counts, notify, then send and dispatch per round) one name holds
``dispatch``, and of what a combine launches (barrier, then push, forward and combine per round) one holds
``combine``.
"""

from __future__ import annotations

import ctypes

from ..jit import KernelSpec
from .common import ROUND_UNIT_TOKENS, family_constants, network_defines
from .launcher import KernelArgs, entries_of
from .status import Status

NUM_THREADS = 512
MAX_RANKS = 256                  # ranks of all nodes; the notify block gives each source a thread
MAX_RANKS_PER_NODE = 8           # one NVLink domain; a dispatched row carries a position per local rank
MAX_LOCAL_EXPERTS = 512          # experts per rank that a count message holds
MAX_CHUNKS = 1024                # signalled chunks per partition: the signal table's rows
# A count message: to the rank, to its node, to each rank of its node, the source's token count.
COUNT_HEADER_WORDS = 3 + MAX_RANKS_PER_NODE
COUNT_WORDS = COUNT_HEADER_WORDS + MAX_LOCAL_EXPERTS + 1  # then per-expert counts; 16-byte multiple
STATE_WORDS = 2                  # uint64 device state: finished internode calls, blocks done of the running kernel
TRAFFIC_WORDS = 4                # uint64 counters: rows and bytes put across nodes by dispatches, then combines
# A round's signal number: the call's number above ROUND_BITS bits of the round's index + 1. Enough for every
# round an int32 token count can need (2^31 tokens in rounds of at least one unit), so no call is refused for it.
ROUND_BITS = 25
assert (1 << ROUND_BITS) > (1 << 31) // ROUND_UNIT_TOKENS
HEADER_BYTES = 8                 # a round's header: its first node position and its rows (int32 each)
PLAN_MAX_TOKENS = 2              # plan word: the largest token count of any rank (after the received and forwarded rows)

CONSTANTS = {"num_threads": NUM_THREADS, "max_ranks": MAX_RANKS, "max_ranks_per_node": MAX_RANKS_PER_NODE,
             "max_local_experts": MAX_LOCAL_EXPERTS, "max_chunks": MAX_CHUNKS,
             "count_header_words": COUNT_HEADER_WORDS, "count_words": COUNT_WORDS, "state_words": STATE_WORDS,
             "traffic_words": TRAFFIC_WORDS, "round_bits": ROUND_BITS, "header_bytes": HEADER_BYTES,
             "plan_max_tokens": PLAN_MAX_TOKENS}
"""What ``internode.cu`` reads as ``CUEP_<NAME>`` macros besides the shared ones."""


def spec(arch: str, across_hosts: bool = False, **features) -> KernelSpec:
    """The internode family for ``arch``; ``across_hosts``: the build that links NVSHMEM's transfer code
    (cuda_src/cuep/network.cuh); ``features``: ``force_fallback``, ``aggressive_ptx``."""
    return KernelSpec.create("internode", arch, network_defines(across_hosts), constants=family_constants(CONSTANTS),
                             uses_nvshmem=True, entries=ENTRIES, **features)


# ------------------------------------------------------------------------------------------------
# Argument structs: ctypes mirrors of internode.cu's, field for field (_ptr: a device address, 0 for
# an absent optional array).

_ptr, _u64, _i64, _i32 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32


class Topology(KernelArgs):
    """Where this rank sits: rank ``node * ranks_per_node + local``."""

    cxx_name = "Topology"
    _fields_ = [("rank", _i32), ("num_ranks", _i32), ("node", _i32), ("num_nodes", _i32), ("local", _i32),
                ("ranks_per_node", _i32)]


class RdmaLayout(KernelArgs):
    """Byte offsets in every rank's RDMA buffer (:class:`cuep.modes.internode.RdmaLayout`)."""

    cxx_name = "RdmaLayout"
    _fields_ = [("count_signals", _i64), ("chunk_signals", _i64), ("round_signals", _i64), ("rows_released", _i64),
                ("partials_released", _i64), ("headers", _i64), ("header_staging", _i64), ("counts", _i64),
                ("count_staging", _i64), ("send", _i64), ("recv", _i64), ("partition_bytes", _i64)]


class NvlLayout(KernelArgs):
    """Byte offsets in every rank's NVL buffer: the combine's push and release flags, and landing rows."""

    cxx_name = "NvlLayout"
    _fields_ = [("push_done", _i64), ("released", _i64), ("landing", _i64), ("landing_bytes", _i64)]


class PlanLayout(KernelArgs):
    """Where each part of a dispatch's plan (one int32 array) starts, in words
    (:class:`cuep.modes.internode.PlanLayout`)."""

    cxx_name = "PlanLayout"
    _fields_ = [("recv_prefix", _i32), ("per_expert", _i32), ("forward_prefix", _i32), ("words", _i32)]


class Round(KernelArgs):
    """The round a kernel moves: its ``index``, the ``count`` of the call's rounds, the source ``tokens`` of each."""

    cxx_name = "Round"
    _fields_ = [("index", _i32), ("count", _i32), ("tokens", _i32)]


class UnitPrefix(KernelArgs):
    """The scan's counts at every multiple of :data:`ROUND_UNIT_TOKENS`: ``[units + 1, R + N]`` int32."""

    cxx_name = "UnitPrefix"
    _fields_ = [("counts", _ptr), ("units", _i32)]


class TokenRows(KernelArgs):
    """A sender's tokens: ``x`` rows, FP8 ``scales`` (strides in floats), top-k ids and weights."""

    cxx_name = "TokenRows"
    _fields_ = [("x", _ptr), ("hidden_bytes", _i64), ("scales", _ptr), ("scale_token_stride", _i64),
                ("scale_channel_stride", _i64), ("num_scales", _i32), ("num_topk", _i32), ("topk_idx", _ptr),
                ("topk_weights", _ptr), ("num_tokens", _i32)]


class ScanArgs(KernelArgs):
    """``cuep::internode::scan``: each token's position among those sent to each rank and each node."""

    cxx_name = "ScanArgs"
    entry = "cuep::internode::scan"
    _fields_ = [("is_token_in_rank", _ptr), ("num_tokens", _i32), ("topo", Topology), ("send_pos", _ptr),
                ("node_pos", _ptr), ("node_list", _ptr), ("counts", _ptr), ("unit_prefix", _ptr)]


class CountsArgs(KernelArgs):
    """``cuep::internode::counts``: this rank's count message to every rank."""

    cxx_name = "CountsArgs"
    entry = "cuep::internode::counts"
    _fields_ = [("counts", _ptr), ("num_tokens_per_expert", _ptr), ("num_experts", _i32), ("num_tokens", _i32),
                ("topo", Topology), ("rdma", _ptr), ("layout", RdmaLayout), ("state", _ptr)]


class SendArgs(KernelArgs):
    """``cuep::internode::send``: a round's tokens, once per destination node, with the round's headers."""

    cxx_name = "SendArgs"
    entry = "cuep::internode::send"
    _fields_ = [("tokens", TokenRows), ("send_pos", _ptr), ("node_list", _ptr), ("prefix", UnitPrefix),
                ("topo", Topology), ("rdma", _ptr), ("layout", RdmaLayout), ("row_bytes", _i64),
                ("chunk_rows", _i32), ("direct_peers", _i32), ("round", Round), ("state", _ptr), ("traffic", _ptr),
                ("status", Status), ("timeout_ns", _u64)]


class NotifyArgs(KernelArgs):
    """``cuep::internode::notify``: every source's counts in, this rank's plan out."""

    cxx_name = "NotifyArgs"
    entry = "cuep::internode::notify"
    _fields_ = [("rdma", _ptr), ("layout", RdmaLayout), ("topo", Topology), ("num_experts", _i32),
                ("expert_alignment", _i32), ("plan", _ptr), ("plan_layout", PlanLayout), ("state", _ptr),
                ("status", Status), ("timeout_ns", _u64)]


class RecvArrays(KernelArgs):
    """Where a dispatch writes what this rank receives (``[num_rows, ...]``; 0 for arrays not asked for)."""

    cxx_name = "RecvArrays"
    _fields_ = [("x", _ptr), ("scales", _ptr), ("topk_idx", _ptr), ("topk_weights", _ptr), ("src_idx", _ptr),
                ("num_rows", _i32)]


class PullArgs(KernelArgs):
    """``cuep::internode::dispatch``: each rank pulls its rows from its node's forwarders over NVLink."""

    cxx_name = "PullArgs"
    entry = "cuep::internode::dispatch"
    _fields_ = [("rdma", _ptr), ("node_rdma", _ptr), ("layout", RdmaLayout), ("topo", Topology), ("row_bytes", _i64),
                ("chunk_rows", _i32), ("hidden_bytes", _i64), ("num_scales", _i32), ("num_topk", _i32),
                ("num_experts", _i32), ("plan", _ptr), ("plan_layout", PlanLayout), ("recv", RecvArrays),
                ("forward_pos", _ptr), ("forward_src", _ptr), ("forward_capacity", _i32), ("round", Round),
                ("state", _ptr), ("status", Status), ("timeout_ns", _u64)]


class CombineInput(KernelArgs):
    """A combine's input as its push and its forward read it: the received rows ``x`` (and their
    ``recv_src_idx``), their top-k weights, and whether they are summed in V2's order (``ordered``, by
    ``order_topk_idx``)."""

    cxx_name = "CombineInput"
    _fields_ = [("x", _ptr), ("recv_src_idx", _ptr), ("num_rows", _i32), ("hidden_bytes", _i64),
                ("topk_weights", _ptr), ("num_topk", _i32), ("order_topk_idx", _ptr), ("ordered", _i32)]


class PushArgs(KernelArgs):
    """``cuep::internode::push`` (combine, first): each rank pushes its rows to the forwarder they came
    through, unless that is itself."""

    cxx_name = "PushArgs"
    entry = "cuep::internode::push"
    _fields_ = [("node_nvl", _ptr), ("nvl", NvlLayout), ("topo", Topology), ("plan", _ptr),
                ("plan_layout", PlanLayout), ("input", CombineInput), ("landing_row_bytes", _i64), ("round", Round),
                ("state", _ptr), ("status", Status), ("timeout_ns", _u64)]


class ForwardArgs(KernelArgs):
    """``cuep::internode::forward`` (combine, second): each forwarder sums its node's copies and puts one
    partial per (token, node) back to the token's source."""

    cxx_name = "ForwardArgs"
    entry = "cuep::internode::forward"
    _fields_ = [("nvl", _ptr), ("node_nvl", _ptr), ("nvl_layout", NvlLayout), ("rdma", _ptr), ("layout", RdmaLayout),
                ("topo", Topology), ("plan", _ptr), ("plan_layout", PlanLayout), ("forward_pos", _ptr),
                ("forward_src", _ptr), ("forward_rows", _i32), ("input", CombineInput), ("landing_row_bytes", _i64),
                ("row_bytes", _i64), ("chunk_rows", _i32), ("direct_peers", _i32), ("round", Round), ("state", _ptr),
                ("traffic", _ptr), ("status", Status), ("timeout_ns", _u64)]


class ReduceArgs(KernelArgs):
    """``cuep::internode::combine``: each source sums the partials of its tokens' nodes, and the biases."""

    cxx_name = "ReduceArgs"
    entry = "cuep::internode::combine"
    _fields_ = [("rdma", _ptr), ("layout", RdmaLayout), ("topo", Topology), ("node_pos", _ptr),
                ("prefix", UnitPrefix), ("num_tokens", _i32), ("hidden_bytes", _i64), ("num_topk", _i32),
                ("row_bytes", _i64), ("chunk_rows", _i32), ("bias0", _ptr), ("bias1", _ptr), ("order_topk_idx", _ptr),
                ("experts_per_node", _i32), ("combined_x", _ptr),
                ("combined_topk_weights", _ptr), ("round", Round), ("state", _ptr), ("status", Status),
                ("timeout_ns", _u64)]


#: Every struct this module mirrors, nested ones included (``tests/test_kernel_args.py`` checks them).
ARGUMENT_STRUCTS = (Topology, RdmaLayout, NvlLayout, PlanLayout, Round, UnitPrefix, TokenRows, ScanArgs, CountsArgs,
                    SendArgs, NotifyArgs, RecvArrays, PullArgs, CombineInput, PushArgs, ForwardArgs, ReduceArgs)
ENTRIES = entries_of(ARGUMENT_STRUCTS)
