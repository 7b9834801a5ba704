"""The eager calls' fast path builds the same kernel arguments as the slow one (issue 38): a struct from a
Buffer's template equals the struct built field by field, the packed output addresses equal the fields
set one by one, a remembered signature is bounded, and carved outputs do not overlap. No GPU needed: the
structs are ctypes mirrors, the device arrays stand-ins with a ``.data.ptr``."""

import ctypes
import random
import types

import numpy as np
import pytest

from cuep import _checks
from cuep._front import carve
from cuep.kernels import intranode as kernels
from cuep.kernels.launcher import KernelArgs
from cuep.kernels.status import Status
from cuep.modes import intranode, low_latency


def _device_array(ptr: int):
    return types.SimpleNamespace(data=types.SimpleNamespace(ptr=ptr))


def _context() -> intranode.Context:
    return intranode.Context(
        library=None, rank=3, num_ranks=8, buffer_ptr=0x7000_0000, buffer_bytes=1 << 30,
        peer_bases=_device_array(0x1000), status=_device_array(0x2000), status_host_ptr=0x3000,
        next_row=_device_array(0x4000), dispatch_state=_device_array(0x5000), device_sms=132,
        timeout_ns=100_000_000_000, barrier=lambda stream: None, raise_if_failed=lambda: None, front=None)


def _random_value(kind):
    """A value of ctypes ``kind``: a nested struct filled at random, or a random integer that fits."""
    if isinstance(kind, type) and issubclass(kind, ctypes.Structure):
        return kind(**{name: _random_value(sub) for name, sub, *_ in kind._fields_})
    return random.randrange(1, 1 << (8 * ctypes.sizeof(kind) - 2))


SHARED = {"peer_bases": 0x1000, "rank": 3, "num_ranks": 8, "region_bytes": intranode.region_bytes(1 << 30),
          "state": 0x5000, "status": Status(0x2000, 0x3000), "next_row": 0x4000, "timeout_ns": 100_000_000_000}


@pytest.mark.parametrize("struct", [kernels.StageArgs, kernels.NotifyArgs, kernels.RoutingArgs, kernels.PushArgs,
                                    kernels.CombineArgs])
def test_a_struct_from_the_template_equals_the_struct_built_whole(struct: type[KernelArgs]):
    random.seed(struct.__name__)
    ctx = _context()
    own = {name: _random_value(kind) for name, kind, *_ in struct._fields_ if name not in SHARED}
    whole = struct(**own, **{name: value for name, value in SHARED.items() if name in dict(struct._fields_)})
    for _ in range(2):  # the template's first use, then a copy of it
        fast = ctx.args_of(struct)
        for name, value in own.items():
            setattr(fast, name, value)
        assert bytes(fast) == bytes(whole)
    assert bytes(ctx.args_of(struct)) != bytes(whole) or not own  # a fresh copy: the last call's fields are gone


def test_packed_output_addresses_equal_the_fields_set_one_by_one():
    regions, _ = low_latency.dispatch_regions(8, 128, 7168, 256, 8, True, False, np.dtype(np.uint16))
    offsets = tuple(regions[name].offset for name in low_latency._OUTPUT_FIELDS)
    base = 0x7F00_0000_0000
    packed, by_field = low_latency.DispatchArgs(), low_latency.DispatchArgs()
    low_latency._OUTPUT_POINTERS.pack_into(packed, low_latency._OUTPUT_START, *[base + o for o in offsets])
    for name in low_latency._OUTPUT_FIELDS:
        setattr(by_field, name, base + regions[name].offset)
    assert bytes(packed) == bytes(by_field)


def test_known_calls_are_bounded_and_keep_no_signature_the_front_could_not_read():
    known = _checks.KnownCalls()
    for i in range(_checks.KnownCalls._LIMIT):
        known.add(("shape", i), i)
    assert known.get(("shape", 0)) == 0 and known.get(("shape", _checks.KnownCalls._LIMIT - 1)) is not None
    known.add(("shape", "one more"), "more")
    assert known.get(("shape", 0)) is None and known.get(("shape", "one more")) == "more"
    known.add(("shape", None), "unread")  # an argument the front cannot read cheaply: checked on every call
    assert known.get(("shape", None)) is None


class SignatureFront:
    """A front over stand-in arrays: their signature is what the checks read of them."""

    def signature(self, value):
        if value is None:
            return ()
        return value.shape, value.dtype, value.strides

    def pointer(self, value):
        return value.data.ptr


def test_a_low_latency_dispatch_checks_each_new_signature_once_and_every_other_one_in_full(monkeypatch):
    """A repeat skips the checks and reads only the addresses; a float token count, or other strides, is
    checked (and raises) although an equal int, or the same shape, passed before."""
    monkeypatch.setattr(_checks, "as_device_array", lambda call, name, value: value)
    full_checks = []
    real = _checks.check_low_latency_dispatch
    monkeypatch.setattr(_checks, "check_low_latency_dispatch", lambda *a: (full_checks.append(a), real(*a)))

    def matrix(shape, dtype, strides, ptr=0x1000):
        return types.SimpleNamespace(shape=shape, dtype=np.dtype(dtype), strides=strides, ndim=len(shape),
                                     itemsize=np.dtype(dtype).itemsize, data=types.SimpleNamespace(ptr=ptr),
                                     flags=types.SimpleNamespace(c_contiguous=strides[-1] == np.dtype(dtype).itemsize))

    x = matrix((8, 256), _checks.bf16_dtype(), (512, 2), 0x1000)
    ids = matrix((8, 4), np.int64, (32, 8), 0x2000)
    ctx = types.SimpleNamespace(front=SignatureFront(), known=_checks.KnownCalls(), num_ranks=4)

    def dispatch(x, max_tokens=16):
        return low_latency.checked_dispatch("low_latency_dispatch()", ctx, x, ids, max_tokens, 64, None, None, True,
                                            False, False)

    first = dispatch(x)
    moved = dispatch(matrix((8, 256), _checks.bf16_dtype(), (512, 2), 0x3000))
    assert len(full_checks) == 1
    assert first[1:] == (0x1000, 0x2000, 0, 0) and moved[1:] == (0x3000, 0x2000, 0, 0) and moved[0] is first[0]
    assert first[0].plan_key == ("dispatch", 16, 256, 64, 4, True, False, False)
    assert (first[0].num_tokens, first[0].ids_are_int64, first[0].use_fp8) == (8, 1, True)
    with pytest.raises(TypeError, match="num_max_dispatch_tokens_per_rank"):
        dispatch(x, 16.0)
    with pytest.raises(ValueError, match="C-contiguous"):
        dispatch(matrix((8, 256), _checks.bf16_dtype(), (2, 16)))
    assert len(full_checks) == 3


def test_carved_outputs_are_aligned_and_apart():
    regions, total = carve([("a", (3,), np.int32, None), ("b", (5, 7), np.bool_, None), ("c", (0, 8), np.int32, None),
                            ("d", (2,), np.int64, None)])
    spans = [(v.offset, v.offset + int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize) for v in regions.values()]
    assert [name for name in regions] == ["a", "b", "c", "d"]
    assert all(start % 128 == 0 for start, _ in spans) and spans[-1][1] <= total
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))


def test_the_torch_front_judges_contiguity_as_torch_does():
    """cuep.torch describes the views it makes without asking torch; its contiguity must be torch's own,
    for every region a dispatch carves (the scales' column-major layout, one column included)."""
    torch = pytest.importorskip("torch")
    from cuep.torch.front import _c_contiguous
    memory = torch.empty(1 << 16, dtype=torch.uint8)
    cases = [((4, 8, 1), (8, 1, 8)), ((4, 8, 2), (16, 1, 8)), ((4, 8, 2), (16, 2, 1)), ((0, 3), (5, 7)),
             ((1, 3), (99, 1)), ((3,), (2,)), ((2, 1, 5), (5, 7, 1))]
    for use_fp8, use_ue8m0, hidden in ((True, False, 512), (True, True, 512), (False, False, 256)):
        regions, _ = low_latency.dispatch_regions(2, 8, hidden, 8, 2, use_fp8, use_ue8m0, np.dtype(np.uint16))
        for view in regions.values():
            item = np.dtype(view.dtype).itemsize
            strides = (tuple(s // item for s in view.strides) if view.strides is not None else
                       torch.empty(view.shape).stride())
            cases.append((view.shape, strides))
    for shape, strides in cases:
        tensor = memory.as_strided(shape, strides)
        assert _c_contiguous(shape, strides) == tensor.is_contiguous(), (shape, strides)


def test_the_torch_low_latency_handle_is_deepep_s_tuple_of_the_dispatch_s_tensors():
    """cuep.torch's low-latency handle is DeepEP's five items, its two tensors the core handle's views of the
    dispatch's allocation; a copy keeps its core handle, a tuple rebuilt from its items does not."""
    torch = pytest.importorskip("torch")
    import copy

    from cuep.torch.buffer import LowLatencyHandle
    max_tokens, hidden, num_experts = 8, 512, 8
    src_info, layout_range = torch.zeros((4, 16), dtype=torch.int32), torch.zeros((4, 2), dtype=torch.int64)
    core = types.SimpleNamespace(items=(src_info, layout_range), num_max_dispatch_tokens_per_rank=max_tokens,
                                 hidden=hidden, num_experts=num_experts)
    front = object()
    handle = LowLatencyHandle.of(core, front)
    assert isinstance(handle, tuple) and len(handle) == 5
    assert handle[0] is src_info and handle[1] is layout_range and handle[2:] == (max_tokens, hidden, num_experts)
    copied = copy.copy(handle)
    assert copied[0] is src_info and copied.core is core and copied.front is front
    rebuilt = LowLatencyHandle((src_info, layout_range, max_tokens, hidden, num_experts))
    assert rebuilt[1] is layout_range and rebuilt.core is None


def test_the_layout_launches_equal_a_launch_built_whole_for_every_call(monkeypatch):
    """A Buffer's layout launches keep a struct per dtype and expert count and set only what changes: call
    after call (dtypes, shapes, expert counts, per-node counts changing), each launch must carry the struct,
    entry and grid that building them whole gives."""
    from cuep.kernels import launcher
    from cuep.kernels import layout as layout_kernel
    launched = []
    monkeypatch.setattr(launcher.Launch, "__call__",
                        lambda self, stream: launched.append((self.entry, self.grid, self.block, bytes(self.args))))
    library = types.SimpleNamespace(function=lambda name: 0x9000)
    status = types.SimpleNamespace(device=_device_array(0x2000), host_ptr=0x3000)
    num_ranks, num_nodes = 8, 2
    launches = layout_kernel.LayoutLaunches(library, num_ranks, num_nodes, status)

    def ids(ptr, shape, dtype):
        return types.SimpleNamespace(data=types.SimpleNamespace(ptr=ptr), shape=shape, dtype=np.dtype(dtype))

    for call, (dtype, shape, num_experts, with_nodes) in enumerate(
            [(np.int64, (4096, 8), 256, True), (np.int32, (128, 8), 256, True), (np.int64, (7, 2), 64, False),
             (np.int64, (4096, 8), 256, False), (np.int32, (1, 1), 256, True)]):
        base = 0x10_0000 * (call + 1)
        per_node = _device_array(base + 0x300) if with_nodes else None
        launches.launch(None, ids(base, shape, dtype), num_experts, _device_array(base + 0x100),
                        _device_array(base + 0x200), per_node, _device_array(base + 0x400))
        whole = layout_kernel.LayoutArgs(
            topk_idx=base, num_tokens=shape[0], num_topk=shape[1], num_experts=num_experts, num_ranks=num_ranks,
            num_nodes=num_nodes, num_tokens_per_expert=base + 0x100, num_tokens_per_rank=base + 0x200,
            num_tokens_per_node=base + 0x300 if with_nodes else 0, is_token_in_rank=base + 0x400,
            status_device=0x2000, status_host=0x3000)
        entry = layout_kernel.LayoutArgs.entries[dtype == np.int64]
        assert launched[-1] == (entry, layout_kernel.num_blocks(num_experts, num_ranks, num_nodes),
                                layout_kernel.NUM_THREADS, bytes(whole)), call


@pytest.mark.parametrize("dtype", [None, np.uint8, np.int32, np.float32, "bf16"])
def test_the_torch_front_s_views_are_the_same_whatever_dtype_its_storage_is_made_as(monkeypatch, dtype):
    """cuep.torch allocates a call's memory as the dtype of its first view (one torch view fewer a call): each
    view must still have the dtype, shape, strides and address that a byte allocation gives, for the regions
    of a low-latency dispatch (FP8, UE8M0, BF16), a layout and a non-cached dispatch's routing arrays."""
    torch = pytest.importorskip("torch")
    from cuep import buffer
    from cuep.torch.front import TorchFront
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)  # CPU-only torch
    front = TorchFront(0)
    front.device = torch.device("cpu")
    dtype = _checks.bf16_dtype() if dtype == "bf16" else dtype
    bf16 = _checks.bf16_dtype()
    calls = []
    for fp8, ue8m0 in ((True, False), (True, True), (False, False)):
        regions, nbytes = low_latency.dispatch_regions(2, 8, 512, 8, 2, fp8, ue8m0, bf16)
        calls.append((tuple(regions.values()), nbytes))
    calls += [buffer._layout_outputs(8, 2, 64, 7), intranode._routing_arrays(7, 8, 4)]
    for regions, nbytes in calls:
        made = front.storage(nbytes, dtype)
        assert made.tensor.numel() * made.tensor.element_size() == nbytes
        for view, tensor in zip(regions, front.readable_views(made, regions)):
            assert tensor.ptr == made.ptr + view.offset
            assert tensor.tensor.data_ptr() == (tensor.ptr if tensor.tensor.numel() else 0)  # torch: 0 when empty
            item = np.dtype(view.dtype).itemsize
            expected = view.strides or tuple(int(np.prod(view.shape[i + 1:])) * item for i in range(len(view.shape)))
            assert tuple(tensor.tensor.shape) == view.shape and tensor.tensor.element_size() == item
            assert tuple(s * item for s in tensor.tensor.stride()) == expected
            assert tensor.c_contiguous == tensor.tensor.is_contiguous()
    if dtype is not None and np.dtype(dtype).itemsize > 1:  # a size its dtype does not divide: bytes instead
        assert front.storage(129, dtype).tensor.dtype == torch.uint8
