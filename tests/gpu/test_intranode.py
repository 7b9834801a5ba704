"""Intranode dispatch/combine on 2 and 4 GPUs against cuep.reference (cases in workers/intranode_worker.py)."""

import pytest

from .launch import run_or_skip


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_dispatch_combine_match_reference(num_ranks):
    run_or_skip("intranode_worker.py", num_ranks, expect=f"intranode worker passed on {num_ranks} ranks")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["CUEP_FORCE_FALLBACK", "CUEP_AGGRESSIVE_PTX"])
def test_fallback_and_aggressive_ptx_builds(variant):
    run_or_skip("intranode_worker.py", 2, env={variant: "1"}, expect="intranode worker passed on 2 ranks")
