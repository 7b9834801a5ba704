"""torch and JAX arrays in and out, the DeepEP API frameworks use, bad input, and exit after an exception."""

import pytest

from .launch import run_or_skip


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_torch_and_jax_arrays_match_cupy_bit_for_bit(num_ranks):
    output = run_or_skip("interop_worker.py", num_ranks, expect=f"interop worker passed on {num_ranks} ranks")
    if "not installed: []" not in output:
        pytest.skip(output[output.index("frameworks tested"):].splitlines()[0])


@pytest.mark.gpu
def test_exit_after_an_exception_is_clean():
    output = run_or_skip("exit_worker.py", 2, expect="user code failed on rank", expect_failure=True)
    assert "NVSHMEM ERROR" not in output and "not freed" not in output, output
