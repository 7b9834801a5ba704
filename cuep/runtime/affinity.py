"""Keeping the threads NVSHMEM starts off the cores that the ranks of the host are bound to.

mpirun binds each rank to a core by default (Open MPI binds to a core for up to two ranks), and a new
thread inherits the affinity of the thread that starts it. NVSHMEM's start leaves a proxy thread that
polls without sleeping. Bound to the rank's one core, it takes that core for a scheduler time slice
whenever the rank's thread waits or its own slice ends, and the rank's next Python line waits for the
slice to end: eager calls grow a tail of stalls hundreds of microseconds long. Moved to processors no
rank of the host is bound to, the proxy polls beside the ranks instead of in their place. Every function
here leaves things as they are where the OS does not tell or refuses: a placement is never an error.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable


def thread_ids() -> set[int]:
    """The ids of this process's threads now (Linux; an empty set where ``/proc`` does not list them)."""
    try:
        return {int(name) for name in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def own_cpus() -> frozenset[int]:
    """The processors the calling thread may run on (empty where the OS does not say)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset()


def job_cpus() -> frozenset[int]:
    """The processors this job may use: those of the process that started this rank (mpirun, torchrun, a
    Slurm step), which keeps the mask the job was given (``taskset``, a cpuset) where the rank's own binding
    narrowed it; every processor of the host where that cannot be read."""
    try:
        return frozenset(os.sched_getaffinity(os.getppid()))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


def smt_siblings(cpus: Iterable[int]) -> frozenset[int]:
    """The hardware threads that share a core with any of ``cpus`` (``cpus`` included; Linux's sysfs)."""
    found = set(cpus)
    for cpu in list(found):
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as listed:
                found |= _cpu_list(listed.read())
        except (OSError, ValueError):
            pass
    return frozenset(found)


def _cpu_list(text: str) -> set[int]:
    """sysfs's ``0-3,8`` as ``{0, 1, 2, 3, 8}``."""
    cpus = set()
    for part in filter(None, text.strip().split(",")):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def placement(job: frozenset[int], rank_cpus: frozenset[int], own: frozenset[int],
              siblings: Callable[[Iterable[int]], frozenset[int]] = smt_siblings) -> frozenset[int]:
    """Where NVSHMEM's threads should run (empty: leave them where they are).

    Arguments:
        job: the processors the job may use (:func:`job_cpus`).
        rank_cpus: those the ranks of this host are bound to, together (empty when unknown).
        own: those this rank's thread is bound to (:func:`own_cpus`).
        siblings: a set of processors with their SMT siblings (:func:`smt_siblings`).

    Returns:
        the job's processors that no rank is bound to, and no SMT sibling of one where that leaves any;
        else, when this rank is bound to one core, the job's other cores; else nothing. A rank bound to a
        socket, or not bound, shares its processors with the proxy as the scheduler sees fit, and the
        proxy stays near the rank's GPU and NIC.
    """
    if not own:
        return frozenset()
    free = job - rank_cpus if rank_cpus else frozenset()
    if free:
        return (free - siblings(rank_cpus)) or free
    one_core = siblings({min(own)})
    return job - one_core if own <= one_core else frozenset()


def keep_off_rank_cores(threads: Iterable[int], rank_cpus: Iterable[int] = ()) -> int:
    """Move ``threads`` (those NVSHMEM's start left) to :func:`placement`'s processors for this rank;
    returns how many moved. A thread that is gone is skipped; where the OS refuses the processors (a
    cpuset narrower than the job's mask says), none moves."""
    target = placement(job_cpus(), frozenset(rank_cpus), own_cpus())
    if not target:
        return 0
    moved = 0
    for thread in threads:
        try:
            os.sched_setaffinity(thread, target)
            moved += 1
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # the processors, not the thread: the next would fail alike
                break
    return moved


__all__ = ["job_cpus", "keep_off_rank_cores", "own_cpus", "placement", "smt_siblings", "thread_ids"]
