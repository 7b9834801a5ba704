"""One carving of a Buffer's symmetric memory, and the allocation that holds it.

Every rank allocates the same bytes at the same offsets (NVSHMEM symmetric memory), so an offset
into this rank's allocation is also the offset into any peer's::

    [control: the barrier's signals][NVL buffer: num_nvl_bytes][RDMA buffer: num_rdma_bytes]

each part starting on a :data:`REGION_ALIGN` boundary. The NVL buffer serves the intranode
(NVLink) mode. The RDMA buffer serves the low-latency mode in a ``low_latency_mode`` Buffer, the
internode mode's network leg otherwise. The whole allocation starts zeroed: the kernels' flags and
epochs count up from zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import _deps
from .._math import align_up
from . import world

REGION_ALIGN = 4096  # a page: regions never share one, so a region's flags never share a line with another's


@dataclass(frozen=True)
class Regions:
    """Byte offsets and sizes of each part of the allocation (the same on every rank)."""

    control_bytes: int
    nvl_offset: int
    nvl_bytes: int
    rdma_offset: int
    rdma_bytes: int
    total_bytes: int

    @classmethod
    def carve(cls, control_bytes: int, nvl_bytes: int, rdma_bytes: int) -> "Regions":
        nvl_offset = align_up(control_bytes, REGION_ALIGN)
        rdma_offset = align_up(nvl_offset + nvl_bytes, REGION_ALIGN)
        return cls(control_bytes, nvl_offset, nvl_bytes, rdma_offset, rdma_bytes, rdma_offset + rdma_bytes)


class SymmetricMemory:
    """Collective: the :class:`Regions` of one Buffer in one symmetric allocation, zeroed on every rank
    before the constructor returns."""

    def __init__(self, regions: Regions):
        self.regions = regions
        self._memory = world.allocate(regions.total_bytes)
        self.base = int(self._memory.handle)
        cupy, core = _deps.cupy(), _deps.cuda_core()
        cupy.cuda.runtime.memset(self.base, 0, regions.total_bytes)
        cupy.cuda.runtime.deviceSynchronize()
        # Every rank's memory is zeroed before any peer signals into it.
        stream = core.Device().create_stream()
        try:
            _deps.nvshmem().barrier_all(stream)
            stream.sync()
        finally:
            stream.close()

    @property
    def control(self) -> int:
        return self.base

    @property
    def nvl(self) -> int:
        return self.base + self.regions.nvl_offset

    @property
    def rdma(self) -> int:
        return self.base + self.regions.rdma_offset

    def peer_addresses(self, offset: int, num_ranks: int, rank: int, pes: range | None = None) -> list[int]:
        """Byte ``offset`` of the allocation of each rank in ``pes`` (default: all ``num_ranks``) as this GPU
        addresses it directly (over NVLink, or on the same GPU); only for ranks NVSHMEM reaches by load
        and store."""
        nvshmem = _deps.nvshmem()
        return [offset + (self.base if pe == rank else int(nvshmem.get_peer_buffer(self._memory, pe).handle))
                for pe in (range(num_ranks) if pes is None else pes)]

    def reaches_every_rank(self, num_ranks: int, rank: int) -> bool:
        """Whether this GPU addresses every rank's allocation directly (NVSHMEM's P2P transport: NVLink,
        or the same GPU), as the kernels' per-peer lookups (``nvshmem_ptr``) would find it. A kernel told
        so skips those lookups where it only asks whether, not where."""
        _deps.nvshmem()  # first, as cuep imports NVSHMEM (torch hidden); it loads nvshmem.bindings
        address_on = _deps.require("nvshmem.bindings").ptr  # nvshmem_ptr: 0 where a peer is not mapped
        return all(pe == rank or address_on(self.base, pe) != 0 for pe in range(num_ranks))

    def view(self, call: str, region: str, dtype, size, offset: int, owner, device_id: int):
        """A CuPy array over ``region`` (``"nvl"`` or ``"rdma"``) from byte ``offset``: ``size`` (an int or
        a shape; ``None``: every whole element to the region's end) elements of ``dtype`` (a NumPy
        dtype). Raises ``ValueError`` naming ``call`` when it does not fit. ``owner`` keeps the memory
        alive while the view is; ``device_id``: this rank's GPU."""
        cupy = _deps.cupy()
        start, total = (self.rdma, self.regions.rdma_bytes) if region == "rdma" else (self.nvl, self.regions.nvl_bytes)
        available = (total - offset) // dtype.itemsize if offset <= total else 0
        shape = (available,) if size is None else tuple(int(n) for n in np.atleast_1d(size))
        count = int(np.prod(shape))
        if min(shape, default=0) < 0 or count > available:
            needed = offset + count * dtype.itemsize
            raise ValueError(f"{call}: a {shape} {dtype} view from byte {offset} needs {needed} bytes, but the "
                             f"{region.upper()} buffer has {total}")
        if count == 0:
            return cupy.empty(shape, dtype=dtype)
        memory = cupy.cuda.UnownedMemory(start + offset, count * dtype.itemsize, owner, device_id)
        return cupy.ndarray(shape, dtype=dtype, memptr=cupy.cuda.MemoryPointer(memory, 0))

    def free(self) -> None:
        """Collective: give the allocation back. Idempotent."""
        if self._memory is not None:
            world.free(self._memory)
            self._memory = None
