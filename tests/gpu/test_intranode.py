"""Intranode dispatch/combine on 2 and 4 GPUs against cuep.reference (cases in workers/intranode_worker.py)."""

import pytest

from .launch import run_worker, skip_reason


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_dispatch_combine_match_reference(num_ranks):
    reason = skip_reason(num_ranks)
    if reason:
        pytest.skip(reason)
    output = run_worker("intranode_worker.py", num_ranks)
    assert f"intranode worker passed on {num_ranks} ranks" in output, output
