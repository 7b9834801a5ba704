"""Low-latency mode and launch module (no GPU needed): the buffer layout arithmetic holds, the
dispatch's shared memory is checked, and the trace points are defined once, for the kernels and the
benchmark alike. (The argument structs' layouts are checked by tests/test_kernel_args.py.)"""

import math

import numpy as np
import pytest

from cuep.kernels import low_latency as kernels
from cuep.modes import low_latency


def test_layout_regions_do_not_overlap_and_fit_the_hint():
    layout = low_latency.data_layout(128, 7168, 4, 288)
    names = ("dispatch_slots", "combine_slots", "choice_slots", "routing_staging", "dispatch_staging",
             "weight_staging", "combine_staging")
    offsets = sorted(getattr(layout, f) for f in names)
    assert offsets[0] == 0 and len(set(offsets)) == len(names)
    assert layout.dispatch_slot_bytes >= 2 * 7168 and layout.dispatch_slot_bytes % 128 == 0
    # paired (16-byte) loads: every source's routing table, and its token rows, start 16-byte aligned
    assert low_latency.ROUTING_WORDS % 2 == 0 and kernels.ROUTING_HEADER_WORDS % 2 == 0
    assert low_latency.flags_bytes(4) % 16 == 0
    # a staged table holds the header, the 72 local experts' counts and 128 tokens of the most choices
    assert layout.routing_staging_words == low_latency.routing_table_words(128, low_latency.MAX_TOPK, 288, 4) == \
        kernels.ROUTING_HEADER_WORDS + 72 + 128 * low_latency.MAX_TOPK
    assert low_latency.routing_table_words(128, 7, 6, 2) == kernels.ROUTING_HEADER_WORDS + 4 + 128 * 8  # both padded
    # the largest call still fits its table: the most tokens of the most choices beside 512 local experts' counts
    most = low_latency.routing_table_words(low_latency.MAX_TOKENS_PER_RANK, low_latency.MAX_TOPK,
                                           kernels.MAX_COUNT_WORDS * 8, 8)
    assert most == low_latency.ROUTING_WORDS
    assert layout.weight_staging_words >= 128 * low_latency.MAX_TOPK
    hint = low_latency.size_hint(128, 7168, 4, 288)
    assert low_latency.data_bytes(hint, 4) >= layout.end
    assert low_latency.data_bytes(hint - 4 * 4096, 4) < layout.end  # the hint is tight to a page per buffer
    assert layout.choice_slots + 128 * kernels.CHOICE_SLOTS * layout.combine_slot_bytes <= layout.end
    # per-rank slots, not per-expert: four buffers stay far below DeepEP's ~GB hint
    assert hint < 192 << 20


def test_four_buffers_follow_the_mask_and_fill_the_region():
    hint = low_latency.size_hint(128, 7168, 4, 288)
    assert kernels.NUM_BUFFERS == 4
    per_buffer = low_latency.buffer_bytes(hint, 4)
    assert per_buffer % 4096 == 0 and low_latency.mask_bytes(4) % 4096 == 0
    assert low_latency.mask_bytes(4) + kernels.NUM_BUFFERS * per_buffer <= hint
    assert per_buffer == low_latency.fixed_bytes(4) + low_latency.data_bytes(hint, 4)
    # a region too small for even the fixed part of a buffer has no data capacity, not a negative one
    assert low_latency.data_bytes(low_latency.mask_bytes(4) + 4096, 4) == 0


def test_flags_and_tables_sit_at_fixed_offsets_whatever_the_shape():
    # polled words never alias message data of another shape: only the data regions depend on it
    small, large = low_latency.size_hint(8, 256, 4, 8), low_latency.size_hint(1024, 7168, 4, 288)
    fixed = low_latency.fixed_bytes(4)
    assert fixed >= low_latency.flags_bytes(4) + 4 * (low_latency.ROUTING_WORDS + low_latency.WEIGHT_WORDS) * 8
    assert small > kernels.NUM_BUFFERS * fixed and large > small
    assert low_latency.flags_bytes(4) % 4096 == 0 and fixed % 4096 == 0


_DEFAULT_BLOCK_BYTES, _HOPPER_BLOCK_BYTES = 48 * 1024, 227 * 1024  # without and with opting in


def test_dispatch_shared_memory_of_deepseek_shapes_needs_no_opt_in():
    # 288 experts (DeepSeek's 256 and redundant ones) at the largest token count, on 4 to 64 ranks
    limit = _DEFAULT_BLOCK_BYTES - kernels.DISPATCH_STATIC_SHARED_BYTES
    for ranks in (4, 8, 16, 32, 64):
        experts = 288 if 288 % ranks == 0 else 256
        assert kernels.dispatch_shared_bytes(low_latency.MAX_TOKENS_PER_RANK, ranks, experts) <= limit, ranks


def test_dispatch_shared_memory_counts_every_expert_s_bitmap():
    # R counts, L x (R + 1) first rows (the receive's), E x ceil(T / 32) bitmap words (the send's), 4 bytes each
    assert kernels.dispatch_shared_bytes(128, 4, 288) == (4 + 72 * 5 + 288 * 4) * 4
    assert kernels.dispatch_shared_bytes(129, 2, 8) == (2 + 4 * 3 + 8 * 5) * 4


@pytest.mark.parametrize("variant", ["default", "fallback", "aggressive_ptx"])
def test_the_dispatch_s_own_shared_memory_fits_its_bound(variant):
    """The dynamic shared memory allowed is the block's limit less DISPATCH_STATIC_SHARED_BYTES: that bound must
    hold what the compiled kernel declares itself, or the largest shapes fail at launch."""
    from .builds import compiled
    from .cubin import static_shared_bytes
    _, artifact = compiled("low_latency", "sm_90", variant)
    declared = static_shared_bytes(artifact.cubin, artifact.symbols[kernels.DISPATCH_ENTRY])
    assert 0 < declared <= kernels.DISPATCH_STATIC_SHARED_BYTES, declared


def test_dispatch_shared_memory_past_the_limit_is_a_clear_error():
    ranks, experts = 8, 2048
    with pytest.raises(ValueError, match=r"num_max_dispatch_tokens_per_rank=1024 from 8 ranks to num_experts=2048") \
            as error:
        kernels.check_dispatch_shared_bytes("low_latency_dispatch()", 1024, ranks, experts, _HOPPER_BLOCK_BYTES)
    most = int(str(error.value).rsplit("<= ", 1)[1].split()[0])
    limit = _HOPPER_BLOCK_BYTES - kernels.DISPATCH_STATIC_SHARED_BYTES
    assert 0 < most < 1024 and most % 32 == 0
    assert kernels.dispatch_shared_bytes(most, ranks, experts) <= limit
    assert kernels.dispatch_shared_bytes(most + 32, ranks, experts) > limit
    assert kernels.check_dispatch_shared_bytes("c", most, ranks, experts, _HOPPER_BLOCK_BYTES) == \
        kernels.dispatch_shared_bytes(most, ranks, experts)
    with pytest.raises(ValueError, match=r"use fewer experts \(num_experts\)"):
        kernels.check_dispatch_shared_bytes("low_latency_dispatch()", 32, 8, 65536, _DEFAULT_BLOCK_BYTES)


def test_dispatch_stages_a_token_per_receiving_warp_with_a_pair_as_far_as_shared_memory_allows():
    layout = kernels.dispatch_shared_bytes(128, 4, 288)  # 4 + 72 * 5 + 288 * 4 words: 16-byte aligned already
    fp8 = low_latency.dispatch_message_bytes(7168, True)
    assert fp8 == 7168 + 56 * 4 and low_latency.dispatch_message_bytes(7168, False) == 2 * 7168
    # 512 pairs over 132 blocks: blocks take up to 4, one warp each
    assert kernels.dispatch_staging(128, 4, 132, fp8, layout, _HOPPER_BLOCK_BYTES) == (4, fp8, layout + 4 * fp8)
    # many pairs per block: every receiving warp of a block that also sends, but the one reading the tables
    staged, stage_bytes, shared = kernels.dispatch_staging(1024, 8, 132, fp8, layout, _HOPPER_BLOCK_BYTES)
    assert staged == kernels.STAGED_TOKENS_MAX == kernels.NUM_THREADS // 32 // 2 - 1
    # a slot is whole 16-byte copies, after the layout rounded up to them
    staged, stage_bytes, shared = kernels.dispatch_staging(128, 2, 8, 7168 + 7168 // 128 * 4 + 4, 10, 1 << 20)
    assert stage_bytes % 16 == 0 and stage_bytes >= 7168 + 228 and shared == 16 + staged * stage_bytes
    # as many as fit beside the layout and the kernel's own; none where none fits
    limit = _DEFAULT_BLOCK_BYTES - kernels.DISPATCH_STATIC_SHARED_BYTES
    staged, _, shared = kernels.dispatch_staging(128, 4, 132, 2 * 7168, layout, _DEFAULT_BLOCK_BYTES)
    assert staged == (limit - layout) // (2 * 7168) and shared <= limit
    assert kernels.dispatch_staging(128, 4, 132, 2 * 7168, limit - 16, _DEFAULT_BLOCK_BYTES) == (0, 2 * 7168, limit - 16)


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


def test_trace_points_are_defined_once_for_kernels_and_benchmark():
    from cuep import bench
    constants = kernels.spec("sm_90").macros()
    stamped = {name: int(value) for name, value in constants if name.startswith("CUEP_TRACE_") and
               name != "CUEP_TRACE_POINTS"}
    for points, printed in ((kernels.DISPATCH_TRACE, bench.DISPATCH_TRACE), (kernels.COMBINE_TRACE, bench.COMBINE_TRACE)):
        indices = [index for index, _ in points.values()]
        assert len(set(indices)) == len(indices) and max(indices) < kernels.TRACE_POINTS
        assert {f"CUEP_TRACE_{name.upper()}": index for name, (index, _) in points.items()}.items() <= stamped.items()
        assert list(printed) == indices  # the benchmark prints them in the order a block passes them
    shared = kernels.DISPATCH_TRACE.keys() & kernels.COMBINE_TRACE.keys()
    assert shared == {"entry", "start", "table_published", "end", "exit"}
    assert all(kernels.DISPATCH_TRACE[n][0] == kernels.COMBINE_TRACE[n][0] for n in shared)
    assert dict(constants)["CUEP_TRACE_POINTS"] == str(kernels.TRACE_POINTS)
