"""EventOverlap: a CUDA event that a stream can wait on, keeping arrays alive until it is waited on."""

from __future__ import annotations

from typing import Any

from . import _deps


class EventOverlap:
    """A CUDA event after a cuep call's work, for overlapping communication with compute.

    Use ``event.current_stream_wait()`` to make the current CuPy stream wait for the event, or
    ``with event: ...`` to run the block first and wait at its end (the block's kernels overlap with
    the communication).

    Arguments:
        event: a ``cupy.cuda.Event`` recorded on the stream whose work this represents, or ``None``.
        extra_arrays: arrays to keep alive until this object is dropped (CuPy has no
            ``record_stream``; holding a reference keeps their memory from being reused too early).
    """

    def __init__(self, event=None, extra_arrays: tuple[Any, ...] | None = None):
        self._event = event
        self._stream = None
        self.extra_arrays = extra_arrays

    @classmethod
    def after_work_on(cls, stream, extra_arrays: tuple[Any, ...] | None = None) -> "EventOverlap":
        """The end of the work enqueued on ``stream`` so far, as an event recorded only when first asked
        for (:attr:`event`, :meth:`current_stream_wait`). A call that the current stream waits for anyway
        (DeepEP returns no event then) so costs no event record; an event recorded later stands for a
        later point of the same stream, which every wait on it may safely take instead. Ask for it
        before a CUDA-graph capture begins on ``stream``, or the record becomes part of the graph."""
        overlap = cls(None, extra_arrays)
        overlap._stream = stream
        return overlap

    @property
    def stands_for_work(self) -> bool:
        """Whether this EventOverlap stands for work to wait for (its event recorded, or to be when asked for)."""
        return self._event is not None or self._stream is not None

    @property
    def event(self):
        """The ``cupy.cuda.Event``, or ``None`` when this EventOverlap stands for no work."""
        if self._event is None and self._stream is not None:
            self._event, self._stream = record_event(self._stream), None
        return self._event

    def current_stream_wait(self) -> None:
        """Make the current CuPy stream wait until the event's work is done (no host block). An
        EventOverlap of no work (a call without ``async_finish`` ran on the current stream) has nothing
        to wait for: this does nothing, as ``with event:`` does."""
        event = self.event
        if event is not None:
            _deps.cupy().cuda.get_current_stream().wait_event(event)

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
