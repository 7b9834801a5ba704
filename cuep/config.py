"""Config: the performance knobs of the high-throughput kernels, and buffer size hints."""

from __future__ import annotations

from dataclasses import dataclass

from . import env
from ._math import ceil_div
from .kernels.common import SCALE_BLOCK
from .modes import internode, intranode

# Sizes that the hints assume: top-8, and (unless CUEP_RANKS_PER_NODE says otherwise) nodes of up to this many
# ranks, as DeepEP's.
MAX_TOPK_HINT = 8
HINT_RANKS_PER_NODE = 8


def hint_ranks_per_node(num_ranks: int, num_ranks_per_node: int | None) -> int:
    """Ranks per node a size hint assumes: the argument, else ``CUEP_RANKS_PER_NODE``, else up to 8."""
    if num_ranks_per_node is None:
        num_ranks_per_node = env.get("CUEP_RANKS_PER_NODE") or min(HINT_RANKS_PER_NODE, num_ranks)
    if num_ranks_per_node <= 0 or num_ranks % num_ranks_per_node:
        raise ValueError(f"num_ranks_per_node={num_ranks_per_node} must divide num_ranks={num_ranks}")
    return num_ranks_per_node


@dataclass(frozen=True)
class Config:
    """How many SMs the normal-mode kernels use, and DeepEP's chunking knobs.

    Arguments:
        num_sms: SMs (thread blocks) for the copy kernels; DeepEP's default is 20. More SMs keep
            more bytes in flight over NVLink; fewer leave SMs free for overlapped compute. Capped at
            the GPU's SM count (the kernels' blocks must all be resident at once).
        num_max_nvl_chunked_send_tokens: DeepEP's ring-buffer chunk sizes, this one and the next three,
            kept for API compatibility (see below for what cuep makes of them).
        num_max_nvl_chunked_recv_tokens: the tokens of one DeepEP ring; sizes the hints' rounds.
        num_max_rdma_chunked_send_tokens: across nodes, the fewest rows of each signalled chunk.
        num_max_rdma_chunked_recv_tokens: with ``num_max_nvl_chunked_recv_tokens``, sizes the hints' round
            across nodes.

    Differs from DeepEP: the kernels move each token straight between the senders' and receivers'
    buffers (no per-channel ring). They go through any batch in rounds of tokens that fit the buffers;
    the chunked receive sizes only size the hints' rounds (as many tokens as DeepEP's rings hold at once).
    Across nodes ``num_max_rdma_chunked_send_tokens`` is the rows each signalled chunk (a put, or rows
    written straight into a peer NVSHMEM maps, then its signal) carries at least: raised where a round
    would need more than ``cuep.kernels.internode.MAX_CHUNKS`` signals, and up to 32 rows so that a round's
    chunks keep every warp of the kernels equally busy (``cuep.modes.internode.balanced_chunk_rows``).
    """

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def __post_init__(self):
        for name in ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                     "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Config(): {name} must be a positive int, got {value!r}")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int, num_tokens: int | None = None,
                                 num_topk: int = MAX_TOPK_HINT, num_ranks_per_node: int | None = None) -> int:
        """Bytes of NVL buffer for dispatch and combine.

        On one node the buffer's size does not limit the batch: the kernels move any number of tokens in
        rounds, and the buffer sets how many tokens a round takes. Two regions (successive rounds use
        them in turn, so that none has to wait for its peers before it writes into their buffers) each
        hold, for every rank, a section of landing rows for one round's tokens: BF16 rows with the
        top-k weights (combine) or with the FP8 scales (dispatch). A round takes ``num_tokens`` tokens
        (an addition to DeepEP's arguments: fewer rounds, more bytes), or by default as many as DeepEP's
        rings hold at once (``num_sms / 2`` channels of ``num_max_nvl_chunked_recv_tokens``), halved
        for the two regions: a hint no larger than DeepEP's for the same arguments. A region also holds
        the routing (top-k ids and weights, send lists: ``12 * num_topk + 4 * num_ranks`` bytes a token)
        of a whole non-cached dispatch: at hidden 7168, over 100000 tokens per rank in the default hint.

        Across nodes (``num_ranks`` more than ``num_ranks_per_node``, which defaults to
        ``CUEP_RANKS_PER_NODE``, else up to 8) the NVL buffer holds the combine's landing rows of a round on
        a forwarder: a section of a round's tokens for each other local rank and each source node, BF16 rows
        with their weights, the round as :meth:`get_rdma_buffer_size_hint`'s; on nodes of one rank (no landing
        rows) the least any Buffer's NVL buffer takes, 64 KiB.
        """
        hidden = hidden_bytes // 2
        ranks_per_node = hint_ranks_per_node(num_ranks, num_ranks_per_node)
        num_nodes = num_ranks // ranks_per_node
        if num_nodes > 1:
            round_tokens = self._internode_round_tokens(num_tokens, ranks_per_node, num_nodes)
            return internode.round_bytes(round_tokens, hidden, num_topk, ranks_per_node, num_nodes)[0]
        if num_tokens is None:
            ring_tokens = self.num_sms // 2 * self.num_max_nvl_chunked_recv_tokens // 2
            num_tokens = max(intranode.ROUND_UNIT_TOKENS,
                             ring_tokens // intranode.ROUND_UNIT_TOKENS * intranode.ROUND_UNIT_TOKENS)
        row_bytes = max(intranode.push_row_bytes(hidden_bytes, 0),  # BF16 dispatch
                        intranode.push_row_bytes(hidden, ceil_div(hidden, SCALE_BLOCK)),  # FP8 dispatch
                        intranode.landing_row_bytes(hidden, num_topk))  # combine
        return intranode.round_nvl_bytes(row_bytes, num_ranks, num_tokens)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int, num_tokens: int | None = None,
                                  num_topk: int = MAX_TOPK_HINT, num_ranks_per_node: int | None = None) -> int:
        """Bytes of RDMA buffer for internode dispatch and combine; 0 when every rank is on one node.

        The buffer's size does not limit the batch: the kernels move any number of tokens in rounds, and the
        buffer sets how many tokens a round takes. It holds a receive partition per node and a send partition
        per other node, each holding one round of one rank's tokens as rows (a BF16 dispatch row with its
        routing, or a combine row), after the signals and count messages. A round takes ``num_tokens`` tokens
        (an addition to DeepEP's arguments, rounded up to whole units of 128: fewer rounds, more bytes). By
        default it takes as many as DeepEP's RDMA rings hold (a send and a receive ring per node, each of
        ``num_sms / 2`` channels of ``num_max_rdma_chunked_recv_tokens``) spread over cuep's partitions, and no
        more than keeps the NVL hint's landing region (a round's rows from every node for each other local
        rank) within DeepEP's NVL rings (``num_sms / 2`` channels of ``num_max_nvl_chunked_recv_tokens`` per
        local rank): both hints are then no larger than DeepEP's, except where those rings hold less than one
        unit from each node (16 nodes at 8 SMs), where a round takes one unit. At the defaults a round takes 1408
        tokens on 2 nodes of 8 ranks, 640 on 4, and 2560 on 2 nodes of 2. ``num_ranks_per_node`` defaults to
        ``CUEP_RANKS_PER_NODE``, else up to 8 (DeepEP's nodes).
        """
        ranks_per_node = hint_ranks_per_node(num_ranks, num_ranks_per_node)
        num_nodes = num_ranks // ranks_per_node
        if num_nodes <= 1:
            return 0
        round_tokens = self._internode_round_tokens(num_tokens, ranks_per_node, num_nodes)
        return internode.round_bytes(round_tokens, hidden_bytes // 2, num_topk, ranks_per_node, num_nodes)[1]

    def _internode_round_tokens(self, num_tokens: int | None, ranks_per_node: int, num_nodes: int) -> int:
        """The tokens of an internode round the hints size the buffers for (see :meth:`get_rdma_buffer_size_hint`)."""
        unit = internode.ROUND_UNIT_TOKENS
        if num_tokens is not None:
            return max(unit, ceil_div(num_tokens, unit) * unit)
        channels = self.num_sms // 2
        # DeepEP's RDMA buffer: a send and a receive ring per node; cuep's: a partition each, less the own node's
        # send partition (internode.rdma_partitions).
        rings_tokens = 2 * num_nodes * channels * self.num_max_rdma_chunked_recv_tokens
        tokens = rings_tokens // internode.rdma_partitions(num_nodes)
        # DeepEP's NVL buffer: a ring per local rank; cuep's: a landing section per other local rank and node.
        sections = internode.landing_sections(ranks_per_node, num_nodes)
        if sections:
            tokens = min(tokens, ranks_per_node * channels * self.num_max_nvl_chunked_recv_tokens // sections)
        return max(unit, tokens // unit * unit)


# SMs of the normal-mode kernels when no Config is given: DeepEP's default, which frameworks read
# (Buffer.num_sms) to split the GPU between communication and overlapped GEMMs, and Megatron sets anyway.
# Where nothing overlaps, more SMs move more bytes: `python -m cuep.bench --mode normal --tune` on 2, 4 and 8
# H200s (docs/performance-log.md, v0.5.0 and v0.5.2) found gains up to 128 SMs (flat from 64 at 2 ranks).
DEFAULT_NUM_SMS = 20


def get_dispatch_config(num_ranks: int, num_sms: int = DEFAULT_NUM_SMS) -> Config:
    """The dispatch Config for ``num_ranks`` (every rank count shares the knobs) with ``num_sms`` SMs."""
    return Config(num_sms=num_sms)


def get_combine_config(num_ranks: int, num_sms: int = DEFAULT_NUM_SMS) -> Config:
    """The combine Config for ``num_ranks`` with ``num_sms`` SMs."""
    return Config(num_sms=num_sms)
