"""cuep's ElasticBuffer against DeepEP V2's (2.1.0, ``deep_ep/buffers/elastic.py``), written out by hand: the
methods' parameters and defaults, the size hint, the analytic SM count, and what is out of scope. No GPU."""

from __future__ import annotations

import inspect
import math
import re

import numpy as np
import pytest

from cuep import Buffer
from cuep.elastic import BUFFER_ALIGNMENT, EPHandle, ElasticBuffer, split_bytes

_ = inspect.Parameter.empty
DEEPEP_V2 = {
    "__init__": [("self", _), ("group", None), ("num_bytes", None), ("num_cpu_bytes", 0),
                 ("num_max_tokens_per_rank", 0), ("hidden", 0), ("num_topk", 0), ("use_fp8_dispatch", False),
                 ("deterministic", False), ("allow_hybrid_mode", True), ("allow_multiple_reduction", True),
                 ("prefer_overlap_with_compute", True), ("sl_idx", 3), ("num_allocated_qps", 0),
                 ("num_cpu_timeout_secs", 300), ("num_gpu_timeout_secs", 100), ("explicitly_destroy", False)],
    "get_buffer_size_hint": [("group", _), ("num_max_tokens_per_rank", _), ("hidden", _), ("num_topk", 0),
                             ("use_fp8_dispatch", False), ("allow_hybrid_mode", True),
                             ("allow_multiple_reduction", True)],
    "barrier": [("self", _), ("use_comm_stream", True), ("with_cpu_sync", False), ("sequential", True)],
    "get_theoretical_num_sms": [("self", _), ("num_experts", _), ("num_topk", _), ("num_scaleout_topk", 0),
                                ("rdma_gbs", 0), ("nvlink_gbs", 0), ("sm_read_gbs", 200), ("sm_write_gbs", 50)],
    "get_theoretical_num_qps": [("self", _), ("num_sms", _)],
    "dispatch": [("self", _), ("x", _), ("topk_idx", None), ("topk_weights", None),
                 ("cumulative_local_expert_recv_stats", None), ("num_experts", None),
                 ("num_max_tokens_per_rank", None), ("expert_alignment", None), ("num_sms", 0), ("num_qps", 0),
                 ("previous_event", None), ("previous_event_before_epilogue", None),
                 ("async_with_compute_stream", False), ("allocate_on_comm_stream", False), ("handle", None),
                 ("do_handle_copy", True), ("do_cpu_sync", None), ("do_expand", False), ("do_zero_padding", False),
                 ("use_tma_aligned_col_major_sf", False)],
    "combine": [("self", _), ("x", _), ("handle", _), ("topk_weights", None), ("bias", None), ("num_sms", 0),
                ("num_qps", 0), ("previous_event", None), ("previous_event_before_epilogue", None),
                ("async_with_compute_stream", False), ("allocate_on_comm_stream", False)],
}
V2_HANDLE_FIELDS = ("do_expand", "num_experts", "expert_alignment", "num_max_tokens_per_rank", "num_sms", "topk_idx",
                    "num_recv_tokens", "num_expanded_tokens", "num_recv_tokens_per_expert_list",
                    "psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                    "num_unaligned_recv_tokens_per_expert", "recv_src_metadata", "dst_buffer_slot_idx",
                    "token_metadata_at_forward", "channel_linked_list")


def parameters(function) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values()
            if p.kind is not inspect.Parameter.KEYWORD_ONLY]


@pytest.mark.parametrize("method", sorted(DEEPEP_V2))
def test_core_method_matches_deepep_v2(method):
    assert parameters(getattr(ElasticBuffer, method)) == DEEPEP_V2[method]


@pytest.mark.parametrize("method", sorted(DEEPEP_V2))
def test_torch_method_matches_deepep_v2(method):
    pytest.importorskip("torch", reason="cuep.torch needs torch")
    import cuep.torch
    want = DEEPEP_V2[method]
    if method == "__init__":  # torch's ElasticBuffer needs its group, as V2's
        want = [("self", _), ("group", _)] + want[2:]
    assert parameters(getattr(cuep.torch.ElasticBuffer, method)) == want


def test_handle_has_v2s_fields():
    for field in V2_HANDLE_FIELDS:
        assert field in inspect.getsource(EPHandle), field


class _Ranks:
    def __init__(self, n: int):
        self.n = n

    def size(self) -> int:
        return self.n


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
@pytest.mark.parametrize("hidden", [2048, 7168])
def test_size_hint_is_v1s_and_needs_no_token_count(num_ranks, hidden):
    hint = ElasticBuffer.get_buffer_size_hint(_Ranks(num_ranks), 4096, hidden)
    v1 = max(Buffer.get_dispatch_config(num_ranks).get_nvl_buffer_size_hint(hidden * 2, num_ranks),
             Buffer.get_combine_config(num_ranks).get_nvl_buffer_size_hint(hidden * 2, num_ranks))
    assert hint % BUFFER_ALIGNMENT == 0 and v1 <= hint < v1 + BUFFER_ALIGNMENT
    assert ElasticBuffer.get_buffer_size_hint(_Ranks(num_ranks), 65536, hidden) == hint


@pytest.mark.parametrize("nodes,ranks_per_node", [(2, 2), (2, 8), (3, 2), (4, 8), (16, 8)])
@pytest.mark.parametrize("hidden", [0, 2048, 7168])
def test_across_nodes_the_hint_is_v1s_two_buffers_and_splits_back_into_them(monkeypatch, nodes, ranks_per_node,
                                                                             hidden):
    monkeypatch.setenv("CUEP_RANKS_PER_NODE", str(ranks_per_node))
    num_ranks = nodes * ranks_per_node
    row_hidden = hidden or 7168
    configs = (Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks))

    def v1(num_tokens=None):
        return [max(getattr(c, f"get_{kind}_buffer_size_hint")(row_hidden * 2, num_ranks, num_tokens) for c in configs)
                for kind in ("nvl", "rdma")]

    hint = ElasticBuffer.get_buffer_size_hint(_Ranks(num_ranks), 4096, row_hidden)
    assert hint % BUFFER_ALIGNMENT == 0 and sum(v1()) <= hint < sum(v1()) + BUFFER_ALIGNMENT
    # Split back (the hidden given or not), each buffer holds at least the round V1's hints were sized for.
    for total, (nvl_want, rdma_want) in ((hint, v1()), (sum(v1(128)), v1(128))):
        nvl, rdma = split_bytes(total, ranks_per_node, nodes, hidden)
        assert nvl + rdma == total and nvl >= nvl_want and rdma >= rdma_want, (nvl, nvl_want, rdma, rdma_want)


def test_one_node_keeps_every_byte_for_nvlink():
    assert split_bytes(123 << 20, 8, 1, 7168) == (123 << 20, 0)


def _unmade(num_ranks: int, prefer_overlap: bool = True, hybrid: bool = True) -> ElasticBuffer:
    """An ElasticBuffer's host state without its GPU resources, for the host-only methods."""
    buffer = object.__new__(ElasticBuffer)
    buffer.num_ranks, buffer.prefer_overlap_with_compute, buffer.allow_hybrid_mode = num_ranks, prefer_overlap, hybrid
    buffer._device_sms, buffer._compute_capability = 132, 90
    buffer.num_allocated_qps = 129 if hybrid else 17
    return buffer


def test_theoretical_sms_follow_v2s_model():
    # 4 ranks, top-6 of 256, 430.3 GB/s of NVLink: rows a rank writes out limit it (1 / 50 GB/s per SM).
    nvlink = 478.125 * 0.9
    expected_ranks = 4 * (1 - math.comb(192, 6) / math.comb(256, 6))
    writes = nvlink / 0.75 / 50
    assert writes > nvlink / 0.75 / expected_ranks / 200
    want = math.ceil(writes * 1.25) + math.ceil(writes * 1.25) % 2
    assert _unmade(4).get_theoretical_num_sms(256, 6) == want == 16
    assert _unmade(4, prefer_overlap=False).get_theoretical_num_sms(256, 6) == 64
    assert _unmade(1).get_theoretical_num_sms(256, 6) == 132  # no traffic: the whole GPU
    with pytest.raises(ValueError, match="num_scaleout_topk"):
        _unmade(4).get_theoretical_num_sms(256, 6, num_scaleout_topk=2)


def test_theoretical_qps_are_v2s():
    assert _unmade(4).get_theoretical_num_qps(16) == 129
    assert _unmade(4, hybrid=False).get_theoretical_num_qps(16) == 9


@pytest.mark.parametrize("name", ["engram_write", "pp_send", "all_gather", "create_agrs_session"])
def test_out_of_scope_sessions_say_so(name):
    with pytest.raises(NotImplementedError, match="out of scope"):
        getattr(_unmade(4), name)


def _expanded_handle(num_max_tokens_per_rank: int, num_topk: int, num_experts: int = 64) -> EPHandle:
    """An expanded dispatch's handle as combine first reads it (no arrays)."""
    handle = object.__new__(EPHandle)
    handle.do_expand, handle.num_max_tokens_per_rank, handle._dispatch = True, num_max_tokens_per_rank, None
    handle.num_experts, handle.expert_alignment = num_experts, 128
    handle.topk_idx = np.zeros((4, num_topk), np.int64)
    return handle


def _single_reduction(num_nvl_bytes: int, num_ranks: int = 4) -> ElasticBuffer:
    """An unmade ElasticBuffer of ``allow_multiple_reduction=False`` with this much NVLink buffer."""
    buffer = _unmade(num_ranks)
    buffer.allow_multiple_reduction, buffer.num_bytes = False, num_nvl_bytes
    buffer._buffer = type("Core", (), {"num_nvl_bytes": num_nvl_bytes})()
    return buffer


@pytest.mark.parametrize("weights, tokens, num_nvl_bytes, error", [
    (np.zeros(8, np.float32), 4096, 1 << 30, "topk_weights must be None"),
    (None, (1 << 24) // 8 + 1, 1 << 30, "tags each row with its token and lane"),
    # 4 ranks x 4096 tokens x 8 lanes + 127 x 16 padding: 133,120 rows of 8 + 4 + 16 routing bytes: 3.7 MB a region.
    (None, 4096, 2 * 3_600_000, "make it with num_bytes >= "),
])
def test_expanded_combine_without_multiple_reduction_states_its_limits(weights, tokens, num_nvl_bytes, error):
    with pytest.raises(ValueError, match=error):
        _single_reduction(num_nvl_bytes).combine(np.zeros((8, 128), np.float32), _expanded_handle(tokens, 8),
                                                 topk_weights=weights)


def test_expanded_combine_without_multiple_reduction_fits_the_hint():
    # The buffer V2's size hint gives for 4096 tokens at hidden 7168 stages the worst case with room to spare.
    hint = ElasticBuffer.get_buffer_size_hint(_Ranks(4), 4096, 7168)
    _single_reduction(hint)._check_lanes_apart("combine()", _expanded_handle(4096, 8), 8, None)
    # At 8 ranks, 16384 tokens, hidden 2048: V1's hint stages too few rows, the hint for the option enough (an
    # alignment of 1 pads nothing), and so does the size the refusal names.
    ranks, handle = _Ranks(8), _expanded_handle(16384, 8, num_experts=256)
    handle.expert_alignment = 1
    plain = ElasticBuffer.get_buffer_size_hint(ranks, 16384, 2048)
    single = ElasticBuffer.get_buffer_size_hint(ranks, 16384, 2048, allow_multiple_reduction=False)
    assert single > plain == ElasticBuffer.get_buffer_size_hint(ranks, 1, 2048)
    _single_reduction(single, 8)._check_lanes_apart("combine()", handle, 8, None)
    with pytest.raises(ValueError, match="make it with num_bytes >= ") as refused:
        _single_reduction(plain, 8)._check_lanes_apart("combine()", handle, 8, None)
    named = int(re.search(r"num_bytes >= (\d+)", str(refused.value)).group(1))
    _single_reduction(named, 8)._check_lanes_apart("combine()", handle, 8, None)
