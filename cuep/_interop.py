"""Foreign GPU arrays (torch, JAX, anything with DLPack or the CUDA array interface) as the core reads them.

No copy is ever made. A torch tensor becomes a :class:`TensorView`: what the checks and the kernels'
arguments read of a device array (pointer, shape, dtype, strides, contiguity), taken from the tensor
directly, because a DLPack round trip per array (torch's stream handshake, then CuPy's import) cost more
host time than a whole eager call. Other arrays become CuPy views through DLPack, which names bfloat16
(the CUDA array interface can only call it an anonymous two-byte type). CuPy has no FP8 dtype, so an FP8
e4m3 array (``torch.float8_e4m3fn``, JAX's ``float8_e4m3fn``) is read as ``uint8`` bytes, which is how
cuep holds FP8.
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
from typing import Any

import numpy as np

from . import _deps

# DLPack's device type for CUDA device memory and its type code for FP8 e4m3 "fn" (no infinities),
# the format of cuep's FP8 data.
_DL_CUDA = 2
_DL_FLOAT8_E4M3FN = 10
# The stream argument DLPack uses for CUDA's legacy default stream (CuPy's stream pointer 0).
_DL_LEGACY_DEFAULT_STREAM = 1


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class TensorView:
    """A torch GPU tensor as the core reads a device array: the attributes of a CuPy array that the checks
    and the kernels' arguments use (``data.ptr``, ``shape``, ``dtype`` as a NumPy dtype, ``strides`` in
    bytes, ``flags.c_contiguous``), read from the tensor (or, through :meth:`known`, given by the code
    that just made it), which it keeps alive. FP8 tensors read as ``uint8``. :func:`to_cupy` gives a CuPy
    array over the same memory where the core needs one."""

    __slots__ = ("tensor", "shape", "dtype", "itemsize", "ptr", "device_id", "c_contiguous", "_strides")

    def __init__(self, tensor, dtype: np.dtype):
        self.tensor, self.shape, self.dtype, self.itemsize = tensor, tensor.shape, dtype, dtype.itemsize
        self.ptr, self.device_id, self.c_contiguous = tensor.data_ptr(), tensor.get_device(), tensor.is_contiguous()
        self._strides = None

    @classmethod
    def known(cls, tensor, dtype: np.dtype, shape: tuple[int, ...], ptr: int, device_id: int,
              strides: tuple[int, ...] | None = None, c_contiguous: bool = True) -> TensorView:
        """The view of a tensor the caller has just made with these attributes (``strides`` in bytes, ``None``
        to read them from the tensor when asked): nothing is asked of the tensor now, since every question to
        torch costs host time."""
        view = cls.__new__(cls)
        view.tensor, view.shape, view.dtype, view.itemsize = tensor, shape, dtype, dtype.itemsize
        view.ptr, view.device_id, view.c_contiguous, view._strides = ptr, device_id, c_contiguous, strides
        return view

    @property
    def data(self) -> "TensorView":  # ``.data.ptr`` and ``.data.device_id``, as on a CuPy array
        return self

    @property
    def flags(self) -> "TensorView":  # ``.flags.c_contiguous``
        return self

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return self.tensor.numel()

    @property
    def strides(self) -> tuple[int, ...]:
        strides = self._strides
        if strides is None:  # worked out on first use: most calls read a tensor's strides once, or never
            itemsize, elements = self.itemsize, self.tensor.stride()
            # A call's inputs are mostly matrices: spelled out, theirs cost a fifth of the general form.
            strides = self._strides = ((elements[0] * itemsize, elements[1] * itemsize) if len(elements) == 2
                                       else tuple([s * itemsize for s in elements]))
        return strides


@functools.cache
def _torch_to_numpy_dtypes() -> dict:
    """torch dtype -> the NumPy dtype cuep reads it as (FP8 e4m3 as its bytes)."""
    import ml_dtypes
    torch = sys.modules["torch"]
    return {torch.bfloat16: np.dtype(ml_dtypes.bfloat16), torch.float32: np.dtype(np.float32),
            torch.float16: np.dtype(np.float16), torch.float64: np.dtype(np.float64),
            torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64), torch.int8: np.dtype(np.int8),
            torch.uint8: np.dtype(np.uint8), torch.bool: np.dtype(np.bool_),
            torch.float8_e4m3fn: np.dtype(np.uint8)}


def _torch_tensor_type():
    """``torch.Tensor`` if the program has imported torch (cuep never imports it for a CuPy user), else ``None``."""
    torch = sys.modules.get("torch")
    return getattr(torch, "Tensor", None)


def as_array(value: Any):
    """``value`` as a device array the core can read, sharing its memory: a CuPy array, a
    :class:`TensorView` for a torch GPU tensor, else a CuPy view through DLPack or the CUDA array
    interface; ``None`` when it is no GPU array (a CPU tensor, say).

    Raises ``TypeError`` for a dtype cuep cannot hold."""
    kind = type(value)
    if kind is TensorView or kind is _deps.cupy().ndarray:
        return value
    # A torch tensor is asked no isinstance() question it can avoid: torch's metaclass makes each one slow.
    tensor_type = _torch_tensor_type()
    if tensor_type is not None and (kind is tensor_type or isinstance(value, tensor_type)):
        if not value.is_cuda:
            return None
        dtype = _torch_to_numpy_dtypes().get(value.dtype)
        if dtype is None:
            raise TypeError(f"unsupported dtype {value.dtype}")
        return TensorView(value, dtype)
    return as_cupy(value)  # CuPy arrays of subclasses, JAX and other DLPack arrays


def to_cupy(array):
    """A CuPy array over the memory of a device array from :func:`as_array` (the array itself if it is one)."""
    if not isinstance(array, TensorView):
        return array
    cupy = _deps.cupy()
    if array.tensor.numel() == 0:
        return cupy.empty(array.shape, dtype=array.dtype)
    strides = array.strides
    extent = array.itemsize * (1 + sum((n - 1) * s for n, s in zip(array.shape, array.tensor.stride())))
    memory = cupy.cuda.UnownedMemory(array.ptr, extent, array.tensor, array.device_id)
    return cupy.ndarray(tuple(array.shape), dtype=array.dtype, memptr=cupy.cuda.MemoryPointer(memory, 0),
                        strides=strides)


def read_on_host(array, stream) -> np.ndarray:
    """``array`` (from :func:`as_array`) copied to the host once ``stream`` reaches it: the one CPU wait of a
    non-cached dispatch (its received counts size the outputs). One function, so that ``cuep.bench --mode
    host`` can time that wait apart from the rest of the call."""
    return to_cupy(array).get(stream=stream)


def as_cupy(value: Any):
    """``value`` as a CuPy array sharing its memory, or ``None`` when it is no GPU array.

    A torch tensor that requires grad is read through ``detach()`` (the same memory), as DeepEP's
    torch API reads it. Raises ``TypeError`` for a dtype CuPy cannot hold (other than FP8 e4m3)."""
    cupy = _deps.cupy()
    if isinstance(value, cupy.ndarray):
        return value
    if isinstance(value, TensorView):
        return to_cupy(value)
    if getattr(value, "requires_grad", False) and hasattr(value, "detach"):
        value = value.detach()
    if hasattr(value, "__dlpack__") and hasattr(value, "__dlpack_device__"):
        if value.__dlpack_device__()[0] != _DL_CUDA:
            return None
        try:
            return cupy.from_dlpack(value)
        except TypeError:
            fp8 = _fp8_bytes(value)
            if fp8 is None:
                raise
            return fp8
    if hasattr(value, "__cuda_array_interface__"):
        return cupy.asarray(value)
    return None


def _fp8_bytes(value: Any):
    """A ``uint8`` CuPy view of an FP8 e4m3 GPU array exported through DLPack, else ``None``."""
    cupy = _deps.cupy()
    capsule = value.__dlpack__(stream=cupy.cuda.get_current_stream().ptr or _DL_LEGACY_DEFAULT_STREAM)
    # The capsule stays unconsumed and alive with the view: its own destructor releases the producer's
    # reference, and the view keeps ``value`` (which owns the memory) alive meanwhile.
    tensor = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))  # DLManagedTensor starts with it
    dtype = tensor.dtype
    if tensor.device.device_type != _DL_CUDA or (dtype.code, dtype.bits, dtype.lanes) != (_DL_FLOAT8_E4M3FN, 8, 1):
        return None
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    strides = tuple(tensor.strides[i] for i in range(tensor.ndim)) if tensor.strides else None
    if math.prod(shape) == 0:
        return cupy.empty(shape, dtype=cupy.uint8)
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if strides else math.prod(shape)
    memory = cupy.cuda.UnownedMemory(tensor.data + tensor.byte_offset, extent, (value, capsule),
                                     tensor.device.device_id)
    return cupy.ndarray(shape, dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0), strides=strides)
