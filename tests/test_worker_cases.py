"""The GPU workers' helpers that run on the CPU: case selection (``CUEP_TEST_CASES``; an unknown name is an
error), the environment block and the combined-sum check."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu" / "workers"))  # as a worker imports it
from common import assert_sum_close, environment, selected_cases  # noqa: E402


def first_case():
    pass


def second_case():
    pass


CASES = [("the first", first_case), ("the second", second_case)]


def name_of(named):
    return named[1].__name__


def test_every_case_runs_unless_selected(monkeypatch):
    monkeypatch.delenv("CUEP_TEST_CASES", raising=False)
    assert selected_cases(CASES, name_of) == CASES
    monkeypatch.setenv("CUEP_TEST_CASES", "second_case,first_case")
    assert selected_cases(CASES, name_of) == CASES  # in the workers' order
    monkeypatch.setenv("CUEP_TEST_CASES", "second_case")
    assert selected_cases(CASES, name_of) == CASES[1:]


@pytest.mark.parametrize("selection", ["first_case,third_case", "first", ","])
def test_a_name_that_matches_no_case_is_an_error(monkeypatch, selection):
    monkeypatch.setenv("CUEP_TEST_CASES", selection)
    with pytest.raises(ValueError, match="names no case of this worker.*its cases are first_case, second_case"):
        selected_cases(CASES, name_of)


def test_environment_sets_variables_for_its_block_only(monkeypatch):
    monkeypatch.setenv("CUEP_TIMEOUT_S", "100")
    monkeypatch.delenv("CUEP_TEST_UNSET", raising=False)
    with environment(CUEP_TIMEOUT_S="3", CUEP_TEST_UNSET="1"):
        assert os.environ["CUEP_TIMEOUT_S"] == "3" and os.environ["CUEP_TEST_UNSET"] == "1"
    assert os.environ["CUEP_TIMEOUT_S"] == "100" and "CUEP_TEST_UNSET" not in os.environ


def test_assert_sum_close_fails_on_one_element_off():
    want = np.linspace(-4, 4, 64, dtype=np.float32).reshape(8, 8)
    assert_sum_close(want + 1e-3, want, np.abs(want), across_nodes=False)
    got = want.copy()
    got[3, 5] += 0.5
    with pytest.raises(AssertionError, match="1 of 64 elements off, e.g. at \\[3 5\\]"):
        assert_sum_close(got, want, np.abs(want), across_nodes=False)
    # Across nodes a BF16 rounding of each partial is allowed: 2^-8 of the magnitude.
    assert_sum_close(want + 2.0 ** -9 * 100, want, np.full_like(want, 100), across_nodes=True)
