"""DeepEP V1's ``deep_ep.utils`` path: :class:`EventHandle`, :class:`EventOverlap` and
:func:`check_nvlink_connections` (Megatron-LM and torchtitan import the events from here).

Its imports are absolute, so that this module is right also when loaded as ``deep_ep.utils`` (see
:mod:`cuep.torch.buffer`).
"""

from __future__ import annotations

from cuep import _deps
from cuep.torch.event import EventHandle, EventOverlap


def check_nvlink_connections(group) -> None:
    """Check that this rank's GPU can reach, peer to peer, the GPU of every rank of ``group`` on its host.

    cuep's intranode kernels store into the peers' buffers, over NVLink or PCIe peer access: that, not
    NVLink itself, is what they need (DeepEP limits PCIe GPUs to pairs). Collective over ``group``. A GPU
    this process cannot see (each rank given only its own with ``CUDA_VISIBLE_DEVICES``) cannot be asked
    here, and is not checked.

    Arguments:
        group: the ``torch.distributed`` process group of the Buffer.

    Raises:
        RuntimeError: naming both GPUs, when one cannot access the other's memory.
    """
    import socket

    from cuep.runtime.world import gpu_identity
    torch, runtime = _deps.torch(), _deps.cupy().cuda.runtime
    device = torch.cuda.current_device()
    host = socket.gethostname()
    everyone = [None] * group.size()
    torch.distributed.all_gather_object(everyone, (host, gpu_identity(device)), group=group)
    visible = {gpu_identity(i): i for i in range(runtime.getDeviceCount())}
    for rank, (their_host, identity) in enumerate(everyone):
        peer = visible.get(identity)
        if their_host != host or peer is None or peer == device:
            continue
        if not runtime.deviceCanAccessPeer(device, peer):
            raise RuntimeError(f"check_nvlink_connections(): GPU {runtime.deviceGetPCIBusId(device)} cannot access the "
                               f"memory of GPU {runtime.deviceGetPCIBusId(peer)} (rank {rank}) peer to peer; cuep's "
                               f"intranode kernels need peer access between the GPUs of one host")


__all__ = ["EventHandle", "EventOverlap", "check_nvlink_connections"]
