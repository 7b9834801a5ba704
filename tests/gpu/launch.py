"""Run a worker script under ``mpirun -np N`` from pytest, or say why it cannot run here.

The launcher is ``$CUEP_TEST_MPIRUN`` when set (e.g. an ``mpirun`` with site flags), otherwise
``mpirun`` or ``mpiexec`` from PATH. GPUs are counted through the driver API, which creates no context.
Every worker runs on whatever GPUs the machine has, one is enough: with fewer GPUs than ranks the
ranks share them (``CUEP_SHARE_GPUS=1``), which tests protocols and results, not speed.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from cuep.runtime.world import visible_gpu_count as gpu_count

WORKERS = Path(__file__).resolve().parent / "workers"
REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER_TIMEOUT_S = 600


def mpirun() -> list[str] | None:
    configured = os.environ.get("CUEP_TEST_MPIRUN")
    if configured:
        return shlex.split(configured)
    found = shutil.which("mpirun") or shutil.which("mpiexec")
    return [found] if found else None


def skip_reason() -> str | None:
    """Why GPU tests cannot run here, or ``None`` when they can (on any number of ranks)."""
    for module, package in (("cupy", "cupy-cuda13x"), ("nvshmem.core", "nvshmem4py-cu13"),
                            ("mpi4py", "mpi4py")):
        if importlib.util.find_spec(module.split(".")[0]) is None:
            return f"{package} is not installed"
    if gpu_count() == 0:
        return "no CUDA GPU (or no driver) on this machine"
    if mpirun() is None:
        return "no mpirun or mpiexec on PATH (set CUEP_TEST_MPIRUN)"
    return None


def run_worker(script: str, num_ranks: int, *args: str, env: dict[str, str] | None = None,
               expect_failure: bool = False) -> str:
    """Run ``workers/<script>`` (or a script by absolute path) on ``num_ranks`` ranks; return its output,
    or fail the test with it (when it exits with 0 and ``expect_failure`` is set too)."""
    command = [*mpirun(), "-np", str(num_ranks), sys.executable, str(WORKERS / script), *args]
    environment = {**os.environ, **(env or {})}
    if gpu_count() < num_ranks:
        environment["CUEP_SHARE_GPUS"] = "1"
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), environment.get("PYTHONPATH")]))
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S, env=environment,
                              check=False)  # the exit status is checked below, with the output
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{shlex.join(command)} did not finish in {WORKER_TIMEOUT_S} s:\n"
                             f"{exc.stdout or ''}{exc.stderr or ''}") from None
    output = done.stdout + done.stderr
    assert (done.returncode != 0) == expect_failure, f"{shlex.join(command)} exited with {done.returncode}:\n{output}"
    return output


def run_or_skip(script: str, num_ranks: int, *args: str, env: dict[str, str] | None = None,
                expect: str | None = None, expect_failure: bool = False) -> str:
    """Skip the calling test with the reason when GPU tests cannot run here; otherwise run the
    worker and check its output contains ``expect`` (default: "passed on N ranks")."""
    import pytest
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    output = run_worker(script, num_ranks, *args, env=env, expect_failure=expect_failure)
    expect = f"passed on {num_ranks} ranks" if expect is None else expect
    assert expect in output, output
    return output


# ------------------------------------------------------------------------------------------------------
# Scripts that start their own ranks (torch.multiprocessing and a gloo group: no mpirun)


def torch_skip_reason() -> str | None:
    """Why GPU tests that start their ranks with torch cannot run here, or ``None`` when they can."""
    for module, package in (("torch", "torch"), ("cupy", "cupy-cuda13x"), ("nvshmem", "nvshmem4py-cu13")):
        if importlib.util.find_spec(module) is None:
            return f"{package} is not installed"
    if gpu_count() == 0:
        return "no CUDA GPU (or no driver) on this machine"
    import torch
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    return None


def run_python(args: list[str], *, env: dict[str, str] | None = None, timeout_s: int = WORKER_TIMEOUT_S,
               expect_failure: bool = False) -> str:
    """Run ``python args...`` from the repository root, with the repository on ``PYTHONPATH``; return its
    output, or fail the test with it (also when it exits with 0 and ``expect_failure`` is set)."""
    command = [sys.executable, *args]
    environment = {**os.environ, **(env or {})}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), environment.get("PYTHONPATH")]))
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=environment,
                              cwd=REPO_ROOT, check=False)  # the exit status is checked below, with the output
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{shlex.join(command)} did not finish in {timeout_s} s:\n"
                             f"{exc.stdout or ''}{exc.stderr or ''}") from None
    output = done.stdout + done.stderr
    assert (done.returncode != 0) == expect_failure, f"{shlex.join(command)} exited with {done.returncode}:\n{output}"
    return output
