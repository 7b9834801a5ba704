"""How the intranode mode lays out its NVL buffer (cuep.modes.intranode): the two regions after the
meta region, and where a non-cached dispatch stages its arrays in one of them."""

import pytest

from cuep.modes import intranode

META, LINE = intranode.META_BYTES, intranode.LANDING_ROW_ALIGN


@pytest.mark.parametrize("nvl_bytes", [META, META + 1000, 1 << 30, (1 << 30) + 77])
def test_regions_fit_the_buffer_and_start_on_128_byte_lines(nvl_bytes):
    region = intranode.region_bytes(nvl_bytes)
    assert LINE == 128 and region % LINE == 0  # so does the second region, after the first
    assert META + 2 * region <= nvl_bytes < META + 2 * (region + LINE)  # the largest that fit
    assert intranode.region_bytes(intranode.nvl_bytes_for(region)) == region


@pytest.mark.parametrize("num_tokens, num_topk, num_ranks", [(1001, 8, 4), (65536, 8, 8), (3, 0, 2), (0, 4, 8)])
def test_staging_layout_is_aligned_and_ordered(num_tokens, num_topk, num_ranks):
    layout = intranode.staging_layout(num_tokens, num_topk, num_ranks)
    offsets = [layout.topk_idx_offset, layout.topk_weights_offset, layout.send_lists_offset, layout.end]
    assert offsets[0] == 0 and offsets == sorted(offsets) and all(offset % intranode.ALIGN == 0 for offset in offsets)
    # Each array ends before the next starts: top-k ids (int64) and weights (float32), one int32 send list
    # per destination. No rows: they are pushed in rounds.
    array_bytes = [num_tokens * num_topk * 8, num_tokens * num_topk * 4, num_ranks * num_tokens * 4]
    assert all(start + size <= end for start, end, size in zip(offsets, offsets[1:], array_bytes))


@pytest.mark.parametrize("row_bytes", [7424, 14464, 14592])
@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
def test_round_tokens_fill_one_region_in_whole_units(row_bytes, num_ranks):
    unit = intranode.ROUND_UNIT_TOKENS
    for num_tokens in (1, unit, 1280, 4096, 10**6):
        nvl_bytes = intranode.round_nvl_bytes(row_bytes, num_ranks, num_tokens)
        tokens = intranode.round_tokens(nvl_bytes, row_bytes, num_ranks)
        assert tokens % unit == 0 and tokens >= unit
        # A region holds one section of landing rows per rank, and no more than the arrival counters cover.
        assert num_ranks * tokens * row_bytes <= intranode.region_bytes(nvl_bytes)
        assert num_ranks * tokens <= intranode.MAX_ROUND_ROWS
        assert tokens == min(-(-num_tokens // unit) * unit, intranode.MAX_ROUND_ROWS // num_ranks // unit * unit)
    assert intranode.round_tokens(intranode.round_nvl_bytes(row_bytes, num_ranks, unit) - LINE, row_bytes,
                                  num_ranks) == 0
