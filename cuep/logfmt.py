"""LogFMT-10: the log-domain message format of ``low_latency_combine(..., use_logfmt=True)``, in NumPy.

The low-latency combine sends each token's FP32 partial sum back to its source rank. In BF16 that
costs ``2 * hidden`` bytes a row; LogFMT-10 codes each value in 10 bits (a sign and a 9-bit level on a
log scale), so a row costs ``1.3125 * hidden`` bytes (160 code bytes and 8 meta bytes per 128
channels) and the combine moves about a third fewer bytes. The format is cuep's own, inspired by the
LogFMT-10 of DeepEP V1; this module is its reference: the kernels in ``cuda_src/low_latency.cu``
follow the same rules, and their constants come from :data:`CONSTANTS` (``CUEP_LOGFMT_*`` macros).

Per block of 128 channels with nonzero magnitudes spanning ``[amin, amax]``, the levels split
``[log2(amin), log2(amax)]`` into 510 equal steps: level 0 is zero, level ``m >= 1`` decodes to
``2 ** (log_min + (m - 1) * step)``. Rounding to the nearest level keeps each nonzero value within a
relative error of ``2 ** (step / 2) - 1``; a block spanning at most 16 octaves has
``step <= 16 / 510``, hence :data:`MAX_RELATIVE_ERROR`. A block spanning more than 16 octaves,
reaching ``2 ** 127``, or holding an inf or a NaN, falls back to BF16 (256 bytes, which is why a
message has an overflow area: a sender transmits only :func:`encoded_bytes` unless some block fell
back).

Byte layout of one message (all little-endian), ``nb = hidden // 128`` blocks:

- compact area, ``[0, 160 * nb)``, 160 bytes per block: byte ``c < 128`` is the low byte of channel
  ``c``'s level; bytes ``[128, 160)`` are 16 ``uint16`` words, word ``w`` holding, for channel
  ``8w + k``, the level's bit 8 at bit ``2k`` and the sign at bit ``2k + 1``.
- meta area, ``align_up(8 * nb, 16)`` bytes: float32 ``log_min`` then float32 ``step`` per block.
  An all-zero block has ``(0, 0)``; a fallback block has ``(0, -1)``.
- overflow area, 96 bytes per block, written only by fallback blocks: their 128 BF16 values are the
  block's 160 compact bytes followed by its 96 overflow bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _deps
from ._math import align_up

BLOCK = 128               # channels per block: one log_min and step each
MAX_LEVEL = 511           # highest level of the 9-bit code; 0 codes zero
MAX_OCTAVES = 16          # widest log2(amax / amin) a block codes within MAX_RELATIVE_ERROR
COMPACT_BYTES = 160       # per block: 128 low bytes + 16 words of (bit 8, sign) pairs
META_BYTES = 8            # per block: float32 log_min, float32 step
OVERFLOW_BYTES = 96       # per block: the rest of a fallback block's 256 BF16 bytes
FALLBACK_STEP = -1        # the step that marks a BF16 block (a real step is never negative)
META_ALIGNMENT = 16       # the meta area ends on a 16-byte boundary so the overflow area starts on one
MAX_LOG2 = 127            # a block whose largest magnitude reaches 2 ** 127 falls back: its top level could
                          # decode past float32's range once its log rounds up

CONSTANTS = {"logfmt_block": BLOCK, "logfmt_max_level": MAX_LEVEL, "logfmt_max_octaves": MAX_OCTAVES,
             "logfmt_compact_bytes": COMPACT_BYTES, "logfmt_meta_bytes": META_BYTES,
             "logfmt_overflow_bytes": OVERFLOW_BYTES, "logfmt_fallback_step": FALLBACK_STEP,
             "logfmt_meta_alignment": META_ALIGNMENT, "logfmt_max_log2": MAX_LOG2}
"""What the low-latency kernels read as ``CUEP_LOGFMT_*`` macros."""

MAX_RELATIVE_ERROR = 0.011
"""Bound on ``|decoded - x| / |x|`` for every nonzero element of an encoded (not fallback) block:
``2 ** (8 / 510) - 1`` (about 0.01093) plus float32 rounding of the logs. Zeros decode exactly; a
fallback block is within BF16's ``2 ** -8``."""

_BF16_BYTES = 2 * BLOCK
_HIGH_WORDS = BLOCK // 8  # each word covers 8 channels at 2 bits each
assert COMPACT_BYTES == BLOCK + 2 * _HIGH_WORDS and COMPACT_BYTES + OVERFLOW_BYTES == _BF16_BYTES


@dataclass(frozen=True)
class Layout:
    """Byte offsets and sizes of one ``hidden``-channel message."""

    hidden: int
    num_blocks: int
    compact_offset: int   # always 0
    meta_offset: int
    overflow_offset: int
    encoded_bytes: int    # compact + meta: what travels when no block falls back
    message_bytes: int    # encoded + overflow: what travels otherwise (the slot size before alignment)


def layout(hidden: int) -> Layout:
    """The :class:`Layout` of a message of ``hidden`` channels (a positive multiple of 128)."""
    if hidden <= 0 or hidden % BLOCK:
        raise ValueError(f"LogFMT needs hidden to be a positive multiple of {BLOCK}, got hidden={hidden}")
    nb = hidden // BLOCK
    meta_offset = COMPACT_BYTES * nb
    overflow_offset = meta_offset + align_up(META_BYTES * nb, META_ALIGNMENT)
    return Layout(hidden, nb, 0, meta_offset, overflow_offset, overflow_offset, overflow_offset + OVERFLOW_BYTES * nb)


def encoded_bytes(hidden: int) -> int:
    """Bytes of a ``hidden``-channel message whose blocks are all encoded."""
    return layout(hidden).encoded_bytes


def message_bytes(hidden: int) -> int:
    """Bytes of a ``hidden``-channel message with room for every block to fall back."""
    return layout(hidden).message_bytes


def _blocks(values) -> tuple[np.ndarray, tuple[int, ...], Layout]:
    """``values`` as float32 `[rows, nb, 128]`, its leading shape, and its layout."""
    values = np.asarray(values, dtype=np.float32)
    if values.ndim == 0:
        raise ValueError("LogFMT needs values of shape [..., hidden], got a scalar")
    lay = layout(values.shape[-1])
    return values.reshape(-1, lay.num_blocks, BLOCK), values.shape[:-1], lay


def _block_stats(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per block: whether it falls back, ``log2(amax)``, ``log2(amin)`` (``-inf`` for an all-zero
    block) and whether any value is nonzero."""
    magnitude = np.abs(blocks)
    finite = np.isfinite(blocks).all(axis=-1)
    amax = np.where(finite, magnitude.max(axis=-1, initial=np.float32(0)), np.float32(0))
    amin = np.where(magnitude > 0, magnitude, np.float32(np.inf)).min(axis=-1)
    nonzero = amax > 0
    with np.errstate(divide="ignore", invalid="ignore"):  # an all-zero block's logs are -inf
        log_amax = np.log2(amax)
        log_amin = np.log2(np.where(nonzero, amin, np.float32(0)))
        span = log_amax - log_amin
    fallback = ~finite | (nonzero & ((span > np.float32(MAX_OCTAVES)) | (log_amax >= np.float32(MAX_LOG2))))
    return fallback, log_amax, log_amin, nonzero


def fallback_blocks(values) -> np.ndarray:
    """Which blocks of ``values`` `[..., hidden]` travel as BF16: bool `[..., hidden // 128]`."""
    blocks, lead, lay = _blocks(values)
    return _block_stats(blocks)[0].reshape(*lead, lay.num_blocks)


def _le_bytes(array: np.ndarray, dtype: str) -> np.ndarray:
    """``array`` as ``dtype`` (a little-endian NumPy type string), then as bytes along a new last axis."""
    array = np.ascontiguousarray(array, dtype=dtype)
    return array.view(np.uint8).reshape(*array.shape, np.dtype(dtype).itemsize)


def encode(values) -> np.ndarray:
    """float32 ``values`` `[..., hidden]` -> LogFMT messages ``uint8`` `[..., message_bytes(hidden)]`.

    The overflow bytes of encoded blocks are zero (the kernels leave them unwritten; :func:`decode`
    never reads them).
    """
    blocks, lead, lay = _blocks(values)
    rows, nb = blocks.shape[:2]
    fallback, log_amax, log_amin, nonzero = _block_stats(blocks)
    encoded = nonzero & ~fallback
    log_min = np.where(encoded, log_amin, np.float32(0)).astype(np.float32)
    step = np.where(encoded, (log_amax - log_min) / np.float32(MAX_LEVEL - 1), np.float32(0)).astype(np.float32)

    magnitude = np.abs(blocks)
    with np.errstate(divide="ignore", invalid="ignore"):
        offset = np.log2(magnitude) - log_min[..., None]
        scaled = np.where(step[..., None] > 0, offset / np.where(step > 0, step, np.float32(1))[..., None], 0)
    # Zeros' -inf logs are coded as level 0 below; nan_to_num only keeps them out of the integer cast.
    levels = 1 + np.rint(np.nan_to_num(scaled, nan=0.0, posinf=0.0, neginf=0.0)).astype(np.int64)
    levels = np.where(magnitude > 0, np.clip(levels, 1, MAX_LEVEL), 0)
    signs = ((blocks < 0) & (magnitude > 0)).astype(np.int64)  # -0.0 codes as level 0, sign 0

    pairs = ((levels >> 8) & 1) | (signs << 1)                     # [rows, nb, 128], 2 bits each
    shifts = 2 * np.arange(8, dtype=np.int64)
    words = (pairs.reshape(rows, nb, _HIGH_WORDS, 8) << shifts).sum(axis=-1)
    compact = np.concatenate([(levels & 0xFF).astype(np.uint8),
                              _le_bytes(words, "<u2").reshape(rows, nb, 2 * _HIGH_WORDS)], axis=-1)
    bfloat16 = _deps.require("ml_dtypes").bfloat16
    bf16 = _le_bytes(blocks.astype(bfloat16).view(np.uint16), "<u2").reshape(rows, nb, _BF16_BYTES)
    compact = np.where(fallback[..., None], bf16[..., :COMPACT_BYTES], compact)
    overflow = np.where(fallback[..., None], bf16[..., COMPACT_BYTES:], np.uint8(0))

    meta = np.stack([log_min, np.where(fallback, np.float32(FALLBACK_STEP), step)], axis=-1)
    out = np.zeros((rows, lay.message_bytes), dtype=np.uint8)
    out[:, :lay.meta_offset] = compact.reshape(rows, COMPACT_BYTES * nb)
    out[:, lay.meta_offset:lay.meta_offset + META_BYTES * nb] = _le_bytes(meta, "<f4").reshape(rows, META_BYTES * nb)
    out[:, lay.overflow_offset:] = overflow.reshape(rows, OVERFLOW_BYTES * nb)
    return out.reshape(*lead, lay.message_bytes)


def _fmaf(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 ``a * b + c`` rounded once, as CUDA's ``fmaf``.

    ``a * b`` of two float32 is exact in float64 and TwoSum gives the sum's float64 rounding ``s`` and
    its exact error ``e``; rounding ``s`` to float32 is then right unless ``s`` sits on a float32
    midpoint that ``e`` would have moved it off, where ``s`` is nudged toward the exact sum first.
    """
    p = a.astype(np.float64) * b.astype(np.float64)
    c = np.broadcast_to(c.astype(np.float64), p.shape)
    s = p + c
    t = s - p
    e = (p - (s - t)) + (c - t)
    r = s.astype(np.float32)
    inexact = np.nonzero(e)  # rare: only a step far finer than log_min's ulp leaves the sum inexact
    if inexact[0].size:
        s_, e_, r_ = s[inexact], e[inexact], r[inexact]
        neighbour = np.nextafter(r_, np.where(s_ > r_, np.float32(np.inf), np.float32(-np.inf)))
        midpoint = s_ == (r_.astype(np.float64) + neighbour.astype(np.float64)) / 2
        nudged = np.nextafter(s_, np.where(e_ > 0, np.inf, -np.inf)).astype(np.float32)
        r[inexact] = np.where(midpoint, nudged, r_)
    return r


def decode(messages, hidden: int) -> np.ndarray:
    """LogFMT messages ``uint8`` `[..., message_bytes(hidden)]` -> float32 `[..., hidden]`."""
    lay = layout(hidden)
    messages = np.asarray(messages)
    if messages.dtype != np.uint8 or messages.ndim == 0 or messages.shape[-1] != lay.message_bytes:
        raise ValueError(f"LogFMT messages of hidden={hidden} must be uint8 [..., {lay.message_bytes}], "
                         f"got {messages.dtype} {messages.shape}")
    lead, nb = messages.shape[:-1], lay.num_blocks
    flat = messages.reshape(-1, lay.message_bytes)
    rows = flat.shape[0]
    compact = flat[:, :lay.meta_offset].reshape(rows, nb, COMPACT_BYTES)
    meta = np.ascontiguousarray(flat[:, lay.meta_offset:lay.meta_offset + META_BYTES * nb]).view("<f4")
    log_min, step = (meta.reshape(rows, nb, 2)[..., i].astype(np.float32) for i in (0, 1))

    words = np.ascontiguousarray(compact[..., BLOCK:]).view("<u2").astype(np.int64)  # [rows, nb, 16]
    pairs = (words[..., None] >> (2 * np.arange(8, dtype=np.int64))) & 3
    pairs = pairs.reshape(rows, nb, BLOCK)
    levels = compact[..., :BLOCK].astype(np.int64) | ((pairs & 1) << 8)
    exponent = _fmaf((np.maximum(levels, 1) - 1).astype(np.float32), step[..., None], log_min[..., None])
    with np.errstate(over="ignore"):
        magnitude = np.where(levels > 0, np.exp2(exponent), np.float32(0))
    decoded = np.where(pairs >> 1, -magnitude, magnitude).astype(np.float32)

    bf16 = np.concatenate([compact[..., :COMPACT_BYTES],
                           flat[:, lay.overflow_offset:].reshape(rows, nb, OVERFLOW_BYTES)], axis=-1)
    as_float = (np.ascontiguousarray(bf16).view("<u2").astype(np.uint32) << 16).view(np.float32)
    decoded = np.where((step == np.float32(FALLBACK_STEP))[..., None], as_float, decoded)
    return decoded.reshape(*lead, hidden)


def round_trip(values) -> np.ndarray:
    """``decode(encode(values))``: what a combine with ``use_logfmt=True`` sums instead of ``values``."""
    values = np.asarray(values, dtype=np.float32)
    return decode(encode(values), values.shape[-1])
