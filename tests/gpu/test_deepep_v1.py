"""DeepEP V1's own tests, unchanged, against cuep.torch on one host (ranks share its GPUs).

They are not in this repository: ``python tests/gpu/deepep_v1.py fetch <DeepEP git repository>`` writes
``tests/utils.py``, ``test_intranode.py`` and ``test_low_latency.py`` of DeepEP's last V1 layout into
``.deepep/tests``, and ``CUEP_DEEPEP_TESTS`` names that folder here. ``tests/gpu/deepep_v1.py`` runs each
file as DeepEP's README does (``python tests/test_low_latency.py --num-processes 4``), on a gloo group.
A run passes when it exits with 0 and prints no Python traceback.
"""

import os
import re
import socket
from pathlib import Path

import pytest

from .launch import run_python, torch_skip_reason

LAUNCHER = Path(__file__).resolve().parent / "deepep_v1.py"
RUN_TIMEOUT_S = 1800  # DeepEP's tests tune and benchmark after checking: minutes with ranks sharing one GPU
LOW_LATENCY_FLAGS = [(), ("--use-logfmt",), ("--disable-nvlink",)]


def _tests_dir() -> Path:
    reason = torch_skip_reason()
    if reason:
        pytest.skip(reason)
    folder = os.environ.get("CUEP_DEEPEP_TESTS")
    if not folder:
        pytest.skip("CUEP_DEEPEP_TESTS is not set: run `python tests/gpu/deepep_v1.py fetch <DeepEP git repository>`, "
                    "then set CUEP_DEEPEP_TESTS=.deepep/tests")
    missing = [name for name in ("utils.py", "test_intranode.py", "test_low_latency.py")
               if not (Path(folder) / name).is_file()]
    if missing:
        pytest.skip(f"CUEP_DEEPEP_TESTS={folder} lacks {', '.join(missing)} (fetch them with tests/gpu/deepep_v1.py)")
    return Path(folder).resolve()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_deepep(test_file: str, num_processes: int, *flags: str, expect_failure: bool = False) -> str:
    """Run DeepEP's ``test_file`` through the launcher with ``--num-processes`` and ``flags``."""
    tests = _tests_dir()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           # their init_dist reads WORLD_SIZE and RANK as the node count and this node's rank
           "WORLD_SIZE": "1", "RANK": "0"}
    return run_python([str(LAUNCHER), str(tests), test_file, "--num-processes", str(num_processes), *flags], env=env,
                      timeout_s=RUN_TIMEOUT_S, expect_failure=expect_failure)


def assert_clean_pass(output: str) -> None:
    assert "Traceback (most recent call last)" not in output, output


@pytest.mark.gpu
@pytest.mark.parametrize("num_processes", [2, 4])
def test_deepep_intranode(num_processes):
    assert_clean_pass(run_deepep("test_intranode.py", num_processes))


@pytest.mark.gpu
@pytest.mark.parametrize("flags", LOW_LATENCY_FLAGS, ids=lambda f: " ".join(f).lstrip("-") or "default")
@pytest.mark.parametrize("num_processes", [2, 4])
def test_deepep_low_latency(num_processes, flags):
    assert_clean_pass(run_deepep("test_low_latency.py", num_processes, *flags))


@pytest.mark.gpu
def test_deepep_low_latency_shrink_with_the_ranks_it_stops():
    """DeepEP's shrink test stops ranks 1, 3 and 5 and checks that exactly they end masked: 8 ranks, as its
    default ``--num-processes``."""
    assert_clean_pass(run_deepep("test_low_latency.py", 8, "--shrink-test"))


@pytest.mark.gpu
@pytest.mark.parametrize("num_processes,stops_at", [(2, "combine"), (4, "clean")])
def test_deepep_low_latency_shrink_fails_only_at_its_check_of_a_rank_beyond_the_group(num_processes, stops_at):
    """At 2 and 4 ranks DeepEP's shrink test cannot pass, whatever the library: after the first combine it
    expects ranks {1, 3} masked, after the first clean {1, 3, 5}, ranks a 2- (4-) rank group does not have.
    Everything before that check must pass: the run fails with an AssertionError in that very check
    (``query_mask_buffer_and_check("combine" | "clean", ...)``) and nowhere else."""
    output = run_deepep("test_low_latency.py", num_processes, "--shrink-test", expect_failure=True)
    assert f'query_mask_buffer_and_check("{stops_at}", buffer, mask_status, expected_masked_ranks)' in output, output
    assert "assert set(mask_status.nonzero().squeeze(-1).tolist()) == expected_masked_ranks" in output, output
    raised = re.findall(r"^([\w.]*(?:Error|Exception))\b", output, flags=re.MULTILINE)
    assert "AssertionError" in raised, output
    unexpected = [name for name in raised if not name.endswith(("AssertionError", "ProcessRaisedException"))]
    assert not unexpected, output
