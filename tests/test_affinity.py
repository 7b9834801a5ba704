"""The threads NVSHMEM starts are moved off the cores the host's ranks are bound to (cuep.runtime.affinity),
and the topology gathers those cores.

Each case runs in a thread of its own, bound there, so the test process keeps its affinity."""

import os
import sys
import threading

import pytest

from cuep.runtime import affinity
from cuep.runtime.topology import host_cpus, own_cpus

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread affinity is Linux's")


def _in_a_thread_bound_to(cpus: set[int], body) -> None:
    """Run ``body()`` in a new thread bound to ``cpus``; re-raise what it raised."""
    failures = []

    def run() -> None:
        try:
            os.sched_setaffinity(0, cpus)
            body()
        except BaseException as exc:  # handed to the test's thread
            failures.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if failures:
        raise failures[0]


def _started_thread() -> tuple[threading.Thread, threading.Event]:
    """A thread that waits until its event is set (it inherits the affinity of the thread starting it)."""
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    return thread, release


def test_the_new_threads_are_listed():
    before = affinity.thread_ids()
    thread, release = _started_thread()
    try:
        assert affinity.thread_ids() - before == {thread.native_id}
    finally:
        release.set()
        thread.join()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two processors to move a thread between")
def test_a_thread_started_by_a_bound_thread_moves_to_the_other_processors():
    allowed = os.sched_getaffinity(0)
    own = {min(allowed)}

    def body() -> None:
        thread, release = _started_thread()
        try:
            assert os.sched_getaffinity(thread.native_id) == own  # inherited: the case being fixed
            assert affinity.keep_off_rank_cores([thread.native_id]) == 1
            moved_to = os.sched_getaffinity(thread.native_id)
            assert moved_to and not moved_to & own and moved_to <= allowed
            assert os.sched_getaffinity(0) == own  # the calling thread keeps its binding
        finally:
            release.set()
            thread.join()

    _in_a_thread_bound_to(own, body)


def test_nothing_moves_when_the_calling_thread_may_run_everywhere():
    everywhere = set(range(os.cpu_count() or 1))

    def body() -> None:
        if os.sched_getaffinity(0) != everywhere:
            pytest.skip("this process may not run on every processor of the host")
        thread, release = _started_thread()
        try:
            assert affinity.keep_off_rank_cores([thread.native_id]) == 0
            assert os.sched_getaffinity(thread.native_id) == everywhere
        finally:
            release.set()
            thread.join()

    try:
        _in_a_thread_bound_to(everywhere, body)
    except OSError as exc:
        pytest.skip(f"cannot bind a thread to every processor here: {exc}")


def test_a_thread_that_is_gone_is_skipped():
    thread, release = _started_thread()
    gone = thread.native_id
    release.set()
    thread.join()
    own = {min(os.sched_getaffinity(0))}
    moved = []
    _in_a_thread_bound_to(own, lambda: moved.append(affinity.keep_off_rank_cores([gone])))
    assert moved == [0]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two processors to move a thread between")
def test_a_thread_keeps_off_every_rank_core_of_the_host_and_off_its_own_where_that_leaves_none():
    allowed = sorted(os.sched_getaffinity(0))
    own, other_rank = {allowed[0]}, {allowed[-1]}
    everywhere = set(range(os.cpu_count() or 1))

    def body() -> None:
        thread, release = _started_thread()
        try:
            assert affinity.keep_off_rank_cores([thread.native_id], own | other_rank) == 1
            assert not os.sched_getaffinity(thread.native_id) & (own | other_rank)
            assert affinity.keep_off_rank_cores([thread.native_id], everywhere) == 1  # every core has a rank
            assert os.sched_getaffinity(thread.native_id) == set(allowed) - own
        finally:
            release.set()
            thread.join()

    if len(allowed) < 3:
        pytest.skip("needs three processors: two ranks' and one to move to")
    _in_a_thread_bound_to(own, body)


def test_the_host_cpus_are_those_of_every_rank_on_the_same_host():
    placements = [("a", frozenset({0})), ("a", frozenset({1})), ("b", frozenset({0})), ("a", frozenset({5, 6}))]
    assert host_cpus(placements, 1) == {0, 1, 5, 6}
    assert host_cpus(placements, 2) == {0}
    assert own_cpus() == os.sched_getaffinity(0)
