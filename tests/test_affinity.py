"""The threads NVSHMEM starts are moved off the cores the host's ranks are bound to (cuep.runtime.affinity),
the topology gathers those cores, and init_world moves the threads its NVSHMEM start left.

:func:`placement` is pure and covered on any host; the cases that move real threads run each in a thread
of its own, bound there, so the test process keeps its affinity."""

import os
import sys
import threading
import types

import numpy as np
import pytest

from cuep.runtime import affinity
from cuep.runtime.topology import Topology, host_cpus

LINUX = sys.platform.startswith("linux") and hasattr(os, "sched_getaffinity")
needs_linux = pytest.mark.skipif(not LINUX, reason="thread affinity is Linux's")


def _no_siblings(cpus):
    return frozenset(cpus)


def _pairs_of_8(cpus):
    """SMT siblings of a host whose core ``c`` has hardware threads ``c`` and ``c + 8``."""
    return frozenset(cpus) | {cpu ^ 8 for cpu in cpus}


HOST = frozenset(range(16))


@pytest.mark.parametrize("job,rank_cpus,own,siblings,expected", [
    # Eight ranks bound to a core each: the proxies go to the eight cores no rank has.
    (HOST, frozenset(range(8)), frozenset({3}), _no_siblings, frozenset(range(8, 16))),
    # Bound to hardware threads: the ranks' SMT siblings are kept free too.
    (HOST, frozenset(range(4)), frozenset({2}), _pairs_of_8, frozenset({4, 5, 6, 7, 12, 13, 14, 15})),
    # Siblings cover what is left: the free threads are used rather than none.
    (HOST, frozenset(range(8)), frozenset({0}), _pairs_of_8, frozenset(range(8, 16))),
    # A rank per core: nothing is free, so the proxy keeps off its own core at least.
    (HOST, HOST, frozenset({5}), _no_siblings, HOST - {5}),
    (HOST, HOST, frozenset({5, 13}), _pairs_of_8, HOST - {5, 13}),
    # Ranks bound to sockets, or not bound: the scheduler places the proxy; nothing moves.
    (HOST, HOST, frozenset(range(8)), _no_siblings, frozenset()),
    (HOST, HOST, HOST, _no_siblings, frozenset()),
    # The job's mask (taskset) bounds the placement.
    (frozenset({0, 1, 2, 3}), frozenset({0, 1}), frozenset({0}), _no_siblings, frozenset({2, 3})),
    # The ranks' processors unknown: off this rank's own core.
    (HOST, frozenset(), frozenset({0}), _no_siblings, HOST - {0}),
    # This thread's binding unknown (not Linux): nothing moves.
    (HOST, frozenset(range(8)), frozenset(), _no_siblings, frozenset()),
])
def test_placement(job, rank_cpus, own, siblings, expected):
    assert affinity.placement(job, rank_cpus, own, siblings) == expected


def test_the_host_cpus_are_those_of_every_rank_on_the_same_host():
    placements = [("a", frozenset({0})), ("a", frozenset({1})), ("b", frozenset({0})), ("a", frozenset({5, 6}))]
    assert host_cpus(placements, 1) == {0, 1, 5, 6}
    assert host_cpus(placements, 2) == {0}


def test_the_topology_gathers_each_rank_s_processors_with_its_host(monkeypatch):
    from cuep.runtime import topology
    monkeypatch.setattr(topology, "host_identity", lambda: "a")
    monkeypatch.setattr(affinity, "own_cpus", lambda: frozenset({1}))
    monkeypatch.delenv("CUEP_RANKS_PER_NODE", raising=False)
    gathered = []

    def allgather(value, phase):
        gathered.append(value)
        return [("a", frozenset({0})), value, ("b", frozenset({7}))]

    with pytest.raises(ValueError, match="same number of ranks"):  # hosts of 2 and 1 ranks: refused
        topology.discover_topology(types.SimpleNamespace(rank=1, allgather=allgather))
    assert gathered == [("a", frozenset({1}))]
    found = topology.discover_topology(types.SimpleNamespace(
        rank=1, allgather=lambda value, phase: [("a", frozenset({0})), value]))
    assert (found.local_rank, found.num_local_ranks, found.host_cpus) == (1, 2, {0, 1})


def test_init_world_moves_the_threads_nvshmem_started(monkeypatch):
    from cuep.runtime import world
    device = types.SimpleNamespace(set_current=lambda: None, use=lambda: None)
    release, started = threading.Event(), []

    def init(**_):
        thread = threading.Thread(target=release.wait)
        thread.start()
        started.append(thread)

    unique_id = types.SimpleNamespace(_data=np.zeros(128, np.uint8))
    fake_nvshmem = types.SimpleNamespace(get_unique_id=lambda empty: unique_id, init=init)
    monkeypatch.setattr(world._deps, "cupy", lambda: types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=lambda _: device)))
    monkeypatch.setattr(world._deps, "cuda_core", lambda: types.SimpleNamespace(Device=lambda _: device))
    monkeypatch.setattr(world._deps, "nvshmem", lambda: fake_nvshmem)
    monkeypatch.setattr(world, "_world", None)
    monkeypatch.setattr(world.atexit, "register", lambda _: None)
    for name in ("NVSHMEM_REMOTE_TRANSPORT", "NVSHMEM_IB_ENABLE_IBGDA"):
        monkeypatch.delenv(name, raising=False)
    moved = []
    monkeypatch.setattr(affinity, "keep_off_rank_cores", lambda threads, rank_cpus: moved.append((threads, rank_cpus)))
    group = types.SimpleNamespace(broadcast=lambda data, what: data, allgather=lambda value, phase: [value])
    try:
        world.init_world(group, Topology(0, 1, 0, 1, 1, frozenset({4})), 1 << 20, 0)
    finally:
        release.set()
        for thread in started:
            thread.join()
    assert moved == [({started[0].native_id}, {4})]


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


@needs_linux
def test_the_new_threads_are_listed():
    before = affinity.thread_ids()
    thread, release = _started_thread()
    try:
        assert affinity.thread_ids() - before == {thread.native_id}
    finally:
        release.set()
        thread.join()


@needs_linux
def test_a_thread_started_by_a_thread_bound_to_one_core_moves_off_that_core():
    allowed = os.sched_getaffinity(0)
    if len(affinity.job_cpus() - affinity.smt_siblings({min(allowed)})) == 0 or len(allowed) < 2:
        pytest.skip("needs a processor outside the first core to move a thread to")
    own = {min(allowed)}

    def body() -> None:
        thread, release = _started_thread()
        try:
            assert os.sched_getaffinity(thread.native_id) == own  # inherited: the case being fixed
            assert affinity.keep_off_rank_cores([thread.native_id], own) == 1
            moved_to = os.sched_getaffinity(thread.native_id)
            assert moved_to and not moved_to & affinity.smt_siblings(own)
            assert os.sched_getaffinity(0) == own  # the calling thread keeps its binding
        finally:
            release.set()
            thread.join()

    _in_a_thread_bound_to(own, body)


@needs_linux
def test_nothing_moves_when_the_ranks_may_run_everywhere():
    everywhere = affinity.job_cpus()

    def body() -> None:
        thread, release = _started_thread()
        try:
            before = os.sched_getaffinity(thread.native_id)
            assert affinity.keep_off_rank_cores([thread.native_id], everywhere) == 0
            assert os.sched_getaffinity(thread.native_id) == before
        finally:
            release.set()
            thread.join()

    try:
        _in_a_thread_bound_to(set(everywhere), body)
    except OSError as exc:
        pytest.skip(f"cannot bind a thread to every processor of the job here: {exc}")


@needs_linux
def test_a_thread_that_is_gone_is_skipped():
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs two processors: with one, nothing is tried")
    thread, release = _started_thread()
    gone = thread.native_id
    release.set()
    thread.join()
    moved = []
    _in_a_thread_bound_to({min(allowed)}, lambda: moved.append(affinity.keep_off_rank_cores([gone])))
    assert moved == [0]
