"""Constants every kernel family shares with the host, defined here once.

Each family's ``spec()`` passes :data:`CONSTANTS` (with its own) as ``KernelSpec.constants``, so the
CUDA side reads them as ``CUEP_<NAME>`` macros (``cuda_src/cuep/common.cuh``) and never restates them.
"""

from __future__ import annotations

from . import status

WARP_SIZE = 32
SCALE_BLOCK = 128            # FP8 channels per float32 scale
UE8M0_SCALES_PER_WORD = 4    # power-of-two scales whose exponent bytes pack into one int32
# The normal modes move a batch in rounds of whole units of source tokens, and count what each rank and
# node gets at every unit (the intranode send_prefix, the internode unit_prefix).
ROUND_UNIT_TOKENS = 128

CONSTANTS = {"warp_size": WARP_SIZE, "scale_block": SCALE_BLOCK, "round_unit_tokens": ROUND_UNIT_TOKENS,
             **status.CONSTANTS}
"""What every family's source sees: the warp size, the FP8 scale block, the round unit, the status words
and the phase codes of :mod:`cuep.kernels.status`."""


NETWORK_DEFINE = "network"


def fp8_row_bytes(hidden: int) -> int:
    """Bytes of one FP8 token as the kernels move it: its e4m3 bytes, then a float32 scale per :data:`SCALE_BLOCK`
    channels."""
    return hidden + hidden // SCALE_BLOCK * 4


def network_defines(across_hosts: bool) -> dict[str, int]:
    """The compile-time switch of the network families' build for ranks across hosts (``CUEP_NETWORK``,
    read by ``cuda_src/cuep/network.cuh``'s families), or none for the one-host build."""
    return {NETWORK_DEFINE: 1} if across_hosts else {}


def bulk_ring_shared_bytes(warps: int, stages: int, chunk_bytes: int) -> int:
    """Shared memory of ``warps`` warps' ``cuep::BulkRing``\\ s (``cuda_src/cuep/copy.cuh``) of ``stages`` chunks of
    ``chunk_bytes``: every warp's chunks, then their mbarriers (8 bytes each)."""
    return warps * stages * (chunk_bytes + 8)


def family_constants(own: dict[str, int] | None = None) -> dict[str, int]:
    """:data:`CONSTANTS` with a family's own (``spec()`` of each launch module passes this)."""
    clash = set(CONSTANTS) & set(own or {})
    assert not clash, f"a family constant shadows a shared one: {sorted(clash)}"
    return {**CONSTANTS, **(own or {})}
