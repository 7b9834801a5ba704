"""What a Buffer's calls hold until their kernels are done (cuep._streams.CallStreams.keep_alive), with
fake streams and events (no GPU): arrays are held until their event completes, never released early, a call
queries only the oldest events, and the events the bookkeeping makes itself are recorded again once done;
the torch front records torch tensors on the stream instead, as DeepEP does, and only the rest is held."""

import types

import numpy as np
import pytest

from cuep import _streams


class FakeEvent:
    """An event whose completion the test decides; it counts the queries and records made of it."""

    made = 0

    def __init__(self, disable_timing: bool = True):
        FakeEvent.made += 1
        self.finished, self.queries, self.records = False, 0, []

    @property
    def done(self) -> bool:
        self.queries += 1
        return self.finished

    def record(self, stream) -> None:
        self.records.append(stream)
        self.finished = False


class FakeStream:
    ptr = 0x10

    def __init__(self, capturing: bool = False):
        self.capturing = capturing

    def is_capturing(self) -> bool:
        return self.capturing


def _streams_with_fake_events(monkeypatch) -> _streams.CallStreams:
    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(Event=FakeEvent, Stream=lambda non_blocking: None))
    monkeypatch.setattr(_streams._deps, "cupy", lambda: fake_cupy)
    FakeEvent.made = 0
    return _streams.CallStreams(front=HoldingFront())


class HoldingFront:
    """A front whose allocator cannot be told which stream uses an array (CuPy's): every array is held."""

    def record_stream(self, stream, arrays):
        return arrays


def held(streams: _streams.CallStreams) -> list:
    return [arrays for _, arrays, _ in streams._in_flight]


def test_arrays_are_held_until_their_event_completes_and_not_an_event_longer(monkeypatch):
    streams, stream = _streams_with_fake_events(monkeypatch), FakeStream()
    given = [FakeEvent() for _ in range(3)]
    for index, event in enumerate(given):
        streams.keep_alive(stream, (f"a{index}",), event)
    assert held(streams) == [("a0",), ("a1",), ("a2",)]
    given[1].finished = True  # done, but behind a running one: held a little longer, never released early
    streams.keep_alive(stream, ("own0",))
    assert held(streams) == [("a0",), ("a1",), ("a2",), ("own0",)]
    assert given[0].queries == 3 and given[1].queries == 0 and given[2].queries == 0  # one query a call
    given[0].finished = True
    streams.keep_alive(stream, ("own1",))
    assert held(streams) == [("a2",), ("own0",), ("own1",)]
    assert given[2].queries == 1  # the first still running ends the walk


def test_own_events_are_recorded_again_once_done_and_given_ones_never(monkeypatch):
    streams, stream = _streams_with_fake_events(monkeypatch), FakeStream()
    streams.keep_alive(stream, ("x",))
    own = streams._in_flight[0][0]
    assert own.records == [stream] and FakeEvent.made == 1
    given = FakeEvent()
    streams.keep_alive(stream, ("y",), given)
    own.finished = given.finished = True
    streams.keep_alive(stream, ("z",))  # both done: released; the own event recorded for z, no new one made
    assert held(streams) == [("z",)] and streams._in_flight[0][0] is own and own.records == [stream, stream]
    assert FakeEvent.made == 2 and given.records == []  # the given event (a caller's) is never recorded again
    own.finished, running = True, FakeEvent()
    streams.keep_alive(stream, ("w",), running)
    streams.keep_alive(stream, ("v",))
    assert [e for e, _, _ in streams._in_flight] == [running, own] and FakeEvent.made == 3


def test_nothing_is_held_while_the_stream_is_captured(monkeypatch):
    streams = _streams_with_fake_events(monkeypatch)
    streams.keep_alive(FakeStream(capturing=True), ("x",))
    assert held(streams) == [] and FakeEvent.made == 0
    streams.keep_alive(FakeStream(), ("y",))
    streams.release()
    assert held(streams) == []


def test_torch_tensors_are_recorded_on_the_stream_and_only_the_rest_is_held(monkeypatch):
    torch = pytest.importorskip("torch")
    from cuep._interop import TensorView
    from cuep.torch import front as torch_front

    recorded = []

    class Tensor(torch.Tensor):  # a CPU tensor cannot record a CUDA stream: note what would be recorded
        def record_stream(self, stream):
            recorded.append((self, stream))

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)  # CPU-only torch
    front = torch_front.TorchFront(0)
    monkeypatch.setattr(front, "torch_stream", lambda stream: f"torch stream {stream.ptr:#x}")
    streams = _streams_with_fake_events(monkeypatch)
    given, viewed = torch.zeros(4).as_subclass(Tensor), torch.ones(2).as_subclass(Tensor)
    handle = object()
    rest = front.record_stream(FakeStream(), (given, TensorView(viewed, np.dtype(np.float32)), None, handle))
    assert recorded == [(given, "torch stream 0x10"), (viewed, "torch stream 0x10")] and rest == (handle,)
    streams.keep_alive(FakeStream(), rest)
    assert held(streams) == [(handle,)] and FakeEvent.made == 1
    streams.keep_alive(FakeStream(), front.record_stream(FakeStream(), (given,)))  # nothing left: no event
    assert held(streams) == [(handle,)] and FakeEvent.made == 1 and len(recorded) == 3
