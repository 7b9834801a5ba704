"""The status words a family's kernels fill when something fails on the device, and their host mirror.

Kernels write each word twice: to a device array and to pinned host memory, so the host reads what
failed without a copy or a wait. A call raises what an earlier kernel recorded, once.
"""

from __future__ import annotations

import numpy as np

from . import _deps, env
from .errors import CuepError
from .kernels import status as codes

_CLEAR = bytes(codes.STATUS_WORDS * 4)  # the host mirror's bytes while nothing failed


class StatusWords:
    """``device``: ``[STATUS_WORDS]`` int32 on the GPU; ``host``: its pinned mirror; ``host_ptr``: the
    mirror's device address, which kernels write through."""

    def __init__(self):
        cupy, driver = _deps.cupy(), _deps.cuda_driver()
        self.device = cupy.zeros(codes.STATUS_WORDS, dtype=cupy.int32)
        pinned = cupy.cuda.alloc_pinned_memory(codes.STATUS_WORDS * 4)
        self.host = np.frombuffer(pinned, np.int32, codes.STATUS_WORDS)
        self.host[:] = 0
        self._host_bytes = memoryview(self.host).cast("B")
        err, address = driver.cuMemHostGetDevicePointer(self.host.ctypes.data, 0)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise CuepError(f"cuep: pinned host memory is not visible to the GPU ({err})")
        self.host_ptr = int(address)

    def clear(self, word: int) -> None:
        """Forget what status word ``word`` recorded (both copies; the device's in stream order)."""
        self.device[word] = 0
        self.host[word] = 0

    def raise_recorded(self, rank: int, timeout_s: float | None = None) -> None:
        """Clear both copies and raise what they recorded (``timeout_s``: the bound the waits ran with,
        for the message; default ``CUEP_TIMEOUT_S``). A record whose flag word has not landed yet (a
        kernel writes its details first) is left for a later call."""
        # Every call checks, so with the cheapest test found: a copy of the mirror's few bytes, compared.
        if self._host_bytes.tobytes() != _CLEAR and codes.holds_a_record(self.host):
            recorded = self.host.copy()
            self.device.fill(0)
            self.host[:] = 0
            codes.raise_if_failed(recorded, rank, env.get("CUEP_TIMEOUT_S") if timeout_s is None else timeout_s)
