"""Internode (hierarchical) dispatch/combine against cuep.reference: the normal-mode worker
(workers/intranode_worker.py) with the ranks split into virtual nodes by ``CUEP_RANKS_PER_NODE``, so
that every layout runs on one host (ranks share its GPUs when there are fewer GPUs than ranks)."""

import pytest

from .launch import run_or_skip

# (nodes, ranks per node)
LAYOUTS = [(2, 2), (4, 1), (3, 2), (2, 4), (4, 2)]

# The cases the fallback and aggressive-PTX builds run: every kernel of the mode, BF16 and FP8.
BUILD_CASES = ("bf16_topk8_masked_odd_tokens,fp8_column_major_scales_hidden_7168,cached_dispatch_new_x,"
               "num_worst_tokens_no_cpu_wait,bytes_across_nodes_are_one_row_per_token_and_node")


def _run(nodes: int, ranks_per_node: int, **env: str) -> None:
    num_ranks = nodes * ranks_per_node
    run_or_skip("intranode_worker.py", num_ranks, env={"CUEP_RANKS_PER_NODE": str(ranks_per_node), **env},
                expect=f"intranode worker passed on {num_ranks} ranks ({nodes} nodes x {ranks_per_node})")


@pytest.mark.gpu
@pytest.mark.parametrize("nodes,ranks_per_node", LAYOUTS, ids=[f"{n}x{r}" for n, r in LAYOUTS])
def test_dispatch_combine_match_reference(nodes, ranks_per_node):
    _run(nodes, ranks_per_node)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["CUEP_FORCE_FALLBACK", "CUEP_AGGRESSIVE_PTX"])
@pytest.mark.parametrize("nodes,ranks_per_node", LAYOUTS, ids=[f"{n}x{r}" for n, r in LAYOUTS])
def test_fallback_and_aggressive_ptx_builds(nodes, ranks_per_node, variant):
    _run(nodes, ranks_per_node, **{variant: "1", "CUEP_TEST_CASES": BUILD_CASES})


@pytest.mark.gpu
@pytest.mark.parametrize("nodes,ranks_per_node", [(2, 2), (4, 1), (4, 2), (2, 4)], ids=["2x2", "4x1", "4x2", "2x4"])
def test_staged_puts_across_virtual_nodes(nodes, ranks_per_node):
    """The path across a network: every row for another node staged, then put through NVSHMEM. Virtual
    nodes on one host take it only with ``CUEP_INTERNODE_PUTS`` (their peers' buffers are written straight).
    More than 2 nodes stage into several send partitions, more than 2 ranks a node land copies in several
    sections (the indices that 2 nodes of 2 reduce to one)."""
    _run(nodes, ranks_per_node, CUEP_INTERNODE_PUTS="1")


@pytest.mark.gpu
@pytest.mark.parametrize("puts", ["1", "0"], ids=["staged_puts", "direct_writes"])
@pytest.mark.parametrize("variant", [None, "CUEP_FORCE_FALLBACK", "CUEP_AGGRESSIVE_PTX"])
def test_network_build_across_virtual_nodes(variant, puts):
    """The build a job across hosts gets (NVSHMEM's transfer code linked, IBGDA included), alone and with
    the fallback or aggressive-PTX path, on one host: with the staged puts that peers on other hosts get, and
    with the direct writes that peers NVSHMEM maps get (several nodes of one host, one NVLink domain)."""
    _run(2, 2, CUEP_NETWORK_BUILD="1", CUEP_INTERNODE_PUTS=puts, CUEP_TEST_CASES=BUILD_CASES,
         **({variant: "1"} if variant else {}))
