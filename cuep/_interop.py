"""Foreign GPU arrays (torch, JAX, anything with DLPack or the CUDA array interface) as CuPy views.

No copy is ever made. DLPack comes first: it names bfloat16, which the CUDA array interface can only
call an anonymous two-byte type. CuPy has no FP8 dtype, so an FP8 e4m3 array (``torch.float8_e4m3fn``,
JAX's ``float8_e4m3fn``) becomes a ``uint8`` view of the same bytes, which is how cuep holds FP8.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

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


def as_cupy(value: Any):
    """``value`` as a CuPy array sharing its memory, or ``None`` when it is no GPU array.

    A torch tensor that requires grad is read through ``detach()`` (the same memory), as DeepEP's
    torch API reads it. Raises ``TypeError`` for a dtype CuPy cannot hold (other than FP8 e4m3)."""
    cupy = _deps.cupy()
    if isinstance(value, cupy.ndarray):
        return value
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
