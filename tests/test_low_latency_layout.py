"""Low-latency launch module (no GPU needed): the ctypes argument structs mirror the C++ ones, the
buffer layout arithmetic holds, and the benchmark names every trace point the kernels stamp."""

import math
import re

import numpy as np
import pytest

from cuep.jit.compiler import source_root
from cuep.kernels import low_latency


def c_struct_fields(name: str) -> list[str]:
    source = (source_root() / "low_latency.cu").read_text()
    body = re.search(r"struct %s \{(.*?)\n\};" % name, source, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    fields = []
    for declaration in body.split(";"):
        declaration = declaration.strip()
        if not declaration or "(" in declaration:  # member functions, none here
            continue
        names = declaration.split(None, 1)[1] if " " in declaration else declaration
        fields += [n.strip().lstrip("*") for n in names.replace("*", " *").split(",") if n.strip()]
    return [f.split()[-1].lstrip("*") for f in fields]


@pytest.mark.parametrize("name, mirror", [("DispatchArgs", low_latency.DispatchArgs),
                                          ("CombineArgs", low_latency.CombineArgs)])
def test_ctypes_structs_mirror_the_kernel_arguments(name, mirror):
    assert [f for f, _ in mirror._fields_] == c_struct_fields(name)


def test_layout_regions_do_not_overlap_and_fit_the_hint():
    layout = low_latency.half_layout(128, 7168, 4)
    names = ("dispatch_slots", "combine_slots", "routing_staging", "dispatch_staging", "weight_staging",
             "combine_staging")
    offsets = sorted(getattr(layout, f) for f in names)
    assert offsets[0] == 0 and len(set(offsets)) == len(names)
    assert layout.dispatch_slot_bytes >= 2 * 7168 and layout.dispatch_slot_bytes % 128 == 0
    # paired (16-byte) loads: every source's routing table, and its token rows, start 16-byte aligned
    assert low_latency.ROUTING_WORDS % 2 == 0 and low_latency.ROUTING_HEADER_WORDS % 2 == 0
    assert low_latency.flags_bytes(4) % 16 == 0
    assert layout.routing_staging_words >= low_latency.ROUTING_HEADER_WORDS + 128 * low_latency.MAX_TOPK
    assert layout.weight_staging_words >= 128 * low_latency.MAX_TOPK
    hint = low_latency.size_hint(128, 7168, 4)
    assert low_latency.half_data_bytes(hint, 4) >= layout.end
    assert low_latency.half_data_bytes(hint - 8192, 4) < layout.end  # the hint is tight to a page
    # per-rank slots, not per-expert: the whole buffer stays far below DeepEP's ~GB hint
    assert hint < 64 << 20


def test_flags_and_tables_sit_at_fixed_offsets_whatever_the_shape():
    # polled words never alias message data of another shape: only the data regions depend on it
    small, large = low_latency.size_hint(8, 256, 4), low_latency.size_hint(1024, 7168, 4)
    fixed = low_latency.fixed_bytes(4)
    assert fixed >= low_latency.flags_bytes(4) + 2 * 4 * (low_latency.ROUTING_WORDS + low_latency.WEIGHT_WORDS) * 8
    assert small > fixed and large > small
    assert low_latency.flags_bytes(4) % 4096 == 0 and fixed % 4096 == 0


def test_dispatch_shared_memory_stays_within_the_default_limit():
    limit = low_latency.MAX_SHARED_BYTES - low_latency.DISPATCH_STATIC_SHARED_BYTES
    assert low_latency.dispatch_shared_bytes(low_latency.MAX_TOKENS_PER_RANK, 64) <= limit


def test_dispatch_shared_memory_past_the_limit_is_a_clear_error():
    ranks = 256
    with pytest.raises(ValueError, match=r"num_max_dispatch_tokens_per_rank=1024 on 256 ranks") as error:
        low_latency.check_dispatch_shared_bytes("low_latency_dispatch()", 1024, ranks)
    most = int(str(error.value).rsplit("<= ", 1)[1].split()[0])
    limit = low_latency.MAX_SHARED_BYTES - low_latency.DISPATCH_STATIC_SHARED_BYTES
    assert low_latency.dispatch_shared_bytes(most, ranks) <= limit < low_latency.dispatch_shared_bytes(most + 32, ranks)
    with pytest.raises(ValueError, match="use fewer ranks per Buffer"):
        low_latency.check_dispatch_shared_bytes("low_latency_dispatch()", 32, 8192)
    assert low_latency.check_dispatch_shared_bytes("c", most, ranks) == low_latency.dispatch_shared_bytes(most, ranks)


def trace_constants(text: str) -> set[int]:
    return {int(v) for v in re.findall(r"constexpr int kTrace\w+ = (\d+);", text)}


@pytest.mark.parametrize("use_fp8, use_ue8m0", [(True, False), (True, True), (False, False)])
def test_dispatch_outputs_share_one_allocation_without_overlap(use_fp8, use_ue8m0):
    num_ranks, max_tokens, hidden, num_experts, num_topk = 4, 96, 1536, 32, 7
    regions, storage_bytes = low_latency.dispatch_regions(num_ranks, max_tokens, hidden, num_experts, num_topk,
                                                         use_fp8, use_ue8m0, np.dtype(np.uint16))
    spans = sorted((r.offset, r.offset + math.prod(r.shape) * np.dtype(r.dtype).itemsize) for r in regions.values())
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start
    assert spans[-1][1] <= storage_bytes
    assert all(r.offset % 128 == 0 for r in regions.values())
    rows = num_ranks * max_tokens
    assert regions["recv_x"].shape == (num_experts // num_ranks, rows, hidden)
    assert np.dtype(regions["recv_x"].dtype).itemsize == (1 if use_fp8 else 2)
    scales = regions["recv_scales"]
    if use_fp8:
        columns = hidden // 128 // (4 if use_ue8m0 else 1)
        assert scales.shape == (num_experts // num_ranks, rows, columns)
        assert scales.strides == (4 * rows * columns, 4, 4 * rows)  # column-major in the last two dims
    else:
        assert math.prod(scales.shape) == 0


def kernel_trace_points() -> tuple[set[int], set[int]]:
    """The dispatch's and the combine's kTrace* constants in low_latency.cu (the combine shares start,
    tables published and end with the dispatch)."""
    source = (source_root() / "low_latency.cu").read_text()
    dispatch_part, combine_part = source.split("// Trace points", 1)[1].split("// Combine (", 1)
    return trace_constants(dispatch_part), trace_constants(combine_part.split("\n\n", 1)[0]) | {0, 1, 9}


def test_bench_names_every_trace_point_the_kernels_stamp():
    from cuep import bench
    dispatch, combine = kernel_trace_points()
    assert set(bench.DISPATCH_TRACE) == dispatch and set(bench.COMBINE_TRACE) == combine
    assert max(dispatch | combine) < low_latency.TRACE_POINTS
