"""Topology planning and heap sizing (pure functions; the collective parts run in the GPU tests)."""

import pytest

from cuep.runtime import plan_topology
from cuep.runtime import world


def test_one_host_four_ranks():
    topology = plan_topology(2, [0, 0, 0, 0], None)
    assert (topology.local_rank, topology.ranks_per_node, topology.node, topology.num_nodes) == (2, 4, 0, 1)


def test_override_makes_two_nodes_of_two():
    topology = plan_topology(3, [0, 0, 0, 0], 2)
    assert (topology.local_rank, topology.num_local_ranks, topology.node, topology.num_nodes) == (3, 4, 1, 2)


def test_two_hosts():
    topology = plan_topology(5, [0, 0, 0, 0, 1, 1, 1, 1], None)
    assert (topology.local_rank, topology.node, topology.num_nodes) == (1, 1, 2)


@pytest.mark.parametrize("hosts, override, message", [
    ([0, 0, 0, 1], None, "same number of ranks"),
    ([0, 1, 0, 1], None, "placed host by host"),
    ([0, 0, 0, 0], 3, "CUEP_RANKS_PER_NODE=3 must divide the 4 ranks"),
])
def test_refusals(hosts, override, message):
    with pytest.raises(ValueError, match=message):
        plan_topology(0, hosts, override)


@pytest.mark.parametrize("text, size", [("1G", 1 << 30), ("512M", 512 << 20), ("4096", 4096), ("2gb", 2 << 30),
                                        ("lots", None)])
def test_heap_size_parsing(text, size):
    assert world.parse_heap_size(text) == size


def test_heap_is_sized_from_the_request(monkeypatch):
    assert world.heap_size_for(0) == world.HEAP_RESERVE_BYTES
    assert world.heap_size_for(1) % (2 << 20) == 0 and world.heap_size_for(1) > world.HEAP_RESERVE_BYTES
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "64M")
    with pytest.raises(ValueError, match="NVSHMEM_SYMMETRIC_SIZE=64M is smaller than"):
        world._size_heap(1 << 30)


def test_nvshmem_defaults_keep_the_users_values():
    environ = {"NVSHMEM_MAX_TEAMS": "40", "NVSHMEM_IBGDA_NUM_RC_PER_PE": "4"}
    world.apply_nvshmem_defaults(environ, num_qps_per_rank=12)
    assert environ == {"NVSHMEM_MAX_TEAMS": "40", "NVSHMEM_DISABLE_NCCL": "1", "NVSHMEM_IBGDA_NUM_RC_PER_PE": "4",
                       "NVSHMEM_DISABLE_LOCAL_ONLY_PROXY": "1"}
    environ = {"NVSHMEM_DISABLE_LOCAL_ONLY_PROXY": "0"}  # a user who wants NVSHMEM's device-side global exit
    world.apply_nvshmem_defaults(environ, num_qps_per_rank=12)
    assert environ == {"NVSHMEM_MAX_TEAMS": "1", "NVSHMEM_DISABLE_NCCL": "1", "NVSHMEM_IBGDA_NUM_RC_PER_PE": "12",
                       "NVSHMEM_DISABLE_LOCAL_ONLY_PROXY": "0"}
    environ = {}
    world.apply_nvshmem_defaults(environ, one_host=True)  # one host: the heap in 2-MiB pieces
    assert environ["NVSHMEM_CUMEM_GRANULARITY"] == "2097152"
    environ = {"NVSHMEM_CUMEM_GRANULARITY": "536870912"}
    world.apply_nvshmem_defaults(environ, one_host=True)
    assert environ["NVSHMEM_CUMEM_GRANULARITY"] == "536870912"
    environ = {}
    world.apply_nvshmem_defaults(environ)  # DeepEP's default
    assert environ["NVSHMEM_IBGDA_NUM_RC_PER_PE"] == "24"


def test_gpus_command_prints_a_rank_count(capsys, monkeypatch):
    from cuep import cli
    from cuep.runtime import world
    monkeypatch.setattr(world, "visible_gpu_count", lambda: 1)
    assert cli.main(["gpus", "--at-least", "2"]) == 0 and capsys.readouterr().out.strip() == "2"
    monkeypatch.setattr(world, "visible_gpu_count", lambda: 4)
    assert cli.main(["gpus", "--at-least", "2"]) == 0 and capsys.readouterr().out.strip() == "4"


def test_every_rank_is_reached_directly_only_where_nvshmem_maps_each_peer(monkeypatch):
    """SymmetricMemory.reaches_every_rank asks NVSHMEM (nvshmem_ptr) for every peer but this rank, and says no
    as soon as one peer is not mapped: the low-latency kernels then look each peer up as before."""
    import types

    from cuep import _deps
    from cuep.runtime.regions import SymmetricMemory

    mapped = {0: 0x1000, 1: 0x2000, 2: 0, 3: 0x4000}  # what nvshmem_ptr gives for each pe; rank 2 unmapped
    asked = []

    def ptr(address, pe):
        asked.append((address, pe))
        return mapped[pe]

    monkeypatch.setattr(_deps, "nvshmem", lambda: None)
    bindings = types.SimpleNamespace(ptr=ptr)
    monkeypatch.setattr(_deps, "require", lambda module: {"nvshmem.bindings": bindings}[module])
    memory = object.__new__(SymmetricMemory)  # no allocation: only its base address is read
    memory.base = 0x7000
    assert memory.reaches_every_rank(4, rank=2)  # rank 2 itself is never asked for
    assert asked == [(0x7000, 0), (0x7000, 1), (0x7000, 3)]
    assert not memory.reaches_every_rank(4, rank=0)
    assert memory.reaches_every_rank(1, rank=0)
