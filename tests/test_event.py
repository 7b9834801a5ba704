"""EventOverlap's lazily recorded events, without a GPU (the record itself is replaced)."""

import pytest

from cuep import event as event_module
from cuep.event import EventOverlap


@pytest.fixture
def records(monkeypatch):
    """Every ``record_event(stream)`` call, returning a distinct token per call."""
    made = []

    def fake_record(stream):
        made.append(stream)
        return ("event", len(made))

    monkeypatch.setattr(event_module, "record_event", fake_record)
    return made


def test_after_work_on_records_nothing_until_asked(records):
    overlap = EventOverlap.after_work_on("stream A", extra_arrays=("x",))
    assert records == []
    assert overlap.extra_arrays == ("x",)
    assert overlap.event == ("event", 1)
    assert records == ["stream A"]


def test_after_work_on_records_once(records):
    overlap = EventOverlap.after_work_on("stream A")
    first, second = overlap.event, overlap.event
    assert first is second and records == ["stream A"]


def test_given_event_is_returned_as_is(records):
    assert EventOverlap("ready").event == "ready"
    assert EventOverlap().event is None
    assert records == []


def test_an_overlap_of_no_work_waits_for_nothing(records):
    """A call without async_finish ran on the current stream: waiting on its EventOverlap, or leaving its
    ``with`` block, records and waits for nothing (serving engines call both whatever the option)."""
    overlap = EventOverlap()
    overlap.current_stream_wait()
    with overlap:
        pass
    assert overlap.event is None and records == []
