"""EventOverlap: a CUDA event that a stream can wait on, keeping arrays alive until it is waited on."""

from __future__ import annotations

from typing import Any

from . import _deps


class EventOverlap:
    """A captured CUDA event on cuep's communication stream, for overlapping communication with compute.

    Use ``event.current_stream_wait()`` to make the current CuPy stream wait for the event, or
    ``with event: ...`` to run the block first and wait at its end (the block's kernels overlap with
    the communication).

    Arguments:
        event: a ``cupy.cuda.Event`` recorded on the stream whose work this represents, or ``None``.
        extra_arrays: arrays to keep alive until this object is dropped (CuPy has no
            ``record_stream``; holding a reference keeps their memory from being reused too early).
    """

    def __init__(self, event=None, extra_arrays: tuple[Any, ...] | None = None):
        self.event = event
        self.extra_arrays = extra_arrays

    def current_stream_wait(self) -> None:
        """Make the current CuPy stream wait until the event's work is done (no host block)."""
        if self.event is None:
            raise ValueError("EventOverlap.current_stream_wait(): this EventOverlap holds no event")
        _deps.cupy().cuda.get_current_stream().wait_event(self.event)

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if self.event is not None:
            self.current_stream_wait()


def record_event(stream):
    """A ``cupy.cuda.Event`` recorded on ``stream`` now, without timing (as DeepEP's events): a timing
    event costs more to record, and every call records one."""
    event = _deps.cupy().cuda.Event(disable_timing=True)
    event.record(stream)
    return event
