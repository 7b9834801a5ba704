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


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["CUEP_FORCE_FALLBACK", "CUEP_AGGRESSIVE_PTX"])
def test_fallback_and_aggressive_ptx_builds(variant):
    reason = skip_reason(2)
    if reason:
        pytest.skip(reason)
    output = run_worker("intranode_worker.py", 2, env={variant: "1"})
    assert "intranode worker passed on 2 ranks" in output, (variant, output)
