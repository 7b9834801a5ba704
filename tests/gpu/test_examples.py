"""The examples check themselves (the README shows them): the CuPy ones run under mpirun, the torch ones under
torchrun."""

import pytest

from .launch import REPO_ROOT, run_or_skip, run_python, torch_skip_reason


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_moe_step_example(num_ranks):
    run_or_skip(str(REPO_ROOT / "examples" / "moe_step.py"), num_ranks, "--tokens", "512", "--hidden", "2048",
                "--experts", "64", "--topk", "8", expect=f"matches cuep.reference on {num_ranks} ranks")


def run_torchrun(script: str, num_ranks: int, *args: str, expect: str) -> None:
    """Run ``examples/<script>`` under torchrun on ``num_ranks`` ranks (one node, no mpirun: the example joins
    torchrun's process group, gloo with ranks sharing GPUs where there are fewer GPUs than ranks) and check its
    output contains ``expect``; skip with the reason where torch, CuPy, nvshmem4py or a GPU is missing."""
    reason = torch_skip_reason()
    if reason:
        pytest.skip(reason)
    output = run_python(["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={num_ranks}",
                         str(REPO_ROOT / "examples" / script), *args])
    assert expect in output, output


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_torch_moe_example(num_ranks):
    run_torchrun("torch_moe.py", num_ranks,
                 expect=f"torch MoE forward and backward match plain torch on {num_ranks} ranks")


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_torch_decode_example(num_ranks):
    run_torchrun("torch_decode.py", num_ranks,
                 expect=f"torch decode step (hooks, CUDA graph) matches plain torch on {num_ranks} ranks")


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
