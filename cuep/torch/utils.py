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
    here; NVSHMEM checks it when the Buffer starts.

    Arguments:
        group: the ``torch.distributed`` process group of the Buffer.

    Raises:
        RuntimeError: naming both GPUs, when one cannot access the other's memory.
    """
    import socket
    torch = _deps.torch()
    device = torch.cuda.current_device()
    mine = (socket.gethostname(), torch.cuda.get_device_properties(device).pci_bus_id)
    everyone = [None] * group.size()
    torch.distributed.all_gather_object(everyone, mine, group=group)
    visible = {torch.cuda.get_device_properties(i).pci_bus_id: i for i in range(torch.cuda.device_count())}
    for rank, (host, bus_id) in enumerate(everyone):
        peer = visible.get(bus_id)
        if host != mine[0] or peer is None or peer == device:
            continue
        if not torch.cuda.can_device_access_peer(device, peer):
            raise RuntimeError(f"check_nvlink_connections(): GPU {mine[1]} cannot access the memory of GPU {bus_id} "
                               f"(rank {rank}) peer to peer; cuep's intranode kernels need peer access between "
                               f"the GPUs of one host")


__all__ = ["EventHandle", "EventOverlap", "check_nvlink_connections"]
