"""A Group over a torch.distributed process group, for jobs started by torchrun,
``torch.multiprocessing`` or Ray, with no MPI.

Its collectives go through the job's key-value store (the TCPStore every process group is made
from), not through the process group's backend: they then work the same for gloo CPU groups (as vLLM
passes them) and NCCL groups, touch no GPU, and can poll with a deadline. Each rank writes its value
under a key of the collective's sequence number and polls until every rank's key exists; a rank whose
key never appears is named in the :class:`~cuep.errors.PeerTimeoutError`.

Keys live under a namespace of the group's global ranks, and the sequence numbers are shared by every
TorchGroup of one process over the same ranks (every rank makes its Buffers in the same order, so the
numbers agree). A rank deletes its key of a collective once the next one completes: by then every rank
has read it.
"""

from __future__ import annotations

import hashlib
import pickle
import time
from typing import Any, ClassVar

from .. import _deps
from ..errors import CuepError, PeerTimeoutError
from .group import Group
from .mpi_group import FIRST_POLL_S, MAX_POLL_S


class TorchGroup(Group):
    """The ranks of the torch ``ProcessGroup`` ``process_group`` (of any backend)."""

    # namespace -> (the next collective's sequence number, this process's key of the last one)
    _sequences: ClassVar[dict[str, tuple[int, str | None]]] = {}

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
        sequence, previous_key = self._sequences.get(namespace, (0, None))
        self._sequences[namespace] = (sequence + 1, f"{namespace}/{sequence}/{self.rank}")
        keys = [f"{namespace}/{sequence}/{rank}" for rank in range(self.num_ranks)]
        store.set(keys[self.rank], pickle.dumps(value))
        self._wait(keys, phase, self.timeout(timeout_s))
        values = _get_all(store, keys)
        if previous_key is not None:  # every rank wrote this collective's key, so all have read the last one
            store.delete_key(previous_key)
        return [pickle.loads(v) for v in values]

    def wait_for_all(self, phase: str, timeout_s: float | None = None) -> None:
        self.allgather(None, phase, timeout_s)

    def same_ranks(self, other: Group) -> bool:
        return isinstance(other, TorchGroup) and other.global_ranks == self.global_ranks

    def usable(self) -> bool:
        return _deps.torch_distributed().is_initialized()

    def _wait(self, keys: list[str], phase: str, timeout_s: float) -> None:
        deadline, pause = time.monotonic() + timeout_s, FIRST_POLL_S
        while not self._store.check(keys):
            if time.monotonic() > deadline:
                missing = [rank for rank, key in enumerate(keys) if not self._store.check([key])]
                raise PeerTimeoutError(self.rank, missing[0] if missing else -1, phase, timeout_s)
            time.sleep(pause)
            pause = min(pause * 2, MAX_POLL_S)


def _default_store(call: str, dist):
    """The store of the default process group, whose processes include every group's."""
    get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get_store is None:
        raise CuepError(f"{call}: this torch has no torch.distributed.distributed_c10d._get_default_store(), which "
                        f"cuep bootstraps through; use torch >= 2.1")
    return get_store()


def _get_all(store, keys: list[str]) -> list[bytes]:
    """The values of ``keys``, which all exist: one round trip where the store can."""
    try:
        return list(store.multi_get(keys))
    except (AttributeError, NotImplementedError, RuntimeError):
        return [store.get(key) for key in keys]
