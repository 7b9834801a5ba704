"""The pool that hands a low-latency call's outputs out again (``cuep._front.OutputPool``): an allocation comes
back only once nothing outside the pool holds it, through any path a caller can hold it by. No GPU needed: the
torch front's own storage, views and watch rule run on CPU tensors, and the CuPy front's rule on stand-ins that
hold each other as CuPy's memory pointers and arrays do."""

import gc
import sys
import types

import numpy as np
import pytest

from cuep import _front
from cuep._front import OutputPool, carve
from cuep.modes import low_latency


class FakeStream:
    def __init__(self, ptr: int, capturing: bool = False):
        self.ptr, self.capturing = ptr, capturing

    def is_capturing(self) -> bool:
        return self.capturing


STREAM = FakeStream(1)


@pytest.fixture
def torch_pool(monkeypatch):
    """The torch front's own pool over CPU tensors (only its allocation replaced); with the dispatch's regions."""
    torch = pytest.importorskip("torch")
    from cuep.torch import front as torch_front
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)  # CPU-only torch
    monkeypatch.delenv("CUEP_REUSE_OUTPUTS", raising=False)
    front = torch_front.TorchFront(0)
    assert front._pool.enabled  # this torch counts a storage's users

    def allocate(nbytes, dtype, regions, readable):
        storage = torch_front.Storage(torch.empty(nbytes // np.dtype(dtype).itemsize, dtype=front._dtypes[dtype][0]))
        return storage, (front.readable_views if readable else front.views)(storage, regions)

    front._pool._allocate = allocate
    regions, nbytes = low_latency.dispatch_regions(2, 8, 512, 8, 2, True, False, np.dtype(np.uint16))
    outputs = (regions["recv_x"], regions["recv_count"], regions["recv_scales"])
    return torch, Taker(front), (nbytes, outputs[0].dtype, outputs)


class Taker:
    """``take(key, stream, nbytes, dtype, regions, readable)`` through a front's ``outputs``."""

    def __init__(self, front):
        self.front = front
        self._entries = front._pool._entries

    def take(self, key, stream, nbytes, dtype, regions, readable, attach=None):
        return self.front.outputs(key, stream, nbytes, dtype, regions, readable, attach)

    def clear(self):
        self.front.release_outputs()


def take(pool, shape, stream=STREAM, key="dispatch", readable=False):
    """``(storage, views)`` of a call that attaches nothing."""
    nbytes, dtype, regions = shape
    storage, views, attached = pool.take(key, stream, nbytes, dtype, regions, readable)
    assert attached is None
    return storage, views


def test_outputs_let_go_of_come_back_as_the_same_objects(torch_pool):
    _, pool, shape = torch_pool
    storage, views = take(pool, shape)
    ids = (id(storage), [id(v) for v in views])
    del storage, views
    storage, views = take(pool, shape)
    assert (id(storage), [id(v) for v in views]) == ids


@pytest.mark.parametrize("hold", ["an output", "the tuple of FP8 data and scales", "a slice of an output",
                                  "a dtype view of an output", "the storage (as a handle does)", "a DLPack export",
                                  "a list holding an output", "an output's untyped storage", "an output's base",
                                  "a tensor autograd saved", "the combined output (a readable view)"])
def test_an_allocation_still_held_is_never_handed_out_again(torch_pool, hold):
    torch, pool, shape = torch_pool
    readable = hold == "the combined output (a readable view)"
    storage, views = take(pool, shape, readable=readable)
    recv_x, recv_count, scales = (view.tensor for view in views) if readable else views
    weight = torch.ones(scales.shape, requires_grad=True)
    held = {"an output": lambda: recv_count,
            "the tuple of FP8 data and scales": lambda: (recv_x, scales),
            "a slice of an output": lambda: recv_x[0, 1:3],
            "a dtype view of an output": lambda: recv_x.view(torch.uint8),
            "the storage (as a handle does)": lambda: types.SimpleNamespace(storage=storage),
            "a DLPack export": lambda: torch.utils.dlpack.to_dlpack(scales),
            "a list holding an output": lambda: [recv_x],
            "an output's untyped storage": lambda: recv_count.untyped_storage(),
            "an output's base": lambda: recv_count._base,
            "a tensor autograd saved": lambda: scales * weight,  # keeps scales itself (in C++) for the gradient
            "the combined output (a readable view)": lambda: recv_count}[hold]()
    del views
    pointer = storage.ptr
    del storage, recv_x, recv_count, scales, weight
    gc.collect()
    again, _ = take(pool, shape, readable=readable)
    assert again.ptr != pointer, f"an allocation still held through {hold} was handed out again"
    del again, _, held
    gc.collect()
    # Let go of, it comes back (the first entry, the oldest, is checked first).
    assert take(pool, shape, readable=readable)[0].ptr == pointer


def test_inference_tensors_go_only_to_calls_under_inference_mode(torch_pool):
    torch, pool, shape = torch_pool
    with torch.inference_mode():
        storage, _ = take(pool, shape)
        pointer = storage.ptr
        del storage, _
    assert take(pool, shape)[0].ptr != pointer  # not an inference tensor outside inference mode
    with torch.inference_mode():
        assert take(pool, shape)[0].ptr == pointer


def test_an_output_made_to_require_gradients_is_dropped_not_handed_out(torch_pool):
    torch, pool, shape = torch_pool
    storage, (recv_x, recv_count, scales) = take(pool, shape)
    pointer = storage.ptr
    scales.requires_grad_()
    del storage, recv_x, recv_count, scales
    again, views = take(pool, shape)
    assert again.ptr != pointer and not any(view.requires_grad for view in views)
    assert len(pool._entries[("dispatch", STREAM.ptr, False)]) == 1  # the spoiled one went back to torch


def test_a_handle_s_tensors_hold_the_allocation_while_they_live(torch_pool):
    """cuep.torch's handle makes its tensors (views of the allocation) when first read, through the storage's
    typed views; those stay with the storage, so the allocation comes back once the tensors are dropped."""
    torch, pool, shape = torch_pool
    storage, _ = take(pool, shape)
    pointer = storage.ptr
    handle_tensor = storage.typed(torch.int64).as_strided((4,), (1,), 0)  # a dtype no output has
    del storage, _
    assert take(pool, shape)[0].ptr != pointer
    del handle_tensor
    assert take(pool, shape)[0].ptr == pointer


def test_a_captured_call_keeps_and_reuses_nothing(torch_pool):
    _, pool, shape = torch_pool
    capturing = FakeStream(1, capturing=True)
    storage, views = take(pool, shape, capturing)
    assert not pool._entries  # a graph's outputs are its own: the pool holds nothing of them
    assert sys.getrefcount(storage) == 2  # this local alone
    assert take(pool, shape, capturing)[0] is not storage
    assert not pool._entries


def test_a_one_off_call_without_a_key_keeps_nothing(torch_pool):
    _, pool, shape = torch_pool
    storage, _ = take(pool, shape, key=None)
    assert not pool._entries and sys.getrefcount(storage) == 2  # this local alone
    assert take(pool, shape, key=None)[0] is not storage


def test_allocations_are_kept_per_key_and_stream_and_bounded(torch_pool):
    _, pool, shape = torch_pool
    storage, _ = take(pool, shape)
    pointer = storage.ptr
    del storage, _
    assert take(pool, shape, FakeStream(2))[0].ptr != pointer
    assert take(pool, shape, key="another shape")[0].ptr != pointer
    held = [take(pool, shape) for _ in range(_front._POOL_ENTRIES + 2)]
    assert len(pool._entries[("dispatch", STREAM.ptr, False)]) == _front._POOL_ENTRIES
    assert len({storage.ptr for storage, _ in held}) == len(held)
    for key in range(_front._POOL_KEYS + 1):
        take(pool, shape, key=key)
    assert len(pool._entries) == _front._POOL_KEYS
    pool.clear()
    assert not pool._entries


class Attacher:
    """A call's ``attach``: a handle over the allocation (as the low-latency dispatch's holds the storage and two
    of its views), handed out, and a private object; it counts how often it ran."""

    def __init__(self):
        self.made = 0

    def __call__(self, storage, views):
        self.made += 1
        handle = types.SimpleNamespace(storage=storage, items=tuple(views[-2:]))
        return (handle, object()), (handle,)


def take_attached(pool, shape, attach, stream=STREAM):
    nbytes, dtype, regions = shape
    return pool.take("dispatch", stream, nbytes, dtype, regions, False, attach)


@pytest.mark.parametrize("hold", ["the handle", "a tensor of the handle", "an output"])
def test_what_a_call_attaches_comes_back_with_its_allocation_and_holds_it_while_handed_out(torch_pool, hold):
    _, pool, shape = torch_pool
    attach = Attacher()
    storage, views, attached = take_attached(pool, shape, attach)
    pointer, first = storage.ptr, attached
    del storage, views, attached
    storage, views, attached = take_attached(pool, shape, attach)
    assert storage.ptr == pointer and attached is first and attach.made == 1  # made once per allocation
    held = {"the handle": lambda: attached[0], "a tensor of the handle": lambda: attached[0].items[0],
            "an output": lambda: views[0]}[hold]()
    del storage, views, attached, first
    gc.collect()
    again, _, other = take_attached(pool, shape, attach)
    assert again.ptr != pointer and attach.made == 2, f"held through {hold}, handed out again"
    del again, _, other, held
    gc.collect()
    assert take_attached(pool, shape, attach)[0].ptr == pointer


def test_a_captured_call_attaches_anew_each_time(torch_pool):
    _, pool, shape = torch_pool
    attach, capturing = Attacher(), FakeStream(1, capturing=True)
    first = take_attached(pool, shape, attach, capturing)[2]
    assert take_attached(pool, shape, attach, capturing)[2] is not first and attach.made == 2
    assert not pool._entries


class FakeMemory:
    pass


class FakePointer:
    """As ``cupy.cuda.MemoryPointer``: holds its memory; ``+`` gives another pointer into it."""

    def __init__(self, mem):
        self.mem = mem

    def __add__(self, offset):
        return FakePointer(self.mem)


class FakeArray:
    """As ``cupy.ndarray``: holds a pointer; a view holds its base and a pointer of its own."""

    def __init__(self, pointer, base=None):
        self.data, self.base = pointer, base

    def view(self):
        return FakeArray(self.data + 0, base=self)


def test_the_cupy_rule_counts_views_exports_and_handles(monkeypatch):
    monkeypatch.delenv("CUEP_REUSE_OUTPUTS", raising=False)
    front = _front.CupyFront()
    regions, nbytes = carve([("a", (4,), np.int32, None), ("b", (2,), np.int64, None)])
    pool = front._pool
    pool._allocate = lambda n, dtype, regs, readable: (storage := FakePointer(FakeMemory()),
                                                       [FakeArray(storage + r.offset) for r in regs])
    shape = (nbytes, np.int32, tuple(regions.values()))
    storage, (a, b) = take(pool, shape)
    pointer = id(storage)
    del storage, a, b
    assert id(take(pool, shape)[0]) == pointer
    for hold in ("view", "export", "handle", "an array on its memory pointer"):
        storage, (a, b) = take(pool, shape)
        assert id(storage) == pointer
        held = {"view": lambda: a.view(), "export": lambda: [b], "handle": lambda: (storage,),
                "an array on its memory pointer": lambda: FakeArray(b.data)}[hold]()
        del storage, a, b
        other, _ = take(pool, shape)
        assert id(other) != pointer, f"held through a {hold}, handed out again"
        del held, other, _


def test_every_front_keeps_outputs_for_reuse():
    for name in ("outputs", "release_outputs"):
        assert hasattr(_front.Front, name) and hasattr(_front.CupyFront, name)
    torch_front = pytest.importorskip("cuep.torch.front")
    assert all(hasattr(torch_front.TorchFront, name) for name in ("outputs", "release_outputs"))


def test_cuep_reuse_outputs_0_allocates_every_time(monkeypatch):
    monkeypatch.setenv("CUEP_REUSE_OUTPUTS", "0")
    front = _front.CupyFront()
    made = []
    front._pool._allocate = lambda *args: made.append(args) or (FakePointer(FakeMemory()), [])
    for _ in range(3):
        front.outputs("dispatch", STREAM, 64, np.int32, ())
    assert len(made) == 3 and not front._pool.enabled and not front._pool._entries
