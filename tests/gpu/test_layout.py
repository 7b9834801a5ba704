"""get_dispatch_layout on 2 and 4 GPUs against cuep.reference (workers/layout_worker.py has the cases)."""

import pytest

from .launch import run_or_skip


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_layout_matches_reference(num_ranks):
    run_or_skip("layout_worker.py", num_ranks, expect=f"layout worker passed on {num_ranks} ranks")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["CUEP_FORCE_FALLBACK", "CUEP_AGGRESSIVE_PTX"])
def test_ampere_fallback_and_aggressive_ptx_paths(variant):
    run_or_skip("layout_worker.py", 2, env={variant: "1"}, expect="layout worker passed on 2 ranks")
