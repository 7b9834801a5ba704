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


@pytest.mark.parametrize("round_scale, use_ue8m0", [(False, False), (True, False), (True, True)])
def test_quantize_round_trip_within_fp8_rounding(round_scale, use_ue8m0):
    x = np.random.default_rng(0).standard_normal((7, 1024)).astype(np.float32) * 10
    codes, scales = fp8.quantize(x, round_scale, use_ue8m0)
    assert codes.dtype == np.uint8 and scales.dtype == (np.int32 if use_ue8m0 else np.float32)
    assert scales.shape == (7, 1024 // 512 if use_ue8m0 else 1024 // 128)
    unpacked = fp8.unpack_ue8m0(scales) if use_ue8m0 else scales
    if round_scale:
        mantissa, _ = np.frexp(unpacked)
        assert (mantissa == 0.5).all()  # powers of two
    back = fp8.dequantize(codes, scales)
    blocks = np.abs(x).reshape(7, 8, 128).max(axis=2)
    step = np.repeat(unpacked, 128, axis=1) if not use_ue8m0 else np.repeat(unpacked, 128, axis=1)
    assert (np.abs(back - x) <= np.maximum(np.abs(x) * 2.0 ** -4, step * 2.0 ** -9) + 1e-7).all()
    assert (np.abs(codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)).max() <= 448)
    assert blocks.shape == (7, 8)


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
