"""The collective-compile protocol of cuep.jit.library, with two simulated ranks of one node.

The MPI side (bounded Ibarrier + allgather/bcast) runs in the GPU tests; here a stand-in group
returns what the other rank would have sent, so each branch of the protocol is checked on a CPU.
"""

import pytest

from cuep.errors import CompileError
from cuep.jit import library
from cuep.kernels import FAMILIES

SPEC = FAMILIES["layout"].spec("sm_80")
OTHER_SPEC = FAMILIES["layout"].spec("sm_90")


def obtain(spec, group):
    return library._obtain_cubins([spec], group)[0]


class TwoRanks:
    """This process is ``rank``; ``other`` is what rank ``1 - rank`` contributes to each collective."""

    def __init__(self, rank, other=lambda mine: mine, leader_status=None):
        self.rank, self.local_rank, self.num_ranks = rank, rank, 2
        self.other, self.leader_status = other, leader_status

    def allgather(self, value, phase):
        pair = [value, self.other(value)]
        return pair if self.rank == 0 else pair[::-1]

    def node_broadcast(self, value, phase):
        return value if self.local_rank == 0 else self.leader_status


def test_ranks_with_different_toolchains_are_refused(cache_dir):
    def older_nvrtc(value):
        if isinstance(value, dict):
            return {**value, "nvrtc": "12.8"}
        return [(name, "another-key") for name, _ in value]
    with pytest.raises(CompileError, match=r"ranks 0 and 1 would build different .* 'nvrtc' differs"):
        obtain(SPEC, TwoRanks(0, other=older_nvrtc))


def test_leader_compiles_and_follower_loads_its_cubin(cache_dir):
    leader = obtain(SPEC, TwoRanks(0))
    follower = obtain(SPEC, TwoRanks(1, leader_status="ok"))
    assert follower == leader and leader.cubin.startswith(b"\x7fELF") and list(leader.symbols) == list(SPEC.entries)


def test_follower_reports_the_leaders_failure(cache_dir):
    with pytest.raises(CompileError, match="local rank 0 of this node failed to build .*\nCompileError: boom"):
        obtain(SPEC, TwoRanks(1, leader_status="CompileError: boom"))


def test_follower_without_the_leaders_cache_says_where_to_look(cache_dir):
    with pytest.raises(CompileError, match="CUEP_CACHE_DIR must be visible to every rank"):
        obtain(SPEC, TwoRanks(1, leader_status="ok"))


def test_cache_disabled_every_rank_compiles(cache_dir, monkeypatch):
    monkeypatch.setenv("CUEP_JIT_DISABLE_CACHE", "1")
    assert obtain(SPEC, TwoRanks(1, leader_status=None)).cubin.startswith(b"\x7fELF")
    assert not cache_dir.exists()


def test_leader_builds_a_list_and_follower_loads_all_of_it(cache_dir):
    leader = library._obtain_cubins([SPEC, OTHER_SPEC], TwoRanks(0))
    follower = library._obtain_cubins([SPEC, OTHER_SPEC], TwoRanks(1, leader_status="ok"))
    assert follower == leader and leader[0] != leader[1]


def test_a_mismatch_names_the_spec_that_differs(cache_dir):
    def other_key_for_the_second(value):
        if isinstance(value, list):
            return [value[0], (value[1][0], "another-key")]
        return {**value, "cuep": "0.0.1"} if isinstance(value, dict) else value
    with pytest.raises(CompileError, match=rf"build different {OTHER_SPEC.name} kernels: their 'cuep' differs"):
        library._obtain_cubins([SPEC, OTHER_SPEC], TwoRanks(0, other=other_key_for_the_second))


def test_ranks_asking_for_different_kernels_are_refused(cache_dir):
    def without_the_second(value):
        return value[:1]
    with pytest.raises(CompileError, match="ranks 0 and 1 ask for different kernels"):
        library._obtain_cubins([SPEC, OTHER_SPEC], TwoRanks(0, other=without_the_second))
