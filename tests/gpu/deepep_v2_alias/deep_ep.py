"""What ``import deep_ep`` finds while tests/gpu/deepep_v2.py runs DeepEP V2's tests, in the launcher's process
and in every rank the test spawns: it installs the launcher's modules in this process, which replace this
module in ``sys.modules`` with ``cuep.torch``, so the import binds ``cuep.torch``. Not a module to import
anywhere else."""

import importlib.util
import sys
from pathlib import Path

_NAME = "cuep_deepep_v2"


def _launcher():
    """The launcher module, loaded from its file (its folder is kept off ``sys.path``) unless it is here."""
    module = sys.modules.get(_NAME)
    if module is None:
        spec = importlib.util.spec_from_file_location(_NAME, Path(__file__).resolve().parents[1] / "deepep_v2.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[_NAME] = module
        spec.loader.exec_module(module)
    return module


_launcher().install()
