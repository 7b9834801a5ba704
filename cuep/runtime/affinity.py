"""Keeping the threads NVSHMEM starts off the cores that the ranks of the host are bound to.

mpirun binds each rank to a core by default (Open MPI binds to a core for up to two ranks), and a new
thread inherits the affinity of the thread that starts it. NVSHMEM's start leaves a proxy thread that
polls without sleeping. Bound to the rank's one core, it takes that core for a scheduler time slice
whenever the rank's thread waits or its own slice ends, and the rank's next Python line waits for the
slice to end: eager calls grow a tail of stalls hundreds of microseconds long. Moved to the processors
no rank of the host is bound to, the proxy polls beside the ranks instead of in their place.
"""

from __future__ import annotations

import os
from typing import Iterable


def thread_ids() -> set[int]:
    """The ids of this process's threads now (Linux; an empty set where ``/proc`` does not list them)."""
    try:
        return {int(name) for name in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def keep_off_rank_cores(threads: Iterable[int], rank_cpus: Iterable[int] = ()) -> int:
    """Let each of ``threads`` run on any processor of the host except ``rank_cpus`` (those the ranks of
    this host are bound to) or, where that leaves none or none are given, except those the calling thread
    is bound to; returns how many moved. None moves when the ranks may run everywhere (nothing to keep
    them off), or where the OS refuses (no ``sched_setaffinity``, a thread gone, a cpuset with no other
    processor)."""
    try:
        own = os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return 0
    host, ranks = set(range(os.cpu_count() or 1)), set(rank_cpus)
    others = (host - ranks if ranks else set()) or host - own
    if not others:
        return 0
    moved = 0
    for thread in threads:
        try:
            os.sched_setaffinity(thread, others)
            moved += 1
        except OSError:
            pass
    return moved


__all__ = ["keep_off_rank_cores", "thread_ids"]
