"""ElasticBuffer (DeepEP V2's API) against cuep.reference (cases in workers/elastic_worker.py): on one node of 2
and 4 ranks, and across virtual nodes (``CUEP_RANKS_PER_NODE``) in V2's hybrid order."""

import pytest

from .launch import run_or_skip


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_elastic_layouts_and_combines_match_reference(num_ranks):
    run_or_skip("elastic_worker.py", num_ranks, expect=f"elastic worker passed on {num_ranks} ranks (one node)")


# (nodes, ranks per node)
LAYOUTS = [(2, 2), (2, 1), (3, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("nodes,ranks_per_node", LAYOUTS, ids=[f"{n}x{r}" for n, r in LAYOUTS])
def test_elastic_across_nodes_matches_reference(nodes, ranks_per_node):
    num_ranks = nodes * ranks_per_node
    run_or_skip("elastic_worker.py", num_ranks, env={"CUEP_RANKS_PER_NODE": str(ranks_per_node)},
                expect=f"elastic worker passed on {num_ranks} ranks ({nodes} nodes)")
