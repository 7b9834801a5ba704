"""Run DeepEP V2's own ``tests/elastic/test_ep.py``, unchanged, against cuep.torch (``ElasticBuffer``), one GPU
per rank (the test's reference uses NCCL's all-to-all, which cannot put two ranks on one GPU).

The test and the pure-Python helpers it imports (``deep_ep/utils/{comm,envs,math,gate,refs,testing}.py``) are
DeepEP's, not this repository's: fetch them from a DeepEP git repository (a checkout or a bare mirror) at
V2 commit dd758ca into the ignored folder ``.deepep/v2``::

    python tests/gpu/deepep_v2.py fetch /path/to/DeepEP
    python tests/gpu/deepep_v2.py .deepep/v2 test_ep.py --num-processes 4 --skip-perf-test

What the launcher provides around the test, without touching a line of it:

- ``import deep_ep`` gives ``cuep.torch`` (the folder ``deepep_v2_alias/`` beside this file holds a
  ``deep_ep.py`` that installs what follows and replaces itself in ``sys.modules``; ``torch.multiprocessing.
  spawn`` copies ``sys.path`` into every rank, whose first ``import deep_ep`` installs the same there).
- ``deep_ep.utils.<helper>`` are the fetched helpers, loaded as that package's modules.
- ``deep_ep._C``, DeepEP's compiled extension, which two helpers import at their top (``envs``, ``comm``)
  but ``test_ep.py`` never calls into: a module whose every attribute raises, naming what was asked.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import runpy
import subprocess
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
ALIAS_DIR = HERE / "deepep_v2_alias"
MODULE_NAME = "cuep_deepep_v2"           # this file's name in sys.modules, where deepep_v2_alias finds it

DEEPEP_V2_COMMIT = "dd758caf451848bd150e1046af3d0a73e5fff38d"   # DeepEP 2.1.0's tree (tests/elastic)
DEEPEP_V2_HELPERS = ("comm", "envs", "math", "gate", "refs", "testing")   # in import order
DEEPEP_V2_TESTS = ("test_ep.py",)
DEFAULT_DEST = REPO_ROOT / ".deepep" / "v2"
HELPERS_ENV = "CUEP_DEEPEP_V2_HELPERS"   # the folder of the fetched helpers, for the spawned ranks

_installed = False


class _NoExtension(types.ModuleType):
    """``deep_ep._C``: DeepEP's compiled extension has no counterpart in cuep."""

    def __getattr__(self, name: str):
        if name.startswith("__"):  # module protocol lookups (spawn's pickling, inspection): plainly absent
            raise AttributeError(name)
        raise NotImplementedError(f"deep_ep._C.{name}: DeepEP's compiled extension is not part of cuep; the test "
                                  f"helpers reached it (cuep.torch answers the test's own calls)")


def install() -> None:
    """Make ``deep_ep`` cuep.torch with the fetched helpers as ``deep_ep.utils.*``. Once per process."""
    global _installed
    if _installed:
        return
    target = importlib.import_module("cuep.torch")
    sys.modules["deep_ep"] = target
    sys.modules["deep_ep.utils"] = target.utils
    # `import deep_ep._C as _C` looks the name up under the module's own name once deep_ep is cuep.torch.
    sys.modules["deep_ep._C"] = sys.modules[f"{target.__name__}._C"] = _NoExtension("deep_ep._C")
    helpers = Path(os.environ[HELPERS_ENV])
    for name in DEEPEP_V2_HELPERS:
        spec = importlib.util.spec_from_file_location(f"deep_ep.utils.{name}", helpers / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        setattr(target.utils, name, module)
    _installed = True


def fetch(source: str, dest: Path = DEFAULT_DEST) -> None:
    """Write DeepEP V2's test and helpers at :data:`DEEPEP_V2_COMMIT` from the git repository ``source`` into
    ``dest`` (the helpers under ``dest/utils``)."""
    (dest / "utils").mkdir(parents=True, exist_ok=True)
    files = [(f"tests/elastic/{name}", dest / name) for name in DEEPEP_V2_TESTS]
    files += [(f"deep_ep/utils/{name}.py", dest / "utils" / f"{name}.py") for name in DEEPEP_V2_HELPERS]
    for path, target in files:
        text = subprocess.run(["git", "-C", source, "show", f"{DEEPEP_V2_COMMIT}:{path}"], check=True,
                              capture_output=True, text=True).stdout
        target.write_text(text)
    print(f"DeepEP V2's {', '.join(DEEPEP_V2_TESTS)} and helpers at {DEEPEP_V2_COMMIT[:7]} written to {dest}")


def run(tests_dir: str, test_file: str, test_args: list[str]) -> None:
    """Run ``tests_dir/test_file`` as ``__main__`` with ``test_args`` as its arguments."""
    tests = Path(tests_dir).resolve()
    script = tests / test_file
    if not script.is_file():
        raise SystemExit(f"{script} does not exist (fetch DeepEP V2's tests first: see {Path(__file__).name}'s "
                         f"docstring)")
    os.environ[HELPERS_ENV] = str(tests / "utils")
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
                         f"       python {sys.argv[0]} <DeepEP V2 tests dir> <test file> [its arguments...]")


if __name__ == "__main__":
    sys.modules[MODULE_NAME] = sys.modules[__name__]  # the alias module's install() is this one's
    main(sys.argv[1:])
