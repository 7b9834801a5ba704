"""Config defaults, validation and the NVL buffer size hint arithmetic."""

import pytest

from cuep.config import Config, get_combine_config, get_dispatch_config
from cuep.kernels import intranode


def test_tuned_defaults_and_override():
    assert get_dispatch_config(4).num_sms == 128 and get_combine_config(4).num_sms == 128
    assert get_dispatch_config(2).num_sms == 96 and get_combine_config(2).num_sms == 128
    assert get_dispatch_config(8).num_sms == 128 and get_combine_config(8).num_sms == 128
    assert [intranode.pusher_warps(r) for r in (2, 4, 8)] == [12, 11, 12]
    assert get_dispatch_config(4, num_sms=20).num_sms == 20


@pytest.mark.parametrize("field", ["num_sms", "num_max_nvl_chunked_send_tokens"])
def test_bad_config_names_the_field(field):
    with pytest.raises(ValueError, match=f"Config\\(\\): {field} must be a positive int"):
        Config(**{field: 0})


@pytest.mark.parametrize("ranks, topk", [(4, 8), (8, 4)])
def test_hint_covers_dispatch_staging_cached_landing_and_combine_landing_twice(ranks, topk):
    hidden, tokens = 7168, 4096
    hint = Config().get_nvl_buffer_size_hint(hidden * 2, ranks, tokens, topk)
    staging = intranode.staging_layout(tokens, hidden * 2, hidden // 128, topk, ranks).end
    cached = ranks * tokens * intranode.push_row_bytes(hidden * 2, 0)
    fp8_cached = ranks * tokens * intranode.push_row_bytes(hidden, hidden // 128)
    landing = tokens * min(ranks, topk) * intranode.landing_row_bytes(hidden, topk)
    region = intranode.region_bytes(hint)
    assert region >= max(staging, landing, fp8_cached)
    assert hint == intranode.META_BYTES + 2 * max(staging, cached, landing)  # no slack beyond what the kernels address


@pytest.mark.parametrize("nvl_bytes", [intranode.META_BYTES, intranode.META_BYTES + 1000, 1 << 30, (1 << 30) + 77])
def test_regions_fit_the_buffer_and_start_on_128_byte_lines(nvl_bytes):
    region = intranode.region_bytes(nvl_bytes)
    assert region % intranode.LANDING_ROW_ALIGN == 0
    assert intranode.META_BYTES + 2 * region <= nvl_bytes < intranode.META_BYTES + 2 * (region + 128)
    assert intranode.region_bytes(intranode.nvl_bytes_for(region)) == region


def test_staging_layout_is_aligned_and_ordered():
    layout = intranode.staging_layout(1001, 2048 * 2, 16, 8, 4)
    offsets = [0, layout.scales_offset, layout.topk_idx_offset, layout.topk_weights_offset,
               layout.send_lists_offset, layout.end]
    assert offsets == sorted(offsets) and all(o % intranode.ALIGN == 0 for o in offsets)
    assert layout.scales_offset >= 1001 * 4096
