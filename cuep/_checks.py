"""Argument checks: each raises TypeError/ValueError naming the call and the argument, before any kernel."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np

from . import _deps, _interop
from .kernels.common import SCALE_BLOCK, UE8M0_SCALES_PER_WORD

INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


class KnownCalls:
    """What the checks concluded for each argument signature that passed them (shapes, dtypes, strides,
    devices, options: what :meth:`cuep._front.Front.signature` reads), so that a later call with the same
    signature skips the checks and reads only its arrays' addresses: every check that depends only on those
    values would pass again, with the same conclusion. What a signature does not cover (the Buffer's state)
    is still checked on every call. A tensor's device is in its signature, compared with the current device
    when the signature is first checked. Bounded: a loop of ever-new shapes forgets now and then."""

    _LIMIT = 64

    def __init__(self):
        self._known: dict = {}

    def get(self, signature: tuple) -> Any:
        """The conclusion kept for ``signature``, or ``None``."""
        return self._known.get(signature)

    def add(self, signature: tuple, conclusion: Any) -> None:
        """Keep ``conclusion`` for ``signature``, unless the front could not read part of it (``None`` in it)."""
        if None in signature:
            return
        if len(self._known) >= self._LIMIT:
            self._known.clear()
        self._known[signature] = conclusion


def as_device_array(call: str, name: str, value: Any):
    """``value`` (CuPy, torch, JAX, anything exporting DLPack or ``__cuda_array_interface__``) as a device
    array the core reads (:func:`cuep._interop.as_array`: a CuPy array or a torch tensor's
    :class:`~cuep._interop.TensorView`) on the current device, without a copy; FP8 e4m3 arrays read as
    ``uint8``. A torch tensor is read in place, with no DLPack stream handshake: it must be ready on the
    stream the call runs on (``cuep.torch``'s calls run on torch's current stream)."""
    cupy = _deps.cupy()
    try:
        array = _interop.as_array(value)
    except TypeError as exc:
        raise TypeError(f"{call}: {name} has a dtype cuep cannot take ({exc}); cuep takes bfloat16, float32, "
                        f"int32, int64, bool and uint8 or float8_e4m3fn") from None
    if array is None:
        where = " on the CPU" if getattr(value, "is_cuda", None) is False else ""
        raise TypeError(f"{call}: {name} must be a GPU array (CuPy, torch, JAX, or anything exporting __dlpack__ or "
                        f"__cuda_array_interface__), got {type(value).__module__}.{type(value).__name__}{where}")
    device = cupy.cuda.runtime.getDevice()
    if array.data.device_id != device:
        raise ValueError(f"{call}: {name} is on GPU {array.data.device_id}, but this rank's Buffer uses GPU {device}")
    return array


# The normal mode's kernels give each top-k entry of a row a lane of one warp, as DeepEP's do.
NORMAL_MAX_TOPK = 32


def check_num_topk(call: str, name: str, num_topk: int, max_topk: int) -> None:
    if num_topk > max_topk:
        raise ValueError(f"{call}: at most {max_topk} experts per token, {name} has {num_topk} columns")


def check_topk_idx(call: str, topk_idx, num_experts: int, num_tokens: int | None = None,
                   max_topk: int | None = None) -> None:
    """Shape, dtype and layout of ``topk_idx`` (no GPU work); ``num_tokens`` also fixes its rows, and
    ``max_topk`` bounds its columns."""
    if topk_idx.dtype not in INDEX_DTYPES:
        raise TypeError(f"{call}: topk_idx must be int32 or int64, got {topk_idx.dtype}")
    if topk_idx.ndim != 2 or (num_tokens is not None and topk_idx.shape[0] != num_tokens):
        rows = "num_tokens" if num_tokens is None else num_tokens
        raise ValueError(f"{call}: topk_idx must have shape [{rows}, num_topk], got {tuple(topk_idx.shape)}")
    if topk_idx.shape[1] == 0:
        raise ValueError(f"{call}: topk_idx must have at least one column (num_topk >= 1), got {tuple(topk_idx.shape)}")
    if max_topk is not None:
        check_num_topk(call, "topk_idx", topk_idx.shape[1], max_topk)
    if not topk_idx.flags.c_contiguous:
        raise ValueError(f"{call}: topk_idx must be C-contiguous; pass cupy.ascontiguousarray(topk_idx)")


def check_num_experts(call: str, num_experts: Any, num_ranks: int) -> None:
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)):
        raise TypeError(f"{call}: num_experts must be an int, got {type(num_experts).__name__}")
    if num_experts <= 0 or num_experts % num_ranks:
        raise ValueError(f"{call}: num_experts must be a positive multiple of the {num_ranks} ranks, got {num_experts}")


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
    multiple = SCALE_BLOCK if fp8 else 8
    if hidden <= 0 or hidden % multiple:
        kind = f"FP8 (one scale per {SCALE_BLOCK} channels)" if fp8 else "BF16 (16-byte vectors)"
        raise ValueError(f"{call}: hidden size must be a positive multiple of {multiple} for {kind}, got {hidden}")


def low_latency_dispatch_inputs(call: str, x, topk_idx, max_tokens: Any, num_experts: Any, num_ranks: int,
                                max_topk: int, max_tokens_limit: int, use_fp8: bool, round_scale: bool,
                                use_ue8m0: bool) -> tuple[Any, Any]:
    """A low-latency dispatch's ``x`` and ``topk_idx`` as device arrays, checked (:func:`check_low_latency_dispatch`)."""
    x = as_device_array(call, "x", x)
    topk_idx = as_device_array(call, "topk_idx", topk_idx)
    check_low_latency_dispatch(call, x, topk_idx, max_tokens, num_experts, num_ranks, max_topk, max_tokens_limit,
                               use_fp8, round_scale, use_ue8m0)
    return x, topk_idx


def check_low_latency_dispatch(call: str, x, topk_idx, max_tokens: Any, num_experts: Any, num_ranks: int,
                               max_topk: int, max_tokens_limit: int, use_fp8: bool, round_scale: bool,
                               use_ue8m0: bool) -> None:
    """Shapes, dtypes and options of a low-latency dispatch (no GPU work)."""
    check_matrix(call, "x", x, [bf16_dtype()])
    num_tokens, hidden = x.shape
    multiple = SCALE_BLOCK * UE8M0_SCALES_PER_WORD if use_ue8m0 else SCALE_BLOCK
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


def optional_vector(call: str, name: str, value: Any, dtype, length: int):
    """``None``, or ``value`` as a contiguous 1-D device array of ``dtype`` and ``length``."""
    if value is None:
        return None
    array = as_device_array(call, name, value)
    check_vector(call, name, array, dtype, length)
    return array


def check_positive_ints(call: str, **values: Any) -> None:
    """Each of ``values`` is a positive int."""
    for name, value in values.items():
        if check_nonnegative_int(call, name, value) == 0:
            raise ValueError(f"{call}: {name} must be positive")


def check_hook_options(call: str, async_finish: bool, return_recv_hook: bool) -> None:
    if async_finish and return_recv_hook:
        raise ValueError(f"{call}: async_finish and return_recv_hook exclude each other (the hook runs the "
                         f"receive on your stream)")


def normal_handle(call: str, handle: Any, num_ranks: int, handle_type: type | None = None):
    """A normal-mode dispatch handle of the Buffer's mode (``handle_type``, default the intranode one), or the
    flat tuple it iterates as (its arrays as CuPy, torch, JAX or, for its host ``scalars``, NumPy or CPU
    torch), as that mode's Handle."""
    if handle_type is None:
        from .modes.intranode import Handle as handle_type
    if not isinstance(handle, handle_type):
        names = handle_type.item_names()
        if not isinstance(handle, (tuple, list)) or len(handle) != len(names):
            raise TypeError(f"{call}: handle must be a dispatch()'s handle or the {len(names)}-item tuple it "
                            f"iterates as, got {type(handle).__name__}")
        arrays = {name: _host_array(item) if name == "scalars" else as_device_array(call, f"handle item {name}", item)
                  for name, item in zip(names, handle)}
        try:
            handle = handle_type.from_arrays(arrays)
        except ValueError as exc:
            raise ValueError(f"{call}: {exc}") from None
    if handle.send_pos.shape[1] != num_ranks:
        raise ValueError(f"{call}: handle comes from a dispatch over {handle.send_pos.shape[1]} ranks, this "
                         f"Buffer has {num_ranks}")
    return handle


def _host_array(value: Any) -> np.ndarray:
    """A host copy of a small array that may live on the host (NumPy, CPU torch) or on the GPU."""
    device = _interop.as_cupy(value)
    return device.get() if device is not None else np.asarray(value)


class DispatchArguments(NamedTuple):
    """A normal-mode dispatch's arguments, checked: device arrays (:func:`as_device_array`), the routing ids
    ``int32`` or ``int64`` as given (:func:`widened_ids` makes them ``int64`` on the call's stream)."""

    x: Any
    scales: Any                   # FP8 scales, or None for BF16
    handle: Any                   # the cached dispatch's handle, or None
    is_token_in_rank: Any
    num_tokens_per_expert: Any
    num_experts: int              # 0 for a cached dispatch
    topk_idx: Any
    topk_weights: Any
    expert_alignment: int
    num_worst_tokens: int


def dispatch_arguments(call: str, num_ranks: int, num_nodes: int, max_experts: int, x, handle, num_tokens_per_rank,
                       num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                       expert_alignment: Any, num_worst_tokens: Any, previous_event, async_finish: bool,
                       allocate_on_comm_stream: bool, handle_type: type | None = None) -> DispatchArguments:
    """Every argument of :meth:`cuep.Buffer.dispatch` but the config; ``handle_type``: the mode's Handle
    (default the intranode one)."""
    x, scales = tokens(call, x)
    expert_alignment = check_expert_alignment(call, expert_alignment)
    num_worst_tokens = check_nonnegative_int(call, "num_worst_tokens", num_worst_tokens)
    check_event_options(call, previous_event, async_finish, allocate_on_comm_stream)
    if handle is not None:
        handle = cached_dispatch_handle(call, handle, x.shape[0], num_ranks, topk_idx, topk_weights, handle_type)
        return DispatchArguments(x, scales, handle, None, None, 0, None, None, expert_alignment, num_worst_tokens)
    routing = dispatch_routing(call, x.shape[0], num_ranks, num_nodes, max_experts, num_tokens_per_rank,
                               num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                               topk_weights)
    return DispatchArguments(x, scales, None, *routing, expert_alignment, num_worst_tokens)


def check_expert_alignment(call: str, expert_alignment: Any) -> int:
    """A dispatch's ``expert_alignment``: an int >= 1."""
    expert_alignment = check_nonnegative_int(call, "expert_alignment", expert_alignment)
    if expert_alignment < 1:
        raise ValueError(f"{call}: expert_alignment must be >= 1, got {expert_alignment}")
    return expert_alignment


def tokens(call: str, x) -> tuple[Any, Any]:
    """A dispatch's ``x``: BF16 ``[num_tokens, hidden]``, or the FP8 pair ``(x_fp8, scales)``; returns
    ``(x, scales)`` as CuPy arrays (``scales`` ``None`` for BF16)."""
    fp8 = isinstance(x, tuple)
    if fp8:
        if len(x) != 2:
            raise ValueError(f"{call}: FP8 x must be a tuple (x_fp8, scales), got {len(x)} items")
        x, scales = (as_device_array(call, name, a) for name, a in zip(("x", "x scales"), x))
    else:
        x, scales = as_device_array(call, "x", x), None
    check_matrix(call, "x", x, [np.uint8] if fp8 else [bf16_dtype()])
    num_tokens, hidden = x.shape
    check_hidden(call, hidden, fp8)
    if fp8:
        check_fp8_scales(call, scales, num_tokens, hidden)
    return x, scales


def check_fp8_scales(call: str, scales, num_tokens: int, hidden: int) -> None:
    """FP8 dispatch scales: `float32` `[num_tokens, hidden / 128]`, or DeepGEMM's packed UE8M0 exponents,
    `int32` `[num_tokens, hidden / 512]` (four per word). The kernels move them as 4-byte words and return
    them as given, as DeepEP does (any strides)."""
    if scales.dtype == np.int32:
        if hidden % (SCALE_BLOCK * UE8M0_SCALES_PER_WORD):
            raise ValueError(f"{call}: packed UE8M0 (int32) x scales need a hidden size that is a multiple of "
                             f"{SCALE_BLOCK * UE8M0_SCALES_PER_WORD}, got {hidden}")
        check_matrix(call, "x scales", scales, [np.int32], num_tokens,
                     hidden // (SCALE_BLOCK * UE8M0_SCALES_PER_WORD), contiguous=False)
    elif scales.dtype != np.float32:
        raise TypeError(f"{call}: x scales must be float32 or int32 (packed UE8M0), got {scales.dtype}")
    else:
        check_matrix(call, "x scales", scales, [np.float32], num_tokens, hidden // SCALE_BLOCK, contiguous=False)


def dispatch_routing(call: str, num_tokens: int, num_ranks: int, num_nodes: int, max_experts: int,
                     num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert,
                     topk_idx, topk_weights) -> tuple[Any, Any, int, Any, Any]:
    """A non-cached dispatch's layout and routing; returns ``(is_token_in_rank, num_tokens_per_expert,
    num_experts, topk_idx (int32 or int64) or None, topk_weights or None)``."""
    if is_token_in_rank is None or num_tokens_per_expert is None or num_tokens_per_rank is None:
        raise ValueError(f"{call}: without a handle, pass num_tokens_per_rank, is_token_in_rank and "
                         f"num_tokens_per_expert from get_dispatch_layout()")
    if (topk_idx is None) != (topk_weights is None):
        raise ValueError(f"{call}: pass topk_idx and topk_weights together, or neither (got only "
                         f"{'topk_idx' if topk_weights is None else 'topk_weights'})")
    check_vector(call, "num_tokens_per_rank", as_device_array(call, "num_tokens_per_rank", num_tokens_per_rank),
                 np.int32, num_ranks)
    if num_tokens_per_rdma_rank is not None:
        check_vector(call, "num_tokens_per_rdma_rank",
                     as_device_array(call, "num_tokens_per_rdma_rank", num_tokens_per_rdma_rank), np.int32, num_nodes)
    is_token_in_rank = as_device_array(call, "is_token_in_rank", is_token_in_rank)
    check_matrix(call, "is_token_in_rank", is_token_in_rank, [np.bool_], num_tokens, num_ranks)
    num_tokens_per_expert = as_device_array(call, "num_tokens_per_expert", num_tokens_per_expert)
    num_experts = num_tokens_per_expert.size
    if num_tokens_per_expert.dtype != np.int32 or num_tokens_per_expert.ndim != 1:
        raise TypeError(f"{call}: num_tokens_per_expert must be [num_experts] int32, got "
                        f"{num_tokens_per_expert.dtype} {tuple(num_tokens_per_expert.shape)}")
    check_num_experts(call, num_experts, num_ranks)
    if num_experts > max_experts:
        raise ValueError(f"{call}: at most {max_experts} experts, got {num_experts}")
    if topk_idx is not None:
        topk_idx = as_device_array(call, "topk_idx", topk_idx)
        check_topk_idx(call, topk_idx, num_experts, num_tokens, max_topk=NORMAL_MAX_TOPK)
        # int32 ids are widened by the caller, on the stream the call runs on
        topk_weights = as_device_array(call, "topk_weights", topk_weights)
        check_matrix(call, "topk_weights", topk_weights, [np.float32], num_tokens, topk_idx.shape[1])
    return is_token_in_rank, num_tokens_per_expert, num_experts, topk_idx, topk_weights


def cached_dispatch_handle(call: str, handle: Any, num_tokens: int, num_ranks: int, topk_idx, topk_weights,
                           handle_type: type | None = None):
    """The handle of a cached dispatch, which takes no routing and must match ``x``'s token count."""
    if topk_idx is not None or topk_weights is not None:
        raise ValueError(f"{call}: a cached dispatch (handle given) takes no topk_idx or topk_weights")
    handle = normal_handle(call, handle, num_ranks, handle_type)
    if handle.num_tokens != num_tokens:
        raise ValueError(f"{call}: handle must come from a dispatch of {num_tokens} tokens, got one of "
                         f"{handle.num_tokens}")
    return handle


def combine_inputs(call: str, x, handle: Any, topk_weights, bias, num_ranks: int, handle_type: type | None = None
                   ) -> tuple[Any, Any, Any, Any, Any]:
    """A normal-mode combine's arguments; returns ``(x, handle, topk_weights or None, bias0, bias1)``."""
    handle = normal_handle(call, handle, num_ranks, handle_type)
    x = as_device_array(call, "x", x)
    check_matrix(call, "x", x, [bf16_dtype()], handle.num_rows)
    check_hidden(call, x.shape[1], fp8=False)
    if topk_weights is not None:
        topk_weights = as_device_array(call, "topk_weights", topk_weights)
        check_matrix(call, "topk_weights", topk_weights, [np.float32], handle.num_rows)
        check_num_topk(call, "topk_weights", topk_weights.shape[1], NORMAL_MAX_TOPK)
    return (x, handle, topk_weights, *combine_biases(call, bias, handle.num_tokens, x.shape[1]))


def combine_biases(call: str, bias, num_tokens: int, hidden: int) -> tuple[Any, Any]:
    """A combine's ``bias``: none, one `[num_tokens, hidden]` BF16 array, or a tuple of two; returns
    ``(bias0, bias1)``, ``None`` where absent."""
    biases = bias if isinstance(bias, tuple) else (bias,)
    if len(biases) > 2:
        raise ValueError(f"{call}: bias must be one array or a tuple of two, got {len(biases)}")
    biases = [as_device_array(call, "bias", b) if b is not None else None for b in biases] + [None] * (2 - len(biases))
    for b in biases:
        if b is not None:
            check_matrix(call, "bias", b, [bf16_dtype()], num_tokens, hidden)
    return biases[0], biases[1]


def low_latency_combine_inputs(call: str, x, topk_idx, topk_weights, handle: Any, out, num_ranks: int
                               ) -> tuple[Any, Any, Any, Any]:
    """A low-latency combine's arguments, as device arrays, checked against its dispatch's ``handle``; returns
    ``(x, topk_idx, topk_weights, out)``, ``out`` ``None`` when not given."""
    x = as_device_array(call, "x", x)
    topk_idx = as_device_array(call, "topk_idx", topk_idx)
    topk_weights = as_device_array(call, "topk_weights", topk_weights)
    if out is not None:
        out = as_device_array(call, "out", out)
    _low_latency_combine_shapes(call, x, topk_idx, topk_weights, handle, out, num_ranks)
    return x, topk_idx, topk_weights, out


def _low_latency_combine_shapes(call: str, x, topk_idx, topk_weights, handle: Any, out, num_ranks: int) -> None:
    bf16 = bf16_dtype()
    shape = (handle.num_experts // num_ranks, num_ranks * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
    if x.dtype != bf16 or x.shape != shape or not x.flags.c_contiguous:
        raise ValueError(f"{call}: x must be a C-contiguous {list(shape)} bfloat16 array, got {x.dtype} "
                         f"{tuple(x.shape)}")
    check_topk_idx(call, topk_idx, handle.num_experts, handle.num_tokens)
    if topk_idx.shape[1] != handle.num_topk:
        raise ValueError(f"{call}: topk_idx must be the dispatch's [{handle.num_tokens}, {handle.num_topk}], got "
                         f"{tuple(topk_idx.shape)}")
    check_matrix(call, "topk_weights", topk_weights, [np.float32], handle.num_tokens, handle.num_topk)
    if out is not None:
        check_matrix(call, "out", out, [bf16], handle.num_tokens, handle.hidden)


def buffer_sizes(call: str, num_nvl_bytes: Any, num_rdma_bytes: Any, num_qps_per_rank: Any,
                 min_nvl_bytes: int) -> tuple[int, int]:
    """A Buffer's ``(num_nvl_bytes, num_rdma_bytes)``; an NVL buffer holds at least ``min_nvl_bytes``."""
    nvl = check_nonnegative_int(call, "num_nvl_bytes", num_nvl_bytes)
    if 0 < nvl < min_nvl_bytes:
        raise ValueError(f"{call}: num_nvl_bytes must be 0 or at least {min_nvl_bytes} (the dispatch metadata "
                         f"region), got {nvl}")
    rdma = check_nonnegative_int(call, "num_rdma_bytes", num_rdma_bytes)
    if check_nonnegative_int(call, "num_qps_per_rank", num_qps_per_rank) == 0:
        raise ValueError(f"{call}: num_qps_per_rank must be >= 1, got 0")
    return nvl, rdma


def same_on_every_rank(call: str, group: Any, **values: Any) -> None:
    """Collective (bounded): raise on every rank unless each of ``values`` is the same on every rank of
    ``group`` (symmetric memory sizes: the kernels derive offsets from them)."""
    seen = sorted(set(group.allgather(tuple(values.values()), call)))
    if len(seen) > 1:
        raise ValueError(f"{call}: {' and '.join(values)} must be the same on every rank, got "
                         f"({', '.join(values)}) pairs {seen}")


def widened_ids(topk_idx, stream):
    """``topk_idx`` as ``int64`` (the normal-mode kernels' ids), converted on ``stream`` when it is ``int32``;
    ``None`` stays ``None``."""
    if topk_idx is None or topk_idx.dtype == np.int64:
        return topk_idx
    with stream:
        return _interop.to_cupy(topk_idx).astype(np.int64)
