"""The internode mode: normal-mode dispatch and combine across nodes, hierarchical.

A token crosses between nodes at most once per destination node, along its source's rail (to the rank
with the same local index there, its forwarder), and reaches the ranks of that node that need it over
NVLink; the combine sums each token's copies inside each node first and sends one partial per
(token, node) back. ``cuda_src/internode.cu`` describes the protocol; this module lays out the
buffers, keeps what a dispatch leaves for combine and cached dispatch (:class:`Handle`), works out the
rounds, and launches each call's kernels through :mod:`cuep.kernels.internode`:

* non-cached :func:`dispatch`: barrier, scan, counts, notify, the CPU wait for the received count and
  the largest token count (unless ``num_worst_tokens``), then send and pull per round;
* cached dispatch (a handle given): barrier, then send and pull per round;
* :func:`combine`: barrier, then push, forward and reduce per round.

Any batch goes through buffers of fixed size, in rounds of ``round_tokens`` source tokens of every rank (at most
:func:`round_tokens_for`, the largest batch split into even rounds): the RDMA buffer holds the signals and count
messages, then a send region of one partition per other node and a receive region of one partition per node
(:class:`RdmaLayout`), each holding one round of one rank's rows; the NVL buffer holds the combine's landing rows
of one round from the node's other ranks (:class:`NvlLayout`). A dispatch with ``num_worst_tokens`` waits for no
count on the CPU, so it cannot learn how many rounds the largest batch needs: it moves the rounds of a bound the
caller gives (``max_tokens_per_rank``; one round without), and every rank reports a larger batch (a status word,
raised by the next call) while every rank's call still ends alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import numpy as np

from .. import _deps, _interop, env
from .._front import Front
from .._math import align_up, ceil_div
from .._status import StatusWords
from ..jit import Library
from ..kernels import internode as kernels
from ..kernels.internode import (COUNT_WORDS, HEADER_BYTES, MAX_CHUNKS, MAX_LOCAL_EXPERTS, MAX_RANKS,
                                 MAX_RANKS_PER_NODE, NUM_THREADS, PLAN_MAX_TOKENS, ROUND_UNIT_TOKENS, STATE_WORDS,
                                 TRAFFIC_WORDS)
from ..kernels.intranode import META_BYTES as MIN_NVL_BYTES
from ..kernels.launcher import launch
from ..kernels.status import Status
from ..runtime.regions import REGION_ALIGN, SymmetricMemory
from ..runtime.topology import Topology
from .handles import FlatHandle

__all__ = ["HANDLE_ARRAYS", "MAX_LOCAL_EXPERTS", "MAX_RANKS", "MAX_RANKS_PER_NODE", "ROUND_UNIT_TOKENS", "ROW_ALIGN",
           "Context", "Handle", "NvlLayout", "PlanLayout", "RdmaLayout", "chunk_rows", "combine", "combine_row_bytes",
           "balanced_chunk_rows", "dispatch", "dispatch_row_bytes", "landing_sections", "nvl_bytes_for",
           "rdma_bytes_for", "rdma_partitions", "round_bytes", "round_tokens_for", "send_partitions"]

ROW_ALIGN = 16        # rows on the wire and in the landing region start on a 16-byte vector
SIGNAL_BYTES = 8      # NVSHMEM signals are uint64
NVL_CONTROL_BYTES = 4096  # the combine's push and release flags (one each per local rank), then the landing rows
MOST_CHUNK_ROWS = 32      # a warp's worth of rows: the largest chunk balanced_chunk_rows makes
WARPS_PER_BLOCK = NUM_THREADS // 32


# ------------------------------------------------------------------------------------------------
# Rows and buffer layouts

def dispatch_row_bytes(hidden_bytes: int, num_scales: int, num_topk: int, ranks_per_node: int) -> int:
    """One dispatched row on the wire: the hidden bytes, the FP8 scales (float32), the top-k ids (int32)
    and weights (float32), the source token (int32), and its position at each rank of the destination
    node, absolute and from the round's first (int32 each); see ``RowShape`` in ``internode.cu``."""
    return align_up(hidden_bytes + 4 * num_scales + 8 * num_topk + 4 + 8 * ranks_per_node, ROW_ALIGN)


def combine_row_bytes(hidden: int, num_topk: int) -> int:
    """One combine row (a pushed copy, or a node's partial on the wire): BF16 hidden, the top-k weights
    (float32), then a tag (int32: the pushing rank's highest top-k lane, for DeepEP V2's order)."""
    return align_up(2 * hidden + 4 * num_topk + 4, ROW_ALIGN)


def round_bytes(round_tokens: int, hidden: int, num_topk: int, ranks_per_node: int, num_nodes: int) -> tuple[int, int]:
    """``(num_nvl_bytes, num_rdma_bytes)`` that rounds of ``round_tokens`` source tokens of ``hidden``-element rows
    with ``num_topk`` choices need: the combine's landing rows of a round from every other rank of the node for
    each source node, and a receive partition per node and a send partition per other node of a round's rows (a
    BF16 dispatch row or a combine row, the larger)."""
    num_ranks = ranks_per_node * num_nodes
    combine_row = combine_row_bytes(hidden, num_topk)
    rdma_row = max(dispatch_row_bytes(2 * hidden, 0, num_topk, ranks_per_node), combine_row)
    return (nvl_bytes_for(landing_sections(ranks_per_node, num_nodes) * round_tokens, combine_row),
            rdma_bytes_for(round_tokens * rdma_row, num_ranks, num_nodes))


def landing_sections(ranks_per_node: int, num_nodes: int) -> int:
    """The sections of a round's rows in a forwarder's NVL landing region: one per (other local rank, source
    node). A forwarder's own copies are not pushed (its forward reads them from the combine's input), so none
    is kept for them: ``(L - 1) * N``, none on nodes of one rank."""
    return (ranks_per_node - 1) * num_nodes


def send_partitions(num_nodes: int) -> int:
    """The send partitions of the RDMA buffer: one per other node. A rank's rows for its own node are written
    in place into its receive region (it is their forwarder), so none is kept for them: ``N - 1``."""
    return num_nodes - 1


def rdma_partitions(num_nodes: int) -> int:
    """All the partitions of the RDMA buffer: :func:`send_partitions`, then a receive partition per node."""
    return send_partitions(num_nodes) + num_nodes


def _control_bytes(num_ranks: int, num_nodes: int) -> int:
    signals = SIGNAL_BYTES * (2 * num_ranks + num_nodes * (MAX_CHUNKS + 2))
    return align_up(signals + 2 * HEADER_BYTES * num_nodes + 2 * num_ranks * COUNT_WORDS * 4, REGION_ALIGN)


@dataclass(frozen=True)
class RdmaLayout:
    """Byte offsets in every rank's RDMA buffer (the same on every rank), as ``RdmaLayout`` in
    ``internode.cu``: count signals ``[R]``, chunk signals ``[N][MAX_CHUNKS]``, round signals ``[N]``, the
    dispatch's and the combine's release signals ``[R]`` and ``[N]``, round headers in and out ``[N]`` each,
    count messages in and out ``[R][COUNT_WORDS]`` each, then ``N - 1`` send partitions (by destination node,
    this rank's own skipped: :func:`send_partitions`) and ``N`` receive partitions (by source node)."""

    count_signals: int
    chunk_signals: int
    round_signals: int
    rows_released: int
    partials_released: int
    headers: int
    header_staging: int
    counts: int
    count_staging: int
    send: int
    recv: int
    partition_bytes: int

    @classmethod
    def carve(cls, rdma_bytes: int, num_ranks: int, num_nodes: int) -> "RdmaLayout":
        offset, parts = 0, {}
        for name, size in (("count_signals", SIGNAL_BYTES * num_ranks),
                           ("chunk_signals", SIGNAL_BYTES * num_nodes * MAX_CHUNKS),
                           ("round_signals", SIGNAL_BYTES * num_nodes), ("rows_released", SIGNAL_BYTES * num_ranks),
                           ("partials_released", SIGNAL_BYTES * num_nodes), ("headers", HEADER_BYTES * num_nodes),
                           ("header_staging", HEADER_BYTES * num_nodes), ("counts", 4 * num_ranks * COUNT_WORDS),
                           ("count_staging", 4 * num_ranks * COUNT_WORDS)):
            parts[name] = offset
            offset += size
        send = _control_bytes(num_ranks, num_nodes)
        partition = max(0, (rdma_bytes - send) // rdma_partitions(num_nodes)) // REGION_ALIGN * REGION_ALIGN
        return cls(**parts, send=send, recv=send + send_partitions(num_nodes) * partition, partition_bytes=partition)

    def mirror(self) -> kernels.RdmaLayout:
        return kernels.RdmaLayout(**self.__dict__)


def rdma_bytes_for(partition_bytes: int, num_ranks: int, num_nodes: int) -> int:
    """The smallest ``num_rdma_bytes`` whose partitions hold ``partition_bytes`` each."""
    return _control_bytes(num_ranks, num_nodes) + rdma_partitions(num_nodes) * align_up(partition_bytes, REGION_ALIGN)


@dataclass(frozen=True)
class NvlLayout:
    """Byte offsets in every rank's NVL buffer: push flags ``[L]``, release flags ``[L]``, then the combine's
    landing rows (:func:`landing_sections`)."""

    push_done: int
    released: int
    landing: int
    landing_bytes: int

    @classmethod
    def carve(cls, nvl_bytes: int) -> "NvlLayout":
        return cls(0, SIGNAL_BYTES * MAX_RANKS_PER_NODE, NVL_CONTROL_BYTES, max(0, nvl_bytes - NVL_CONTROL_BYTES))

    def mirror(self) -> kernels.NvlLayout:
        return kernels.NvlLayout(**self.__dict__)


def nvl_bytes_for(landing_rows: int, row_bytes: int) -> int:
    """The smallest ``num_nvl_bytes`` whose landing region holds ``landing_rows`` combine rows, and no less than
    any Buffer's NVL buffer holds (the normal mode's meta region, which shares it; nodes of one rank land no
    rows)."""
    return max(NVL_CONTROL_BYTES + landing_rows * row_bytes, MIN_NVL_BYTES)


@dataclass(frozen=True)
class PlanLayout:
    """Where each part of a dispatch's plan (one int32 array the notify kernel writes) starts: the
    received and forwarded row counts and the largest token count of any rank (words 0, 1 and 2), then
    ``recv_prefix[R + 1]``, ``per_expert[E / R]`` and ``forward_prefix[N + 1]`` (their meaning:
    ``PlanLayout`` in ``internode.cu``)."""

    recv_prefix: int
    per_expert: int
    forward_prefix: int
    words: int

    #: plan[NUM_RECV]: the rows this rank receives (kPlanNumRecv in ``internode.cu``).
    NUM_RECV: ClassVar[int] = 0
    #: plan[MAX_TOKENS]: the largest token count of any rank, which sets the call's rounds.
    MAX_TOKENS: ClassVar[int] = PLAN_MAX_TOKENS

    @classmethod
    def create(cls, num_ranks: int, num_nodes: int, num_local_experts: int) -> "PlanLayout":
        sizes = {"recv_prefix": num_ranks + 1, "per_expert": num_local_experts, "forward_prefix": num_nodes + 1}
        offsets, word = {}, cls.MAX_TOKENS + 1
        for name, size in sizes.items():
            offsets[name] = word
            word += size
        return cls(**offsets, words=word)

    def mirror(self) -> kernels.PlanLayout:
        return kernels.PlanLayout(**self.__dict__)


def chunk_rows(chunk_tokens: int, round_rows: int) -> int:
    """Rows per signalled chunk (a put, or rows written in place, then its signal): ``chunk_tokens`` (the
    Config's RDMA send chunk), raised so that a partition's ``round_rows`` rows need at most ``MAX_CHUNKS``
    signals."""
    return max(chunk_tokens, ceil_div(round_rows, MAX_CHUNKS), 1)


def balanced_chunk_rows(chunk_tokens: int, round_rows: int, parts: int, num_sms: int) -> int:
    """Rows per chunk for a kernel whose ``num_sms`` blocks' warps take a round's chunks in turn from ``parts``
    partitions of up to ``round_rows`` rows each (a dispatch's pull: a partition per local forwarder and source
    node; a combine's forward: one per source node). Each warp sums or copies its chunk's rows one after another,
    so a round lasts as long as the warp with the most rows: the chunks are the fewest waves over every warp of
    chunks of at most :data:`MOST_CHUNK_ROWS` rows (a warp's worth, which the send and the pull read the routing
    of at once), then as small as still gives every warp at most one chunk a wave, rather than a few warps one
    more than the rest. At least ``chunk_tokens`` (the Config's) and whatever keeps the signals within
    ``MAX_CHUNKS`` (:func:`chunk_rows`). A chunk is written by one rank and read by another, each working out its
    rows from these arguments, so they must be the same on every rank: the Config's (the same everywhere, as
    DeepEP requires), ``num_sms`` not capped by this GPU's SMs."""
    warps = max(1, num_sms) * WARPS_PER_BLOCK
    total = parts * round_rows
    waves = max(1, ceil_div(total, warps * MOST_CHUNK_ROWS))
    rows = max(chunk_tokens, ceil_div(total, waves * warps), 1)
    while rows < MOST_CHUNK_ROWS and parts * ceil_div(round_rows, rows) > waves * warps:
        rows += 1  # each partition's last chunk may be partial
    return chunk_rows(rows, round_rows)


# ------------------------------------------------------------------------------------------------
# Handle

@dataclass
class Handle(FlatHandle):
    """What an internode dispatch leaves for combine and for cached dispatch.

    ``plan``: the notify kernel's plan (:class:`PlanLayout`) on the GPU; ``plan_host`` its host copy
    when the dispatch waited on the CPU (``None`` with ``num_worst_tokens``). ``send_pos[t, r]``: row of
    token ``t`` among those sent to rank ``r`` (-1 if not sent); ``node_pos[t, n]`` the same per node, with
    ``node_list[n, p]`` its inverse; ``counts``: tokens to each rank, then to each node; ``unit_prefix[u]``:
    the same counts of the tokens before token ``u * ROUND_UNIT_TOKENS`` (a last row: every token).
    ``forward_pos[f, j]``: for row ``f`` this rank forwarded, its position among the rows of its round that
    local rank ``j`` received from its source (-1: none); ``forward_src[f]``: its source token (both -1 past
    the rows forwarded, with ``num_worst_tokens``).
    ``recv_gbl_rank_prefix_sum[r]``: the rows received from ranks ``0..r`` (a view of ``plan``; item -4 of
    the flat tuple, where DeepEP's users read it). ``recv_src_idx[i]``: source token of received row ``i``.
    ``round_tokens``, ``num_rounds``: the source tokens of each of the dispatch's rounds, and how many it
    ran; its cached dispatches and combines run the same.

    Like DeepEP's handle it iterates as a flat tuple of arrays (:data:`HANDLE_ARRAYS` in order: the GPU
    arrays, then ``scalars``, a host ``int64`` array ``[num_recv_tokens or -1, num_local_experts,
    round_tokens, num_rounds]``), so frameworks can save it with their tensors; :meth:`from_arrays` takes
    that tuple back.
    """

    num_tokens: int
    num_rows: int
    num_recv_tokens: int | None
    num_local_experts: int
    round_tokens: int
    num_rounds: int
    plan: Any
    plan_host: np.ndarray | None
    send_pos: Any
    node_pos: Any
    node_list: Any
    counts: Any
    unit_prefix: Any
    forward_pos: Any
    forward_src: Any
    recv_gbl_rank_prefix_sum: Any
    recv_src_idx: Any
    is_token_in_rank: Any

    @property
    def num_ranks(self) -> int:
        return self.send_pos.shape[1]

    ARRAY_DTYPES: ClassVar[dict[str, Any]] = {
        "plan": np.int32, "send_pos": np.int32, "node_pos": np.int32, "node_list": np.int32, "counts": np.int32,
        "unit_prefix": np.int32, "forward_pos": np.int32, "forward_src": np.int32,
        "recv_gbl_rank_prefix_sum": np.int32, "recv_src_idx": np.int32, "is_token_in_rank": np.bool_}

    def scalars(self) -> list[int]:
        return [-1 if self.num_recv_tokens is None else self.num_recv_tokens, self.num_local_experts,
                self.round_tokens, self.num_rounds]

    @classmethod
    def from_arrays(cls, arrays: dict[str, Any]) -> "Handle":
        """The handle whose flat tuple held ``arrays`` (CuPy arrays, ``scalars`` on the host), by name.

        Raises ``ValueError`` when their shapes do not fit together."""
        cls.check_dtypes(arrays)
        send_pos, node_pos, scalars = arrays["send_pos"], arrays["node_pos"], arrays["scalars"]
        if (send_pos.ndim != 2 or node_pos.ndim != 2 or node_pos.shape[0] != send_pos.shape[0] or scalars.shape != (4,)
                or node_pos.shape[1] == 0 or send_pos.shape[1] % node_pos.shape[1]):
            raise ValueError("handle: its arrays do not fit together; pass back the tuple a dispatch's handle gave")
        num_tokens, num_ranks, num_nodes = send_pos.shape[0], send_pos.shape[1], node_pos.shape[1]
        round_tokens, num_rounds = int(scalars[2]), int(scalars[3])
        forward_pos = arrays["forward_pos"]
        if (arrays["is_token_in_rank"].shape != send_pos.shape or arrays["recv_src_idx"].ndim != 1
                or arrays["unit_prefix"].shape != (ceil_div(num_tokens, ROUND_UNIT_TOKENS) + 1, num_ranks + num_nodes)
                or forward_pos.ndim != 2 or forward_pos.shape[1] != num_ranks // num_nodes
                or arrays["forward_src"].shape != forward_pos.shape[:1]
                or round_tokens <= 0 or round_tokens % ROUND_UNIT_TOKENS or num_rounds <= 0):
            raise ValueError("handle: its arrays do not fit together; pass back the tuple a dispatch's handle gave")
        num_recv = int(scalars[0]) if scalars[0] >= 0 else None
        return cls(num_tokens=num_tokens, num_rows=arrays["recv_src_idx"].shape[0], num_recv_tokens=num_recv,
                   num_local_experts=int(scalars[1]), round_tokens=round_tokens, num_rounds=num_rounds,
                   plan_host=None, **{name: arrays[name] for name in cls.ARRAY_DTYPES})


#: The handle's flat tuple, in order: its GPU arrays, then the host ``scalars``.
HANDLE_ARRAYS = Handle.item_names()


# ------------------------------------------------------------------------------------------------
# Context

@dataclass
class Context:
    """What the internode calls need from a Buffer: one per Buffer whose ranks span several nodes.

    Attributes:
        library: the loaded internode family.
        topology: where this rank sits (``ranks_per_node`` <= :data:`MAX_RANKS_PER_NODE`).
        rdma, nvl: this rank's RDMA and NVL buffers (symmetric addresses), zeroed before first use.
        rdma_layout, nvl_layout: how they are carved.
        node_rdma, node_nvl: `[L]` `uint64` device arrays: each rank of this node's buffers as this GPU
            addresses them (NVLink).
        state: `[STATE_WORDS]` `uint64` device array, zeroed: finished calls, blocks done.
        traffic: `[TRAFFIC_WORDS]` `uint64` device array: rows and bytes sent to other nodes by
            dispatches, then by combines (see :meth:`traffic_counts`).
        status, status_host_ptr: the status words and the device address of their pinned host mirror.
        device_sms: the GPU's SMs (each copy kernel's grid is capped at them).
        direct_peers: rows for a rank of another node that this GPU addresses (NVSHMEM's P2P transport) are
            written straight into its buffer, not staged and put (unless ``CUEP_INTERNODE_PUTS``).
        timeout_ns: the bound on every wait.
        barrier: ``barrier(stream)`` enqueues a device barrier of every rank.
        raise_if_failed: raises what the status words' host mirror recorded.
        front: where the outputs come from (:mod:`cuep._front`).
    """

    library: Library
    topology: Topology
    rdma: int
    nvl: int
    rdma_layout: RdmaLayout
    nvl_layout: NvlLayout
    node_rdma: Any
    node_nvl: Any
    state: Any
    traffic: Any
    status: Any
    status_host_ptr: int
    device_sms: int
    direct_peers: bool
    timeout_ns: int
    barrier: Callable[[Any], None]
    raise_if_failed: Callable[[], None]
    front: Front

    @classmethod
    def create(cls, library: Library, memory: SymmetricMemory, status: StatusWords, topology: Topology,
               device_sms: int, timeout_s: float, barrier: Callable[[Any], None],
               raise_if_failed: Callable[[], None], front: Front) -> "Context":
        """The context of a Buffer whose symmetric ``memory`` holds both buffers (zeroed)."""
        cupy = _deps.cupy()
        regions = memory.regions
        first = topology.node * topology.ranks_per_node
        node_ranks = range(first, first + topology.ranks_per_node)
        rdma_peers = memory.peer_addresses(regions.rdma_offset, topology.num_ranks, topology.rank, node_ranks)
        nvl_peers = memory.peer_addresses(regions.nvl_offset, topology.num_ranks, topology.rank, node_ranks)
        return cls(library=library, topology=topology, rdma=memory.rdma, nvl=memory.nvl,
                   rdma_layout=RdmaLayout.carve(regions.rdma_bytes, topology.num_ranks, topology.num_nodes),
                   nvl_layout=NvlLayout.carve(regions.nvl_bytes),
                   node_rdma=cupy.asarray(np.array(rdma_peers, dtype=np.uint64)),
                   node_nvl=cupy.asarray(np.array(nvl_peers, dtype=np.uint64)),
                   state=cupy.zeros(STATE_WORDS, dtype=cupy.uint64),
                   traffic=cupy.zeros(TRAFFIC_WORDS, dtype=cupy.uint64), status=status.device,
                   status_host_ptr=status.host_ptr, device_sms=device_sms,
                   direct_peers=not env.get("CUEP_INTERNODE_PUTS"), timeout_ns=int(timeout_s * 1e9),
                   barrier=barrier, raise_if_failed=raise_if_failed, front=front)

    def status_mirror(self) -> Status:
        return Status(self.status.data.ptr, self.status_host_ptr)

    def topology_mirror(self) -> kernels.Topology:
        t = self.topology
        return kernels.Topology(rank=t.rank, num_ranks=t.num_ranks, node=t.node, num_nodes=t.num_nodes,
                                local=t.rank % t.ranks_per_node, ranks_per_node=t.ranks_per_node)

    def traffic_counts(self) -> dict[str, int]:
        """Rows and bytes this rank has sent to other nodes since the Buffer was made, once the GPU's
        work is done: ``dispatch_rows``, ``dispatch_bytes``, ``combine_rows``, ``combine_bytes``."""
        _deps.cupy().cuda.Device().synchronize()
        words = self.traffic.get()
        return dict(zip(("dispatch_rows", "dispatch_bytes", "combine_rows", "combine_bytes"), map(int, words)))

    def partition_rows(self, row_bytes: int) -> int:
        return self.rdma_layout.partition_bytes // row_bytes


def round_tokens_for(ctx: Context, hidden: int, num_topk: int) -> int:
    """The source tokens of each round of a dispatch of ``hidden``-element rows with ``num_topk`` choices and
    of its combines: the most whole units of :data:`ROUND_UNIT_TOKENS` whose rows fit a partition of the RDMA
    buffer (a BF16 dispatch row, the largest; a combine row with ``num_topk`` weights) and whose combine
    copies fit the NVL landing region (:func:`landing_sections`); 0 when not one unit fits."""
    t = ctx.topology
    rows = min(ctx.partition_rows(dispatch_row_bytes(2 * hidden, 0, num_topk, t.ranks_per_node)),
               ctx.partition_rows(combine_row_bytes(hidden, num_topk)))
    sections = landing_sections(t.ranks_per_node, t.num_nodes)
    if sections:
        rows = min(rows, ctx.nvl_layout.landing_bytes // combine_row_bytes(hidden, num_topk) // sections)
    return rows // ROUND_UNIT_TOKENS * ROUND_UNIT_TOKENS


def _round_refusal(call: str, ctx: Context, hidden: int, num_topk: int) -> ValueError:
    t = ctx.topology
    unit = ROUND_UNIT_TOKENS
    nvl, rdma = round_bytes(unit, hidden, num_topk, t.ranks_per_node, t.num_nodes)
    has_rdma = ctx.rdma_layout.recv + t.num_nodes * ctx.rdma_layout.partition_bytes
    has_nvl = ctx.nvl_layout.landing + ctx.nvl_layout.landing_bytes
    return ValueError(f"{call}: across nodes the tokens move in rounds of whole units of {unit}, and one unit of "
                      f"hidden {hidden} with top-{num_topk} needs num_rdma_bytes >= {rdma} and num_nvl_bytes >= {nvl}; "
                      f"this Buffer has num_rdma_bytes={has_rdma} and num_nvl_bytes={has_nvl} (the Config hints "
                      f"give sizes for rounds of many units)")


def _even_rounds(max_tokens: int, round_tokens: int) -> tuple[int, int]:
    """``(num_rounds, tokens)``: the fewest rounds of at most ``round_tokens`` (the most the buffers hold) that
    take ``max_tokens``, each of as few whole units as still take them all, so that no round is left with a
    remainder (every round costs about as much beyond its tokens' share: waits, launches, the last chunks)."""
    num_rounds = max(1, ceil_div(max_tokens, round_tokens))
    return num_rounds, min(round_tokens, align_up(ceil_div(max(max_tokens, 1), num_rounds), ROUND_UNIT_TOKENS))


# ------------------------------------------------------------------------------------------------
# Calls

def _ptr(array) -> int:
    return 0 if array is None else array.data.ptr


def _token_rows(x, scales, topk_idx, topk_weights) -> kernels.TokenRows:
    rows = kernels.TokenRows(x=x.data.ptr, hidden_bytes=x.shape[1] * x.itemsize, num_tokens=x.shape[0],
                             topk_idx=_ptr(topk_idx), topk_weights=_ptr(topk_weights),
                             num_topk=topk_idx.shape[1] if topk_idx is not None else 0)
    if scales is not None:
        rows.scales, rows.num_scales = scales.data.ptr, scales.shape[1]
        rows.scale_token_stride, rows.scale_channel_stride = scales.strides[0] // 4, scales.strides[1] // 4
    return rows


def _grid(ctx: Context, num_sms: int) -> int:
    return max(1, min(num_sms, ctx.device_sms))


def dispatch(ctx: Context, stream, x, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert,
             num_experts: int, handle: Handle | None, expert_alignment: int, num_worst_tokens: int, num_sms: int,
             chunk_tokens: int, max_tokens_per_rank: int | None = None):
    """Enqueue an internode dispatch on ``stream`` (outputs are allocated on the current stream).

    Arguments as :func:`cuep.modes.intranode.dispatch`, plus ``chunk_tokens``: the fewest rows per signalled
    chunk (the Config's ``num_max_rdma_chunked_send_tokens``; :func:`balanced_chunk_rows`), and
    ``max_tokens_per_rank``: with ``num_worst_tokens``, a bound on every rank's token count, the same on every
    rank, that sets the rounds (``None``: one round).

    Returns:
        ``(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle)``;
        a cached dispatch returns ``[]`` for the list, and top-k arrays only where it was given top-k ids.
    """
    front = ctx.front
    t = ctx.topology
    L, N, R = t.ranks_per_node, t.num_nodes, t.num_ranks
    cached = handle is not None
    num_tokens = x.shape[0]
    hidden_bytes = x.shape[1] * x.itemsize
    hidden = x.shape[1]
    num_scales = scales.shape[1] if scales is not None else 0
    num_topk = topk_idx.shape[1] if topk_idx is not None else 0
    row_bytes = dispatch_row_bytes(hidden_bytes, num_scales, num_topk, L)
    if cached:
        round_tokens = handle.round_tokens
        if ctx.partition_rows(row_bytes) < round_tokens:
            raise _round_refusal("dispatch()", ctx, hidden, num_topk)
    else:
        round_tokens = round_tokens_for(ctx, hidden, num_topk)
        if round_tokens == 0:
            raise _round_refusal("dispatch()", ctx, hidden, num_topk)
    grid = _grid(ctx, num_sms)
    topo, layout, status = ctx.topology_mirror(), ctx.rdma_layout.mirror(), ctx.status_mirror()
    state = ctx.state.data.ptr

    ctx.barrier(stream)
    if cached:
        num_local_experts = handle.num_local_experts
        send_pos, node_list, unit_prefix = handle.send_pos, handle.node_list, handle.unit_prefix
        plan = handle.plan
    else:
        num_local_experts = num_experts // R
        send_pos = front.empty((num_tokens, R), np.int32)
        node_pos = front.empty((num_tokens, N), np.int32)
        node_list = front.empty((N, max(num_tokens, 1)), np.int32)
        counts = front.empty((R + N,), np.int32)
        unit_prefix = front.empty((ceil_div(num_tokens, ROUND_UNIT_TOKENS) + 1, R + N), np.int32)
        scan = kernels.ScanArgs(is_token_in_rank=is_token_in_rank.data.ptr, num_tokens=num_tokens, topo=topo,
                                send_pos=send_pos.data.ptr, node_pos=node_pos.data.ptr, node_list=node_list.data.ptr,
                                counts=counts.data.ptr, unit_prefix=unit_prefix.data.ptr)
        launch(ctx.library, scan.entry, stream, R + N, NUM_THREADS, scan)
        message = kernels.CountsArgs(counts=counts.data.ptr, num_tokens_per_expert=num_tokens_per_expert.data.ptr,
                                     num_experts=num_experts, num_tokens=num_tokens, topo=topo, rdma=ctx.rdma,
                                     layout=layout, state=state)
        launch(ctx.library, message.entry, stream, 1, NUM_THREADS, message)
    plan_layout = PlanLayout.create(R, N, num_local_experts)

    per_expert: list[int] = []
    num_recv = None
    plan_host = None
    if cached:
        num_rows, num_rounds, forward_pos, forward_src, forward_capacity = (handle.num_rows, handle.num_rounds, None,
                                                                           None, 0)
        plan_host = handle.plan_host
    else:
        plan = front.empty((plan_layout.words,), np.int32)
        notify = kernels.NotifyArgs(rdma=ctx.rdma, layout=layout, topo=topo, num_experts=num_experts,
                                    expert_alignment=expert_alignment, plan=plan.data.ptr,
                                    plan_layout=plan_layout.mirror(), state=state, status=status,
                                    timeout_ns=ctx.timeout_ns)
        launch(ctx.library, notify.entry, stream, 1, NUM_THREADS, notify)
        if num_worst_tokens > 0:
            # The rounds of the caller's bound, whatever the batches (the count of rounds from the batches needs
            # the CPU wait this call does not make): a batch past them is reported by every rank (the pull records
            # it), not sent.
            num_rows = num_worst_tokens
            if max_tokens_per_rank:
                num_rounds, round_tokens = _even_rounds(max_tokens_per_rank, round_tokens)
            else:
                num_rounds = 1
            # Each source on this rank's rail sends it at most its rounds' tokens.
            forward_capacity = N * round_tokens * num_rounds
        else:
            plan_host = _interop.read_on_host(plan, stream)  # the one CPU wait of a non-cached dispatch: sizes the outputs
            ctx.raise_if_failed()  # a peer that never sent its counts leaves a plan that means nothing
            num_recv = num_rows = int(plan_host[PlanLayout.NUM_RECV])
            forward_capacity = int(plan_host[1])
            num_rounds, round_tokens = _even_rounds(int(plan_host[PlanLayout.MAX_TOKENS]), round_tokens)
            per_expert = plan_host[plan_layout.per_expert:plan_layout.per_expert + num_local_experts].tolist()
        forward_pos = front.empty((forward_capacity, L), np.int32)
        forward_src = front.empty((forward_capacity,), np.int32)

    chunk = balanced_chunk_rows(chunk_tokens, round_tokens, L * N, num_sms)  # balanced for the pull, the heavier
    recv_x = front.empty((num_rows, x.shape[1]), x.dtype)
    recv_scales = front.empty((num_rows, num_scales), scales.dtype) if scales is not None else None
    recv_topk_idx = front.empty((num_rows, num_topk), np.int64) if topk_idx is not None else None
    recv_topk_weights = front.empty((num_rows, num_topk), np.float32) if topk_weights is not None else None
    recv_src_idx = front.empty((num_rows,), np.int32)
    prefix = kernels.UnitPrefix(counts=unit_prefix.data.ptr, units=unit_prefix.shape[0] - 1)
    send = kernels.SendArgs(
        tokens=_token_rows(x, scales, topk_idx, topk_weights), send_pos=send_pos.data.ptr,
        node_list=node_list.data.ptr, prefix=prefix, topo=topo, rdma=ctx.rdma, layout=layout, row_bytes=row_bytes,
        chunk_rows=chunk, direct_peers=int(ctx.direct_peers), state=state, traffic=ctx.traffic.data.ptr,
        status=status, timeout_ns=ctx.timeout_ns)
    pull = kernels.PullArgs(
        rdma=ctx.rdma, node_rdma=ctx.node_rdma.data.ptr, layout=layout, topo=topo, row_bytes=row_bytes,
        chunk_rows=chunk, hidden_bytes=hidden_bytes, num_scales=num_scales, num_topk=num_topk,
        num_experts=num_local_experts * R, plan=plan.data.ptr, plan_layout=plan_layout.mirror(),
        recv=kernels.RecvArrays(x=recv_x.data.ptr, scales=_ptr(recv_scales), topk_idx=_ptr(recv_topk_idx),
                                topk_weights=_ptr(recv_topk_weights), src_idx=recv_src_idx.data.ptr,
                                num_rows=num_rows),
        forward_pos=_ptr(forward_pos), forward_src=_ptr(forward_src), forward_capacity=forward_capacity, state=state,
        status=status, timeout_ns=ctx.timeout_ns)
    for index in range(num_rounds):
        send.round = pull.round = kernels.Round(index=index, count=num_rounds, tokens=round_tokens)
        launch(ctx.library, send.entry, stream, grid, NUM_THREADS, send)
        launch(ctx.library, pull.entry, stream, grid, NUM_THREADS, pull)
    if cached:
        return recv_x, recv_scales, recv_topk_idx, recv_topk_weights, [], handle
    # DeepEP's recv_gbl_rank_prefix_sum: the plan's row prefix over source ranks, without its leading 0.
    recv_gbl_rank_prefix_sum = front.view(plan.data, (R,), np.int32, (plan_layout.recv_prefix + 1) * 4)
    handle = Handle(num_tokens=num_tokens, num_rows=num_rows, num_recv_tokens=num_recv,
                    num_local_experts=num_local_experts, round_tokens=round_tokens, num_rounds=num_rounds, plan=plan,
                    plan_host=plan_host, send_pos=send_pos, node_pos=node_pos, node_list=node_list, counts=counts,
                    unit_prefix=unit_prefix, forward_pos=forward_pos, forward_src=forward_src,
                    recv_gbl_rank_prefix_sum=recv_gbl_rank_prefix_sum, recv_src_idx=recv_src_idx,
                    is_token_in_rank=is_token_in_rank)
    return recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert, handle


def combine(ctx: Context, stream, x, handle: Handle, topk_weights, bias0, bias1, num_sms: int, chunk_tokens: int,
            order: tuple[Any, Any, int] | None = None):
    """Enqueue an internode combine on ``stream`` (outputs are allocated on the current stream), in its
    dispatch's rounds.

    Arguments as :func:`cuep.modes.intranode.combine`, plus ``chunk_tokens`` (the Config's
    ``num_max_rdma_chunked_send_tokens``; :func:`balanced_chunk_rows`) and
    ``order``: ``None`` for DeepEP V1's sums, or ``(recv_topk_idx, topk_idx, experts_per_rank)`` for
    DeepEP V2's hybrid order (the dispatch's received local ids `[num_rows, num_topk]` and sent global ids
    `[num_tokens, num_topk]`, both `int64`; the order of the sums is described in ``internode.cu``).

    Returns:
        ``(combined_x, combined_topk_weights)``.
    """
    t = ctx.topology
    L, N, R = t.ranks_per_node, t.num_nodes, t.num_ranks
    hidden = x.shape[1]
    num_topk = topk_weights.shape[1] if topk_weights is not None else 0
    order_recv_topk_idx, order_topk_idx, experts_per_rank = order if order is not None else (None, None, 0)
    if order is not None:
        num_topk = order_topk_idx.shape[1]  # the rows carry a weight per lane, and their tag after them
    row_bytes = combine_row_bytes(hidden, num_topk)
    round_tokens = handle.round_tokens
    if (ctx.partition_rows(row_bytes) < round_tokens
            or ctx.nvl_layout.landing_bytes // row_bytes < landing_sections(L, N) * round_tokens):
        raise _round_refusal("combine()", ctx, hidden, num_topk)
    plan_layout = PlanLayout.create(R, N, handle.num_local_experts)
    grid = _grid(ctx, num_sms)
    chunk = balanced_chunk_rows(chunk_tokens, round_tokens, N, num_sms)  # balanced for the forward
    topo, layout, status = ctx.topology_mirror(), ctx.rdma_layout.mirror(), ctx.status_mirror()
    state = ctx.state.data.ptr
    combined_x = ctx.front.empty((handle.num_tokens, hidden), x.dtype)
    combined_weights = ctx.front.empty((handle.num_tokens, num_topk), np.float32) \
        if topk_weights is not None and topk_weights.shape[1] else None

    ctx.barrier(stream)
    combine_input = kernels.CombineInput(x=x.data.ptr, recv_src_idx=handle.recv_src_idx.data.ptr,
                                         num_rows=handle.num_rows, hidden_bytes=hidden * x.itemsize,
                                         topk_weights=_ptr(topk_weights), num_topk=num_topk,
                                         order_topk_idx=_ptr(order_recv_topk_idx), ordered=int(order is not None))
    push = kernels.PushArgs(node_nvl=ctx.node_nvl.data.ptr, nvl=ctx.nvl_layout.mirror(), topo=topo,
                            plan=handle.plan.data.ptr, plan_layout=plan_layout.mirror(), input=combine_input,
                            landing_row_bytes=row_bytes, state=state, status=status, timeout_ns=ctx.timeout_ns)
    forward = kernels.ForwardArgs(
        nvl=ctx.nvl, node_nvl=ctx.node_nvl.data.ptr, nvl_layout=ctx.nvl_layout.mirror(), rdma=ctx.rdma, layout=layout,
        topo=topo, plan=handle.plan.data.ptr, plan_layout=plan_layout.mirror(), forward_pos=handle.forward_pos.data.ptr,
        forward_src=handle.forward_src.data.ptr, forward_rows=handle.forward_src.shape[0], input=combine_input,
        landing_row_bytes=row_bytes, row_bytes=row_bytes, chunk_rows=chunk, direct_peers=int(ctx.direct_peers),
        state=state, traffic=ctx.traffic.data.ptr, status=status, timeout_ns=ctx.timeout_ns)
    reduce = kernels.ReduceArgs(
        rdma=ctx.rdma, layout=layout, topo=topo, node_pos=handle.node_pos.data.ptr,
        prefix=kernels.UnitPrefix(counts=handle.unit_prefix.data.ptr, units=handle.unit_prefix.shape[0] - 1),
        num_tokens=handle.num_tokens, hidden_bytes=hidden * x.itemsize, num_topk=num_topk, row_bytes=row_bytes,
        chunk_rows=chunk, bias0=_ptr(bias0), bias1=_ptr(bias1), order_topk_idx=_ptr(order_topk_idx),
        experts_per_node=experts_per_rank * L, combined_x=combined_x.data.ptr,
        combined_topk_weights=_ptr(combined_weights), state=state, status=status, timeout_ns=ctx.timeout_ns)
    for index in range(handle.num_rounds):
        push.round = forward.round = reduce.round = kernels.Round(index=index, count=handle.num_rounds,
                                                                  tokens=round_tokens)
        launch(ctx.library, push.entry, stream, grid, NUM_THREADS, push)
        launch(ctx.library, forward.entry, stream, grid, NUM_THREADS, forward)
        launch(ctx.library, reduce.entry, stream, grid, NUM_THREADS, reduce)
    return combined_x, combined_weights
