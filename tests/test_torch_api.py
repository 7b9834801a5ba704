"""cuep.torch against DeepEP V1's module, written out by hand: names, parameters and defaults (needs torch;
skipped with the reason without it), and cuep imported without torch."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

# DeepEP V1 (its last V1 layout, deep_ep/buffer.py and csrc/config.hpp's Python binding): every public
# method's parameters in order, with their defaults (inspect.Parameter.empty: none).
_ = inspect.Parameter.empty
DEEPEP_V1 = {
    "__init__": [("self", _), ("group", _), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0), ("low_latency_mode", False),
                 ("num_qps_per_rank", 24), ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False),
                 ("use_fabric", False), ("explicitly_destroy", False), ("enable_shrink", False), ("comm", None)],
    "destroy": [("self", _)],
    "is_sm90_compiled": [],
    "set_num_sms": [("new_num_sms", _)],
    "capture": [],
    "get_low_latency_rdma_size_hint": [("num_max_dispatch_tokens_per_rank", _), ("hidden", _), ("num_ranks", _),
                                       ("num_experts", _)],
    "get_comm_stream": [("self", _)],
    "get_local_buffer_tensor": [("self", _), ("dtype", _), ("size", None), ("offset", 0), ("use_rdma_buffer", False)],
    "get_dispatch_config": [("num_ranks", _)],
    "get_combine_config": [("num_ranks", _)],
    "get_dispatch_layout": [("self", _), ("topk_idx", _), ("num_experts", _), ("previous_event", None),
                            ("async_finish", False), ("allocate_on_comm_stream", False)],
    "dispatch": [("self", _), ("x", _), ("handle", None), ("num_tokens_per_rank", None),
                 ("num_tokens_per_rdma_rank", None), ("is_token_in_rank", None), ("num_tokens_per_expert", None),
                 ("topk_idx", None), ("topk_weights", None), ("expert_alignment", 1), ("num_worst_tokens", 0),
                 ("config", None), ("previous_event", None), ("async_finish", False),
                 ("allocate_on_comm_stream", False)],
    "combine": [("self", _), ("x", _), ("handle", _), ("topk_weights", None), ("bias", None), ("config", None),
                ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)],
    "clean_low_latency_buffer": [("self", _), ("num_max_dispatch_tokens_per_rank", _), ("hidden", _),
                                 ("num_experts", _)],
    "low_latency_dispatch": [("self", _), ("x", _), ("topk_idx", _), ("num_max_dispatch_tokens_per_rank", _),
                             ("num_experts", _), ("cumulative_local_expert_recv_stats", None),
                             ("dispatch_wait_recv_cost_stats", None), ("use_fp8", True), ("round_scale", False),
                             ("use_ue8m0", False), ("async_finish", False), ("return_recv_hook", False)],
    "low_latency_combine": [("self", _), ("x", _), ("topk_idx", _), ("topk_weights", _), ("handle", _),
                            ("use_logfmt", False), ("zero_copy", False), ("async_finish", False),
                            ("return_recv_hook", False), ("out", None), ("combine_wait_recv_cost_stats", None)],
    "low_latency_update_mask_buffer": [("self", _), ("rank_to_mask", _), ("mask", False)],
    "low_latency_query_mask_buffer": [("self", _), ("mask_status", _)],
    "low_latency_clean_mask_buffer": [("self", _)],
    "get_next_low_latency_combine_buffer": [("self", _), ("handle", _)],
}
# DeepEP's Buffer.dispatch and combine forward to these across nodes, with the same parameters.
DEEPEP_V1["internode_dispatch"] = DEEPEP_V1["dispatch"]
DEEPEP_V1["internode_combine"] = DEEPEP_V1["combine"]
DEEPEP_V1_CONFIG = [("num_sms", 20), ("num_max_nvl_chunked_send_tokens", 6), ("num_max_nvl_chunked_recv_tokens", 256),
                    ("num_max_rdma_chunked_send_tokens", 6), ("num_max_rdma_chunked_recv_tokens", 256)]
DEEPEP_V1_EVENT_OVERLAP = [("self", _), ("event", None), ("extra_tensors", None)]


def _parameters(function) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.fixture(scope="module")
def deep_ep():
    pytest.importorskip("torch", reason="torch is not installed (pip install torch)")
    import cuep.torch
    return cuep.torch


@pytest.mark.parametrize("method", sorted(DEEPEP_V1))
def test_buffer_method_matches_deepep_v1(deep_ep, method):
    assert _parameters(getattr(deep_ep.Buffer, method)) == DEEPEP_V1[method]


def test_module_exports_deepep_names(deep_ep):
    import torch
    assert deep_ep.topk_idx_t is torch.int64
    assert {"Buffer", "Config", "EventOverlap", "topk_idx_t"} <= set(deep_ep.__all__)
    assert _parameters(deep_ep.Config) == DEEPEP_V1_CONFIG
    assert deep_ep.Config(24, 8, 256) == deep_ep.Config(num_sms=24, num_max_nvl_chunked_send_tokens=8)
    assert _parameters(deep_ep.EventOverlap.__init__) == DEEPEP_V1_EVENT_OVERLAP
    for name in ("current_stream_wait", "__enter__", "__exit__"):
        assert callable(getattr(deep_ep.EventOverlap, name))


def test_buffer_without_a_group_names_the_arguments(deep_ep):
    with pytest.raises(ValueError, match="pass the expert-parallel group as group"):
        deep_ep.Buffer(None)


def test_previous_event_must_be_an_event(deep_ep):
    from cuep.torch.event import core_event
    assert core_event("dispatch()", None) is None
    assert core_event("dispatch()", deep_ep.EventOverlap()) is None  # an EventOverlap of no work, as DeepEP
    with pytest.raises(TypeError, match="dispatch\\(\\): previous_event must be an EventOverlap"):
        core_event("dispatch()", "yesterday")


def test_a_low_latency_handle_goes_back_only_as_its_dispatch_returned_it(deep_ep):
    """The combine takes the handle a dispatch returned (tests/test_fast_path.py checks that a copy keeps its
    state); a plain tuple or a handle rebuilt from its items raises, naming the call, before any kernel runs."""
    import types
    buffer, other = deep_ep.Buffer.__new__(deep_ep.Buffer), deep_ep.Buffer.__new__(deep_ep.Buffer)
    buffer._front, other._front = object(), object()
    core = types.SimpleNamespace(num_max_dispatch_tokens_per_rank=8, hidden=512, num_experts=8, items=("src", "range"))
    handle = deep_ep.LowLatencyHandle.of(core, buffer._front)
    assert buffer._core_low_latency_handle("low_latency_combine()", handle) is core
    rebuilt = deep_ep.LowLatencyHandle(("src", "range", 8, 512, 8))
    for bad, what in ((rebuilt, "a handle rebuilt from its items"), (("src", "range", 8, 512, 8), "tuple")):
        with pytest.raises(TypeError, match=f"low_latency_combine\\(\\): handle must be .* got {what}"):
            buffer._core_low_latency_handle("low_latency_combine()", bad)
    with pytest.raises(ValueError, match="another Buffer"):
        other._core_low_latency_handle("low_latency_combine()", handle)


def _run_without_torch(code: str) -> subprocess.CompletedProcess:
    hide_torch = "import sys; sys.modules['torch'] = None\n"  # `import torch` then fails, as with no torch
    return subprocess.run([sys.executable, "-c", hide_torch + code], capture_output=True, text=True, timeout=120)


def test_cuep_imports_without_torch():
    done = _run_without_torch("import cuep, cuep.reference; print(cuep.Buffer.__name__)")
    assert done.returncode == 0 and done.stdout.strip() == "Buffer", done.stderr


def test_cuep_torch_without_torch_says_what_to_install():
    done = _run_without_torch("import cuep.torch")
    assert done.returncode != 0
    assert "MissingDependencyError: cuep.torch needs PyTorch with CUDA: pip install torch." in done.stderr, done.stderr


# Every call that makes or reads tensors on the host path runs with torch-function modes off.
TORCH_FUNCTION_OFF = ["combine", "dispatch", "get_dispatch_layout", "get_local_buffer_tensor", "get_low_latency_trace",
                      "get_next_low_latency_combine_buffer", "internode_combine", "internode_dispatch",
                      "low_latency_combine", "low_latency_dispatch", "low_latency_query_mask_buffer"]


@pytest.mark.parametrize("method", TORCH_FUNCTION_OFF)
def test_tensor_calls_run_with_torch_function_modes_off(deep_ep, method):
    assert getattr(getattr(deep_ep.Buffer, method), "__wrapped__", None) is not None, \
        f"Buffer.{method} runs under the caller's torch-function modes"


def test_a_default_device_does_not_reach_the_host_path(deep_ep):
    """``torch.set_default_device`` (DeepEP's tests set it) installs a torch-function mode; inside a wrapped call
    it is off, and back on after, also when the call raises."""
    import torch

    from cuep.torch._buffer import _torch_function_off

    @_torch_function_off
    def seen(fail: bool = False):
        if fail:
            raise ValueError("bad argument")
        return torch._C._is_torch_function_mode_enabled(), torch.empty(1).device.type

    torch.set_default_device("meta")
    try:
        assert seen() == (False, "cpu")  # the mode would have made it a meta tensor
        with pytest.raises(ValueError, match="bad argument"):
            seen(fail=True)
        assert torch._C._is_torch_function_mode_enabled() and torch.empty(1).device.type == "meta"
    finally:
        torch.set_default_device(None)
