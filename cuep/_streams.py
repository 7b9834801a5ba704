"""Which stream a Buffer's call runs on, what it waits for, and what stays alive until it is done.

DeepEP's rules, kept by every mode: a call runs after ``previous_event`` (default: the work already
on the current stream) and after the Buffer's previous call; ``async_finish`` leaves the current
stream free and returns an event; ``allocate_on_comm_stream`` allocates the outputs on the comm stream.
Arrays that a kernel on the comm stream still uses after an ``async_finish`` call returns are kept from
reuse until it is done: a normal-mode call's torch tensors are recorded on that stream for torch's caching
allocator, as DeepEP records its tensors; anything else (CuPy's pool has no ``record_stream``), and a
low-latency call's arrays, which its output pool counts, are held here until the kernel's event completes.
Nothing is held or recorded for a call being captured into a CUDA graph: the graph's owner keeps its arrays.
Streams are the front's (:mod:`cuep._front`): CuPy's current stream for ``cuep.Buffer``, torch's for
``cuep.torch``.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

from . import _deps
from ._front import Front
from .errors import CuepError
from .event import EventOverlap, record_event


class CallStreams:
    """One Buffer's comm stream, its previous call and the arrays its queued kernels still use."""

    def __init__(self, front: Front):
        self.front = front
        self.comm_stream = _deps.cupy().cuda.Stream(non_blocking=True)
        # (event, arrays, whether the event is this object's own), oldest first
        self._in_flight: collections.deque[tuple[Any, tuple, bool]] = collections.deque()
        self._spare_events: list = []  # own events whose work is done, recorded again instead of made anew
        # (stream pointer, EventOverlap after it) of the last layout, dispatch or combine
        self._last_call: tuple[int, EventOverlap] | None = None

    def keep_alive(self, stream, arrays: tuple, event=None) -> None:
        """Hold ``arrays`` until the work enqueued on ``stream`` so far completes (``event``, recorded there
        now when not given): the stream may still read or write them after the caller drops its references.

        Nothing is held for a stream being captured into a CUDA graph: its kernels run when the graph is
        replayed, and the graph's owner keeps their arrays (DeepEP's rule); and querying events while a
        capture runs would invalidate it."""
        if stream.is_capturing():
            return
        in_flight = self._in_flight
        # Oldest first, stopping at the first still running: a call queries one event or two, not every one
        # held (a decode step's hooks can hold one per layer). An entry behind a slower stream's waits a
        # little longer: held longer, never released early.
        while in_flight and in_flight[0][0].done:
            done, _, own = in_flight.popleft()
            if own:
                self._spare_events.append(done)
        if not arrays:
            return
        own = event is None
        if own and self._spare_events:
            event = self._spare_events.pop()
            event.record(stream)
        elif own:
            event = record_event(stream)
        in_flight.append((event, arrays, own))

    def release(self) -> None:
        """Forget every held array (after a device synchronisation)."""
        self._in_flight.clear()
        self._spare_events.clear()

    def run(self, previous_event: EventOverlap | None, async_finish: bool, allocate_on_comm_stream: bool,
            enqueue: Callable[[Any], tuple[tuple, tuple]]) -> tuple[tuple, EventOverlap]:
        """Run ``enqueue(stream)`` after ``previous_event`` (default: the current stream's work) and after
        the previous call; returns its outputs and an :class:`EventOverlap` for them.

        A call that the current stream waits for anyway (no ``previous_event``, ``async_finish`` or
        ``allocate_on_comm_stream``) runs on the current stream itself, unless it is being captured:
        going through the comm stream would only add two cross-stream hops. Other calls run on the
        comm stream, allocating there or on the current stream. ``enqueue`` returns ``(outputs,
        inputs)``; with ``async_finish`` both are kept alive until the comm stream is done with them.
        """
        compute_stream = self.front.current_stream()
        capturing = compute_stream.is_capturing()
        if previous_event is None and not async_finish and not allocate_on_comm_stream and not capturing:
            self._wait_for_last_call(compute_stream)
            outputs, inputs = enqueue(compute_stream)
            # No event is recorded unless someone waits on this call from another stream (DeepEP returns
            # none here): back-to-back calls then have nothing but kernels between them on the GPU.
            self._last_call = (compute_stream.ptr, EventOverlap.after_work_on(compute_stream))
            return outputs, EventOverlap.after_work_on(compute_stream)
        comm_stream = self.comm_stream
        if not capturing:
            self._wait_for_last_call(comm_stream)
        comm_stream.wait_event(previous_event.event if previous_event is not None else record_event(compute_stream))
        if allocate_on_comm_stream:
            with self.front.allocating_on(comm_stream):
                outputs, inputs = enqueue(comm_stream)
        else:
            outputs, inputs = enqueue(comm_stream)
        done = record_event(comm_stream)
        if async_finish and not capturing:  # (a graph's owner keeps its arrays, as keep_alive says)
            # torch's allocator is told (DeepEP's record_stream); what it cannot be told is held here.
            self.keep_alive(comm_stream, self.front.record_stream(comm_stream, (*inputs, *outputs)), done)
        else:
            compute_stream.wait_event(done)
        if not capturing:  # a captured call runs when its graph is replayed, ordered by the replay's stream
            self._last_call = (comm_stream.ptr, EventOverlap(done))
        return outputs, EventOverlap(done)

    def _wait_for_last_call(self, stream) -> None:
        """Order ``stream`` after the previous call if that ran on another stream: calls share the
        buffer's flags and epochs, so they must not overlap."""
        if self._last_call is not None and self._last_call[0] != stream.ptr:
            stream.wait_event(self._last_call[1].event)

    def run_with_hook(self, launch: Callable[[Any, int], None], send: int, receive: int, async_finish: bool,
                      return_recv_hook: bool, keep: tuple,
                      check_alive: Callable[[str], None]) -> tuple[EventOverlap, Callable[[], None] | None]:
        """The low-latency rule: ``launch(stream, phases)`` on the current stream (with ``async_finish``,
        on the comm stream after it); with ``return_recv_hook`` only the ``send`` phase runs now and
        the returned hook runs ``receive``. ``keep``: the call's arrays, held until the kernels that
        use them are done."""
        phases = send if return_recv_hook else send | receive
        event = EventOverlap()
        if async_finish:
            comm_stream = self.comm_stream
            comm_stream.wait_event(record_event(self.front.current_stream()))
            launch(comm_stream, phases)
            done = record_event(comm_stream)
            self.keep_alive(comm_stream, keep, done)
            event = EventOverlap(done, extra_arrays=keep)
        else:
            launch(self.front.current_stream(), phases)
        if not return_recv_hook:
            return event, None
        pending = [launch]

        def hook() -> None:
            """Receive this call's data (on the current stream). Call it once."""
            if not pending:
                raise CuepError("low-latency receive hook: this hook already ran; each hook runs once")
            check_alive("low-latency receive hook")
            stream = self.front.current_stream()
            pending.pop()(stream, receive)
            # The receive reads the call's arrays (top-k ids, handle) now, long after the call returned.
            self.keep_alive(stream, keep)
        return event, hook
