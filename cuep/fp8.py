"""FP8 e4m3 with per-128-channel float32 scales, on NumPy or CuPy arrays (whichever you pass).

CuPy has no FP8 dtype, so FP8 data lives in ``uint8`` arrays of e4m3 bytes; a torch user gets a
zero-copy ``torch.from_dlpack(a).view(torch.float8_e4m3fn)``. The rules are those of cuep's kernels,
bit for bit: per block of 128 channels, ``amax = max(|x|, 1e-4)``, ``scale_inv = amax / 448``
(rounded up to a power of two with ``round_scale``), e4m3 of ``x * 448 / amax`` (or of
``x / scale_inv`` when rounded) to nearest even, saturating at 448. UE8M0 packs the exponent byte
of four power-of-two scales into one int32, the first block in the lowest byte.
"""

from __future__ import annotations

import numpy as np

from .kernels.common import SCALE_BLOCK, UE8M0_SCALES_PER_WORD  # the kernels' FP8 layout, defined once

E4M3_MAX = np.float32(448.0)
MIN_AMAX = np.float32(1e-4)
_MAX_CODE, _NAN_CODE = 0x7E, 0x7F


def _xp(array):
    """The array module (numpy or cupy) of ``array``."""
    module = type(array).__module__.split(".")[0]
    if module == "cupy":
        import cupy
        return cupy
    return np


def encode_e4m3(values):
    """float32 values -> e4m3 bytes (``uint8``), nearest even, saturating to +-448, NaN to 0x7f."""
    xp = _xp(values)
    values = values.astype(xp.float32, copy=False)
    bits = values.view(xp.uint32).astype(xp.int64)
    sign = (bits >> 31) << 7
    magnitude = xp.abs(values)
    exponent = xp.maximum(((bits >> 23) & 0xFF) - 127, -7)
    mantissa = bits & 0x7FFFFF
    kept, rest, half = mantissa >> 20, mantissa & 0xFFFFF, 0x80000
    kept = kept + ((rest > half) | ((rest == half) & ((kept & 1) == 1)))
    normal = xp.minimum(((exponent + 7) << 3) + kept, _MAX_CODE)
    min_normal = np.float32(2.0 ** -6)
    subnormal = xp.rint(xp.minimum(xp.nan_to_num(magnitude), min_normal) * np.float32(512)).astype(xp.int64)
    code = xp.where(magnitude < min_normal, subnormal, normal)
    code = xp.where(magnitude >= E4M3_MAX, _MAX_CODE, code)
    code = xp.where(xp.isnan(values), _NAN_CODE, code)
    return (sign | code).astype(xp.uint8)


def _e4m3_table() -> np.ndarray:
    codes = np.arange(256)
    exponent, mantissa = (codes >> 3) & 0xF, (codes & 7).astype(np.float32)
    magnitude = np.where(exponent == 0, mantissa * np.float32(2.0 ** -9),
                         (1 + mantissa / 8) * np.exp2(exponent.astype(np.float32) - 7))
    table = np.where(codes >> 7, -magnitude, magnitude).astype(np.float32)
    table[(codes & 0x7F) == _NAN_CODE] = np.nan
    return table


_TABLE = _e4m3_table()


def decode_e4m3(codes):
    """e4m3 bytes (``uint8``) -> float32."""
    xp = _xp(codes)
    return xp.asarray(_TABLE)[codes]


def _power_of_two_at_least(values):
    xp = _xp(values)
    bits = values.view(xp.uint32)
    rounded = xp.where(bits & 0x7FFFFF, (bits & 0x7F800000) + 0x800000, bits).astype(xp.uint32)
    return rounded.view(xp.float32)


def quantize(x, round_scale: bool = False, use_ue8m0: bool = False):
    """Per-token FP8 cast of ``x`` `[num_tokens, hidden]` (bf16 or float32, hidden a multiple of 128).

    Returns ``(x_fp8, scales)``: `uint8` e4m3 bytes and `[num_tokens, hidden // 128]` float32 scales
    to multiply by, or with ``use_ue8m0`` (which implies ``round_scale``) `[num_tokens, hidden // 512]`
    int32 words of packed UE8M0 exponents.
    """
    xp = _xp(x)
    num_tokens, hidden = x.shape
    if hidden % SCALE_BLOCK:
        raise ValueError(f"quantize(): hidden must be a multiple of {SCALE_BLOCK}, got {hidden}")
    blocks = x.astype(xp.float32).reshape(num_tokens, hidden // SCALE_BLOCK, SCALE_BLOCK)
    amax = xp.maximum(xp.abs(blocks).max(axis=2), MIN_AMAX).astype(xp.float32)
    scale_inv = amax / E4M3_MAX
    scale = E4M3_MAX / amax
    if round_scale or use_ue8m0:
        scale_inv = _power_of_two_at_least(scale_inv)
        scale = np.float32(1) / scale_inv
    codes = encode_e4m3(blocks * scale[:, :, None]).reshape(num_tokens, hidden)
    return codes, pack_ue8m0(scale_inv) if use_ue8m0 else scale_inv


def pack_ue8m0(scales):
    """`[..., n]` power-of-two float32 scales (n a multiple of 4) -> `[..., n // 4]` int32 of exponent bytes."""
    xp = _xp(scales)
    exponents = ((scales.astype(xp.float32).view(xp.uint32) >> 23) & 0xFF).astype(xp.uint32)
    grouped = exponents.reshape(*exponents.shape[:-1], exponents.shape[-1] // UE8M0_SCALES_PER_WORD,
                                UE8M0_SCALES_PER_WORD)
    words = grouped[..., 0] | (grouped[..., 1] << 8) | (grouped[..., 2] << 16) | (grouped[..., 3] << 24)
    return words.view(xp.int32)


def unpack_ue8m0(words):
    """Inverse of :func:`pack_ue8m0`: int32 words -> float32 power-of-two scales."""
    xp = _xp(words)
    unsigned = words.view(xp.uint32)
    exponents = xp.stack([(unsigned >> (8 * i)) & 0xFF for i in range(UE8M0_SCALES_PER_WORD)], axis=-1)
    scales = (exponents.astype(xp.uint32) << 23).view(xp.float32)
    return scales.reshape(*words.shape[:-1], words.shape[-1] * UE8M0_SCALES_PER_WORD)


def dequantize(x_fp8, scales):
    """``x_fp8`` `[..., hidden]` e4m3 bytes times their float32 scales `[..., hidden // 128]` (or packed
    UE8M0 int32 words) -> float32."""
    xp = _xp(x_fp8)
    if scales.dtype == xp.int32:
        scales = unpack_ue8m0(scales)
    values = decode_e4m3(x_fp8)
    blocks = values.reshape(*values.shape[:-1], values.shape[-1] // SCALE_BLOCK, SCALE_BLOCK)
    return (blocks * scales[..., None]).reshape(values.shape)
