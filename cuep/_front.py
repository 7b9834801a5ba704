"""How a Buffer's front hands arrays out and finds its streams.

The core allocates every output and asks for every current stream through a front, so ``cuep.Buffer``
(:class:`CupyFront`: CuPy arrays from CuPy's pool, CuPy's current stream) and ``cuep.torch.Buffer``
(torch tensors from torch's caching allocator, torch's current stream) share the checks, the modes and
the launches. What a front hands out is a device array the core reads like any input (a CuPy array, or a
:class:`~cuep._interop.TensorView`); :meth:`export` turns it into what the front's users get.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ContextManager, Protocol

import numpy as np

from . import _deps
from ._math import align_up

_ARRAY_ALIGN = 128  # each carved array starts a cache line of its own


class Front(Protocol):
    """The array library and stream convention of one Buffer's callers.

    The core holds FP8 e4m3 data as ``uint8`` (CuPy has no FP8 dtype) and asks for ``uint8`` outputs only
    for FP8 data, so a front may hand those out as its own FP8 type (the torch front does)."""

    def empty(self, shape: tuple[int, ...], dtype) -> Any:
        """An uninitialised output array of ``shape`` and NumPy ``dtype``, allocated for the current stream."""

    def storage(self, nbytes: int, dtype=None) -> Any:
        """``nbytes`` of device memory for one call's outputs, with its address as ``.ptr``; ``dtype``: the NumPy
        dtype of the call's first view, which a front may allocate the memory as (the torch front does: its
        first typed view is then the allocation itself)."""

    def view(self, storage: Any, shape: tuple[int, ...], dtype, offset: int,
             strides: tuple[int, ...] | None = None) -> Any:
        """An array of ``storage`` (from :meth:`storage`, or the ``.data`` of an array from :meth:`empty`) from
        byte ``offset`` (``strides`` in bytes; ``None``: C order), of the callers' kind: the core hands it out
        and never reads it."""

    def views(self, storage: Any, regions: tuple[View, ...]) -> list:
        """:meth:`view` of each of ``regions`` of ``storage`` (from :meth:`storage` only), ``regions`` a tuple
        the caller keeps: a front may work out once what a tuple's views need."""

    def readable_views(self, storage: Any, regions: tuple[View, ...]) -> list:
        """:meth:`views`, as the core reads arrays (as :meth:`empty` hands them out): for outputs that a kernel
        of this call or a later one is given too."""

    def current_stream(self) -> Any:
        """The callers' current stream, as a CuPy stream (the launches take CuPy streams)."""

    def allocating_on(self, stream) -> ContextManager:
        """A context in which :meth:`empty` and :meth:`storage` allocate for ``stream``."""

    def export(self, array: Any) -> Any:
        """What the callers get for a device array of this front (``None`` stays ``None``)."""


class CupyFront:
    """``cuep.Buffer``'s front: CuPy arrays from CuPy's memory pool, CuPy's current stream."""

    def empty(self, shape: tuple[int, ...], dtype) -> Any:
        return _deps.cupy().empty(shape, dtype=dtype)

    def storage(self, nbytes: int, dtype=None) -> Any:
        return _deps.cupy().cuda.alloc(nbytes)  # a pool allocation, without an array object around it

    def view(self, storage: Any, shape: tuple[int, ...], dtype, offset: int,
             strides: tuple[int, ...] | None = None) -> Any:
        return _deps.cupy().ndarray(shape, dtype=dtype, memptr=storage + offset, strides=strides)

    def views(self, storage: Any, regions: tuple[View, ...]) -> list:
        ndarray = _deps.cupy().ndarray
        return [ndarray(view.shape, dtype=view.dtype, memptr=storage + view.offset, strides=view.strides)
                for view in regions]

    readable_views = views  # the core reads CuPy arrays as they are

    def current_stream(self) -> Any:
        return _deps.cupy().cuda.get_current_stream()

    def allocating_on(self, stream) -> ContextManager:
        return stream  # a CuPy stream is the context that makes it current, and CuPy's pool allocates for it

    def export(self, array: Any) -> Any:
        return getattr(array, "tensor", array)  # a caller's own torch tensor (given as ``out=``) goes back as it came


@dataclass(frozen=True)
class View:
    """One array carved out of a call's single allocation: ``strides`` ``None`` means C order."""

    shape: tuple[int, ...]
    dtype: Any
    offset: int
    strides: tuple[int, ...] | None = None


def carve(specs) -> tuple[dict[str, View], int]:
    """Regions ``name -> View`` for ``(name, shape, dtype, strides)`` packed into one allocation, and its
    bytes: a call's outputs in one allocation cost one allocation's host time, plus a view each."""
    regions, total = {}, 0
    for name, shape, dtype, strides in specs:
        regions[name] = View(shape, dtype, total, strides)
        total += align_up(math.prod(shape) * np.dtype(dtype).itemsize, _ARRAY_ALIGN)
    return regions, total
