"""get_dispatch_layout on 2 and 4 GPUs against cuep.reference (workers/layout_worker.py has the cases)."""

import pytest

from .launch import run_worker, skip_reason


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_layout_matches_reference(num_ranks):
    reason = skip_reason(num_ranks)
    if reason:
        pytest.skip(reason)
    output = run_worker("layout_worker.py", num_ranks)
    assert f"layout worker passed on {num_ranks} ranks" in output, output


@pytest.mark.gpu
def test_ampere_fallback_and_aggressive_ptx_paths():
    reason = skip_reason(2)
    if reason:
        pytest.skip(reason)
    for variant in ({"CUEP_FORCE_FALLBACK": "1"}, {"CUEP_AGGRESSIVE_PTX": "1"}):
        output = run_worker("layout_worker.py", 2, env=variant)
        assert "layout worker passed on 2 ranks" in output, (variant, output)
