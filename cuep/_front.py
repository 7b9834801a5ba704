"""How a Buffer's front hands arrays out and finds its streams.

The core allocates every output and asks for every current stream through a front, so ``cuep.Buffer``
(:class:`CupyFront`: CuPy arrays from CuPy's pool, CuPy's current stream) and ``cuep.torch.Buffer``
(torch tensors from torch's caching allocator, torch's current stream) share the checks, the modes and
the launches. What a front hands out is a device array the core reads like any input (a CuPy array, or a
:class:`~cuep._interop.TensorView`); :meth:`export` turns it into what the front's users get.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Protocol

import numpy as np

from . import _deps, env
from ._math import align_up

_ARRAY_ALIGN = 128  # each carved array starts a cache line of its own
_POOL_ENTRIES = 4   # allocations kept per key and stream: two results in flight, and the two the caller still holds
_POOL_KEYS = 8      # keys kept (a decode loop uses one per call kind and shape); the oldest goes first

#: ``attach(storage, views) -> (attached, handed_out)``: what a caller keeps with a pooled allocation, and which
#: of those objects it hands to its own callers (:class:`OutputPool`).
Attach = Callable[[Any, list], tuple[Any, tuple]]


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

    def outputs(self, key: Any, stream, nbytes: int, dtype, regions: tuple[View, ...], readable: bool = False,
                attach: Attach | None = None) -> tuple[Any, list, Any]:
        """``(storage, views, attached)``: :meth:`storage` and :meth:`views` (:meth:`readable_views` if
        ``readable``) with what ``attach(storage, views)`` made of them, or the same three an earlier call with
        this ``key`` on ``stream`` got, once nothing outside the front holds any of them (:class:`OutputPool`);
        ``key`` ``None``: new ones, not kept. ``attached`` is ``None`` without ``attach``."""

    def signature(self, value: Any) -> Any:
        """What the checks of a call read of ``value``, cheaply, where it is this front's own kind of array
        (its type, shape, dtype, strides and device, hashable; ``()`` for ``None``), else ``None``: a call whose
        arguments have a signature it has checked before skips the checks (:class:`cuep._checks.KnownCalls`)."""

    def pointer(self, value: Any) -> int:
        """The device address of ``value``: an array with a :meth:`signature`, or one the checks read."""

    def export_handle(self, handle: Any) -> Any:
        """What the callers get for a low-latency dispatch's handle (made once per pooled allocation)."""

    def release_outputs(self) -> None:
        """Forget the allocations :meth:`outputs` keeps for reuse."""

    def current_stream(self) -> Any:
        """The callers' current stream, as a CuPy stream (the launches take CuPy streams)."""

    def allocating_on(self, stream) -> ContextManager:
        """A context in which :meth:`empty` and :meth:`storage` allocate for ``stream``."""

    def export(self, array: Any) -> Any:
        """What the callers get for a device array of this front (``None`` stays ``None``)."""

    def record_stream(self, stream, arrays: tuple) -> tuple:
        """Tell the allocator that work enqueued on ``stream`` so far uses ``arrays``, so that the memory of any
        the callers drop is not handed out again before that work is done; returns those it could not tell
        about, which the caller holds until then (:meth:`cuep._streams.CallStreams.keep_alive`)."""


class OutputPool:
    """A call's outputs handed out again, call after call, once nothing outside the pool holds them.

    Making a low-latency call's outputs (an allocation, then an array per output) is a large share of its
    host time, and a decode loop makes the same outputs call after call with few of them alive at once. So
    their allocations are kept here, by key and stream, and one is handed out again, with the same array
    objects, once its callers have let go of every one of its arrays, of every view of them and of the
    handle that holds it. Nothing reads that memory then but work already queued on that stream, which the
    next call follows in stream order: the rule by which a caching allocator hands out freed memory again
    on the same stream. (Work on another stream must keep its own reference while it runs; torch's
    ``record_stream`` does not count.) Nothing is kept or reused while ``stream`` is being captured into a CUDA
    graph: those outputs belong to the graph.

    The front says what counts: ``allocate(nbytes, dtype, regions, readable)`` makes ``(storage, views)``, and
    ``watch(storage, views)`` gives ``(watched, counts, spoiled)``: the objects whose Python references count
    (the outputs, the storage, what an output wraps or shares, the likeliest held first); ``counts()``, what
    refers to them from elsewhere (a caller's views of the memory; references held in C++); and ``spoiled()``,
    asked of an entry no caller holds, whether a caller changed one of its objects in a way the next call must
    not inherit (that entry is dropped).

    ``context()``, where given, says what else an allocation's reuse depends on: its allocations are kept apart
    by its value too (torch's inference mode, whose tensors only calls under it may take).

    The caller may attach objects of its own to an allocation when it is made (``attach``: the call's handle,
    its filled kernel arguments), which come back with it: they are made once per allocation instead of once
    per call, and the ones it hands out (``attach``'s second result) count as holders too."""

    def __init__(self, allocate: Callable[..., tuple[Any, list]], watch: Callable[[Any, list], tuple],
                 enabled: bool = True, context: Callable[[], Any] | None = None):
        self._allocate, self._watch, self.enabled, self._context = allocate, watch, enabled, context
        self._entries: dict[tuple, list[_PoolEntry]] = {}

    def take(self, key: Any, stream, nbytes: int, dtype, regions: tuple[View, ...], readable: bool,
             attach: Attach | None = None) -> tuple[Any, list, Any]:
        """``(storage, views, attached)`` for a call with ``key`` on ``stream``: an entry no caller holds, else a
        new allocation (kept if there is room). Allocated and not kept when the pool is off, ``key`` is ``None``
        (a one-off call) or ``stream`` is being captured."""
        if not self.enabled or key is None or stream.is_capturing():
            storage, views = self._allocate(nbytes, dtype, regions, readable)
            return storage, views, attach(storage, views)[0] if attach is not None else None
        key = (key, stream.ptr) if self._context is None else (key, stream.ptr, self._context())
        entries = self._entries.get(key)
        if entries is None:
            if len(self._entries) >= _POOL_KEYS:
                del self._entries[next(iter(self._entries))]
            entries = self._entries[key] = []
        for entry in entries:
            if entry.unheld():
                if not entry.spoiled():
                    return entry.storage, entry.views, entry.attached
                entries.remove(entry)  # let go of, but changed by its caller: its memory goes back
                break
        entry = self._new_entry(nbytes, dtype, regions, readable, attach)
        # Counted now, while only the entry holds its objects: every later count is taken the same way.
        entry.count_unheld()
        if len(entries) < _POOL_ENTRIES:
            entries.append(entry)
        return entry.storage, entry.views, entry.attached

    def _new_entry(self, nbytes: int, dtype, regions: tuple[View, ...], readable: bool,
                   attach: Attach | None) -> _PoolEntry:
        storage, views = self._allocate(nbytes, dtype, regions, readable)
        attached, handed_out = attach(storage, views) if attach is not None else (None, ())
        watched, counts, spoiled = self._watch(storage, views)
        return _PoolEntry(storage, views, attached, [*handed_out, *watched], counts, spoiled)

    def clear(self) -> None:
        self._entries.clear()


class _PoolEntry:
    __slots__ = ("storage", "views", "attached", "watched", "counts", "spoiled", "_references", "_counts")

    def __init__(self, storage: Any, views: list, attached: Any, watched: list, counts: Callable[[], tuple],
                 spoiled: Callable[[], bool]):
        self.storage, self.views, self.attached = storage, views, attached
        self.watched, self.counts, self.spoiled = tuple(watched), counts, spoiled
        self._references: tuple[int, ...] = ()
        self._counts: tuple[int, ...] = ()

    def count_unheld(self) -> None:
        """Take the counts of an entry nobody else holds: what :meth:`unheld` compares with, counted the same way
        (``map`` hands each object to ``getrefcount`` with the one reference of its iteration, no loop variable)."""
        self._references = tuple(map(sys.getrefcount, self.watched))
        self._counts = self.counts()

    def unheld(self) -> bool:
        """Whether no caller holds any of the entry's objects: every reference count as when it was made, then
        the front's counts (one ``map`` over a C function: the decode loop asks this every call)."""
        return tuple(map(sys.getrefcount, self.watched)) == self._references and self.counts() == self._counts


def _cupy_watch(storage, views: list) -> tuple[list, Callable[[], tuple], Callable[[], bool]]:
    """A CuPy allocation's holders (:class:`OutputPool`): each array, the storage (a handle holds it), and each
    array's memory pointer (an array made on it, ``memptr=out.data``, shares it); then the references to the
    memory object, which a view or slice a caller makes of an output holds. A CuPy array has nothing a
    caller could change that the next call would inherit."""
    mem = storage.mem
    return [*views, storage, *(view.data for view in views)], lambda: (sys.getrefcount(mem),), lambda: False


class CupyFront:
    """``cuep.Buffer``'s front: CuPy arrays from CuPy's memory pool, CuPy's current stream."""

    def __init__(self):
        self._pool = OutputPool(self._allocate, _cupy_watch, enabled=env.get("CUEP_REUSE_OUTPUTS"))

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

    def outputs(self, key: Any, stream, nbytes: int, dtype, regions: tuple[View, ...], readable: bool = False,
                attach: Attach | None = None) -> tuple[Any, list, Any]:
        return self._pool.take(key, stream, nbytes, dtype, regions, readable, attach)

    def release_outputs(self) -> None:
        self._pool.clear()

    def _allocate(self, nbytes: int, dtype, regions: tuple[View, ...], readable: bool) -> tuple[Any, list]:
        storage = self.storage(nbytes, dtype)
        return storage, self.views(storage, regions)

    def signature(self, value: Any) -> Any:
        if value is None:
            return ()
        if type(value) is _deps.cupy().ndarray:
            return value.shape, value.dtype, value.strides, value.data.device_id
        return None  # a subclass, or another library's array: read through the checks

    def pointer(self, value: Any) -> int:
        return value.data.ptr

    def export_handle(self, handle: Any) -> Any:
        return handle  # CuPy callers get the core's handle

    def current_stream(self) -> Any:
        return _deps.cupy().cuda.get_current_stream()

    def allocating_on(self, stream) -> ContextManager:
        return stream  # a CuPy stream is the context that makes it current, and CuPy's pool allocates for it

    def export(self, array: Any) -> Any:
        return getattr(array, "tensor", array)  # a caller's own torch tensor (given as ``out=``) goes back as it came

    def record_stream(self, stream, arrays: tuple) -> tuple:
        return arrays  # CuPy's pool has no record_stream: every array is held


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
