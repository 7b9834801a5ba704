"""cuep.logfmt: LogFMT-10 layout sizes, byte format against a per-channel encoder, error bound, BF16 fallback."""

import ml_dtypes
import numpy as np
import pytest

from cuep import logfmt
from cuep.kernels import common


def relative_error(decoded: np.ndarray, values: np.ndarray) -> np.ndarray:
    """|decoded - values| / |values| where values are nonzero and finite, 0 elsewhere (float64, so exact)."""
    values, decoded = values.astype(np.float64), decoded.astype(np.float64)
    measured = np.isfinite(values) & (values != 0)
    error = np.zeros(values.shape)
    error[measured] = np.abs(decoded[measured] - values[measured]) / np.abs(values[measured])
    return error


def bf16_rounded(values: np.ndarray) -> np.ndarray:
    return values.astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.mark.parametrize("hidden, meta, encoded, message", [
    (128, 16, 176, 272),            # one block: 8 meta bytes padded to 16
    (384, 32, 512, 800),            # odd block count: 24 meta bytes padded to 32
    (2048, 128, 2688, 4224),
    (7168, 448, 9408, 14784),
])
def test_layout_sizes(hidden, meta, encoded, message):
    lay = logfmt.layout(hidden)
    nb = hidden // 128
    assert (lay.num_blocks, lay.compact_offset, lay.meta_offset) == (nb, 0, 160 * nb)
    assert lay.overflow_offset - lay.meta_offset == meta
    assert (lay.encoded_bytes, lay.message_bytes) == (encoded, message)
    assert (logfmt.encoded_bytes(hidden), logfmt.message_bytes(hidden)) == (encoded, message)
    assert lay.overflow_offset % 16 == 0
    assert logfmt.encode(np.zeros((3, hidden), np.float32)).shape == (3, message)


@pytest.mark.parametrize("hidden", [100, 0, -128, 64])
def test_layout_rejects_hidden_not_a_positive_multiple_of_128(hidden):
    with pytest.raises(ValueError, match="hidden"):
        logfmt.layout(hidden)
    with pytest.raises(ValueError, match="hidden"):
        logfmt.encode(np.ones((2, max(hidden, 1)), np.float32))


def test_decode_rejects_a_wrong_message_size():
    with pytest.raises(ValueError, match="272"):
        logfmt.decode(np.zeros((2, 176), np.uint8), 128)


def test_constants_are_the_kernels_and_clash_with_no_shared_one():
    assert logfmt.CONSTANTS == {"logfmt_block": 128, "logfmt_max_level": 511, "logfmt_max_octaves": 16,
                                "logfmt_compact_bytes": 160, "logfmt_meta_bytes": 8, "logfmt_overflow_bytes": 96,
                                "logfmt_fallback_step": -1, "logfmt_meta_alignment": 16, "logfmt_max_log2": 127}
    assert all(type(v) is int for v in logfmt.CONSTANTS.values())
    assert not set(logfmt.CONSTANTS) & set(common.CONSTANTS)
    assert 2 ** (8 / 510) - 1 < logfmt.MAX_RELATIVE_ERROR < 2 ** (8 / 510) - 1 + 1e-4


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_round_trip_of_normal_data_is_within_the_bound(scale):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2000, 1024)) * scale).astype(np.float32)
    x[::7, 5::11] = 0
    x[3, 128:256] = 0                                   # a whole zero block
    fallback = logfmt.fallback_blocks(x)
    assert fallback.shape == (2000, 8)
    y = logfmt.round_trip(x)
    assert y.dtype == np.float32 and y.shape == x.shape
    encoded = ~np.repeat(fallback, 128, axis=1)
    error = relative_error(y, x)
    assert error[encoded].max() <= logfmt.MAX_RELATIVE_ERROR
    np.testing.assert_array_equal(y[~encoded], bf16_rounded(x[~encoded]))  # N(0,1) tails: rare > 16 octaves
    assert (y[x == 0] == 0).all()
    np.testing.assert_array_equal(np.sign(y), np.sign(x))


def test_one_huge_channel_falls_back_to_exact_bf16():
    x = np.random.default_rng(2).standard_normal((2, 512)).astype(np.float32)
    x[0, 130] = 1e6                                     # block 1 of row 0 now spans > 16 octaves
    x[1, 300] = np.inf                                  # block 2 of row 1
    x[1, 400] = np.nan                                  # block 3 of row 1
    x[1, 401] = -0.0
    fallback = logfmt.fallback_blocks(x)
    np.testing.assert_array_equal(fallback, [[False, True, False, False], [False, False, True, True]])

    messages = logfmt.encode(x)
    lay = logfmt.layout(512)
    meta = np.ascontiguousarray(messages[:, lay.meta_offset:lay.meta_offset + 32]).view("<f4").reshape(2, 4, 2)
    np.testing.assert_array_equal(meta[fallback], [[0.0, -1.0]] * 3)
    overflow = messages[:, lay.overflow_offset:].reshape(2, 4, 96)
    assert (overflow[~fallback] == 0).all() and (overflow[0, 1] != 0).any()

    y = logfmt.decode(messages, 512)
    blocks, decoded = x.reshape(2, 4, 128), y.reshape(2, 4, 128)
    np.testing.assert_array_equal(decoded[fallback], bf16_rounded(blocks[fallback]))  # NaN == NaN here
    assert np.isnan(y[1, 400]) and y[1, 300] == np.inf and np.signbit(y[1, 401])
    assert relative_error(decoded[fallback], blocks[fallback]).max() <= 2 ** -8
    assert relative_error(decoded[~fallback], blocks[~fallback]).max() <= logfmt.MAX_RELATIVE_ERROR


def test_sixteen_octaves_encode_and_a_hair_more_falls_back():
    x = np.linspace(1, 2, 128, dtype=np.float32)[None].repeat(2, axis=0)
    x[:, 0] = 2.0 ** -15                                # log2 span exactly 16
    x[1, 1] = 2.0 ** -15 * (1 - 2.0 ** -16)            # far enough below to move a float32 log2 of 15
    np.testing.assert_array_equal(logfmt.fallback_blocks(x), [[False], [True]])


def test_a_block_reaching_two_to_the_127_falls_back_and_stays_finite():
    values = np.full((1, 128), 2.0 ** 126, np.float32)
    values[0, 0] = np.float32(3.0e38)  # one octave wide, but its top level would decode past float32
    assert logfmt.fallback_blocks(values).tolist() == [[True]]
    assert np.isfinite(logfmt.round_trip(values)).all()
    assert not logfmt.fallback_blocks(values / np.float32(4)).any()


def test_all_zero_block_and_equal_magnitudes():
    x = np.zeros((2, 256), np.float32)
    x[1, :128] = np.where(np.arange(128) % 3, 0.75, -0.75)   # step 0: every nonzero value is level 1
    x[1, 128:] = -2.5
    x[1, 131] = 0
    messages = logfmt.encode(x)
    lay = logfmt.layout(256)
    meta = np.ascontiguousarray(messages[:, lay.meta_offset:lay.meta_offset + 16]).view("<f4").reshape(2, 2, 2)
    np.testing.assert_array_equal(meta[0], [[0, 0], [0, 0]])
    np.testing.assert_array_equal(meta[1], [[np.log2(np.float32(0.75)), 0], [np.log2(np.float32(2.5)), 0]])
    assert (messages[0] == 0).all()
    low = messages[1, :320].reshape(2, 160)[:, :128]
    assert (low[0] == 1).all() and (low[1] == np.where(np.arange(128) == 3, 0, 1)).all()
    y = logfmt.decode(messages, 256)
    assert (y[0] == 0).all()
    np.testing.assert_allclose(y[1], x[1], rtol=1e-6)
    assert (y[1][x[1] == 0] == 0).all()


def scalar_encode_block(v: np.ndarray) -> tuple[bytes, float, float]:
    """One encodable block, channel by channel as the format describes: its 160 compact bytes, log_min, step."""
    magnitudes = [abs(float(a)) for a in v if a != 0]
    log_min = np.log2(np.float32(min(magnitudes)))
    step = (np.log2(np.float32(max(magnitudes))) - log_min) / np.float32(510)
    levels, signs = [], []
    for a in v:
        a = np.float32(a)
        if a == 0:
            levels.append(0)
        else:
            level = 1 + int(np.rint((np.log2(abs(a)) - log_min) / step)) if step > 0 else 1
            levels.append(min(max(level, 1), 511))
        signs.append(int(a < 0))
    out = bytearray(level & 0xFF for level in levels)
    for w in range(16):
        word = 0
        for k in range(8):
            c = 8 * w + k
            word |= ((levels[c] >> 8) & 1) << (2 * k) | signs[c] << (2 * k + 1)
        out += word.to_bytes(2, "little")
    return bytes(out), float(log_min), float(step)


def test_bytes_follow_the_layout():
    v = np.zeros(256, np.float32)
    v[0], v[1], v[2], v[9], v[127] = 1.0, -2.0 ** 10, 2.0 ** -6, -(2.0 ** 3), 5.0     # block 0 spans 16 octaves
    v[128:] = np.random.default_rng(3).standard_normal(128).astype(np.float32)      # block 1
    messages = logfmt.encode(v)
    lay = logfmt.layout(256)
    assert messages.shape == (lay.message_bytes,)
    meta = np.frombuffer(messages[lay.meta_offset:lay.meta_offset + 16].tobytes(), "<f4")
    for b in range(2):
        compact, log_min, step = scalar_encode_block(v[128 * b:128 * (b + 1)])
        assert messages[160 * b:160 * (b + 1)].tobytes() == compact
        assert (meta[2 * b], meta[2 * b + 1]) == (log_min, step)
    # block 0 by hand: log_min = -6, step = 16/510; 1.0 is 6 octaves up -> level 1 + rint(191.25) = 192
    assert meta[0] == -6 and meta[1] == np.float32(16) / np.float32(510)
    assert messages[0] == 192 and messages[2] == 1 and messages[127] == (1 + round((6 + np.log2(5)) * 510 / 16)) & 0xFF
    assert messages[1] == (511 & 0xFF)                  # the amax channel takes the top level
    word0 = int.from_bytes(messages[128:130].tobytes(), "little")
    assert word0 & 0b1111 == 0b1100                     # channel 0: bit 8 of 192 = 0, +; channel 1: bit 8 = 1, -
    word1 = int.from_bytes(messages[130:132].tobytes(), "little")
    assert (word1 >> 2) & 3 == 0b11                     # channel 9: -8 is 9 octaves up, level 288 > 255, -
    assert (messages[lay.meta_offset + 16:] == 0).all()  # no padding here (16 meta bytes), overflow zero
    # what the decoder does, by hand: 2 ** (log_min + (m - 1) * step)
    y = logfmt.decode(messages, 256)
    assert y[0] == np.exp2(np.float32(-6 + 191 * np.float64(meta[1])))
    assert y[1] == pytest.approx(-(2.0 ** 10), rel=1e-5) and y[2] == 2.0 ** -6


def test_decode_ignores_the_overflow_of_encoded_blocks():
    x = np.random.default_rng(4).standard_normal((4, 768)).astype(np.float32)
    x[2, 300] = 1e9                                     # one fallback block, whose overflow is read
    messages = logfmt.encode(x)
    lay = logfmt.layout(768)
    garbage = messages.copy()
    overflow = garbage[:, lay.overflow_offset:].reshape(4, 6, 96)
    overflow[~logfmt.fallback_blocks(x)] = 0xA5
    np.testing.assert_array_equal(logfmt.decode(garbage, 768), logfmt.decode(messages, 768))


def test_the_bound_is_nearly_reached_over_sixteen_octaves():
    # Every block spans exactly 16 octaves (step 16/510), so the worst rounding is half a step:
    # a lossless (BF16) or finer-stepped encoding would stay far below the bound.
    rng = np.random.default_rng(5)
    x = np.exp2(rng.uniform(-8, 8, (1000, 1024))).astype(np.float32) * rng.choice([-1, 1], (1000, 1024))
    x[:, ::128], x[:, 1::128] = 2.0 ** -8, -(2.0 ** 8)
    x = x.astype(np.float32)
    assert not logfmt.fallback_blocks(x).any()
    error = relative_error(logfmt.round_trip(x), x)
    assert 0.95 * (2 ** (8 / 510) - 1) < error.max() <= logfmt.MAX_RELATIVE_ERROR
    # and the mean of a uniform error in the log domain: a quarter step in log2
    mean_log_error = np.abs(np.log2(np.abs(logfmt.round_trip(x) / x))).mean()
    assert mean_log_error == pytest.approx(16 / 510 / 4, rel=0.02)


def test_leading_shapes_and_rows_are_independent():
    x = np.random.default_rng(6).standard_normal((2, 3, 256)).astype(np.float32)
    messages = logfmt.encode(x)
    assert messages.shape == (2, 3, logfmt.message_bytes(256))
    np.testing.assert_array_equal(messages[1, 2], logfmt.encode(x[1, 2]))
    decoded = logfmt.decode(messages, 256)
    assert decoded.shape == x.shape
    np.testing.assert_array_equal(decoded[1, 2], logfmt.decode(messages[1, 2], 256))  # a row alone, as in the batch
    assert relative_error(decoded, x).max() <= logfmt.MAX_RELATIVE_ERROR  # fallback blocks: 2^-8, below it
    assert logfmt.encode(np.zeros((0, 256), np.float32)).shape == (0, logfmt.message_bytes(256))
    bf16 = x.astype(ml_dtypes.bfloat16)                  # bf16 input is widened exactly
    np.testing.assert_array_equal(logfmt.encode(bf16), logfmt.encode(bf16.astype(np.float32)))


def test_decode_rounds_the_exponent_once_like_fmaf():
    # (1 + 2^-23) * 2^-24 (1 - 2^-23) + (1 + 2^-23) = 1 + 3 * 2^-24 - 2^-70: just below a float32 midpoint,
    # so one rounding gives 1 + 2^-23; rounding through float64 lands on the midpoint and goes to 1 + 2^-22.
    a, b, c = (np.array([v], np.float32) for v in (1 + 2 ** -23, 2 ** -24 * (1 - 2 ** -23), 1 + 2 ** -23))
    assert logfmt._fmaf(a, b, c)[0] == np.float32(1 + 2 ** -23)
    assert (a.astype(np.float64) * b + c).astype(np.float32)[0] == np.float32(1 + 2 ** -22)
    exact = logfmt._fmaf(np.float32([191, 510]), np.float32([16 / 510]), np.float32([-6]))
    np.testing.assert_array_equal(exact, (np.float32([191, 510]).astype(np.float64) * np.float32(16 / 510) - 6)
                                  .astype(np.float32))
