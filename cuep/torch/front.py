"""The torch front: outputs from torch's caching allocator, work on torch's current stream.

:class:`TorchFront` is the :class:`cuep._front.Front` of ``cuep.torch.Buffer``. Every output is a
``torch.empty`` of the current device (so on torch's current stream, and inside a torch CUDA-graph
capture from the graph's pool), held by the core as a :class:`~cuep._interop.TensorView`; the launches
go to torch's current stream, wrapped once per stream as a CuPy stream.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import numpy as np

from .. import _deps
from .._checks import bf16_dtype
from .._interop import TensorView


class TorchFront:
    """Outputs as torch tensors on GPU ``device_index``; streams are torch's current ones."""

    def __init__(self, device_index: int):
        torch, cupy = _deps.torch(), _deps.cupy()
        self._torch, self._cupy = torch, cupy
        self.device_index, self.device = device_index, torch.device("cuda", device_index)
        self._raw_current_stream = torch._C._cuda_getCurrentRawStream
        self._cupy_streams: dict[int, Any] = {}    # raw stream -> cupy.cuda.ExternalStream
        self._torch_streams: dict[int, Any] = {}   # raw stream -> torch.cuda.ExternalStream
        pairs = [(np.int32, torch.int32), (np.int64, torch.int64), (np.float32, torch.float32),
                 (np.uint8, torch.uint8), (np.bool_, torch.bool), (np.float16, torch.float16),
                 (np.int8, torch.int8), (np.float64, torch.float64)]
        # Keyed by the NumPy scalar type and by its dtype: the modes pass either.
        self._torch_dtypes = {key: theirs for ours, theirs in pairs for key in (ours, np.dtype(ours))}
        self._torch_dtypes[bf16_dtype()] = torch.bfloat16
        self._uint8 = torch.uint8

    def torch_dtype(self, dtype):
        """The torch dtype of NumPy ``dtype`` (FP8 bytes are ``uint8`` here; callers view them as FP8)."""
        return self._torch_dtypes[dtype]

    def empty(self, shape: tuple[int, ...], dtype) -> TensorView:
        tensor = self._torch.empty(shape, dtype=self._torch_dtypes[dtype], device=self.device)
        return TensorView(tensor, np.dtype(dtype))

    def storage(self, nbytes: int) -> TensorView:
        return TensorView(self._torch.empty(nbytes, dtype=self._uint8, device=self.device), np.dtype(np.uint8))

    def view(self, storage: TensorView, shape: tuple[int, ...], dtype, offset: int,
             strides: tuple[int, ...] | None = None) -> TensorView:
        dtype = np.dtype(dtype)
        item = dtype.itemsize
        base = storage.tensor
        if base.dtype != self._uint8:
            base = base.view(self._uint8)
        if strides is None:
            count = 1
            for n in shape:
                count *= n
            tensor = base[offset:offset + count * item].view(self._torch_dtypes[dtype]).view(shape)
        else:
            tensor = base[offset:].view(self._torch_dtypes[dtype]).as_strided(shape, [s // item for s in strides])
        return TensorView(tensor, dtype)

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

    def allocating_on(self, stream) -> ContextManager:
        if stream.ptr == self._raw_current_stream(self.device_index):
            return contextlib.nullcontext()
        return self._torch.cuda.stream(self.torch_stream(stream))

    def export(self, array: Any) -> Any:
        if array is None or isinstance(array, self._torch.Tensor):
            return array
        if isinstance(array, TensorView):
            return array.tensor
        return self._torch.from_dlpack(array)  # a CuPy array the core made itself
