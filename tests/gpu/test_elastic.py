"""ElasticBuffer (DeepEP V2's API) on 2 and 4 GPUs against cuep.reference (cases in workers/elastic_worker.py)."""

import pytest

from .launch import run_or_skip


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_elastic_layouts_and_combines_match_reference(num_ranks):
    run_or_skip("elastic_worker.py", num_ranks, expect=f"elastic worker passed on {num_ranks} ranks")
