"""cuep.fp8: e4m3 encoding against ml_dtypes, scale rules, UE8M0 packing (NumPy; the same code runs on CuPy)."""

import ml_dtypes
import numpy as np
import pytest

from cuep import fp8


def test_encode_matches_ml_dtypes_for_every_bf16_value():
    values = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
    finite = np.isfinite(values)
    expected = np.clip(values[finite], -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(fp8.encode_e4m3(values[finite]), expected)
    assert (fp8.encode_e4m3(np.array([np.nan], np.float32)) & 0x7F) == 0x7F


def test_encode_rounds_to_nearest_even_and_saturates():
    # 1.0625 is halfway between 1.0 (0x38) and 1.125 (0x39): even wins; 1e6 saturates to 448 (0x7e)
    assert fp8.encode_e4m3(np.array([1.0625, 1.1875, 1e6, -1e6], np.float32)).tolist() == [0x38, 0x3A, 0x7E, 0xFE]


def test_decode_inverts_encode():
    codes = np.arange(256, dtype=np.uint8)
    finite = (codes & 0x7F) != 0x7F
    np.testing.assert_array_equal(fp8.encode_e4m3(fp8.decode_e4m3(codes[finite])), codes[finite])


def tokens() -> np.ndarray:
    """7 tokens of hidden 1024: normals x10, a zero block (the amax floor), and a block whose one large
    value pushes the rest into e4m3's subnormals."""
    x = np.random.default_rng(0).standard_normal((7, 1024)).astype(np.float32) * 10
    x[1, :128] = 0
    x[3, 256:384] *= np.float32(1e-3)
    x[3, 256] = 1000
    return x


def documented_quantize(x: np.ndarray, round_scale: bool):
    """The rule cuep.fp8 documents, with ml_dtypes' e4m3 cast and frexp's powers of two: per block of
    128 channels amax = max(|x|, 1e-4); scale_inv = amax / 448, or the smallest power of two at least
    that; e4m3 of x * (448 / amax), or of x / scale_inv, saturating at 448."""
    blocks = x.reshape(len(x), -1, 128)
    amax = np.maximum(np.abs(blocks).max(axis=2), np.float32(1e-4))
    scale_inv, scale = amax / np.float32(448), np.float32(448) / amax
    if round_scale:
        mantissa, exponent = np.frexp(scale_inv)
        scale_inv = np.where(mantissa == 0.5, scale_inv, np.ldexp(np.float32(1), exponent)).astype(np.float32)
        scale = np.float32(1) / scale_inv
    scaled = np.clip(blocks * scale[:, :, None], -448, 448)
    return scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).reshape(x.shape), scale_inv


@pytest.mark.parametrize("round_scale", [False, True])
def test_quantize_follows_the_documented_rule_bit_for_bit(round_scale):
    x = tokens()
    codes, scales = fp8.quantize(x, round_scale)
    want_codes, want_scales = documented_quantize(x, round_scale)
    assert codes.dtype == np.uint8 and scales.dtype == np.float32 and scales.shape == (7, 1024 // 128)
    np.testing.assert_array_equal(codes, want_codes)
    np.testing.assert_array_equal(scales, want_scales)
    assert ((codes & 0x7F) < 0x7F).all()  # finite inputs never give the NaN code


def test_rounded_scale_is_the_smallest_power_of_two_at_least_amax_over_448():
    x = tokens()
    _, scales = fp8.quantize(x, round_scale=True)
    exact = np.maximum(np.abs(x).reshape(7, 8, 128).max(axis=2), np.float32(1e-4)) / np.float32(448)
    mantissa, _ = np.frexp(scales)
    assert (mantissa == 0.5).all()
    assert (scales >= exact).all() and (scales / 2 < exact).all()


def test_ue8m0_scales_are_the_rounded_scales_packed_four_to_a_word():
    x = tokens()
    codes, words = fp8.quantize(x, use_ue8m0=True)  # implies round_scale
    rounded_codes, rounded = fp8.quantize(x, round_scale=True)
    assert words.dtype == np.int32 and words.shape == (7, 1024 // 512)
    np.testing.assert_array_equal(codes, rounded_codes)
    exponents = ((rounded.view(np.uint32) >> 23) & 0xFF).reshape(7, 2, 4)
    want = (exponents << np.array([0, 8, 16, 24], np.uint32)).sum(axis=2, dtype=np.uint32)
    np.testing.assert_array_equal(words.view(np.uint32), want)
    np.testing.assert_array_equal(fp8.unpack_ue8m0(words), rounded)


@pytest.mark.parametrize("round_scale, use_ue8m0", [(False, False), (True, False), (True, True)])
def test_dequantize_is_e4m3_times_scale_and_round_trips_within_fp8_rounding(round_scale, use_ue8m0):
    x = tokens()
    codes, scales = fp8.quantize(x, round_scale, use_ue8m0)
    scale_inv = np.repeat(fp8.unpack_ue8m0(scales) if use_ue8m0 else scales, 128, axis=1)
    back = fp8.dequantize(codes, scales)
    np.testing.assert_array_equal(back, codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale_inv)
    # e4m3 keeps 3 mantissa bits: half a step is 2^-4 of |x| for normals, 2^-10 of scale_inv below them.
    assert (np.abs(back - x) <= np.maximum(np.abs(x) * 2.0 ** -4, scale_inv * 2.0 ** -9) + 1e-7).all()


def test_scale_follows_the_block_amax():
    x = np.zeros((1, 256), np.float32)
    x[0, 5], x[0, 200] = 448.0, -2.0
    codes, scales = fp8.quantize(x)
    assert scales.tolist() == [[1.0, np.float32(2.0) / np.float32(448)]]
    assert codes[0, 5] == 0x7E and codes[0, 200] == 0xFE
    _, zero_scales = fp8.quantize(np.zeros((1, 128), np.float32))
    assert zero_scales[0, 0] == np.float32(1e-4) / np.float32(448)


def test_ue8m0_packs_four_exponents_low_byte_first():
    scales = np.array([[1.0, 2.0, 0.5, 2.0 ** -10]], np.float32)
    word = int(fp8.pack_ue8m0(scales).view(np.uint32)[0, 0])
    assert [(word >> (8 * i)) & 0xFF for i in range(4)] == [127, 128, 126, 117]
    np.testing.assert_array_equal(fp8.unpack_ue8m0(fp8.pack_ue8m0(scales)), scales)
