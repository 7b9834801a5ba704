"""The torch front: outputs from torch's caching allocator, work on torch's current stream.

:class:`TorchFront` is the :class:`cuep._front.Front` of ``cuep.torch.Buffer``. Every output is a
``torch.empty`` of the current device (so on torch's current stream, and inside a torch CUDA-graph
capture from the graph's pool), held by the core as a :class:`~cuep._interop.TensorView`; the launches
go to torch's current stream, wrapped once per stream as a CuPy stream.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from typing import Any, Callable, ContextManager

import numpy as np

from .. import _deps, env
from .._checks import bf16_dtype
from .._front import Attach, OutputPool, View
from .._interop import TensorView
from .handles import LowLatencyHandle


_MAX_VIEWS = 256    # views of single regions remembered; a decode loop uses a handful
_MAX_RECIPES = 64   # tuples of a call's regions remembered (one per plan, as the plans are bounded)


class TorchFront:
    """Outputs as torch tensors on GPU ``device_index``; streams are torch's current ones.

    The core holds FP8 data as ``uint8`` (CuPy has no FP8 dtype), and every ``uint8`` output it asks for is
    FP8 data: here those are ``torch.float8_e4m3fn`` tensors, as DeepEP returns them, read by the core as
    ``uint8``."""

    def __init__(self, device_index: int):
        torch, cupy = _deps.torch(), _deps.cupy()
        self._torch, self._cupy = torch, cupy
        self.device_index, self.device = device_index, torch.device("cuda", device_index)
        self._raw_current_stream = torch._C._cuda_getCurrentRawStream
        self._cupy_streams: dict[int, Any] = {}    # raw stream -> cupy.cuda.ExternalStream
        self._torch_streams: dict[int, Any] = {}   # raw stream -> torch.cuda.ExternalStream
        self._views: dict[tuple, tuple] = {}        # (shape, dtype, byte offset, byte strides) -> _element_view
        self._recipes: dict[int, tuple] = {}        # id(regions) -> (regions, the steps of each View)
        pairs = [(np.int32, torch.int32), (np.int64, torch.int64), (np.float32, torch.float32),
                 (np.uint8, torch.float8_e4m3fn), (np.bool_, torch.bool), (np.float16, torch.float16),
                 (np.int8, torch.int8), (np.float64, torch.float64), (bf16_dtype(), torch.bfloat16)]
        # Keyed by the NumPy scalar type and by its dtype (the modes pass either): (torch dtype, NumPy dtype).
        self._dtypes = {key: (theirs, np.dtype(ours)) for ours, theirs in pairs for key in (ours, np.dtype(ours))}
        self._uint8, self._tensor = torch.uint8, torch.Tensor
        counts_holders = hasattr(torch._C, "_storage_Use_Count") and hasattr(torch.Tensor, "_use_count")
        # Outputs made under inference mode are inference tensors: they go to calls under it only.
        self._pool = OutputPool(self._allocate, functools.partial(_watch, torch),
                                enabled=counts_holders and env.get("CUEP_REUSE_OUTPUTS"),
                                context=torch.is_inference_mode_enabled)

    def empty(self, shape: tuple[int, ...], dtype) -> TensorView:
        torch_dtype, numpy_dtype = self._dtypes[dtype]
        tensor = self._torch.empty(shape, dtype=torch_dtype, device=self.device)
        return TensorView.known(tensor, numpy_dtype, tensor.shape, tensor.data_ptr(), self.device_index)

    def storage(self, nbytes: int, dtype=None) -> Storage:
        if dtype is not None:
            torch_dtype, numpy_dtype = self._dtypes[dtype]
            if nbytes % numpy_dtype.itemsize == 0:  # allocated as the first view's dtype: a typed view fewer
                return Storage(self._torch.empty(nbytes // numpy_dtype.itemsize, dtype=torch_dtype, device=self.device))
        return Storage(self._torch.empty(nbytes, dtype=self._uint8, device=self.device))

    def view(self, storage, shape: tuple[int, ...], dtype, offset: int, strides: tuple[int, ...] | None = None):
        """A torch tensor of ``storage`` (a :class:`Storage`, or an array from :meth:`empty`) from byte ``offset``."""
        key = (shape, dtype, offset, strides)
        found = self._views.get(key)
        if found is None:  # a call's regions repeat call after call: worked out once
            if len(self._views) >= _MAX_VIEWS:
                self._views.clear()
            found = self._views[key] = self._element_view(shape, dtype, offset, strides)
        torch_dtype, element_strides, element_offset = found
        if isinstance(storage, Storage):
            return storage.typed(torch_dtype).as_strided(shape, element_strides, element_offset)
        typed = storage.tensor.view(torch_dtype)
        return typed.as_strided(shape, element_strides, typed.storage_offset() + element_offset)

    def views(self, storage: Storage, regions: tuple[View, ...]) -> list:
        typed = storage.typed
        return [typed(torch_dtype).as_strided(shape, strides, offset)
                for torch_dtype, shape, strides, offset, _ in self._steps(regions)]

    def readable_views(self, storage: Storage, regions: tuple[View, ...]) -> list[TensorView]:
        typed, known, base, device = storage.typed, TensorView.known, storage.ptr, self.device_index
        return [known(typed(torch_dtype).as_strided(shape, strides, offset), numpy_dtype, shape, base + view.offset,
                      device, view.strides, contiguous)
                for torch_dtype, shape, strides, offset, (view, numpy_dtype, contiguous) in self._steps(regions)]

    def outputs(self, key: Any, stream, nbytes: int, dtype, regions: tuple[View, ...], readable: bool = False,
                attach: Attach | None = None) -> tuple[Any, list, Any]:
        return self._pool.take(key, stream, nbytes, dtype, regions, readable, attach)

    def signature(self, value: Any) -> Any:
        if value is None:
            return ()
        if type(value) is self._tensor:  # four queries, each a C call: a TensorView asks five and makes an object
            return value.shape, value.dtype, value.stride(), value.get_device()
        return None  # a subclass, or another library's array: read through the checks

    def pointer(self, value: Any) -> int:
        return value.data_ptr() if type(value) is self._tensor else value.data.ptr

    def export_handle(self, handle: Any) -> LowLatencyHandle:
        return LowLatencyHandle.of(handle, self)

    def release_outputs(self) -> None:
        self._pool.clear()

    def _allocate(self, nbytes: int, dtype, regions: tuple[View, ...], readable: bool) -> tuple[Storage, list]:
        storage = self.storage(nbytes, dtype)
        return storage, (self.readable_views if readable else self.views)(storage, regions)

    def _steps(self, regions: tuple[View, ...]) -> tuple:
        """Per View of ``regions``: ``(torch dtype, shape, element strides, element offset, (View, NumPy
        dtype, C-contiguous))``, worked out on the tuple's first use (a call's regions come from its plan,
        call after call)."""
        found = self._recipes.get(id(regions))
        if found is None or found[0] is not regions:
            if len(self._recipes) >= _MAX_RECIPES:
                self._recipes.clear()
            steps = []
            for view in regions:
                torch_dtype, element_strides, element_offset = self._element_view(view.shape, view.dtype,
                                                                                  view.offset, view.strides)
                contiguous = _c_contiguous(view.shape, element_strides)
                steps.append((torch_dtype, view.shape, element_strides, element_offset,
                              (view, self._dtypes[view.dtype][1], contiguous)))
            found = self._recipes[id(regions)] = (regions, tuple(steps))  # holds regions: its id stays its own
        return found[1]

    def _element_view(self, shape, dtype, offset: int, strides) -> tuple[Any, tuple[int, ...], int]:
        """``(torch dtype, strides, offset)`` in elements of a view given in bytes (``strides`` ``None``: C order)."""
        item = np.dtype(dtype).itemsize
        if strides is None:
            element_strides, step = [], 1
            for n in reversed(shape):
                element_strides.append(step)
                step *= n
            element_strides.reverse()
        else:
            element_strides = [s // item for s in strides]
        return self._dtypes[dtype][0], tuple(element_strides), offset // item

    def current_stream(self):
        raw = self._raw_current_stream(self.device_index)
        stream = self._cupy_streams.get(raw)
        if stream is None:
            stream = self._cupy_streams[raw] = self._cupy.cuda.ExternalStream(raw, self.device_index)
        return stream

    def torch_stream(self, stream):
        """``stream`` (a CuPy stream of this device) as a torch stream."""
        found = self._torch_streams.get(stream.ptr)
        if found is None:
            found = self._torch_streams[stream.ptr] = self._torch.cuda.ExternalStream(stream.ptr, device=self.device)
        return found

    def record_stream(self, stream, arrays: tuple) -> tuple:
        """Each torch tensor of ``arrays`` (as given, or read through a :class:`TensorView`) is recorded on
        ``stream``, as DeepEP records a call's tensors: torch's allocator then keeps a dropped tensor's memory
        until the stream's work enqueued so far is done, no longer. Holding the tensors instead kept them
        until a later call found that work done, which in a training step, whose host runs ahead of the GPU,
        meant until after the next layers had allocated theirs. Returns what is not a torch tensor."""
        torch_stream, tensor_type, rest = None, self._torch.Tensor, []
        for array in arrays:
            tensor = array.tensor if type(array) is TensorView else array
            if isinstance(tensor, tensor_type):
                if torch_stream is None:
                    torch_stream = self.torch_stream(stream)
                tensor.record_stream(torch_stream)
            elif array is not None:
                rest.append(array)
        return tuple(rest)

    def allocating_on(self, stream) -> ContextManager:
        if stream.ptr == self._raw_current_stream(self.device_index):
            return contextlib.nullcontext()
        return self._torch.cuda.stream(self.torch_stream(stream))

    def export(self, array: Any) -> Any:
        if type(array) is TensorView:
            return array.tensor
        if array is None or isinstance(array, self._torch.Tensor):
            return array
        return self._torch.from_dlpack(array)  # a CuPy array the core made itself


def _c_contiguous(shape: tuple[int, ...], element_strides: tuple[int, ...]) -> bool:
    """Whether a view of ``shape`` with ``element_strides`` is C-contiguous, as torch and CuPy judge it: the
    stride of a dimension of one element does not count, and an empty view is contiguous."""
    if 0 in shape:
        return True
    expected = 1
    for n, stride in zip(reversed(shape), reversed(element_strides)):
        if n != 1 and stride != expected:
            return False
        expected *= n
    return True


def _watch(torch, storage: Storage, views: list) -> tuple[list, Callable[[], tuple], Callable[[], bool]]:
    """What holds a pooled allocation (:class:`cuep._front.OutputPool`).

    Watched, the likeliest held first: each view handed out and the tensor a readable view wraps (the caller
    gets that tensor), the storage (a handle holds it), its untyped storage and typed views (a caller reaches
    them through ``untyped_storage()`` and ``_base``). Counted: the storage's use count less its own typed views
    (made on demand, the handle's too), which is what else holds the memory (a caller's views and exports); then
    each tensor's own use count, for references from C++ (autograd's saved tensors, say), which raise neither of
    the others on every torch. Spoiled: an output a caller made require gradients (or hooked, or gave a
    ``grad``, which need that) must not come back to the next call with them."""
    outputs = [view.tensor if type(view) is TensorView else view for view in views]
    typed = storage.typed_views()
    tensors = (*outputs, *typed)
    use_count, handle, tensor_use_count = torch._C._storage_Use_Count, storage.untyped._cdata, torch.Tensor._use_count
    requires_grad = operator.attrgetter("requires_grad")

    # (map over C functions: every call that takes an output from the pool asks these)
    def counts() -> tuple[int, ...]:
        return (use_count(handle) - storage.num_typed_views(), *map(tensor_use_count, tensors))

    def spoiled() -> bool:
        return any(map(requires_grad, outputs))

    readable = [view for view in views if type(view) is TensorView]
    return [*views, *(view.tensor for view in readable), storage, storage.untyped, *typed], counts, spoiled


class Storage:
    """One call's outputs in one tensor (``.ptr`` its address; of the first view's dtype, else ``uint8``), and its
    typed views, made once each: every torch op costs host time, so a region is one ``as_strided`` of its
    dtype's view (the tensor itself for its own dtype)."""

    __slots__ = ("tensor", "ptr", "_typed", "_untyped")

    def __init__(self, tensor):
        self.tensor, self.ptr, self._typed, self._untyped = tensor, tensor.data_ptr(), {tensor.dtype: tensor}, None

    @property
    def untyped(self):
        """The tensor's untyped storage, made once (torch hands the same object to every caller who asks)."""
        if self._untyped is None:
            self._untyped = self.tensor.untyped_storage()
        return self._untyped

    def typed_views(self) -> list:
        return list(self._typed.values())

    def num_typed_views(self) -> int:
        return len(self._typed)

    def typed(self, torch_dtype):
        """The whole storage as ``torch_dtype`` elements."""
        view = self._typed.get(torch_dtype)
        if view is None:
            view = self._typed[torch_dtype] = self.tensor.view(torch_dtype)
        return view
