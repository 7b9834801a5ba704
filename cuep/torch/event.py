"""DeepEP's ``EventHandle`` and ``EventOverlap`` on torch's streams.

An :class:`EventHandle` holds a CUDA event after some work (recorded on torch's current stream when made
without one); :class:`EventOverlap` wraps it with DeepEP's methods. The event itself is a
``cupy.cuda.Event`` that the core recorded (cuep's kernels launch through CuPy); waiting on it puts a
``cudaStreamWaitEvent`` on torch's current stream, exactly as a torch event would.
"""

from __future__ import annotations

from typing import Any

from .. import _deps
from ..event import EventOverlap as CoreEventOverlap
from ..event import record_event


def _torch_current_stream_ptr() -> int:
    torch = _deps.torch()
    return torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())


class EventHandle:
    """A CUDA event after the work on a stream: made without arguments, it is recorded on torch's current
    stream now (DeepEP's ``EventHandle()``).

    Arguments:
        overlap: the core's :class:`cuep.EventOverlap` for a call's work (cuep's own calls pass it).
    """

    __slots__ = ("overlap",)

    def __init__(self, overlap: CoreEventOverlap | None = None):
        if overlap is None:
            cupy = _deps.cupy()
            stream = cupy.cuda.ExternalStream(_torch_current_stream_ptr(), _deps.torch().cuda.current_device())
            overlap = CoreEventOverlap(record_event(stream))
        self.overlap = overlap

    def current_stream_wait(self) -> None:
        """Make torch's current stream wait for the event (no host block)."""
        event = self.overlap.event
        if event is None:
            raise ValueError("EventHandle.current_stream_wait(): this handle holds no event")
        _deps.cupy().cuda.runtime.streamWaitEvent(_torch_current_stream_ptr(), event.ptr, 0)


class EventOverlap:
    """A CUDA event after a cuep call's work, for overlapping communication with compute (DeepEP's class).

    Use ``event.current_stream_wait()`` to make torch's current stream wait for it, or ``with event: ...``
    to run the block first (its kernels overlap the communication) and wait at its end.

    Arguments:
        event: an :class:`EventHandle`, or ``None`` (an EventOverlap of no work, as DeepEP returns without
            ``async_finish``).
        extra_tensors: tensors to keep alive as long as this object (DeepEP's stand-in for
            ``record_stream``, which CUDA graphs do not allow).
    """

    def __init__(self, event: EventHandle | None = None, extra_tensors: tuple[Any, ...] | None = None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Make torch's current stream wait for the event's work to finish; nothing to do for an
        EventOverlap of no work (a call without ``async_finish``), as ``with event:``."""
        if self.event is not None:
            self.event.current_stream_wait()

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


def core_event(call: str, event: Any) -> CoreEventOverlap | None:
    """The core's :class:`cuep.EventOverlap` of a ``previous_event`` given to ``call``."""
    if event is None or isinstance(event, CoreEventOverlap):
        return event
    if isinstance(event, EventOverlap):  # one of no work waits for nothing, as DeepEP reads it
        return event.event.overlap if event.event is not None else None
    if isinstance(event, EventHandle):
        return event.overlap
    raise TypeError(f"{call}: previous_event must be an EventOverlap (Buffer.capture() makes one), "
                    f"got {type(event).__name__}")


def wrap(overlap: CoreEventOverlap) -> EventOverlap:
    """The torch EventOverlap of a core call's event: of no event where the call left no work to wait for (a
    low-latency call without ``async_finish``), as DeepEP returns it."""
    return EventOverlap(EventHandle(overlap)) if overlap.stands_for_work else EventOverlap()
