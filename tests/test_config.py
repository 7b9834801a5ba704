"""cuep.Config through the public API: a dispatch and a combine Config for every rank count, the
``Buffer.set_num_sms`` override, validation, and NVL size hints that hold what the calls stage.

The tuned SM counts themselves are not repeated here: a retune changes them, not their behaviour.
"""

import itertools

import pytest

import cuep
from cuep import Config
from cuep.modes import intranode

SUPPORTED_RANKS = range(1, 9)  # the intranode kernels: up to 8 ranks on one node
HIDDENS = (384, 1024, 2048, 4096, 7168)


@pytest.fixture
def tuned_sms(monkeypatch):
    """The default count for the test (``set_num_sms`` sets a class attribute); whatever was set comes back after."""
    from cuep.config import DEFAULT_NUM_SMS
    monkeypatch.setattr(cuep.Buffer, "num_sms", DEFAULT_NUM_SMS)


def nvl_hint(hidden: int, num_ranks: int, num_tokens: int = 4096, num_topk: int = 8) -> int:
    return Config().get_nvl_buffer_size_hint(hidden * 2, num_ranks, num_tokens, num_topk)


@pytest.mark.parametrize("num_ranks", SUPPORTED_RANKS)
def test_every_rank_count_has_a_dispatch_and_a_combine_config(tuned_sms, num_ranks):
    for config in (cuep.Buffer.get_dispatch_config(num_ranks), cuep.Buffer.get_combine_config(num_ranks)):
        assert isinstance(config, Config)
        assert isinstance(config.num_sms, int) and config.num_sms > 0, config


def test_num_sms_is_deepeps_int_and_what_calls_use(tuned_sms):
    """Frameworks read Buffer.num_sms before making a Buffer (SGLang splits the GPU with it): an int, DeepEP's 20,
    and the count the calls use when they pass no Config."""
    assert cuep.Buffer.num_sms == 20 and type(cuep.Buffer.num_sms) is int
    assert cuep.Buffer.get_dispatch_config(4).num_sms == cuep.Buffer.get_combine_config(8).num_sms == 20


def test_set_num_sms_overrides_dispatch_and_combine_for_every_rank_count(tuned_sms):
    cuep.Buffer.set_num_sms(24)
    assert cuep.Buffer.num_sms == 24
    for num_ranks in SUPPORTED_RANKS:
        assert cuep.Buffer.get_dispatch_config(num_ranks).num_sms == 24
        assert cuep.Buffer.get_combine_config(num_ranks).num_sms == 24


@pytest.mark.parametrize("bad", [0, -2, True, 2.5, "8"])
def test_set_num_sms_rejects_what_is_not_a_positive_int_and_keeps_the_count(tuned_sms, bad):
    cuep.Buffer.set_num_sms(24)
    with pytest.raises(ValueError, match=r"Buffer\.set_num_sms\(\): new_num_sms must be a positive int"):
        cuep.Buffer.set_num_sms(bad)
    assert cuep.Buffer.num_sms == 24 and cuep.Buffer.get_dispatch_config(4).num_sms == 24


def test_defaults_match_deepep():
    config = Config()
    assert (config.num_sms, config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens,
            config.num_max_rdma_chunked_send_tokens, config.num_max_rdma_chunked_recv_tokens) == (20, 6, 256, 6, 256)


@pytest.mark.parametrize("field, bad", [
    ("num_sms", 0), ("num_sms", True), ("num_max_nvl_chunked_send_tokens", -1),
    ("num_max_nvl_chunked_recv_tokens", 3.0), ("num_max_rdma_chunked_send_tokens", 0),
    ("num_max_rdma_chunked_recv_tokens", None),
])
def test_bad_config_names_the_field(field, bad):
    with pytest.raises(ValueError, match=f"Config\\(\\): {field} must be a positive int, got {bad!r}"):
        Config(**{field: bad})


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_hint_grows_with_hidden(num_ranks):
    hints = [nvl_hint(hidden, num_ranks) for hidden in HIDDENS]
    assert all(a < b for a, b in itertools.pairwise(hints)), hints


@pytest.mark.parametrize("hidden", [1024, 7168])
def test_hint_grows_with_ranks(hidden):
    hints = [nvl_hint(hidden, num_ranks) for num_ranks in SUPPORTED_RANKS]
    assert all(a < b for a, b in itertools.pairwise(hints)), hints


def test_hint_does_not_shrink_with_more_tokens_or_a_larger_top_k():
    by_tokens = [nvl_hint(2048, 4, num_tokens) for num_tokens in (1, 128, 1001, 4096, 8192)]
    by_topk = [nvl_hint(2048, 4, 4096, num_topk) for num_topk in (1, 2, 4, 8, 16)]
    assert by_tokens == sorted(by_tokens) and by_topk == sorted(by_topk), (by_tokens, by_topk)


def deepep_nvl_hint(config: Config, hidden_bytes: int, num_ranks: int) -> int:
    """DeepEP V1's NVL hint on one node (csrc/config.hpp, as arithmetic): num_sms / 2 channels, each with a
    ring of num_max_nvl_chunked_recv_tokens slots per rank; a slot holds a row, an 8-byte source record and
    room for 128 top-k ids (int64), 128 weights and 128 scales (float32); plus 5 int32 counters per ring."""
    rings = config.num_sms // 2 * num_ranks
    slot = hidden_bytes + 8 + 128 * (8 + 4 + 4)
    return -(-(rings * 5 * 4 + rings * config.num_max_nvl_chunked_recv_tokens * slot) // 128) * 128


@pytest.mark.parametrize("num_sms", [8, 20, 24, 128])
@pytest.mark.parametrize("num_ranks", SUPPORTED_RANKS)
def test_default_hint_is_no_larger_than_deepeps(num_sms, num_ranks):
    """Frameworks size the Buffer from the hint with no token count (Megatron does), then send any batch."""
    config = Config(num_sms=num_sms)
    for hidden in HIDDENS:
        assert config.get_nvl_buffer_size_hint(hidden * 2, num_ranks) <= deepep_nvl_hint(config, hidden * 2, num_ranks)


@pytest.mark.parametrize("num_ranks, num_topk, hidden, num_tokens", [
    (8, 8, 7168, 4096),  # DeepSeek-V3's shape
    (1, 8, 2048, 1001),
    (4, 16, 2048, 1001),  # more top-k entries than ranks
    (8, 4, 384, 1),  # one token, a hidden of three scale blocks
    (2, 1, 1024, 513),
])
def test_hint_for_a_token_count_moves_it_in_one_round(num_ranks, num_topk, hidden, num_tokens):
    """Given num_tokens, the hint's rounds take them all at once: a region holds a section of that many
    landing rows (rounded up to whole units) per rank for a dispatch (BF16 rows, FP8 rows with their scales)
    and a combine (BF16 rows with their weights), and a dispatch's staged routing."""
    hint = nvl_hint(hidden, num_ranks, num_tokens, num_topk)
    unit, num_scales = intranode.ROUND_UNIT_TOKENS, -(-hidden // 128)
    rows = [intranode.push_row_bytes(hidden * 2, 0), intranode.push_row_bytes(hidden, num_scales),
            intranode.landing_row_bytes(hidden, num_topk)]
    for row_bytes in rows:
        assert intranode.round_tokens(hint, row_bytes, num_ranks) >= -(-num_tokens // unit) * unit
    assert intranode.staging_layout(num_tokens, num_topk, num_ranks).end <= intranode.region_bytes(hint)
    # ... and not much more: one unit's worth of rows, lines of 128 bytes, plus a fixed metadata region.
    largest = num_ranks * -(-num_tokens // unit) * unit * max(rows)
    assert hint <= 2 * largest + intranode.META_BYTES + (1 << 12), (hint, largest)
