"""Constants every kernel family shares with the host, defined here once.

Each family's ``spec()`` passes :data:`CONSTANTS` (with its own) as ``KernelSpec.constants``, so the
CUDA side reads them as ``CUEP_<NAME>`` macros (``cuda_src/cuep/common.cuh``) and never restates them.
"""

from __future__ import annotations

WARP_SIZE = 32
SCALE_BLOCK = 128  # FP8 channels per float32 scale

CONSTANTS = {"warp_size": WARP_SIZE, "scale_block": SCALE_BLOCK}
