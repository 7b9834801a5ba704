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


@pytest.mark.parametrize("num_tokens, hidden_bytes, num_scales, num_topk, num_ranks",
                         [(1001, 2048 * 2, 16, 8, 4), (1001, 7168, 56, 8, 8), (3, 1024 * 2, 0, 0, 2), (0, 4096, 32, 4, 8)])
def test_staging_layout_is_aligned_and_ordered(num_tokens, hidden_bytes, num_scales, num_topk, num_ranks):
    layout = intranode.staging_layout(num_tokens, hidden_bytes, num_scales, num_topk, num_ranks)
    offsets = [0, layout.scales_offset, layout.topk_idx_offset, layout.topk_weights_offset, layout.send_lists_offset,
               layout.end]
    assert offsets == sorted(offsets) and all(offset % intranode.ALIGN == 0 for offset in offsets)
    # Each array ends before the next starts: rows, FP8 scales (float32), top-k ids (int64) and weights
    # (float32), one int32 send list per destination.
    array_bytes = [num_tokens * hidden_bytes, num_tokens * num_scales * 4, num_tokens * num_topk * 8,
                   num_tokens * num_topk * 4, num_ranks * num_tokens * 4]
    assert all(start + size <= end for start, end, size in zip(offsets, offsets[1:], array_bytes))
