"""Integer arithmetic every layer sizes things with."""

from __future__ import annotations


def ceil_div(a: int, b: int) -> int:
    """``a / b`` rounded up, for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def align_up(n: int, alignment: int) -> int:
    """The smallest multiple of ``alignment`` that is at least ``n``."""
    return ceil_div(n, alignment) * alignment
