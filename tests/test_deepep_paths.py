"""DeepEP V1's module paths through cuep.torch (no GPU needed): with ``cuep.torch`` as a process's
``deep_ep``, every public name DeepEP V1's package gives resolves by the same path, to the same objects, and
Megatron-LM's own DeepEP code (``megatron-core``'s ``fused_a2a``) finds DeepEP there.

The names below are written out by hand from DeepEP V1 (commit 567632d): ``deep_ep/__init__.py``,
``deep_ep/utils.py`` and ``deep_ep/buffer.py``, without their imports of torch, os and typing.
"""

import importlib
import sys

import pytest

torch = pytest.importorskip("torch", reason="cuep.torch needs torch (pip install torch)")

DEEPEP_V1_NAMES = {
    "deep_ep": ["Buffer", "Config", "EventOverlap", "topk_idx_t"],
    "deep_ep.utils": ["EventHandle", "EventOverlap", "check_nvlink_connections"],
    "deep_ep.buffer": ["Buffer", "Config", "EventHandle", "EventOverlap", "check_nvlink_connections"],
}


@pytest.fixture
def deep_ep_is_cuep_torch(monkeypatch):
    """``sys.modules["deep_ep"] = cuep.torch``, as the README says; every ``deep_ep*`` module loaded since is
    forgotten after the test."""
    import cuep.torch
    before = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "deep_ep"}
    monkeypatch.setitem(sys.modules, "deep_ep", cuep.torch)
    yield cuep.torch
    for name in [name for name in sys.modules if name.split(".")[0] == "deep_ep"]:
        del sys.modules[name]
    sys.modules.update(before)


@pytest.mark.parametrize("path", sorted(DEEPEP_V1_NAMES))
def test_every_public_name_of_deepep_v1_resolves_by_its_path(deep_ep_is_cuep_torch, path):
    module = importlib.import_module(path)
    for name in DEEPEP_V1_NAMES[path]:
        assert hasattr(module, name), f"{path}.{name}"
        top = getattr(deep_ep_is_cuep_torch, name, None)
        if top is not None:  # the same object under every path, not a second copy of a class
            assert getattr(module, name) is top, f"{path}.{name}"
    assert deep_ep_is_cuep_torch.topk_idx_t is torch.int64


def test_imports_as_frameworks_write_them(deep_ep_is_cuep_torch):
    namespace = {}
    exec("from deep_ep import Buffer, Config\nfrom deep_ep.utils import EventHandle, EventOverlap\n"
         "from deep_ep.buffer import Buffer as LegacyBuffer", namespace)
    assert namespace["Buffer"] is namespace["LegacyBuffer"] is deep_ep_is_cuep_torch.Buffer
    assert namespace["EventOverlap"] is deep_ep_is_cuep_torch.EventOverlap
    assert isinstance(deep_ep_is_cuep_torch.Buffer.num_sms, int)


def test_megatron_fused_a2a_has_deep_ep(deep_ep_is_cuep_torch, monkeypatch):
    """Megatron-LM's fused_a2a imports ``Buffer`` from ``deep_ep`` and the events from ``deep_ep.utils`` when it
    is imported, and quietly runs without DeepEP (HAVE_DEEP_EP False) if either import fails."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[frameworks]')")
    name = "megatron.core.transformer.moe.fused_a2a"
    monkeypatch.delitem(sys.modules, name, raising=False)
    fused_a2a = importlib.import_module(name)
    monkeypatch.delitem(sys.modules, name)  # imported again by whoever needs it next, against their deep_ep
    assert fused_a2a.HAVE_DEEP_EP
    assert fused_a2a.Buffer is deep_ep_is_cuep_torch.Buffer
    assert fused_a2a.EventOverlap is deep_ep_is_cuep_torch.EventOverlap
    assert fused_a2a.EventHandle is deep_ep_is_cuep_torch.EventHandle
