"""tests/gpu/deepep_v2.py, the launcher of DeepEP V2's own ``test_ep.py``, on the CPU: a stand-in folder shaped like
the fetched one (the test, and its helpers under ``utils/``, which import ``deep_ep._C`` at their top and each
other relatively, as V2's do) shows that the launcher's process and every rank the test spawns get ``deep_ep`` as
cuep.torch, with ``ElasticBuffer`` and ``EPHandle``, the fetched helpers as ``deep_ep.utils.<name>``, and a
``deep_ep._C`` whose every attribute raises, naming what was asked."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

LAUNCHER = Path(__file__).resolve().parent / "gpu" / "deepep_v2.py"

HELPERS = {
    "comm": "import deep_ep._C as _C\nORIGIN = 'stand-in comm'\n",
    "envs": "import deep_ep._C as _C\nfrom deep_ep.utils import comm\nORIGIN = 'stand-in envs'\n",
    "math": "ORIGIN = 'stand-in math'\n",
    "gate": "ORIGIN = 'stand-in gate'\n",
    "refs": "from .envs import ORIGIN as ENVS\nfrom .math import ORIGIN as MATH\nORIGIN = 'stand-in refs'\n",
    "testing": "from deep_ep.utils import envs, refs\nORIGIN = 'stand-in testing'\n",
}

STAND_IN = '''
import argparse
import sys

import torch

import deep_ep
from deep_ep.utils import testing


def check(where):
    import deep_ep.utils
    assert deep_ep.__name__ == "cuep.torch", deep_ep
    assert hasattr(deep_ep, "ElasticBuffer") and hasattr(deep_ep, "EPHandle")
    assert [getattr(deep_ep.utils, name).ORIGIN for name in ("comm", "envs", "math", "gate", "refs", "testing")] == [
        f"stand-in {name}" for name in ("comm", "envs", "math", "gate", "refs", "testing")]
    assert sys.modules["deep_ep.utils.testing"] is testing and testing.refs.MATH == "stand-in math"
    import deep_ep._C as _C  # as V2's comm and envs import it
    try:
        _C.get_local_rank
    except NotImplementedError as error:
        print(f"{where}: {sys.argv[1:]} {error}", flush=True)
    else:
        raise AssertionError("deep_ep._C answered")


def test_loop(local_rank, num_local_ranks):
    check(f"rank {local_rank}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-processes", type=int)
    args = parser.parse_args()
    check("launcher")
    torch.multiprocessing.spawn(test_loop, args=(args.num_processes,), nprocs=args.num_processes)
'''


def test_the_launcher_and_every_spawned_rank_get_cuep_torch_and_the_fetched_helpers(tmp_path):
    pytest.importorskip("torch", reason="torch is not installed (the launcher runs torch tests)")
    (tmp_path / "utils").mkdir()
    for name, text in HELPERS.items():
        (tmp_path / "utils" / f"{name}.py").write_text(text)
    (tmp_path / "test_stand_in.py").write_text(textwrap.dedent(STAND_IN))
    done = subprocess.run([sys.executable, str(LAUNCHER), str(tmp_path), "test_stand_in.py", "--num-processes", "2"],
                          capture_output=True, text=True, timeout=300, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for where in ("launcher", "rank 0", "rank 1"):
        assert f"{where}: ['--num-processes', '2'] deep_ep._C.get_local_rank: DeepEP's compiled extension" in output, \
            output


def test_a_folder_without_the_test_is_refused_with_how_to_fetch_it(tmp_path):
    done = subprocess.run([sys.executable, str(LAUNCHER), str(tmp_path), "test_ep.py"], capture_output=True,
                          text=True, check=False)
    assert done.returncode != 0 and "fetch DeepEP V2's tests first" in done.stderr, done.stderr


def test_usage_without_arguments():
    done = subprocess.run([sys.executable, str(LAUNCHER)], capture_output=True, text=True, check=False)
    assert done.returncode != 0 and "usage:" in done.stderr, done.stderr
