"""A Group over a torch.distributed process group, for jobs started by torchrun,
``torch.multiprocessing`` or Ray, with no MPI.

Its collectives go through the job's key-value store (the TCPStore every process group is made
from), not through the process group's backend: they then work the same for gloo CPU groups (as vLLM
passes them) and NCCL groups, touch no GPU, and can poll with a deadline. Each rank writes its value
under a key of the collective's sequence number and polls until every rank's key exists; a rank whose
key never appears is named in the :class:`~cuep.errors.PeerTimeoutError`. Each value travels with its
collective's phase, so ranks that went out of step raise instead of reading each other's values.

Keys live under a namespace of the group's global ranks, and the sequence numbers are shared by every
TorchGroup of one process over the same ranks (every rank makes its Buffers in the same order, so the
numbers agree). A rank deletes its keys of earlier collectives once a later one completes: by then every
rank has read them.

A host barrier (:meth:`TorchGroup.wait_for_all`) is often a job's last collective, after which rank 0 may
tear its process group down, and with ``init_process_group(init_method=...)`` global rank 0's process hosts
the store. So in a group that holds global rank 0, every rank writes after the barrier that it has left it,
and rank 0 returns only once all have: no peer is still reading the store when its host may go. (Under
torchrun the store lives in the launcher's agent, and the round only costs a round trip.)
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any, ClassVar

from .. import _deps
from ..errors import CuepError
from .group import Group, poll_until


_STORE_HOST = 0  # the global rank whose process hosts the job's store under init_process_group(init_method=...)


class TorchGroup(Group):
    """The ranks of the torch ``ProcessGroup`` ``process_group`` (of any backend)."""

    # namespace -> (the next collective's sequence number, this process's keys not deleted yet)
    _sequences: ClassVar[dict[str, tuple[int, list[str]]]] = {}

    def __init__(self, call: str, process_group):
        dist = _deps.torch_distributed()
        if not dist.is_initialized():
            raise CuepError(f"{call}: torch.distributed is not initialised; call "
                            f"torch.distributed.init_process_group() before creating a Buffer")
        self.process_group = process_group
        self.global_ranks = tuple(dist.get_process_group_ranks(process_group))
        self.rank, self.num_ranks = dist.get_rank(process_group), len(self.global_ranks)
        if self.rank < 0:
            raise ValueError(f"{call}: this process (global rank {dist.get_rank()}) is not in the group")
        self._store = _default_store(call, dist)
        digest = hashlib.sha1(repr(self.global_ranks).encode()).hexdigest()[:16]
        self._namespace = f"cuep/group/{digest}"

    def allgather(self, value: Any, phase: str, timeout_s: float | None = None) -> list[Any]:
        store, namespace = self._store, self._namespace
        sequence, undeleted = self._sequences.get(namespace, (0, []))
        keys = [f"{namespace}/{sequence}/{rank}" for rank in range(self.num_ranks)]
        self._sequences[namespace] = (sequence + 1, [*undeleted, keys[self.rank]])
        store.set(keys[self.rank], pickle.dumps((phase, value)))
        self._wait(keys, phase, self.timeout(timeout_s))
        phases_and_values = [pickle.loads(v) for v in _get_all(store, keys)]
        for key in undeleted:  # every rank wrote this collective's key, so all have read the earlier ones
            store.delete_key(key)
        self._sequences[namespace] = (sequence + 1, [keys[self.rank]])
        strays = [rank for rank, (theirs, _) in enumerate(phases_and_values) if theirs != phase]
        if strays:
            raise CuepError(f"rank {self.rank} reached '{phase}' while rank {strays[0]} reached "
                            f"'{phases_and_values[strays[0]][0]}': every rank must make the same cuep calls in "
                            f"the same order")
        return [value for _, value in phases_and_values]

    def wait_for_all(self, phase: str, timeout_s: float | None = None) -> None:
        self.allgather(None, phase, timeout_s)
        if _STORE_HOST not in self.global_ranks:
            return
        # The barrier's number (allgather advanced the sequence), for this barrier's departure keys.
        sequence = self._sequences[self._namespace][0] - 1
        keys = [f"{self._namespace}/left/{sequence}/{rank}" for rank in range(self.num_ranks)]
        self._store.set(keys[self.rank], b"")
        if self.global_ranks[self.rank] == _STORE_HOST:  # leaves last
            try:
                self._wait(keys, f"{phase} (the others leaving it)", self.timeout(timeout_s))
            finally:
                for key in keys:
                    self._store.delete_key(key)

    def same_ranks(self, other: Group) -> bool:
        return isinstance(other, TorchGroup) and other.global_ranks == self.global_ranks

    def usable(self) -> bool:
        return _deps.torch_distributed().is_initialized()

    def _wait(self, keys: list[str], phase: str, timeout_s: float) -> None:
        def missing_rank() -> int:
            return next((rank for rank, key in enumerate(keys) if not self._store.check([key])), -1)
        poll_until(lambda: self._store.check(keys), self.rank, phase, timeout_s, missing_rank)


def _default_store(call: str, dist):
    """The store of the default process group, whose processes include every group's."""
    get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get_store is None:
        raise CuepError(f"{call}: this torch has no torch.distributed.distributed_c10d._get_default_store(), which "
                        f"cuep bootstraps through; use torch >= 2.4")
    return get_store()


def _get_all(store, keys: list[str]) -> list[bytes]:
    """The values of ``keys``, which all exist: one round trip where the store can."""
    try:
        return list(store.multi_get(keys))
    except (AttributeError, NotImplementedError, RuntimeError):
        return [store.get(key) for key in keys]
