"""The examples run under mpirun and check themselves (the README shows them)."""

import pytest

from .launch import REPO_ROOT, run_worker, skip_reason


@pytest.mark.gpu
def test_dispatch_layout_example():
    reason = skip_reason(2)
    if reason:
        pytest.skip(reason)
    output = run_worker(str(REPO_ROOT / "examples" / "dispatch_layout.py"), 2, "--tokens", "1024", "--hidden", "1024")
    assert "layout matches cuep.reference on every rank" in output, output
