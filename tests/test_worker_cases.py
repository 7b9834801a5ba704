"""The GPU workers' case selection (``CUEP_TEST_CASES``), which runs on the CPU: an unknown name is an error."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu" / "workers"))  # as a worker imports it
from common import selected_cases  # noqa: E402


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
