"""From an mpi4py communicator to a ready NVSHMEM world (see world.py), with topology and bounded collectives."""

from .group import MpiGroup, wait_for_all
from .topology import Topology, discover_topology, plan_topology

__all__ = ["MpiGroup", "Topology", "discover_topology", "plan_topology", "wait_for_all"]
