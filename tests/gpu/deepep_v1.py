"""Run DeepEP V1's own tests (``test_intranode.py``, ``test_low_latency.py``), unchanged, against cuep.torch
on one host whose ranks may share GPUs.

The tests are DeepEP's, not this repository's: fetch them from a DeepEP git repository (a checkout or a
bare mirror) at the last V1 layout, commit 567632d (``tests/`` with ``utils.py``, before EPv2), into the
ignored folder ``.deepep/tests``::

    python tests/gpu/deepep_v1.py fetch /path/to/DeepEP            # git -C ... show 567632d:tests/<file>
    python tests/gpu/deepep_v1.py .deepep/tests test_intranode.py --num-processes 4
    python tests/gpu/deepep_v1.py .deepep/tests test_low_latency.py --num-processes 2 --use-logfmt

(``git -C /path/to/DeepEP show 567632dd59810d77b3cc05553df953cc0f779799:tests/utils.py`` and the same for
the two test files does the fetch by hand.) ``tests/gpu/test_deepep_v1.py`` runs these under pytest when
``CUEP_DEEPEP_TESTS`` names that folder.

What the launcher changes around the tests, without touching a line of them:

- ``import deep_ep`` gives ``cuep.torch`` (``CUEP_DEEPEP_MODULE`` names another module, for checks of this
  launcher itself): the folder ``deepep_v1_alias/`` beside this file holds a ``deep_ep.py`` that installs
  what follows and replaces itself in ``sys.modules``. The test's folder comes first on ``sys.path``, the
  alias folder second, and ``torch.multiprocessing.spawn`` copies that path into every rank it starts,
  whose first ``import deep_ep`` (at the top of the test module, before any rank work) installs the same
  patches there.
- ``torch.distributed.init_process_group`` makes a gloo group whatever backend is asked for, and drops
  ``device_id``: NCCL refuses two ranks on one GPU. The tests' own collectives (``all_reduce``,
  ``all_gather``, ``barrier``) then run on gloo, which takes CUDA tensors.
- ``torch.cuda.set_device(i)`` selects GPU ``i`` modulo the number of GPUs (their ``init_dist`` passes the
  local rank), and ``CUEP_SHARE_GPUS=1`` lets cuep put several ranks on one GPU.
- ``torch.distributed.all_gather_into_tensor`` hands gloo its tensors flat: gloo splits the output along
  dim 0 into one chunk per rank and wants each chunk shaped like the input.
- A Buffer made with ``enable_shrink=True`` is made with ``CUEP_TIMEOUT_S`` set to
  ``CUEP_DEEPEP_SHRINK_TIMEOUT_S`` (default 30 s): cuep reads it when the Buffer is made, as the bound after
  which its kernels mask a silent peer. Outside that, ``CUEP_TIMEOUT_S`` bounds host waits; a
  ``--shrink-test`` run sets it to 600 s unless it is set, because the ranks that stop wait in
  ``Buffer.destroy()`` until the others finish the whole test.

DeepEP's shrink test stops ranks 1, 3 and 5 (at their first dispatch, combine and clean) and then checks
that exactly those ranks are masked, so it can pass only with 6 ranks or more: at 2 ranks its check after
the first combine expects rank 3 masked, at 4 ranks its check after the first clean expects rank 5.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import numbers
import os
import runpy
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
ALIAS_DIR = HERE / "deepep_v1_alias"
MODULE_NAME = "cuep_deepep_v1"           # this file's name in sys.modules, where deepep_v1_alias finds it

DEEPEP_V1_COMMIT = "567632dd59810d77b3cc05553df953cc0f779799"   # the last commit with DeepEP's V1 tests/ layout
DEEPEP_V1_FILES = ("utils.py", "test_intranode.py", "test_low_latency.py")
DEFAULT_DEST = REPO_ROOT / ".deepep" / "tests"
SHRINK_KERNEL_TIMEOUT_S = "30"           # default of CUEP_DEEPEP_SHRINK_TIMEOUT_S
SHRINK_HOST_TIMEOUT_S = "600"            # CUEP_TIMEOUT_S of a --shrink-test run unless set

_installed = False


# ------------------------------------------------------------------------------------------------------
# The patches, in the launcher's process and in every rank


def gpu_index(device, num_gpus: int):
    """The GPU that ``torch.cuda.set_device(device)`` selects here: its index modulo ``num_gpus`` (an int,
    ``"cuda:N"`` or a ``torch.device``); ``device`` unchanged when it names no index or there is no GPU."""
    if isinstance(device, numbers.Integral):
        index = int(device)
    else:
        import torch
        index = torch.device(device).index
    if index is None or index < 0 or num_gpus <= 0:
        return device
    return index % num_gpus


def _gloo_whatever_backend(init_process_group):
    @functools.wraps(init_process_group)  # inspect.signature still shows device_id: init_dist passes it
    def gloo_init_process_group(backend=None, *args, **kwargs):
        kwargs.pop("device_id", None)
        return init_process_group("gloo", *args, **kwargs)
    return gloo_init_process_group


def _gpu_modulo_count(set_device):
    @functools.wraps(set_device)
    def set_device_modulo_count(device):
        import torch
        return set_device(gpu_index(device, torch.cuda.device_count()))
    return set_device_modulo_count


def _flat_tensors(all_gather_into_tensor):
    @functools.wraps(all_gather_into_tensor)
    def all_gather_into_flat_tensor(output_tensor, input_tensor, group=None, async_op=False):
        if output_tensor.is_contiguous() and input_tensor.is_contiguous():
            output_tensor, input_tensor = output_tensor.view(-1), input_tensor.view(-1)
        return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
    return all_gather_into_flat_tensor


def _shrink_kernel_timeout(buffer_init):
    signature = inspect.signature(buffer_init)

    @functools.wraps(buffer_init)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        if not bound.arguments.get("enable_shrink"):
            return buffer_init(self, *args, **kwargs)
        saved = os.environ.get("CUEP_TIMEOUT_S")
        os.environ["CUEP_TIMEOUT_S"] = os.environ.get("CUEP_DEEPEP_SHRINK_TIMEOUT_S", SHRINK_KERNEL_TIMEOUT_S)
        try:
            return buffer_init(self, *args, **kwargs)
        finally:
            if saved is None:
                del os.environ["CUEP_TIMEOUT_S"]
            else:
                os.environ["CUEP_TIMEOUT_S"] = saved
    return __init__


def install() -> None:
    """Patch torch as the module docstring says and make ``deep_ep`` the module ``CUEP_DEEPEP_MODULE``
    names (default ``cuep.torch``). Once per process; the alias module calls it in every rank."""
    global _installed
    if _installed:
        return
    import torch
    import torch.distributed as dist
    os.environ["CUEP_SHARE_GPUS"] = "1"
    dist.init_process_group = _gloo_whatever_backend(dist.init_process_group)
    dist.all_gather_into_tensor = _flat_tensors(dist.all_gather_into_tensor)
    torch.cuda.set_device = _gpu_modulo_count(torch.cuda.set_device)
    target = importlib.import_module(os.environ.get("CUEP_DEEPEP_MODULE") or "cuep.torch")
    target.Buffer.__init__ = _shrink_kernel_timeout(target.Buffer.__init__)
    sys.modules["deep_ep"] = target
    _installed = True


# ------------------------------------------------------------------------------------------------------
# Commands


def fetch(source: str, dest: Path = DEFAULT_DEST) -> None:
    """Write DeepEP's V1 ``tests/`` files at :data:`DEEPEP_V1_COMMIT` from the git repository ``source``
    (a checkout or a bare mirror) into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in DEEPEP_V1_FILES:
        text = subprocess.run(["git", "-C", source, "show", f"{DEEPEP_V1_COMMIT}:tests/{name}"], check=True,
                              capture_output=True, text=True).stdout
        (dest / name).write_text(text)
    print(f"DeepEP V1 tests ({', '.join(DEEPEP_V1_FILES)}) at {DEEPEP_V1_COMMIT[:7]} written to {dest}")


def run(tests_dir: str, test_file: str, test_args: list[str]) -> None:
    """Run ``tests_dir/test_file`` as ``__main__`` with ``test_args`` as its arguments, patched."""
    tests = Path(tests_dir).resolve()
    script = tests / test_file
    if not script.is_file():
        raise SystemExit(f"{script} does not exist (fetch DeepEP's tests first: see {Path(__file__).name}'s docstring)")
    if "--shrink-test" in test_args:
        os.environ.setdefault("CUEP_TIMEOUT_S", SHRINK_HOST_TIMEOUT_S)
    # This file's folder holds this repository's own test_intranode.py and test_low_latency.py: DeepEP's
    # test_intranode imports its test_low_latency, which must be DeepEP's.
    sys.path[:] = [str(tests), str(ALIAS_DIR)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]
    if importlib.util.find_spec("cuep") is None:
        sys.path.append(str(REPO_ROOT))
    install()
    sys.argv = [str(script), *test_args]
    runpy.run_path(str(script), run_name="__main__")


def main(argv: list[str]) -> None:
    if argv[:1] == ["fetch"] and len(argv) in (2, 3):
        fetch(argv[1], Path(argv[2]) if len(argv) == 3 else DEFAULT_DEST)
    elif len(argv) >= 2 and argv[0] != "fetch":
        run(argv[0], argv[1], argv[2:])
    else:
        raise SystemExit(f"usage: python {sys.argv[0]} fetch <DeepEP git repository> [dest]\n"
                         f"       python {sys.argv[0]} <DeepEP tests dir> <test file> [its arguments...]")


if __name__ == "__main__":
    sys.modules[MODULE_NAME] = sys.modules[__name__]  # the alias module's install() is this one's
    main(sys.argv[1:])
