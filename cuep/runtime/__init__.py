"""From a group of ranks (mpi4py or torch.distributed) to a ready NVSHMEM world (see world.py), with
topology and bounded collectives."""

from .group import Group, NodeGroup, as_group
from .mpi_group import MpiGroup
from .topology import Topology, discover_topology, plan_topology

__all__ = ["Group", "MpiGroup", "NodeGroup", "Topology", "as_group", "discover_topology", "plan_topology"]
