"""Launch module of ``cuda_src/intranode.cu``, the NVLink dispatch and combine kernels: their spec, the
constants this side shares with the CUDA side, the argument struct of each entry, and launch shapes.

The call sequences that launch them (stage, barrier, notify, pull; cached push; combine) and the
buffer layout they assume are :mod:`cuep.modes.intranode`'s. Each entry has an argument struct::

    cuep::intranode::stage(StageArgs)           grid stage_grid(num_ranks, num_sms)
    cuep::intranode::notify(NotifyArgs)         grid 1
    cuep::intranode::receive_routing(RoutingArgs)   grid num_sms (every block resident at once)
    cuep::intranode::dispatch_push(PushArgs)    grid num_sms (every block resident at once)
    cuep::intranode::combine(CombineArgs)       grid num_sms (every block resident at once)
    cuep::intranode::combine_bulk(CombineArgs)  the same on at most BULK_PUSH_MAX_BLOCKS SMs (Hopper builds),
                                                with combine_launch's dynamic shared memory

all with :data:`NUM_THREADS` threads a block. An entry takes its struct's fields, nested ones
included, as scalar parameters in order (a struct parameter changed the code NVRTC made of the hot
loops), and the launcher passes the struct's bytes as those parameters: so no field may sit in a
nested struct's tail padding, where the next parameter would not (``tests/test_kernel_params.py``
checks each mirror against its compiled entry's parameters). The fields of each struct are described
beside the C++ struct and its kernel; pointers are device addresses, ``0`` where an optional array is
absent.

A profile finds a call's main kernel by name, as with DeepEP's: a dispatch launches one kernel whose
name holds ``dispatch`` (``dispatch_push``, after stage, barrier, notify and routing when not cached)
and a combine one with ``combine``.
"""

from __future__ import annotations

import ctypes
import dataclasses

from ..jit import KernelSpec
from . import common
from .launcher import KernelArgs, entries_of
from .status import Status

NUM_THREADS = 512
MAX_RANKS = 8                    # one NVLink domain; the notify kernel maps one thread per rank
META_BYTES = 64 * 1024           # each buffer's meta region: the sender's header, then the protocol's flags
CONTROL_BYTES = 20 * 1024        # the protocol's flags (SenderControl), at the end of the meta region
META_HEADER_BYTES = 4 * 8 + MAX_RANKS * 4  # SenderMeta before its per-expert counts
MAX_EXPERTS = (META_BYTES - CONTROL_BYTES - META_HEADER_BYTES) // 4  # int32 per-expert counts that fit the header
STATE_WORDS = 5                  # uint64 device state: dispatch epoch, blocks done, calls, rounds ended, pushers done
ROUND_UNIT_TOKENS = common.ROUND_UNIT_TOKENS  # rounds take whole units of source tokens; send_prefix has a row per unit
MAX_ROUND_ROWS = 1024 * ROUND_UNIT_TOKENS  # landing rows of a round: kMaxChunks counters of at most a unit each

COMBINE_REDUCER_WARPS = 8        # warps of each combine block that reduce from the start; the rest push
BULK_PUSH_MAX_BLOCKS = 32        # a combine of at most this many blocks pushes through the bulk-copy unit
BULK_PUSH_STAGES = 4             # chunks of shared memory each of its pusher warps cycles through
BULK_PUSH_CHUNK_BYTES = 4096     # bytes of each of its bulk copies

BULK_PUSH_SHARED_BYTES = common.bulk_ring_shared_bytes(NUM_THREADS // 32 - COMBINE_REDUCER_WARPS, BULK_PUSH_STAGES,
                                                       BULK_PUSH_CHUNK_BYTES)  # combine_bulk's dynamic shared memory

CONSTANTS = {"num_threads": NUM_THREADS, "max_ranks": MAX_RANKS, "meta_bytes": META_BYTES,
             "control_bytes": CONTROL_BYTES, "max_experts": MAX_EXPERTS, "state_words": STATE_WORDS,
             "combine_reducer_warps": COMBINE_REDUCER_WARPS, "bulk_push_stages": BULK_PUSH_STAGES,
             "bulk_push_chunk_bytes": BULK_PUSH_CHUNK_BYTES, "bulk_push_shared_bytes": BULK_PUSH_SHARED_BYTES}
"""What ``intranode.cu`` reads as ``CUEP_<NAME>`` macros besides the shared ones (its ``static_assert``\\ s
check that they fit together)."""


def spec(arch: str, **features) -> KernelSpec:
    """The intranode family for ``arch``; ``features``: ``force_fallback``, ``aggressive_ptx``. The bulk-push
    combine (``COMBINE_BULK_ENTRY``) exists in Hopper-path builds only."""
    built = KernelSpec.create("intranode", arch, constants=common.family_constants(CONSTANTS),
                              entries=tuple(e for e in ENTRIES if e != COMBINE_BULK_ENTRY), **features)
    return dataclasses.replace(built, entries=ENTRIES) if built.sm90_features else built


# ------------------------------------------------------------------------------------------------
# Launch shapes

def combine_launch(sm90_features: bool, grid: int) -> tuple[str, int]:
    """The combine entry for ``grid`` blocks and its dynamic shared memory: on the Hopper path, a combine of
    at most :data:`BULK_PUSH_MAX_BLOCKS` blocks pushes through the bulk-copy unit (``combine_bulk``), each
    pusher warp through :data:`BULK_PUSH_STAGES` chunks and as many mbarriers (``cuep::BulkRing``);
    otherwise the warps copy (``combine``, no dynamic shared memory)."""
    if not sm90_features or grid > BULK_PUSH_MAX_BLOCKS:
        return COMBINE_ENTRY, 0
    return COMBINE_BULK_ENTRY, BULK_PUSH_SHARED_BYTES


# How the Hopper path launches a dispatch's push (cached or not, ElasticBuffer's on one node too) and the combine:
# (blocks per cluster, the largest grid launched so). The GPU places a cluster's blocks in one GPC, which changes the
# SMs a grid lands on, and with them what the copies move. On 4 x H100, against block by block: the push in clusters
# of 4 moved 2-8% more at 20-32 SMs (within 2% at 8-16), the combine in pairs 0.7-3.4% more at 24 SMs (within 1.2%
# at 8-32 otherwise). Pairs for the push moved less at 20-28, clusters of 4 for the combine at 20-24. Past 32 SMs no
# shape gained at every count (the push in clusters of 4 lost 1.5-2.7% at 40), so larger grids go block by block
# (docs/performance-log.md, session 56). The kernels do not use the cluster itself.
PUSH_CLUSTER = (4, 32)
COMBINE_CLUSTER = (2, 32)


def cluster_blocks(shape: tuple[int, int], sm90_features: bool, grid: int) -> int:
    """Blocks per cluster of a launch of ``grid`` blocks shaped by ``shape`` (:data:`PUSH_CLUSTER` or
    :data:`COMBINE_CLUSTER`): its cluster size on the Hopper path where the grid is a multiple of it and at most
    the shape's largest grid, else one."""
    size, max_grid = shape
    return size if sm90_features and grid % size == 0 and grid <= max_grid else 1


def stage_grid(num_ranks: int, num_sms: int) -> int:
    """Blocks of the stage kernel: one per destination scans ``is_token_in_rank``, ``num_sms`` stage top-k ids
    and weights."""
    return num_ranks + num_sms


# Warps per block of a cached (push) dispatch that push this rank's tokens before copying rows out;
# the others copy landed rows out from the start. Chosen by measurement (docs/performance-log.md): the
# 4-rank count with the copies at 4 KB a warp (session 60), the others before them (v0.5).
_PUSHER_WARPS = {4: 10}
_DEFAULT_PUSHER_WARPS = 12


def pusher_warps(num_ranks: int) -> int:
    """``PushArgs.push_warps`` for ``num_ranks`` ranks (the kernel caps it at a block's warps less one)."""
    return _PUSHER_WARPS.get(num_ranks, _DEFAULT_PUSHER_WARPS)


# The most blocks of a dispatch's push whose pushers are numbered warp by warp across the blocks. On few
# blocks the runs left over in each round, dealt block by block, load the first SMs with a run a warp more
# than the rest, every round; from 32 blocks up dealing block by block was as fast or faster
# (docs/performance-log.md, session 61).
_DEAL_BY_WARP_MAX_BLOCKS = 24


def push_deal_by_warp(grid: int) -> int:
    """``PushArgs.deal_by_warp`` for a launch of ``grid`` blocks: 1 (pushers numbered warp by warp across the
    blocks) on at most :data:`_DEAL_BY_WARP_MAX_BLOCKS` blocks, else 0 (block by block)."""
    return int(grid <= _DEAL_BY_WARP_MAX_BLOCKS)


# ------------------------------------------------------------------------------------------------
# Argument structs: ctypes mirrors of intranode.cu's, field for field (_ptr: a device address, 0 for
# an absent optional array). Status (where a launch records a timeout or an overflow) is shared. Each
# entry's mirror sets scalar_parameters: the entry takes its fields as parameters (see the top).

_ptr, _u64, _i64, _i32 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32


class TokenRows(KernelArgs):
    """A sender's token rows: ``x`` `[num_tokens, hidden_bytes]`, FP8 ``scales`` (strides in floats)."""

    cxx_name = "TokenRows"
    _fields_ = [("x", _ptr), ("hidden_bytes", _i64), ("scales", _ptr), ("scale_token_stride", _i64),
                ("scale_channel_stride", _i64), ("num_scales", _i32)]


class SenderTokens(KernelArgs):
    """This rank's routing in a non-cached dispatch, and where the stage kernel puts it (offsets
    relative to the call's region: :class:`cuep.modes.intranode.StagingLayout`)."""

    cxx_name = "SenderTokens"
    _fields_ = [("topk_idx", _ptr), ("topk_weights", _ptr), ("num_topk", _i32), ("num_tokens", _i32),
                ("buffer", _ptr), ("topk_idx_offset", _i64), ("topk_weights_offset", _i64),
                ("send_lists_offset", _i64)]


class StageArgs(KernelArgs):
    """``cuep::intranode::stage``: stage this rank's routing in its buffer, scan its send lists."""

    cxx_name = "StageArgs"
    entry = "cuep::intranode::stage"
    scalar_parameters = True
    _fields_ = [("tokens", SenderTokens), ("is_token_in_rank", _ptr), ("num_tokens_per_expert", _ptr),
                ("num_experts", _i32), ("num_ranks", _i32), ("send_pos", _ptr), ("send_prefix", _ptr),
                ("peer_bases", _ptr),
                ("rank", _i32), ("region_bytes", _i64), ("state", _ptr), ("status", Status),
                ("timeout_ns", _u64)]


class NotifyArgs(KernelArgs):
    """``cuep::intranode::notify``: read every sender's header, write this rank's receive plan."""

    cxx_name = "NotifyArgs"
    entry = "cuep::intranode::notify"
    scalar_parameters = True
    _fields_ = [("peer_bases", _ptr), ("rank", _i32), ("num_ranks", _i32), ("num_experts", _i32),
                ("expert_alignment", _i32), ("recv_info", _ptr), ("rank_prefix_matrix", _ptr)]


class RecvRouting(KernelArgs):
    """Where a non-cached dispatch's routing kernel writes what this rank receives besides the rows."""

    cxx_name = "RecvRouting"
    _fields_ = [("topk_idx", _ptr), ("topk_weights", _ptr), ("src_idx", _ptr)]


class RoutingArgs(KernelArgs):
    """``cuep::intranode::receive_routing``: read the routing of the rows this rank receives from the
    senders' staging."""

    cxx_name = "RoutingArgs"
    entry = "cuep::intranode::receive_routing"
    scalar_parameters = True
    _fields_ = [("num_topk", _i32), ("peer_bases", _ptr), ("recv_info", _ptr), ("rank", _i32), ("num_ranks", _i32),
                ("num_experts", _i32), ("num_rows", _i32), ("recv", RecvRouting), ("state", _ptr), ("status", Status),
                ("next_row", _ptr), ("timeout_ns", _u64)]


class PushArgs(KernelArgs):
    """``cuep::intranode::dispatch_push``: a dispatch's rows, pushed into the receivers' landing rows in rounds."""

    cxx_name = "PushArgs"
    entry = "cuep::intranode::dispatch_push"
    scalar_parameters = True
    _fields_ = [("rows", TokenRows), ("send_pos", _ptr), ("send_prefix", _ptr), ("recv_src_idx", _ptr),
                ("num_tokens", _i32), ("push_warps", _i32), ("deal_by_warp", _i32), ("row_bytes", _i64),
                ("peer_bases", _ptr), ("recv_info", _ptr), ("rank", _i32), ("num_ranks", _i32),
                ("region_bytes", _i64), ("round_tokens", _i32), ("num_rows", _i32), ("recv_x", _ptr),
                ("recv_scales", _ptr), ("state", _ptr), ("status", Status), ("next_row", _ptr),
                ("timeout_ns", _u64)]


COMBINE_ENTRY, COMBINE_BULK_ENTRY = "cuep::intranode::combine", "cuep::intranode::combine_bulk"


class CombineArgs(KernelArgs):
    """``cuep::intranode::combine``: push received rows back to their sources, which sum them, in rounds;
    ``combine_bulk`` (Hopper builds only) the same, its pushers copying through the bulk-copy unit."""

    cxx_name = "CombineArgs"
    entries = (COMBINE_ENTRY, COMBINE_BULK_ENTRY)
    scalar_parameters = True
    _fields_ = [("peer_bases", _ptr), ("recv_info", _ptr), ("send_pos", _ptr), ("send_prefix", _ptr),
                ("recv_src_idx", _ptr), ("rank", _i32), ("num_ranks", _i32), ("num_tokens", _i32),
                ("round_tokens", _i32), ("num_rows", _i32), ("x", _ptr),
                ("hidden_bytes", _i64), ("topk_weights", _ptr), ("num_topk", _i32), ("landing_row_bytes", _i64),
                ("region_bytes", _i64), ("bias0", _ptr), ("bias1", _ptr),
                ("order_topk_idx", _ptr), ("order_num_topk", _i32), ("experts_per_rank", _i32),
                ("combined_x", _ptr),
                ("combined_topk_weights", _ptr), ("state", _ptr), ("status", Status), ("next_row", _ptr),
                ("timeout_ns", _u64)]


#: Every struct this module mirrors, nested ones included (``tests/test_kernel_args.py`` checks their layouts;
#: :class:`~cuep.kernels.status.Status` is checked with its own module).
ARGUMENT_STRUCTS = (TokenRows, SenderTokens, StageArgs, NotifyArgs, RecvRouting, RoutingArgs, PushArgs,
                    CombineArgs)
ENTRIES = entries_of(ARGUMENT_STRUCTS)
