"""How cuep imports its heavy dependencies."""

import sys
import types

from cuep import _deps


def test_nvshmem_is_imported_without_torch(monkeypatch):
    seen = {}

    def fake_require(module):
        seen["torch"] = sys.modules.get("torch", "absent")  # None: `import torch` raises ImportError
        return types.ModuleType(module)

    monkeypatch.setattr(_deps, "require", fake_require)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    _deps.nvshmem.cache_clear()
    try:
        _deps.nvshmem()
    finally:
        _deps.nvshmem.cache_clear()
    assert seen["torch"] is None and "torch" not in sys.modules


def test_nvshmem_keeps_a_torch_the_program_imported(monkeypatch):
    fake_torch = types.ModuleType("torch")
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    monkeypatch.setattr(_deps, "require", lambda module: types.ModuleType(module))
    _deps.nvshmem.cache_clear()
    try:
        _deps.nvshmem()
    finally:
        _deps.nvshmem.cache_clear()
    assert sys.modules["torch"] is fake_torch
