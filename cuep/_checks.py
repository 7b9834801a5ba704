"""Argument checks: each raises TypeError/ValueError naming the call and the argument, before any kernel."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from . import _deps, _interop, env

INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def as_device_array(call: str, name: str, value: Any):
    """A CuPy view of ``value`` (CuPy, torch, JAX, anything exporting DLPack or ``__cuda_array_interface__``)
    on the current device, without a copy; FP8 e4m3 arrays become ``uint8`` views."""
    cupy = _deps.cupy()
    try:
        array = _interop.as_cupy(value)
    except TypeError as exc:
        raise TypeError(f"{call}: {name} has a dtype cuep cannot take ({exc}); cuep takes bfloat16, float32, "
                        f"int32, int64, bool and uint8 or float8_e4m3fn") from None
    if array is None:
        raise TypeError(f"{call}: {name} must be a GPU array (CuPy, torch, JAX, or anything exporting __dlpack__ or "
                        f"__cuda_array_interface__), got {type(value).__module__}.{type(value).__name__}")
    device = cupy.cuda.runtime.getDevice()
    if array.data.device_id != device:
        raise ValueError(f"{call}: {name} is on GPU {array.data.device_id}, but this rank's Buffer uses GPU {device}")
    return array


def check_topk_idx(call: str, topk_idx, num_experts: int, num_tokens: int | None = None) -> None:
    """Shape, dtype and layout of ``topk_idx`` (no GPU work); ``num_tokens`` also fixes its rows."""
    if topk_idx.dtype not in INDEX_DTYPES:
        raise TypeError(f"{call}: topk_idx must be int32 or int64, got {topk_idx.dtype}")
    if topk_idx.ndim != 2 or (num_tokens is not None and topk_idx.shape[0] != num_tokens):
        rows = "num_tokens" if num_tokens is None else num_tokens
        raise ValueError(f"{call}: topk_idx must have shape [{rows}, num_topk], got {tuple(topk_idx.shape)}")
    if topk_idx.shape[1] == 0:
        raise ValueError(f"{call}: topk_idx must have at least one column (num_topk >= 1), got {tuple(topk_idx.shape)}")
    if not topk_idx.flags.c_contiguous:
        raise ValueError(f"{call}: topk_idx must be C-contiguous; pass cupy.ascontiguousarray(topk_idx)")


def check_num_experts(call: str, num_experts: Any, num_ranks: int) -> None:
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)):
        raise TypeError(f"{call}: num_experts must be an int, got {type(num_experts).__name__}")
    if num_experts <= 0 or num_experts % num_ranks:
        raise ValueError(f"{call}: num_experts must be a positive multiple of the {num_ranks} ranks, got {num_experts}")


def check_expert_ids(call: str, topk_idx, num_experts: int, stream) -> None:
    """Every id in ``topk_idx`` is -1 or in ``[0, num_experts)``.

    Reads the values on the GPU and waits for them (one small reduction), so it is skipped while
    ``stream`` is being captured into a CUDA graph and when ``CUEP_SKIP_VALUE_CHECKS`` is set.
    """
    if topk_idx.size == 0 or env.get("CUEP_SKIP_VALUE_CHECKS") or stream.is_capturing():
        return
    cupy = _deps.cupy()
    with stream:
        low, high = (int(v) for v in cupy.stack([topk_idx.min(), topk_idx.max()]).get())
    problem = expert_id_range_problem(low, high, num_experts)
    if problem:
        raise ValueError(f"{call}: {problem}")


def expert_id_range_problem(low: int, high: int, num_experts: int) -> str | None:
    """What is wrong with expert ids spanning ``[low, high]``, or ``None``."""
    if low < -1:
        return f"topk_idx holds {low}; entries must be -1 (no expert) or expert ids in [0, {num_experts})"
    if high >= num_experts:
        return (f"topk_idx holds expert id {high}, but num_experts={num_experts} "
                f"(valid ids: -1 for none, 0..{num_experts - 1})")
    return None


def check_nonnegative_int(call: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{call}: {name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{call}: {name} must be >= 0, got {value}")
    return int(value)


def check_event_options(call: str, previous_event, async_finish: bool, allocate_on_comm_stream: bool) -> None:
    if allocate_on_comm_stream and (previous_event is None or not async_finish):
        raise ValueError(f"{call}: allocate_on_comm_stream=True needs previous_event and async_finish=True "
                         f"(the outputs then belong to the communication stream)")


@functools.cache
def bf16_dtype() -> np.dtype:
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


def numpy_dtype(call: str, dtype: Any) -> np.dtype:
    """``dtype`` (NumPy, ``ml_dtypes``, CuPy or torch) as a NumPy dtype; FP8 types as ``uint8``, the way
    cuep holds FP8."""
    name = str(dtype).removeprefix("torch.")
    if name.startswith("float8_"):
        return np.dtype(np.uint8)
    if name == "bfloat16":
        return bf16_dtype()
    try:
        return np.dtype(dtype if not hasattr(dtype, "is_floating_point") else name)
    except TypeError:
        raise TypeError(f"{call}: dtype must be a NumPy, ml_dtypes or torch dtype, got {dtype!r}") from None


def check_matrix(call: str, name: str, array, dtypes, rows: int | None = None, cols: int | None = None,
                 contiguous: bool = True) -> None:
    """A 2-D array of one of ``dtypes`` with the given row/column counts (``None``: any).

    Every eager call runs this, so nothing is formatted unless a check fails."""
    if array.dtype not in dtypes:
        names = " or ".join(str(np.dtype(d)) for d in dtypes)
        raise TypeError(f"{call}: {name} must be {names}, got {array.dtype}")
    if array.ndim != 2 or (rows is not None and array.shape[0] != rows) or (cols is not None and array.shape[1] != cols):
        expected = f"[{'num_rows' if rows is None else rows}, {'any' if cols is None else cols}]"
        raise ValueError(f"{call}: {name} must have shape {expected}, got {tuple(array.shape)}")
    if contiguous and not array.flags.c_contiguous:
        raise ValueError(f"{call}: {name} must be C-contiguous; pass cupy.ascontiguousarray({name})")


def check_hidden(call: str, hidden: int, fp8: bool) -> None:
    multiple = 128 if fp8 else 8
    if hidden <= 0 or hidden % multiple:
        kind = "FP8 (one scale per 128 channels)" if fp8 else "BF16 (16-byte vectors)"
        raise ValueError(f"{call}: hidden size must be a positive multiple of {multiple} for {kind}, got {hidden}")


def check_low_latency_dispatch(call: str, x, topk_idx, max_tokens: Any, num_experts: Any, num_ranks: int,
                               max_topk: int, max_tokens_limit: int, use_fp8: bool, round_scale: bool,
                               use_ue8m0: bool) -> None:
    """Shapes, dtypes and options of a low-latency dispatch (no GPU work)."""
    check_matrix(call, "x", x, [bf16_dtype()])
    num_tokens, hidden = x.shape
    multiple = 512 if use_ue8m0 else 128
    if hidden <= 0 or hidden % multiple:
        raise ValueError(f"{call}: hidden size must be a positive multiple of {multiple}"
                         f"{' with use_ue8m0' if use_ue8m0 else ''}, got {hidden}")
    max_tokens = check_nonnegative_int(call, "num_max_dispatch_tokens_per_rank", max_tokens)
    if not 0 < max_tokens <= max_tokens_limit:
        raise ValueError(f"{call}: num_max_dispatch_tokens_per_rank must be in [1, {max_tokens_limit}], got {max_tokens}")
    if num_tokens > max_tokens:
        raise ValueError(f"{call}: x has {num_tokens} tokens, more than num_max_dispatch_tokens_per_rank={max_tokens}")
    check_topk_idx(call, topk_idx, num_experts, num_tokens)
    if topk_idx.shape[1] > max_topk:
        raise ValueError(f"{call}: at most {max_topk} experts per token, topk_idx has {topk_idx.shape[1]}")
    check_num_experts(call, num_experts, num_ranks)
    if use_ue8m0 and not (use_fp8 and round_scale):
        raise ValueError(f"{call}: use_ue8m0=True needs use_fp8=True and round_scale=True (UE8M0 holds powers of two)")
    if round_scale and not use_fp8:
        raise ValueError(f"{call}: round_scale=True needs use_fp8=True")


def check_vector(call: str, name: str, array, dtype, length: int) -> None:
    """A contiguous 1-D array of ``dtype`` and ``length``."""
    if array.dtype != np.dtype(dtype) or array.ndim != 1 or array.shape[0] != length or not array.flags.c_contiguous:
        raise ValueError(f"{call}: {name} must be a contiguous [{length}] {np.dtype(dtype)} array, got "
                         f"{array.dtype} {tuple(array.shape)}")


def check_hook_options(call: str, async_finish: bool, return_recv_hook: bool) -> None:
    if async_finish and return_recv_hook:
        raise ValueError(f"{call}: async_finish and return_recv_hook exclude each other (the hook runs the "
                         f"receive on your stream)")


def intranode_handle(call: str, handle: Any, num_ranks: int):
    """A normal-mode dispatch handle, or the flat tuple it iterates as (its arrays as CuPy, torch, JAX or,
    for its host ``scalars``, NumPy or CPU torch), as a :class:`~cuep.kernels.intranode.Handle`."""
    from .kernels.intranode import HANDLE_ARRAYS, Handle
    if isinstance(handle, Handle):
        return handle
    if not isinstance(handle, (tuple, list)) or len(handle) != len(HANDLE_ARRAYS):
        raise TypeError(f"{call}: handle must be a dispatch()'s handle or the {len(HANDLE_ARRAYS)}-item tuple it "
                        f"iterates as, got {type(handle).__name__}")
    arrays = {name: _host_array(item) if name == "scalars" else as_device_array(call, f"handle item {name}", item)
              for name, item in zip(HANDLE_ARRAYS, handle)}
    try:
        restored = Handle.from_arrays(arrays)
    except ValueError as exc:
        raise ValueError(f"{call}: {exc}") from None
    if restored.send_pos.shape[1] != num_ranks:
        raise ValueError(f"{call}: handle comes from a dispatch over {restored.send_pos.shape[1]} ranks, this "
                         f"Buffer has {num_ranks}")
    return restored


def _host_array(value: Any) -> np.ndarray:
    """A host copy of a small array that may live on the host (NumPy, CPU torch) or on the GPU."""
    device = _interop.as_cupy(value)
    return device.get() if device is not None else np.asarray(value)
