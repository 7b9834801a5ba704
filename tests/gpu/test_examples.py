"""The examples run under mpirun and check themselves (the README shows them)."""

import importlib.util

import pytest

from .launch import REPO_ROOT, run_or_skip


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_moe_step_example(num_ranks):
    run_or_skip(str(REPO_ROOT / "examples" / "moe_step.py"), num_ranks, "--tokens", "512", "--hidden", "2048",
                "--experts", "64", "--topk", "8", expect=f"matches cuep.reference on {num_ranks} ranks")


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_torch_moe_example(num_ranks):
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (the torch example needs it: pip install torch)")
    run_or_skip(str(REPO_ROOT / "examples" / "torch_moe.py"), num_ranks,
                expect=f"torch MoE forward and backward match plain torch on {num_ranks} ranks")


@pytest.mark.gpu
def test_dispatch_layout_example():
    run_or_skip(str(REPO_ROOT / "examples" / "dispatch_layout.py"), 2, "--tokens", "1024", "--hidden", "1024",
                expect="layout matches cuep.reference on every rank")


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_moe_prefill_example(num_ranks):
    run_or_skip(str(REPO_ROOT / "examples" / "moe_prefill.py"), num_ranks, "--tokens", "1024", "--hidden", "1024",
                expect="max relative error vs one-GPU computation")


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_decode_overlap_example(num_ranks):
    run_or_skip(str(REPO_ROOT / "examples" / "decode_overlap.py"), num_ranks, "--tokens", "96",
                expect="max relative error vs one-GPU computation")
