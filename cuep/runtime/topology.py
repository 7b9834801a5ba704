"""Who is where: world rank, node, local rank, the device each rank drives and the processors its host's
ranks are bound to.

Ranks per node come from each rank's host identity, gathered over the group. ``CUEP_RANKS_PER_NODE`` can make nodes
smaller than the physical host (e.g. 2 on a 4-GPU host: 2 nodes x 2 GPUs), so the internode path
runs, and is tested, on one machine. Logical nodes are ranks ``[n * ranks_per_node, (n + 1) *
ranks_per_node)``; the split must agree with the hosts, which the checks below enforce.
"""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass
from pathlib import Path

from .. import env
from . import affinity


@dataclass(frozen=True)
class Topology:
    """Placement of this rank. ``num_nodes > 1`` means the internode (hierarchical) path applies."""

    rank: int
    num_ranks: int
    local_rank: int          # index among the ranks of this physical host: picks the GPU
    num_local_ranks: int     # ranks on this physical host
    ranks_per_node: int      # ranks per logical node (physical unless CUEP_RANKS_PER_NODE)
    host_cpus: frozenset[int] = frozenset()  # processors the ranks of this host may run on (their bindings)

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.ranks_per_node


def plan_topology(rank: int, host_of_rank: list[int], override: int | None) -> Topology:
    """Topology from every rank's host index (pure, so CPU tests cover every refusal)."""
    num_ranks = len(host_of_rank)
    host = host_of_rank[rank]
    host_sizes = {h: host_of_rank.count(h) for h in set(host_of_rank)}
    if len(set(host_sizes.values())) != 1:
        raise ValueError(f"every host must run the same number of ranks, got {sorted(host_sizes.values())}")
    num_local = host_sizes[host]
    for first in range(0, num_ranks, num_local):
        if len(set(host_of_rank[first:first + num_local])) != 1:
            raise ValueError(f"ranks must be placed host by host (ranks {first}..{first + num_local - 1} on one "
                             f"host); launch with mpirun's default by-slot mapping")
    ranks_per_node = num_local
    if override is not None:
        if num_local % override:
            raise ValueError(f"CUEP_RANKS_PER_NODE={override} must divide the {num_local} ranks of each host")
        ranks_per_node = override
    local_rank = host_of_rank[:rank].count(host)
    return Topology(rank=rank, num_ranks=num_ranks, local_rank=local_rank, num_local_ranks=num_local,
                    ranks_per_node=ranks_per_node)


def host_identity() -> str:
    """What tells this host apart from every other: its name and its kernel's boot id."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # not Linux: the name alone
        boot_id = ""
    return f"{socket.gethostname()}/{boot_id}"


def host_cpus(placements: list[tuple[str, frozenset[int]]], rank: int) -> frozenset[int]:
    """The processors of every rank on ``rank``'s host, from each rank's ``(host identity, processors)``."""
    host = placements[rank][0]
    return frozenset().union(*(cpus for identity, cpus in placements if identity == host))


def discover_topology(group) -> Topology:
    """Collective over ``group`` (a :class:`~cuep.runtime.group.Group`): which ranks share a host, and the
    processors they are bound to."""
    placements = group.allgather((host_identity(), affinity.own_cpus()), "topology")
    identities = [identity for identity, _ in placements]
    hosts = list(dict.fromkeys(identities))
    host_of_rank = [hosts.index(identity) for identity in identities]
    topology = plan_topology(group.rank, host_of_rank, env.get("CUEP_RANKS_PER_NODE"))
    return dataclasses.replace(topology, host_cpus=host_cpus(placements, group.rank))
