"""NumPy oracle of every cuep operation's semantics. Tests use it; Buffer never does.

Functions take plain NumPy arrays (every rank's inputs where an operation spans ranks) and need no
communicator, no GPU and no MPI.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ._math import align_up


class DispatchLayout(NamedTuple):
    """What ``Buffer.get_dispatch_layout`` returns, minus the event."""

    num_tokens_per_rank: np.ndarray          # [num_ranks] int32
    num_tokens_per_rdma_rank: np.ndarray | None  # [num_nodes] int32, None on one node
    num_tokens_per_expert: np.ndarray        # [num_experts] int32
    is_token_in_rank: np.ndarray             # [num_tokens, num_ranks] bool


def get_dispatch_layout(topk_idx: np.ndarray, num_experts: int, num_ranks: int,
                        num_ranks_per_node: int | None = None) -> DispatchLayout:
    """Layout of one rank's tokens.

    Rank ``r`` holds experts ``[r * E / R, (r + 1) * E / R)``; node ``n`` holds ranks
    ``[n * ranks_per_node, (n + 1) * ranks_per_node)``. A ``-1`` entry routes nowhere. An expert
    counts every entry naming it; a rank (node) counts each token once if any of its top-k experts
    lives there.
    """
    topk_idx = np.asarray(topk_idx)
    if topk_idx.ndim != 2:
        raise ValueError(f"topk_idx must be [num_tokens, num_topk], got shape {topk_idx.shape}")
    if num_experts % num_ranks:
        raise ValueError(f"num_experts={num_experts} must be a multiple of num_ranks={num_ranks}")
    ranks_per_node = num_ranks if num_ranks_per_node is None else num_ranks_per_node
    if num_ranks % ranks_per_node:
        raise ValueError(f"num_ranks={num_ranks} must be a multiple of num_ranks_per_node={ranks_per_node}")
    if ((topk_idx < -1) | (topk_idx >= num_experts)).any():
        raise ValueError(f"topk_idx entries must be -1 or in [0, {num_experts})")
    num_tokens = topk_idx.shape[0]
    routed = topk_idx >= 0
    experts = topk_idx[routed]
    per_expert = np.bincount(experts, minlength=num_experts).astype(np.int32)

    rank_of = np.where(routed, topk_idx // (num_experts // num_ranks), -1)
    is_token_in_rank = np.zeros((num_tokens, num_ranks), dtype=bool)
    rows = np.broadcast_to(np.arange(num_tokens)[:, None], topk_idx.shape)
    is_token_in_rank[rows[routed], rank_of[routed]] = True
    per_rank = is_token_in_rank.sum(axis=0).astype(np.int32)

    per_node = None
    num_nodes = num_ranks // ranks_per_node
    if num_nodes > 1:
        in_node = is_token_in_rank.reshape(num_tokens, num_nodes, ranks_per_node).any(axis=2)
        per_node = in_node.sum(axis=0).astype(np.int32)
    return DispatchLayout(per_rank, per_node, per_expert, is_token_in_rank)


def cross_node_copies(topk_idx: np.ndarray, num_experts: int, num_ranks: int, num_ranks_per_node: int,
                      rank: int) -> int:
    """How many token copies ``rank`` sends across node boundaries in a hierarchical dispatch (and
    receives back in its combine): for each token, the nodes other than its own that hold one of its
    experts, each counted once whatever the ranks it reaches there. Times the row bytes, it is what the
    internode mode may put on the network for this rank's tokens; the tests hold the mode to it."""
    layout = get_dispatch_layout(topk_idx, num_experts, num_ranks, num_ranks_per_node)
    num_nodes = num_ranks // num_ranks_per_node
    in_node = layout.is_token_in_rank.reshape(-1, num_nodes, num_ranks_per_node).any(axis=2)
    in_node[:, rank // num_ranks_per_node] = False
    return int(in_node.sum())


def rank_prefix_matrix(topk_idxs: list[np.ndarray], num_experts: int) -> np.ndarray:
    """DeepEP's rank prefix matrix of a dispatch, the first item of its handle: `[R, R]` `int32`, entry
    ``[i][j]`` the tokens that ranks ``0..i`` send to rank ``j`` (each token once per rank). Its column
    ``j`` is receiver ``j``'s ``recv_gbl_rank_prefix_sum`` across nodes (item -4 of that handle)."""
    num_ranks = len(topk_idxs)
    sent = np.stack([get_dispatch_layout(np.asarray(t), num_experts, num_ranks).num_tokens_per_rank
                     for t in topk_idxs])
    return np.cumsum(sent, axis=0).astype(np.int32)


class DispatchResult(NamedTuple):
    """What one receiving rank gets from ``Buffer.dispatch``."""

    recv_x: np.ndarray                      # [num_recv, hidden], rows by (source rank, source token)
    recv_scales: np.ndarray | None          # [num_recv, hidden // 128]
    recv_topk_idx: np.ndarray | None        # [num_recv, num_topk] local expert ids, -1 elsewhere
    recv_topk_weights: np.ndarray | None    # [num_recv, num_topk], 0 where the id is -1
    num_recv_tokens_per_expert: list[int]   # per local expert, aligned
    recv_src: np.ndarray                    # [num_recv, 2]: (source rank, source token)


def dispatch(xs: list[np.ndarray], topk_idxs: list[np.ndarray], num_experts: int, topk_weights: list | None = None,
             scales: list | None = None, expert_alignment: int = 1) -> list[DispatchResult]:
    """Every rank's dispatch result, from every rank's inputs (``xs[s]``: rank ``s``'s tokens).

    A token goes to each rank holding one of its experts, once; ranks receive rows ordered by
    source rank, then source token.
    """
    num_ranks = len(xs)
    per_rank = num_experts // num_ranks
    results = []
    for r in range(num_ranks):
        rows, row_scales, ids, weights, sources = [], [], [], [], []
        for s in range(num_ranks):
            topk = np.asarray(topk_idxs[s])
            owner = np.where(topk >= 0, topk // per_rank, -1)
            tokens = np.nonzero((owner == r).any(axis=1))[0]
            rows.append(xs[s][tokens])
            if scales is not None:
                row_scales.append(scales[s][tokens])
            local = owner[tokens] == r
            ids.append(np.where(local, topk[tokens] - r * per_rank, -1))
            if topk_weights is not None:
                weights.append(np.where(local, topk_weights[s][tokens], 0).astype(np.float32))
            sources.append(np.stack([np.full(len(tokens), s), tokens], axis=1))
        counts = [sum(int((np.asarray(t) == r * per_rank + e).sum()) for t in topk_idxs) for e in range(per_rank)]
        aligned = [align_up(c, expert_alignment) for c in counts]
        results.append(DispatchResult(np.concatenate(rows), np.concatenate(row_scales) if scales is not None else None,
                                      np.concatenate(ids).astype(np.int64),
                                      np.concatenate(weights) if topk_weights is not None else None,
                                      aligned, np.concatenate(sources).astype(np.int64)))
    return results


def combine(recv_xs: list[np.ndarray], recv_srcs: list[np.ndarray], num_tokens: list[int],
            recv_topk_weights: list | None = None, biases: list | None = None):
    """Every source rank's combine result: for each of its tokens, the float32 sum of the rows that
    the ranks holding a copy send back, plus ``biases[s]`` (a list of arrays per rank, or None).

    Returns ``(combined_x, combined_topk_weights)`` lists, one entry per source rank.
    """
    hidden = recv_xs[0].shape[1]
    combined = [np.zeros((n, hidden), dtype=np.float32) for n in num_tokens]
    weights = None
    if recv_topk_weights is not None:
        weights = [np.zeros((n, recv_topk_weights[0].shape[1]), dtype=np.float32) for n in num_tokens]
    for r, (rows, sources) in enumerate(zip(recv_xs, recv_srcs)):
        for i, (s, t) in enumerate(sources):
            combined[s][t] += rows[i].astype(np.float32)
            if weights is not None:
                weights[s][t] += recv_topk_weights[r][i]
    if biases is not None:
        for s, extra in enumerate(biases):
            for b in extra or ():
                combined[s] += b.astype(np.float32)
    return combined, weights


class ElasticLayout(NamedTuple):
    """What one receiving rank's ``ElasticBuffer.dispatch`` lays out, beyond the compact rows of :func:`dispatch`."""

    src_global: np.ndarray         # [num_recv] source rank * num_max_tokens_per_rank + source token
    expanded_row: np.ndarray       # [num_recv, num_topk] each lane's expanded row, -1 for other ranks' lanes
    num_expanded_rows: int         # the sum of the aligned per-expert counts
    psum_per_expert: np.ndarray    # [num_local_experts] expert e's first row plus its count (V2's expanded form)
    psum_per_expert_compact: np.ndarray  # [num_local_experts] inclusive prefix sum of the aligned counts
    num_unaligned_per_expert: np.ndarray  # [num_local_experts]


def elastic_layout(result: DispatchResult, num_max_tokens_per_rank: int, num_local_experts: int,
                   expert_alignment: int = 1) -> ElasticLayout:
    """DeepEP V2's expanded layout of one rank's compact rows ``result`` (:func:`dispatch`'s): expert ``e`` owns
    rows from the sum of the earlier experts' counts rounded up to ``expert_alignment``, and within an expert
    the entries come in received-row order, then lane order."""
    ids = result.recv_topk_idx
    counts = np.array([(ids == e).sum() for e in range(num_local_experts)], dtype=np.int64)
    aligned = np.array([align_up(int(c), expert_alignment) for c in counts], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(aligned)[:-1]]).astype(np.int64)
    expanded = np.full(ids.shape, -1, dtype=np.int64)
    taken = starts.copy()
    for i, k in zip(*np.nonzero(ids >= 0)):  # row-major: received order, then lane order
        expanded[i, k] = taken[ids[i, k]]
        taken[ids[i, k]] += 1
    src_global = result.recv_src[:, 0] * num_max_tokens_per_rank + result.recv_src[:, 1]
    return ElasticLayout(src_global, expanded, int(aligned.sum()), (starts + counts).astype(np.int32),
                         np.cumsum(aligned).astype(np.int32), counts.astype(np.int32))


def elastic_combine(contributions: list[np.ndarray], topk_idxs: list[np.ndarray], num_experts: int,
                    biases: list | None = None, ranks_per_node: int | None = None) -> list[np.ndarray]:
    """DeepEP V2's combine, bit for bit: for each source token, FP32 from its biases (``biases[s]``: rank ``s``'s
    tuple of up to two BF16 arrays, or ``None``), plus each holder rank's row in the order of that rank's highest
    top-k lane, rounded to BF16 once. ``contributions[s]``: `[num_tokens_s, num_ranks, hidden]` BF16, the row each
    rank sends back for each of rank ``s``'s tokens (read only where the token went). Returns BF16 results.

    With ``ranks_per_node`` less than the ranks (V2's hybrid order, across nodes): each node's holder rows are
    first summed in FP32 in the order of each rank's highest lane and rounded to BF16, and those node partials
    take the place of the rows, in the order of each node's highest lane."""
    num_ranks = len(topk_idxs)
    per_rank = num_experts // num_ranks
    per_node = ranks_per_node or num_ranks
    results = []
    for s, topk in enumerate(topk_idxs):
        topk = np.asarray(topk)
        rows = contributions[s]
        out = np.zeros((topk.shape[0], rows.shape[2]), dtype=np.float32)
        for b in (biases[s] if biases is not None and biases[s] is not None else ()):
            out += b.astype(np.float32)
        for t in range(topk.shape[0]):
            holders = [int(e) // per_rank if e >= 0 else -1 for e in topk[t]]
            represented = [h for k, h in enumerate(holders) if h >= 0 and h not in holders[k + 1:]]  # highest lanes
            if per_node == num_ranks:
                for h in represented:
                    out[t] += rows[t, h].astype(np.float32)
                continue
            nodes = [h // per_node for h in represented]
            for i, node in enumerate(nodes):
                if node in nodes[i + 1:]:
                    continue  # the node's highest lane is that of its last represented rank
                partial = np.zeros(rows.shape[2], dtype=np.float32)
                for h in represented:
                    if h // per_node == node:
                        partial += rows[t, h].astype(np.float32)
                out[t] += partial.astype(rows.dtype).astype(np.float32)
        results.append(out.astype(rows.dtype))
    return results


def lane_order_sum(rows: np.ndarray, start: np.ndarray | None = None) -> np.ndarray:
    """`[n, lanes, hidden]` BF16 rows summed over the lanes in order in FP32, from ``start`` (`[n, hidden]` FP32, or
    zeros), rounded to BF16 once: V2's sum of a token's expanded rows on the expert's rank, and (``start`` the
    token's biases, its lanes' expanded rows, zeros for lanes without an expert) its combine with
    ``allow_multiple_reduction=False``."""
    acc = np.zeros((rows.shape[0], rows.shape[2]), dtype=np.float32) if start is None else start.astype(np.float32)
    for k in range(rows.shape[1]):
        acc += rows[:, k].astype(np.float32)
    return acc.astype(rows.dtype)


class LowLatencyDispatchResult(NamedTuple):
    """What one receiving rank gets from ``Buffer.low_latency_dispatch`` (rows past a count are zero here)."""

    recv_x: np.ndarray          # [L, R * max_tokens, hidden]: e4m3 bytes (uint8) or the input dtype
    recv_scales: np.ndarray | None  # [L, R * max_tokens, hidden // 128] float32, or // 512 int32 (UE8M0)
    recv_count: np.ndarray      # [L] int32
    recv_src: list[np.ndarray]  # per local expert, [count, 2]: (source rank, source token) of each row


class _Routes(NamedTuple):
    """Every (expert, source rank, source token) that the tokens' choices name, each once, sorted in that
    order: local expert ``e`` of a rank receives its rows in (source rank, source token) order. Ids
    outside ``[0, num_experts)`` route nowhere; a token naming an expert twice is delivered once."""

    key: np.ndarray       # sorted: (expert * num_ranks + source) * stride + token
    expert: np.ndarray
    source: np.ndarray
    token: np.ndarray
    first: np.ndarray     # [num_experts + 1]: expert x's routes are first[x] .. first[x + 1] - 1
    num_ranks: int
    stride: int           # more than any rank's token count

    @classmethod
    def of(cls, topk_idxs: list[np.ndarray], num_experts: int) -> "_Routes":
        num_ranks = len(topk_idxs)
        stride = max((len(topk) for topk in topk_idxs), default=0) + 1
        keys = [np.zeros(0, np.int64)]
        for s, topk in enumerate(topk_idxs):
            topk = np.asarray(topk, dtype=np.int64)
            tokens, choices = np.nonzero((topk >= 0) & (topk < num_experts))
            keys.append((topk[tokens, choices] * num_ranks + s) * stride + tokens)
        key = np.unique(np.concatenate(keys))
        expert, rest = np.divmod(key, num_ranks * stride)
        source, token = np.divmod(rest, stride)
        return cls(key, expert, source, token, np.searchsorted(expert, np.arange(num_experts + 1)), num_ranks,
                   stride)

    def rows(self, expert: np.ndarray, source: int, token: np.ndarray) -> np.ndarray:
        """The row of each (``expert``, ``source``, ``token``), all routed, among its expert's received rows."""
        key = (expert * self.num_ranks + source) * self.stride + token
        return np.searchsorted(self.key, key) - self.first[expert]


def low_latency_dispatch(xs: list[np.ndarray], topk_idxs: list[np.ndarray], num_experts: int, max_tokens: int,
                         use_fp8: bool = True, round_scale: bool = False,
                         use_ue8m0: bool = False) -> list[LowLatencyDispatchResult]:
    """Every rank's low-latency dispatch result from every rank's inputs.

    Each source quantises its tokens once (``cuep.fp8.quantize``); local expert ``e`` of rank ``r``
    receives, in rows ``0 .. count - 1``, every token that chose it, ordered by (source rank, source token).
    """
    from . import fp8
    num_ranks = len(xs)
    per_rank = num_experts // num_ranks
    sent = [fp8.quantize(np.asarray(x), round_scale, use_ue8m0) if use_fp8 else (np.asarray(x), None) for x in xs]
    hidden = xs[0].shape[1]
    routes = _Routes.of(topk_idxs, num_experts)
    # Every source's sent rows stacked, so a route's row is one index: its source's offset plus its token.
    offsets = np.cumsum([0] + [len(x) for x in xs])
    row_of_route = offsets[routes.source] + routes.token
    data = np.concatenate([d for d, _ in sent])
    scales = np.concatenate([c for _, c in sent]) if use_fp8 else None
    results = []
    for r in range(num_ranks):
        recv_x = np.zeros((per_rank, num_ranks * max_tokens, hidden), dtype=data.dtype)
        recv_scales = np.zeros((per_rank, num_ranks * max_tokens, scales.shape[1]), scales.dtype) if use_fp8 else None
        counts, sources = np.zeros(per_rank, np.int32), []
        for e in range(per_rank):
            begin, end = routes.first[r * per_rank + e], routes.first[r * per_rank + e + 1]
            counts[e] = end - begin
            sources.append(np.stack([routes.source[begin:end], routes.token[begin:end]], axis=1))
            recv_x[e, :counts[e]] = data[row_of_route[begin:end]]
            if use_fp8:
                recv_scales[e, :counts[e]] = scales[row_of_route[begin:end]]
        results.append(LowLatencyDispatchResult(recv_x, recv_scales, counts, sources))
    return results


def low_latency_combine(expert_outputs: list[np.ndarray], topk_idxs: list[np.ndarray], topk_weights: list[np.ndarray],
                        num_experts: int, dispatch_topk_idxs: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """Every source rank's low-latency combine result, float32 `[num_tokens, hidden]`.

    ``expert_outputs[r]``: rank ``r``'s `[L, R * max_tokens, hidden]` outputs, row-aligned with its
    dispatch result. Token ``t`` of rank ``s`` gets ``sum_k weights[t, k] * output(expert k, its row)``
    over the entries naming an expert (summed in float64 in ``k`` order, then rounded to float32).
    ``dispatch_topk_idxs``: the dispatch's ids, where the combine's (``topk_idxs``) set some of them to
    ``-1`` since (those entries add nothing); default ``topk_idxs``.
    """
    num_ranks = len(expert_outputs)
    per_rank = num_experts // num_ranks
    if dispatch_topk_idxs is None:
        dispatch_topk_idxs = topk_idxs
    for s, (combined_ids, dispatched_ids) in enumerate(zip(topk_idxs, dispatch_topk_idxs)):
        combined_ids, dispatched_ids = np.asarray(combined_ids), np.asarray(dispatched_ids)
        if combined_ids.shape != dispatched_ids.shape or not (
                (combined_ids == dispatched_ids) | (combined_ids == -1)).all():
            raise ValueError(f"rank {s}'s combine ids differ from its dispatch's other than by entries set to -1")
    routes = _Routes.of(dispatch_topk_idxs, num_experts)
    combined = []
    for s, (topk, weights) in enumerate(zip(topk_idxs, topk_weights)):
        topk, weights = np.asarray(topk, dtype=np.int64), np.asarray(weights, dtype=np.float64)
        out = np.zeros((len(topk), expert_outputs[0].shape[2]), dtype=np.float64)
        for k in range(topk.shape[1]):
            (tokens,) = np.nonzero((topk[:, k] >= 0) & (topk[:, k] < num_experts))
            experts = topk[tokens, k]
            rows = routes.rows(experts, s, tokens)
            ranks, local = np.divmod(experts, per_rank)
            for r in np.unique(ranks):
                on_r = ranks == r
                picked = np.asarray(expert_outputs[r][local[on_r], rows[on_r]]).astype(np.float64)
                out[tokens[on_r]] += weights[tokens[on_r], k][:, None] * picked
        combined.append(out.astype(np.float32))
    return combined


def low_latency_handle_items(result: LowLatencyDispatchResult, num_ranks: int) -> tuple[list[np.ndarray], np.ndarray]:
    """DeepEP's first two low-latency handle items for one receiver, from its reference ``result``:
    per local expert, the source token index of each received row (its first ``recv_count[e]`` rows; what
    follows is unspecified), and `[L, R]` `int64` ``(first row << 32) | rows`` from each source rank."""
    src_info = [pairs[:, 1].astype(np.int32) for pairs in result.recv_src]
    layout_range = np.zeros((len(result.recv_src), num_ranks), np.int64)
    for e, pairs in enumerate(result.recv_src):
        counts = np.bincount(pairs[:, 0], minlength=num_ranks).astype(np.int64)
        begins = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        layout_range[e] = (begins << 32) | counts
    return src_info, layout_range
