"""Low-latency shrink mode on 2, 4 and 8 ranks: the last rank stops calling, the others mask it and go on
without it, then every rank cleans the masks (cases in workers/shrink_worker.py)."""

import pytest

from .launch import run_or_skip


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_shrink_masks_a_rank_that_stops(num_ranks):
    run_or_skip("shrink_worker.py", num_ranks, expect=f"shrink worker passed on {num_ranks} ranks")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["CUEP_FORCE_FALLBACK", "CUEP_AGGRESSIVE_PTX"])
def test_shrink_fallback_and_aggressive_ptx_builds(variant):
    run_or_skip("shrink_worker.py", 2, env={variant: "1"}, expect="shrink worker passed on 2 ranks")
