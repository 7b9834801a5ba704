"""GPU worker for cuep.torch, DeepEP V1's module for torch frameworks (``import cuep.torch as deep_ep``).

Run without mpirun: ``python torch_worker.py --suite {normal,low_latency,shrink} --num-ranks N`` starts N
ranks with ``torch.multiprocessing`` (spawn), joined in a gloo process group as frameworks pass it (NCCL
refuses two ranks on one GPU; here rank ``r`` uses GPU ``r % torch.cuda.device_count()`` and
``CUEP_SHARE_GPUS=1``). ``normal`` is the intranode mode, or the internode mode on virtual nodes when
``CUEP_RANKS_PER_NODE`` splits the ranks. ``CUEP_TEST_CASES`` (comma-separated function names) runs a subset.

Every rank rebuilds every rank's inputs from one seed (``common.SeededInputs``) and computes what it must
get with ``cuep.reference``: moved data (rows, FP8 bytes and scales, top-k, counts, handle items) is
compared bit for bit, reductions within the rounding they perform. Besides the results, the cases check
what a torch caller sees: dtypes (``torch.float8_e4m3fn``, float32 or packed UE8M0 int32 scales with
DeepEP's shapes and strides), ``num_recv_tokens_per_expert_list`` a list of ints, handles that are
tuples with DeepEP's items where DeepEP's users read them, ``EventOverlap``, torch streams, CUDA graphs
through ``torch.cuda.graph``, autograd, errors naming the argument before any kernel runs, and no growth
of torch's or CuPy's memory over 1000 calls. Each case is one function; ``run_cases`` runs them in
order (the order fixes each case's inputs) and every rank prints one summary line at the end.
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import sys
import traceback
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from common import (BF16, AbsoluteRows, AllInputs, RankInputs, SeededInputs, assert_sum_close, bits, environment,
                    expect_error, expert_outputs, selected_cases)

import cuep
import cuep.torch as deep_ep
from cuep import logfmt, reference

# Set in each rank by ``run_rank`` (this module is imported again in every spawned rank).
rank: int = -1
num_ranks: int = 0
GROUP: Any = None


def host(tensor) -> np.ndarray | None:
    """A torch tensor as NumPy: BF16 as ``ml_dtypes.bfloat16``, FP8 as its ``uint8`` bytes (``None`` stays)."""
    if tensor is None:
        return None
    tensor = tensor.detach().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).cpu().numpy().view(BF16)
    if tensor.dtype == torch.float8_e4m3fn:
        return tensor.view(torch.uint8).cpu().numpy()
    return tensor.cpu().numpy()


def gpu(array: np.ndarray | None):
    """A NumPy array as a tensor on this rank's GPU (BF16 as ``torch.bfloat16``; ``None`` stays)."""
    if array is None:
        return None
    array = np.ascontiguousarray(array)
    if array.dtype == BF16:
        return torch.from_numpy(array.view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(array).cuda()


def gpu_fp8(codes: np.ndarray, scales: np.ndarray, column_major: bool = False):
    """E4M3 bytes and their float32 scales as DeepEP takes them: ``(float8_e4m3fn, float32)`` tensors."""
    scales = gpu(scales)
    return gpu(codes).view(torch.float8_e4m3fn), scales.T.contiguous().T if column_major else scales


def assert_tensor(tensor, dtype, shape, what: str) -> None:
    assert isinstance(tensor, torch.Tensor), f"{what}: {type(tensor).__name__}, not a torch tensor"
    assert tensor.is_cuda and tensor.device.index == torch.cuda.current_device(), (what, tensor.device)
    assert tensor.dtype == dtype, (what, tensor.dtype, dtype)
    assert tuple(tensor.shape) == tuple(shape), (what, tuple(tensor.shape), tuple(shape))


def same_bits(got, want, what: str) -> None:
    np.testing.assert_array_equal(bits(got), bits(want), err_msg=what)


def assert_no_memory_growth(step, calls: int = 1000, warmup: int = 20, slack_bytes: int = 1 << 20) -> None:
    """``step`` ``warmup`` times, then ``calls`` times: neither torch's allocated memory nor CuPy's pool may
    grow by more than ``slack_bytes``."""
    import cupy
    pool = cupy.get_default_memory_pool()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(), pool.used_bytes()
    for _ in range(calls):
        step()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated(), pool.used_bytes()
    assert after[0] <= before[0] + slack_bytes, f"torch.cuda.memory_allocated() grew from {before[0]} to {after[0]}"
    assert after[1] <= before[1] + slack_bytes, f"CuPy's pool grew from {before[1]} to {after[1]} bytes"


def on_last_rank_only(bad_calls) -> None:
    """The last rank makes each ``(call, argument name)`` of ``bad_calls``, which must raise ``TypeError`` or
    ``ValueError`` naming the argument; the other ranks make none. A call that launched a kernel before
    raising would leave this rank out of step with the others, which the caller's next call on every rank
    (checked against the reference) would show."""
    if rank != num_ranks - 1:
        return
    for call, name in bad_calls:
        expect_error((TypeError, ValueError), call, f"no TypeError or ValueError for a bad {name}", match=name)
    torch.cuda.synchronize()


# ======================================================================================================
# Normal mode (intranode, or internode on virtual nodes)

NORMAL_SEED = 13


class Normal:
    """The normal suite's sizes, fixed once the rank count is known."""

    experts = 0
    ranks_per_node = 0
    across_nodes = False
    nvl_bytes = 512 << 20
    rdma_bytes = 0
    inputs: SeededInputs


def normal_buffer(nvl_bytes: int | None = None):
    return deep_ep.Buffer(GROUP, nvl_bytes or Normal.nvl_bytes, Normal.rdma_bytes)


def layout_of(buffer, topk):
    """``get_dispatch_layout`` as dispatch's keyword arguments."""
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, Normal.experts)
    return dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert)


def tokens_of(mine: RankInputs, column_major_scales: bool = False):
    """This rank's ``x`` as DeepEP takes it: BF16, or ``(float8_e4m3fn, float32 scales)``."""
    if mine.scales is None:
        return gpu(mine.x)
    return gpu_fp8(mine.x, mine.scales, column_major_scales)


def check_normal_handle(handle, inputs: AllInputs) -> None:
    """DeepEP's items of a normal-mode handle: on one node item 0, the rank prefix matrix `[R, R]` int32
    (entry ``[i][j]``: tokens that ranks 0..i send to rank j); across nodes item -4,
    ``recv_gbl_rank_prefix_sum`` `[R]` int32 (tokens this rank receives from ranks 0..i)."""
    assert isinstance(handle, tuple), type(handle)
    sent = np.stack([reference.get_dispatch_layout(i.topk_idx, Normal.experts, num_ranks).num_tokens_per_rank
                     for i in inputs])  # [source rank, destination rank]
    if Normal.across_nodes:
        assert_tensor(handle[-4], torch.int32, (num_ranks,), "handle[-4] (recv_gbl_rank_prefix_sum)")
        np.testing.assert_array_equal(host(handle[-4]), np.cumsum(sent[:, rank]), err_msg="recv_gbl_rank_prefix_sum")
    else:
        assert_tensor(handle[0], torch.int32, (num_ranks, num_ranks), "handle[0] (rank_prefix_matrix)")
        np.testing.assert_array_equal(host(handle[0]), np.cumsum(sent, axis=0), err_msg="rank_prefix_matrix")


def after_this_stream(buffer, options: dict) -> dict:
    """``options`` with ``previous_event=buffer.capture()`` when they ask for ``capture_previous``: captured
    now, once the call's inputs are on the current stream (the call waits for that event instead of it)."""
    if options.pop("capture_previous", False):
        captured = buffer.capture()
        assert isinstance(captured, deep_ep.EventOverlap), type(captured)
        options["previous_event"] = captured
    return options


def dispatch_and_check(buffer, inputs: AllInputs, with_topk: bool = True, num_worst_tokens: int = 0,
                       column_major_scales: bool = False, **options):
    """Layout and dispatch of this rank's inputs, every output checked against the reference (and the
    handle's DeepEP items). ``options`` go to ``dispatch``, ``capture_previous`` as :func:`after_this_stream`
    says. Returns ``(recv_x, recv_topk_weights, handle)``."""
    mine = inputs[rank]
    topk = gpu(mine.topk_idx)
    x = tokens_of(mine, column_major_scales)
    weights = gpu(mine.topk_weights) if with_topk else None
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, Normal.experts)
    want = reference.get_dispatch_layout(mine.topk_idx, Normal.experts, num_ranks, Normal.ranks_per_node)
    assert_tensor(per_rank, torch.int32, (num_ranks,), "num_tokens_per_rank")
    assert_tensor(per_expert, torch.int32, (Normal.experts,), "num_tokens_per_expert")
    assert_tensor(in_rank, torch.bool, (len(mine.x), num_ranks), "is_token_in_rank")
    np.testing.assert_array_equal(host(per_rank), want.num_tokens_per_rank)
    np.testing.assert_array_equal(host(per_expert), want.num_tokens_per_expert)
    np.testing.assert_array_equal(host(in_rank), want.is_token_in_rank)
    if Normal.across_nodes:
        assert_tensor(per_rdma, torch.int32, (num_ranks // Normal.ranks_per_node,), "num_tokens_per_rdma_rank")
        np.testing.assert_array_equal(host(per_rdma), want.num_tokens_per_rdma_rank)
    else:
        assert per_rdma is None, per_rdma

    recv_x, recv_topk, recv_weights, per_expert_list, handle, event = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk if with_topk else None, topk_weights=weights,
        num_worst_tokens=num_worst_tokens, **after_this_stream(buffer, options))
    assert isinstance(event, deep_ep.EventOverlap), type(event)
    if options.get("async_finish"):
        event.current_stream_wait()
    expected = reference.dispatch(inputs.xs, inputs.topk_idxs, Normal.experts, inputs.topk_weights, inputs.scales)[rank]
    received = len(expected.recv_x)
    rows = num_worst_tokens or received
    hidden = mine.x.shape[1]
    if mine.scales is None:
        data, scales = recv_x, None
        assert_tensor(data, torch.bfloat16, (rows, hidden), "recv_x")
    else:
        assert isinstance(recv_x, tuple) and len(recv_x) == 2, type(recv_x)
        data, scales = recv_x
        assert_tensor(data, torch.float8_e4m3fn, (rows, hidden), "recv_x[0]")
        assert_tensor(scales, torch.float32, (rows, hidden // 128), "recv_x[1] (scales)")
        assert scales.is_contiguous(), scales.stride()  # DeepEP's received scales are row-major
        same_bits(host(scales)[:received], expected.recv_scales, "received scales")
    same_bits(host(data)[:received], expected.recv_x, "received rows")
    if with_topk:
        assert_tensor(recv_topk, deep_ep.topk_idx_t, (rows, mine.topk_idx.shape[1]), "recv_topk_idx")
        assert_tensor(recv_weights, torch.float32, (rows, mine.topk_idx.shape[1]), "recv_topk_weights")
        np.testing.assert_array_equal(host(recv_topk)[:received], expected.recv_topk_idx)
        np.testing.assert_array_equal(host(recv_weights)[:received], expected.recv_topk_weights)
        assert (host(recv_topk)[received:] == -1).all() and (host(recv_weights)[received:] == 0).all()
    else:
        assert recv_topk is None and recv_weights is None
    assert type(per_expert_list) is list and all(type(n) is int for n in per_expert_list), per_expert_list
    assert per_expert_list == ([] if num_worst_tokens else expected.num_recv_tokens_per_expert), per_expert_list
    check_normal_handle(handle, inputs)
    return recv_x, recv_weights, handle


def combine_and_check(buffer, inputs: AllInputs, recv_x, recv_weights, handle, biases=None, **options) -> None:
    """Each rank scales the BF16 rows it received by (rank + 1) and combines them back (with the received
    weights, and ``biases``: one or two lists of every rank's bias); sums and weights against the reference.
    ``options`` go to ``combine``, ``capture_previous`` as :func:`after_this_stream` says."""
    all_recv = reference.dispatch(inputs.xs, inputs.topk_idxs, Normal.experts, inputs.topk_weights)
    scaled = [(r.recv_x.astype(np.float32) * (k + 1)).astype(BF16) for k, r in enumerate(all_recv)]
    rows = recv_x.shape[0]
    mine = np.zeros((rows, scaled[rank].shape[1]), dtype=BF16)  # num_worst_tokens padding rows are not combined
    mine[:len(scaled[rank])] = scaled[rank]
    bias = None
    if biases is not None:
        bias = tuple(gpu(b[rank]) for b in biases)
        bias = bias[0] if len(bias) == 1 else bias
    combined, combined_weights, event = buffer.combine(gpu(mine), handle, topk_weights=recv_weights, bias=bias,
                                                       **after_this_stream(buffer, options))
    if options.get("async_finish"):
        event.current_stream_wait()
    per_source_biases = [[b[s] for b in biases] for s in range(num_ranks)] if biases else None
    sources = [r.recv_src for r in all_recv]
    want_x, want_w = reference.combine(scaled, sources, inputs.num_tokens, [r.recv_topk_weights for r in all_recv],
                                       per_source_biases)
    magnitude, _ = reference.combine([np.abs(s.astype(np.float32)) for s in scaled], sources, inputs.num_tokens, None,
                                     [[np.abs(b.astype(np.float32)) for b in per] for per in per_source_biases]
                                     if biases else None)
    assert_tensor(combined, torch.bfloat16, (inputs.num_tokens[rank], mine.shape[1]), "combined_x")
    assert_sum_close(host(combined).astype(np.float32), want_x[rank].astype(BF16).astype(np.float32), magnitude[rank],
                     Normal.across_nodes)
    if recv_weights is None:
        assert combined_weights is None, combined_weights
    else:
        assert_tensor(combined_weights, torch.float32, want_w[rank].shape, "combined_topk_weights")
        np.testing.assert_allclose(host(combined_weights), want_w[rank], rtol=1e-6, atol=1e-6)


def bf16_normals(key: int, rows: int, hidden: int, source: int) -> np.ndarray:
    """Rank ``source``'s BF16 tokens for a cached dispatch, the same on every rank."""
    return np.random.default_rng([NORMAL_SEED, key, source]).standard_normal((rows, hidden)).astype(BF16)


# ---- cases --------------------------------------------------------------------------------------------


def layout_bf16_top8_odd_tokens_with_weights(buffer):
    assert deep_ep.topk_idx_t == torch.int64, deep_ep.topk_idx_t
    inputs = Normal.inputs(lambda s: 1001 + 3 * s, 2048, Normal.experts, 8)
    recv_x, recv_weights, handle = dispatch_and_check(buffer, inputs)
    combine_and_check(buffer, inputs, recv_x, recv_weights, handle)


def fp8_float8_e4m3fn_with_column_major_scales(buffer):
    inputs = Normal.inputs(513, 7168, Normal.experts, 8, fp8=True)
    dispatch_and_check(buffer, inputs, column_major_scales=True)


def cached_dispatch_and_combine_with_one_and_two_biases(buffer):
    """A cached dispatch of new tokens with the handle, then with the tuple rebuilt from its items (as a
    framework hands a saved handle back); each combined with one bias, then two."""
    inputs = Normal.inputs(700, 1024, Normal.experts, 6)
    _, recv_weights, handle = dispatch_and_check(buffer, inputs)
    new_x = [bf16_normals(1, 700, 1024, s) for s in range(num_ranks)]
    expected = reference.dispatch(new_x, inputs.topk_idxs, Normal.experts)[rank]
    for given in (handle, tuple(item for item in handle)):
        recv_x, recv_topk, recv_w, per_expert_list, _, _ = buffer.dispatch(gpu(new_x[rank]), handle=given)
        assert recv_topk is None and recv_w is None and per_expert_list == [], (recv_topk, recv_w, per_expert_list)
        same_bits(host(recv_x), expected.recv_x, "cached dispatch")
    biases = [[np.random.default_rng([NORMAL_SEED, 2, k, s]).standard_normal((700, 1024)).astype(BF16)
               for s in range(num_ranks)] for k in range(2)]
    new_inputs = inputs.with_tokens(new_x)
    combine_and_check(buffer, new_inputs, recv_x, recv_weights, handle, biases=biases[:1])
    combine_and_check(buffer, new_inputs, recv_x, recv_weights, tuple(handle), biases=biases)


def without_topk(buffer):
    inputs = Normal.inputs(300, 1024, Normal.experts, 4)
    recv_x, _, handle = dispatch_and_check(buffer, inputs, with_topk=False)
    combine_and_check(buffer, inputs, recv_x, None, handle)


def async_previous_event_comm_stream_on_a_torch_side_stream(buffer):
    """On a torch side stream: layout, dispatch and combine after ``previous_event=buffer.capture()``, with
    ``async_finish`` and ``allocate_on_comm_stream``, waited for with ``current_stream_wait()`` and ``with``."""
    comm_stream = buffer.get_comm_stream()
    assert isinstance(comm_stream, torch.cuda.Stream), type(comm_stream)
    side = torch.cuda.Stream()
    inputs = Normal.inputs(500, 2048, Normal.experts, 8)
    with torch.cuda.stream(side):
        recv_x, recv_weights, handle = dispatch_and_check(buffer, inputs, capture_previous=True, async_finish=True,
                                                          allocate_on_comm_stream=True)
        combine_and_check(buffer, inputs, recv_x, recv_weights, handle, capture_previous=True, async_finish=True)
        _, _, event = buffer.combine(recv_x, handle, previous_event=buffer.capture(), async_finish=True)
        with event:  # the block is queued first, then the side stream waits for the combine
            overlapped = torch.ones((256, 256), device="cuda") @ torch.ones((256, 256), device="cuda")
        assert float(overlapped[0, 0]) == 256.0
    side.synchronize()


def async_inputs_dropped_by_the_caller_keep_their_memory(buffer):
    """An ``async_finish`` dispatch whose ``x`` the caller drops at once, as a framework drops a temporary:
    torch's allocator must not hand x's memory to the tensors made next on this stream while the comm stream
    still reads it (cuep records the call's tensors on the comm stream, as DeepEP does, instead of holding
    them until a later call)."""
    inputs = Normal.inputs(2048, 4096, Normal.experts, 8)
    x = gpu(inputs[rank].x)
    recv_x, _, _, _, _, event = buffer.dispatch(x, **layout_of(buffer, gpu(inputs[rank].topk_idx)),
                                                previous_event=buffer.capture(), async_finish=True)
    del x
    # Written on this stream while the dispatch may still read x: had they taken its memory, recv_x would hold 7s.
    garbage = [torch.full((2048, 4096), 7.0, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    event.current_stream_wait()
    expected = reference.dispatch(inputs.xs, inputs.topk_idxs, Normal.experts)[rank]
    np.testing.assert_array_equal(bits(host(recv_x)), bits(expected.recv_x))
    del garbage


def num_worst_tokens_without_cpu_wait(buffer):
    inputs = Normal.inputs(lambda s: 100 + 50 * s, 1024, Normal.experts, 8)
    worst = sum(100 + 50 * s for s in range(num_ranks))
    recv_x, recv_weights, handle = dispatch_and_check(buffer, inputs, num_worst_tokens=worst)
    combine_and_check(buffer, inputs, recv_x, recv_weights, handle)


def zero_tokens_on_rank_1(buffer):
    inputs = Normal.inputs(lambda s: 0 if s == 1 else 400, 1024, Normal.experts, 8)
    recv_x, recv_weights, handle = dispatch_and_check(buffer, inputs)
    combine_and_check(buffer, inputs, recv_x, recv_weights, handle)


class DispatchFunction(torch.autograd.Function):
    """DeepEP README's training dispatch: forward dispatches the tokens, backward combines their gradients."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, buffer, saved: dict):
        recv_x, _, recv_weights, _, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                                                               **layout_of(buffer, topk_idx))
        ctx.buffer, ctx.handle = buffer, handle
        saved["handle"] = handle
        ctx.mark_non_differentiable(recv_weights)
        return recv_x, recv_weights

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_weights):
        grad_x, _, _ = ctx.buffer.combine(grad_recv_x.contiguous(), ctx.handle)
        return grad_x, None, None, None, None


class CombineFunction(torch.autograd.Function):
    """DeepEP README's training combine: forward combines, backward dispatches the gradient with the handle."""

    @staticmethod
    def forward(ctx, x, buffer, handle):
        combined, _, _ = buffer.combine(x, handle)
        ctx.buffer, ctx.handle = buffer, handle
        return combined

    @staticmethod
    def backward(ctx, grad_combined):
        grad_x, _, _, _, _, _ = ctx.buffer.dispatch(grad_combined.contiguous(), handle=ctx.handle)
        return grad_x, None, None


def autograd_layer_forward_and_gradient(buffer):
    """y = combine((rank + 1) * dispatch(x)): each token comes back as x times the sum of (r + 1) over the
    ranks r it reached, and so does its gradient, the dispatch of dL/dy back and its combine."""
    inputs = Normal.inputs(lambda s: 300 + 11 * s, 1024, Normal.experts, 8)
    mine = inputs[rank]
    grads = [bf16_normals(3, len(i.x), 1024, s) for s, i in enumerate(inputs)]
    x = gpu(mine.x).requires_grad_()
    saved = {}
    recv_x, _ = DispatchFunction.apply(x, gpu(mine.topk_idx), gpu(mine.topk_weights), buffer, saved)
    expert_out = recv_x * torch.tensor(rank + 1, dtype=torch.bfloat16, device="cuda")
    y = CombineFunction.apply(expert_out, buffer, saved["handle"])
    y.backward(gpu(grads[rank]))
    in_rank = reference.get_dispatch_layout(mine.topk_idx, Normal.experts, num_ranks).is_token_in_rank
    factor = (in_rank * np.arange(1, num_ranks + 1)).sum(axis=1, keepdims=True).astype(np.float32)
    for got, source, what in ((y, mine.x, "forward"), (x.grad, grads[rank], "gradient")):
        assert_tensor(got, torch.bfloat16, source.shape, what)
        want = source.astype(np.float32) * factor
        # (r + 1) x rounded to BF16 at each rank, the sum rounded once more (and, across nodes, each
        # node's partial): within 2^-7 of sum (r + 1) |x|
        excess = np.abs(host(got).astype(np.float32) - want) - (np.abs(want) * 2.0 ** -7 + 1e-6)
        assert (excess <= 0).all(), (what, float(excess.max()))


def bad_inputs_raise_before_any_kernel(buffer):
    """CPU tensors, wrong dtypes, non-contiguous tensors and foreign or malformed handles raise naming the
    argument, on the last rank alone; then every rank's next calls still match the reference."""
    inputs = Normal.inputs(200, 1024, Normal.experts, 4)
    recv_x, recv_weights, handle = dispatch_and_check(buffer, inputs)
    other = normal_buffer(64 << 20)
    other_inputs = Normal.inputs(200, 1024, Normal.experts, 4)
    other_x = other_inputs[rank]
    _, _, _, _, other_handle, _ = other.dispatch(gpu(other_x.x), topk_idx=gpu(other_x.topk_idx),
                                                 topk_weights=gpu(other_x.topk_weights),
                                                 **layout_of(other, gpu(other_x.topk_idx)))
    mine = inputs[rank]
    x, topk, weights = gpu(mine.x), gpu(mine.topk_idx), gpu(mine.topk_weights)
    layout = layout_of(buffer, topk)
    wide_x = torch.zeros((x.shape[0], 2 * x.shape[1]), dtype=torch.bfloat16, device="cuda")
    wide_topk = torch.zeros((topk.shape[0], 2 * topk.shape[1]), dtype=torch.int64, device="cuda")
    on_last_rank_only([
        (lambda: buffer.get_dispatch_layout(topk.cpu(), Normal.experts), "topk_idx"),
        (lambda: buffer.get_dispatch_layout(topk.float(), Normal.experts), "topk_idx"),
        (lambda: buffer.get_dispatch_layout(wide_topk[:, ::2], Normal.experts), "topk_idx"),
        (lambda: buffer.dispatch(x.cpu(), **layout), "x"),
        (lambda: buffer.dispatch(x.float(), **layout), "x"),
        (lambda: buffer.dispatch(wide_x[:, ::2], **layout), "x"),
        (lambda: buffer.dispatch(x, topk_idx=topk, topk_weights=weights.double(), **layout), "topk_weights"),
        (lambda: buffer.dispatch(x, topk_idx=topk, topk_weights=weights.cpu(), **layout), "topk_weights"),
        (lambda: buffer.dispatch(x, **{**layout, "is_token_in_rank": layout["is_token_in_rank"].int()}),
         "is_token_in_rank"),
        (lambda: buffer.dispatch(x, **{**layout, "num_tokens_per_rank": layout["num_tokens_per_rank"].cpu()}),
         "num_tokens_per_rank"),
        (lambda: buffer.dispatch(x[:100], handle=handle), "handle"),
        (lambda: buffer.dispatch(x, handle=other_handle), "handle"),
        (lambda: buffer.dispatch(x, handle=handle[:-1]), "handle"),
        (lambda: buffer.combine(recv_x.float(), handle), "x"),
        (lambda: buffer.combine(recv_x.cpu(), handle), "x"),
        (lambda: buffer.combine(recv_x, handle, topk_weights=recv_weights.half()), "topk_weights"),
        (lambda: buffer.combine(recv_x, other_handle), "handle"),
        (lambda: buffer.combine(recv_x, handle[:-1]), "handle"),
    ])
    dist.barrier(group=GROUP)
    combine_and_check(buffer, inputs, recv_x, recv_weights, handle)
    zero_tokens_on_rank_1(buffer)
    other.destroy()


def a_group_that_is_not_the_nvshmem_world_raises(buffer):
    """A Buffer over a group of rank 0 alone, while the process's NVSHMEM world holds every rank."""
    alone = dist.new_group([0])
    if rank == 0:
        expect_error((TypeError, ValueError), lambda: deep_ep.Buffer(alone, 1 << 20),
                     "a Buffer over a group that is not the NVSHMEM world was created", match="group")
    dist.barrier(group=GROUP)
    zero_tokens_on_rank_1(buffer)


def thousand_calls_hold_no_memory(buffer):
    mine = Normal.inputs(64, 256, Normal.experts, 8)[rank]
    x, topk, weights = gpu(mine.x), gpu(mine.topk_idx), gpu(mine.topk_weights)

    def step():
        recv_x, _, recv_weights, _, handle, _ = buffer.dispatch(x, topk_idx=topk, topk_weights=weights,
                                                                **layout_of(buffer, topk))
        buffer.combine(recv_x, handle, topk_weights=recv_weights)
    assert_no_memory_growth(step)


def local_buffer_tensor_views_the_buffer(buffer):
    """get_local_buffer_tensor: torch views of the NVL buffer (on this rank's GPU, any dtype, FP8 as
    float8_e4m3fn), two of them over the same bytes. The staging the views touch is rewritten by the next
    dispatch before any kernel reads it; every rank synchronises before going on."""
    words = buffer.get_local_buffer_tensor(torch.int32, torch.Size([4, 32]), offset=buffer.num_nvl_bytes - 1024)
    assert_tensor(words, torch.int32, (4, 32), "get_local_buffer_tensor(int32)")
    assert words.device == torch.device("cuda", torch.cuda.current_device()), words.device
    raw = buffer.get_local_buffer_tensor(torch.float8_e4m3fn, 512, offset=buffer.num_nvl_bytes - 1024)
    assert_tensor(raw, torch.float8_e4m3fn, (512,), "get_local_buffer_tensor(float8_e4m3fn)")
    words.copy_(torch.arange(128, dtype=torch.int32, device=words.device).view(4, 32))
    torch.cuda.synchronize()
    assert raw.view(torch.uint8)[:8].tolist() == [0, 0, 0, 0, 1, 0, 0, 0], raw.view(torch.uint8)[:8]
    whole = buffer.get_local_buffer_tensor(torch.bfloat16)
    assert whole.numel() == buffer.num_nvl_bytes // 2 and whole.dtype == torch.bfloat16, (whole.numel(), whole.dtype)
    dist.barrier(group=GROUP)


def normal_suite():
    Normal.experts = 16 * num_ranks
    Normal.ranks_per_node = int(os.environ.get("CUEP_RANKS_PER_NODE") or num_ranks)
    Normal.across_nodes = Normal.ranks_per_node < num_ranks
    # Across nodes the RDMA partitions must hold the largest case's tokens (1024 of hidden 7168).
    Normal.rdma_bytes = cuep.Config().get_rdma_buffer_size_hint(2 * 7168, num_ranks, num_tokens=1024) \
        if Normal.across_nodes else 0
    Normal.inputs = SeededInputs(NORMAL_SEED, num_ranks)
    buffer = normal_buffer()
    cases = [layout_bf16_top8_odd_tokens_with_weights, fp8_float8_e4m3fn_with_column_major_scales,
             cached_dispatch_and_combine_with_one_and_two_biases, without_topk,
             async_previous_event_comm_stream_on_a_torch_side_stream,
             async_inputs_dropped_by_the_caller_keep_their_memory, num_worst_tokens_without_cpu_wait,
             zero_tokens_on_rank_1, autograd_layer_forward_and_gradient, bad_inputs_raise_before_any_kernel,
             a_group_that_is_not_the_nvshmem_world_raises, local_buffer_tensor_views_the_buffer,
             thousand_calls_hold_no_memory]
    layout = (f"{num_ranks // Normal.ranks_per_node} nodes x {Normal.ranks_per_node}" if Normal.across_nodes
              else "one node")
    return [functools.partial(case, buffer) for case in cases], buffer.destroy, layout


# ======================================================================================================
# Low-latency mode

LL_SEED = 17
MAX_TOKENS = 128


class LowLatency:
    experts = 0
    few_experts = 0
    rdma_bytes = 0
    inputs: SeededInputs


def check_low_latency_handle(handle, expected, num_experts: int, hidden: int) -> None:
    """DeepEP's items of a low-latency handle: item 0 `[E_local, R * T]` int32, the source token of each
    received row; item 1 `[E_local, R]` int64, ``(begin << 32) | count`` of each source rank's rows; then
    ``num_max_dispatch_tokens_per_rank``, ``hidden``, ``num_experts``."""
    assert isinstance(handle, tuple), type(handle)
    local, rows = num_experts // num_ranks, num_ranks * MAX_TOKENS
    assert_tensor(handle[0], torch.int32, (local, rows), "handle[0] (source token of each row)")
    assert_tensor(handle[1], torch.int64, (local, num_ranks), "handle[1] (begin << 32 | count per source)")
    assert [int(v) for v in handle[2:5]] == [MAX_TOKENS, hidden, num_experts], handle[2:5]
    source_tokens, ranges = host(handle[0]), host(handle[1])
    for e, pairs in enumerate(expected.recv_src):
        np.testing.assert_array_equal(source_tokens[e, :len(pairs)], pairs[:, 1], err_msg=f"handle[0][{e}]")
        for s in range(num_ranks):
            from_s = np.flatnonzero(pairs[:, 0] == s)
            begin, count = int(ranges[e, s]) >> 32, int(ranges[e, s]) & 0xFFFFFFFF
            assert count == len(from_s), (e, s, count, len(from_s))
            if count:
                assert begin == from_s[0], (e, s, begin, from_s[0])


def check_low_latency_received(received, recv_count, handle, expected, num_experts: int, hidden: int,
                               use_fp8: bool, use_ue8m0: bool = False) -> None:
    """What a low-latency dispatch returned, against one rank's reference result: DeepEP's dtypes, shapes
    and strides, the counts, every received row (and its scales) and the handle's items."""
    local, rows = num_experts // num_ranks, num_ranks * MAX_TOKENS
    assert_tensor(recv_count, torch.int32, (local,), "recv_count")
    counts = host(recv_count)
    np.testing.assert_array_equal(counts, expected.recv_count)
    if use_fp8:
        assert isinstance(received, tuple) and len(received) == 2, type(received)
        data, scales = received
        assert_tensor(data, torch.float8_e4m3fn, (local, rows, hidden), "recv_x[0]")
        columns = hidden // (512 if use_ue8m0 else 128)
        assert_tensor(scales, torch.int32 if use_ue8m0 else torch.float32, (local, rows, columns), "recv_x[1]")
        assert scales.stride() == (columns * rows, 1, rows), f"scales strides {scales.stride()}: not DeepEP's"
        scales = host(scales)
    else:
        data, scales = received, None
        assert_tensor(data, torch.bfloat16, (local, rows, hidden), "recv_x")
    data = host(data)
    for e, n in enumerate(counts):
        same_bits(data[e, :n], expected.recv_x[e, :n], f"rows of local expert {e}")
        if use_fp8:
            np.testing.assert_array_equal(scales[e, :n], expected.recv_scales[e, :n], err_msg=f"scales of {e}")
    check_low_latency_handle(handle, expected, num_experts, hidden)


def ll_dispatch_and_check(buffer, inputs: AllInputs, num_experts: int, use_fp8=True, round_scale=False,
                          use_ue8m0=False, hook=False, async_finish=False, stats=None):
    mine = inputs[rank]
    received, recv_count, handle, event, recv_hook = buffer.low_latency_dispatch(
        gpu(mine.x), gpu(mine.topk_idx), MAX_TOKENS, num_experts, cumulative_local_expert_recv_stats=stats,
        use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0, async_finish=async_finish,
        return_recv_hook=hook)
    assert isinstance(event, deep_ep.EventOverlap), type(event)
    assert (recv_hook is not None) == hook, recv_hook
    if hook:
        recv_hook()
    if async_finish:
        event.current_stream_wait()
    expected = reference.low_latency_dispatch(inputs.xs, inputs.topk_idxs, num_experts, MAX_TOKENS, use_fp8,
                                              round_scale, use_ue8m0)
    check_low_latency_received(received, recv_count, handle, expected[rank], num_experts, mine.x.shape[1], use_fp8,
                               use_ue8m0)
    return handle, expected


def check_combined(combined, inputs: AllInputs, outputs, num_experts: int, relative: float = 2.0 ** -7) -> None:
    """The combine's BF16 result within ``relative`` of sum_k |w_k x_k| of the reference (BF16 partials:
    each rank's partial rounded once, then the sum: 2^-7)."""
    weights = inputs.topk_weights
    want = reference.low_latency_combine(outputs, inputs.topk_idxs, weights, num_experts)[rank]
    bound = reference.low_latency_combine([AbsoluteRows(o) for o in outputs], inputs.topk_idxs,
                                          [np.abs(w) for w in weights], num_experts)[rank]
    assert_tensor(combined, torch.bfloat16, want.shape, "combined_x")
    excess = np.abs(host(combined).astype(np.float32) - want) - (bound * relative + 1e-6)
    assert (excess <= 0).all(), float(excess.max())


def ll_combine_and_check(buffer, inputs: AllInputs, expected, num_experts: int, handle, hook=False,
                         async_finish=False, use_logfmt=False, relative=2.0 ** -7):
    outputs = expert_outputs(expected, num_experts)
    mine = inputs[rank]
    combined, event, recv_hook = buffer.low_latency_combine(gpu(outputs[rank]), gpu(mine.topk_idx),
                                                            gpu(mine.topk_weights), handle, use_logfmt=use_logfmt,
                                                            async_finish=async_finish, return_recv_hook=hook)
    assert (recv_hook is not None) == hook, recv_hook
    if hook:
        recv_hook()
    if async_finish:
        event.current_stream_wait()
    check_combined(combined, inputs, outputs, num_experts, relative)


# ---- cases --------------------------------------------------------------------------------------------


def fp8_top8_hidden_7168_uneven_tokens_handle_items(buffer):
    inputs = LowLatency.inputs(lambda s: MAX_TOKENS - 17 * s, 7168, LowLatency.experts, 8)
    handle, expected = ll_dispatch_and_check(buffer, inputs, LowLatency.experts)
    ll_combine_and_check(buffer, inputs, expected, LowLatency.experts, handle)


def fp8_round_scale_and_packed_ue8m0_scales(buffer):
    for use_ue8m0 in (False, True):
        inputs = LowLatency.inputs(100, 2048, LowLatency.experts, 8)
        handle, expected = ll_dispatch_and_check(buffer, inputs, LowLatency.experts, round_scale=True,
                                                 use_ue8m0=use_ue8m0)
        ll_combine_and_check(buffer, inputs, expected, LowLatency.experts, handle)


def bf16_zero_tokens_on_rank_1_zero_copy_and_out(buffer):
    """The expert outputs written into ``get_next_low_latency_combine_buffer(handle)``, combined with
    ``zero_copy=True`` into ``out=``: passing that buffer as ``x``, and passing the original tensor (as
    DeepEP's test does)."""
    for pass_the_buffer in (True, False):
        inputs = LowLatency.inputs(lambda s: 0 if s == 1 else 77, 2048, LowLatency.few_experts, 8, masked=0.3)
        handle, expected = ll_dispatch_and_check(buffer, inputs, LowLatency.few_experts, use_fp8=False)
        outputs = expert_outputs(expected, LowLatency.few_experts)
        x = gpu(outputs[rank])
        target = buffer.get_next_low_latency_combine_buffer(handle)
        assert_tensor(target, torch.bfloat16, x.shape, "get_next_low_latency_combine_buffer()")
        target[:, :, :] = x
        out = torch.empty((len(inputs[rank].x), 2048), dtype=torch.bfloat16, device="cuda")
        mine = inputs[rank]
        combined, _, _ = buffer.low_latency_combine(target if pass_the_buffer else x, gpu(mine.topk_idx),
                                                    gpu(mine.topk_weights), handle, zero_copy=True, out=out)
        assert combined.data_ptr() == out.data_ptr() or out.numel() == 0, "the combine did not write into out="
        check_combined(out, inputs, outputs, LowLatency.few_experts)


def hooks_two_micro_batches_in_flight(buffer):
    batches = [LowLatency.inputs(MAX_TOKENS, 7168, LowLatency.experts, 8) for _ in range(2)]
    sent = [buffer.low_latency_dispatch(gpu(b[rank].x), gpu(b[rank].topk_idx), MAX_TOKENS, LowLatency.experts,
                                        return_recv_hook=True) for b in batches]
    combines = []
    for inputs, (received, recv_count, handle, _, hook) in zip(batches, sent, strict=True):
        hook()
        expected = reference.low_latency_dispatch(inputs.xs, inputs.topk_idxs, LowLatency.experts, MAX_TOKENS)
        check_low_latency_received(received, recv_count, handle, expected[rank], LowLatency.experts, 7168, True)
        outputs = expert_outputs(expected, LowLatency.experts)
        mine = inputs[rank]
        combined, _, combine_hook = buffer.low_latency_combine(gpu(outputs[rank]), gpu(mine.topk_idx),
                                                               gpu(mine.topk_weights), handle, return_recv_hook=True)
        combines.append((inputs, outputs, combined, combine_hook))
    for inputs, outputs, combined, combine_hook in combines:
        combine_hook()
        check_combined(combined, inputs, outputs, LowLatency.experts)


def async_finish_and_cumulative_stats(buffer):
    stats = torch.zeros(LowLatency.experts // num_ranks, dtype=torch.int32, device="cuda")
    total = np.zeros(LowLatency.experts // num_ranks, dtype=np.int64)
    for _ in range(2):
        inputs = LowLatency.inputs(90, 2048, LowLatency.experts, 8)
        handle, expected = ll_dispatch_and_check(buffer, inputs, LowLatency.experts, async_finish=True, stats=stats)
        total += expected[rank].recv_count
        ll_combine_and_check(buffer, inputs, expected, LowLatency.experts, handle, async_finish=True)
    np.testing.assert_array_equal(host(stats), total)


def logfmt_combine_bf16_and_fp8_dispatch(buffer):
    """LogFMT partials: each element within ``logfmt.MAX_RELATIVE_ERROR`` (BF16 blocks 2^-8), then the
    result's BF16 rounding."""
    relative = logfmt.MAX_RELATIVE_ERROR + 2.0 ** -8 * (1 + logfmt.MAX_RELATIVE_ERROR) + 2.0 ** -16
    for hidden, use_fp8 in ((2048, False), (7168, True)):
        inputs = LowLatency.inputs(MAX_TOKENS, hidden, LowLatency.experts, 8)
        handle, expected = ll_dispatch_and_check(buffer, inputs, LowLatency.experts, use_fp8=use_fp8)
        ll_combine_and_check(buffer, inputs, expected, LowLatency.experts, handle, use_logfmt=True, relative=relative)


def put_path_without_nvlink():
    put = deep_ep.Buffer(GROUP, 0, LowLatency.rdma_bytes, low_latency_mode=True,
                         allow_nvlink_for_low_latency_mode=False)
    for use_fp8 in (True, False):
        inputs = LowLatency.inputs(MAX_TOKENS - 5, 7168, LowLatency.experts, 8)
        handle, expected = ll_dispatch_and_check(put, inputs, LowLatency.experts, use_fp8=use_fp8)
        ll_combine_and_check(put, inputs, expected, LowLatency.experts, handle)
    put.destroy()


def cuda_graph_captured_with_torch_replayed_with_new_inputs(buffer):
    """Dispatch (BF16) and combine of the received rows captured once with ``torch.cuda.graph``; each of 5
    replays after new inputs were copied into the captured tensors moves and combines those inputs."""
    hidden, num_topk = 2048, 8
    first = LowLatency.inputs(MAX_TOKENS, hidden, LowLatency.experts, num_topk)[rank]
    x, topk, weights = gpu(first.x), gpu(first.topk_idx), gpu(first.topk_weights)

    def step():
        received, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, topk, MAX_TOKENS, LowLatency.experts,
                                                                         use_fp8=False)
        combined, _, _ = buffer.low_latency_combine(received, topk, weights, handle)
        return received, recv_count, handle, combined

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture, as torch.cuda.graph asks
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        received, recv_count, handle, combined = step()
    for _ in range(5):
        inputs = LowLatency.inputs(MAX_TOKENS, hidden, LowLatency.experts, num_topk)
        expected = reference.low_latency_dispatch(inputs.xs, inputs.topk_idxs, LowLatency.experts, MAX_TOKENS,
                                                  use_fp8=False)
        x.copy_(gpu(inputs[rank].x))
        topk.copy_(gpu(inputs[rank].topk_idx))
        weights.copy_(gpu(inputs[rank].topk_weights))
        graph.replay()
        torch.cuda.synchronize()
        check_low_latency_received(received, recv_count, handle, expected[rank], LowLatency.experts, hidden, False)
        check_combined(combined, inputs, [e.recv_x for e in expected], LowLatency.experts)


def profile_shows_one_dispatch_and_one_combine_kernel(buffer):
    """As DeepEP's ``bench_kineto`` reads a profile: one kernel name containing ``dispatch`` and one
    containing ``combine``; with receive hooks each call shows twice under ``::dispatch`` / ``::combine``
    (send, then receive). Kernel names only: nothing is timed."""
    mine = LowLatency.inputs(MAX_TOKENS, 7168, LowLatency.experts, 8)[rank]
    x, topk, weights = gpu(mine.x), gpu(mine.topk_idx), gpu(mine.topk_weights)
    expert_x = torch.zeros((LowLatency.experts // num_ranks, num_ranks * MAX_TOKENS, 7168), dtype=torch.bfloat16,
                           device="cuda")
    torch.cuda.synchronize()
    for hooks in (False, True):
        dist.barrier(group=GROUP)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            _, _, handle, _, hook = buffer.low_latency_dispatch(x, topk, MAX_TOKENS, LowLatency.experts,
                                                                return_recv_hook=hooks)
            if hooks:
                hook()
            _, _, hook = buffer.low_latency_combine(expert_x, topk, weights, handle, return_recv_hook=hooks)
            if hooks:
                hook()
            torch.cuda.synchronize()
        names = [event.key for event in profile.key_averages()]
        events = [event.name for event in profile.events()]
        for word in ("dispatch", "combine"):
            assert sum(word in name for name in names) == 1, (word, names)
            if hooks:
                assert sum(f"::{word}" in name for name in events) == 2, (word, events)


def bad_inputs_raise_before_any_kernel_ll(buffer):
    """CPU tensors, wrong dtypes, non-contiguous tensors and foreign or malformed handles raise naming the
    argument, on the last rank alone; then every rank's combine of the same dispatch matches the reference."""
    experts = LowLatency.few_experts
    inputs = LowLatency.inputs(64, 1024, experts, 4)
    other = deep_ep.Buffer(GROUP, 0, LowLatency.rdma_bytes, low_latency_mode=True)
    mine = inputs[rank]
    x, topk, weights = gpu(mine.x), gpu(mine.topk_idx), gpu(mine.topk_weights)
    _, _, other_handle, _, _ = other.low_latency_dispatch(x, topk, MAX_TOKENS, experts, use_fp8=False)
    handle, expected = ll_dispatch_and_check(buffer, inputs, experts, use_fp8=False)
    expert_x = gpu(expert_outputs(expected, experts)[rank])
    wide_x = torch.zeros((x.shape[0], 2 * x.shape[1]), dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(x)
    stats64 = torch.zeros(experts // num_ranks, dtype=torch.int64, device="cuda")
    on_last_rank_only([
        (lambda: buffer.low_latency_dispatch(x.cpu(), topk, MAX_TOKENS, experts), "x"),
        (lambda: buffer.low_latency_dispatch(x.float(), topk, MAX_TOKENS, experts), "x"),
        (lambda: buffer.low_latency_dispatch(wide_x[:, ::2], topk, MAX_TOKENS, experts), "x"),
        (lambda: buffer.low_latency_dispatch(x, topk.cpu(), MAX_TOKENS, experts), "topk_idx"),
        (lambda: buffer.low_latency_dispatch(x, topk.float(), MAX_TOKENS, experts), "topk_idx"),
        (lambda: buffer.low_latency_dispatch(x, topk, MAX_TOKENS, experts, cumulative_local_expert_recv_stats=stats64),
         "cumulative_local_expert_recv_stats"),
        (lambda: buffer.low_latency_combine(expert_x.float(), topk, weights, handle), "x"),
        (lambda: buffer.low_latency_combine(expert_x, topk, weights.cpu(), handle), "topk_weights"),
        (lambda: buffer.low_latency_combine(expert_x, topk, weights.double(), handle), "topk_weights"),
        (lambda: buffer.low_latency_combine(expert_x, topk, weights, handle, out=out.float()), "out"),
        (lambda: buffer.low_latency_combine(expert_x, topk, weights, handle, out=out.cpu()), "out"),
        (lambda: buffer.low_latency_combine(expert_x, topk, weights, handle[:2]), "handle"),
        (lambda: buffer.low_latency_combine(expert_x, topk, weights, other_handle), "handle"),
    ])
    dist.barrier(group=GROUP)
    ll_combine_and_check(buffer, inputs, expected, experts, handle)
    other.destroy()


def clean_low_latency_buffer_between_calls(buffer):
    buffer.clean_low_latency_buffer(MAX_TOKENS, 7168, LowLatency.experts)
    inputs = LowLatency.inputs(MAX_TOKENS, 2048, LowLatency.experts, 8)
    handle, expected = ll_dispatch_and_check(buffer, inputs, LowLatency.experts)
    ll_combine_and_check(buffer, inputs, expected, LowLatency.experts, handle)


def outputs_let_go_of_come_back_and_held_ones_keep_their_rows(buffer):
    """A step's tensors come back to the next step as the same tensors once the caller has let go of them;
    one still held in any way (the FP8 pair, a view, a tensor of the handle, a slice of the combined tokens)
    keeps its contents through the steps after it. Every step is checked against the reference."""
    experts = LowLatency.experts

    def step(inputs):
        mine = inputs[rank]
        received, recv_count, handle, _, _ = buffer.low_latency_dispatch(gpu(mine.x), gpu(mine.topk_idx), MAX_TOKENS,
                                                                        experts, use_fp8=True)
        expected = reference.low_latency_dispatch(inputs.xs, inputs.topk_idxs, experts, MAX_TOKENS, True)
        outputs = expert_outputs(expected, experts)
        combined, _, _ = buffer.low_latency_combine(gpu(outputs[rank]), gpu(mine.topk_idx), gpu(mine.topk_weights),
                                                    handle)
        check_low_latency_received(received, recv_count, handle, expected[rank], experts, mine.x.shape[1], True)
        check_combined(combined, inputs, outputs, experts)
        return received, recv_count, handle, combined

    def identities_of_a_step():  # everything the step returned is let go of on return
        received, recv_count, _, combined = step(LowLatency.inputs(96, 2048, experts, 8))
        return id(received[0]), id(received[1]), id(recv_count), id(combined), received[0].data_ptr()

    assert identities_of_a_step() == identities_of_a_step(), \
        "a step's tensors, let go of, did not come back to the next step"
    for hold in ("the FP8 pair", "a uint8 view of the data", "the handle's first tensor", "a slice of the combined"):
        received, recv_count, handle, combined = step(LowLatency.inputs(96, 2048, experts, 8))
        held = {"the FP8 pair": lambda: received, "a uint8 view of the data": lambda: received[0].view(torch.uint8),
                "the handle's first tensor": lambda: handle[0], "a slice of the combined": lambda: combined[3:40]}[hold]()
        contents = [host(t).copy() for t in (held if isinstance(held, tuple) else (held,))]
        del received, recv_count, handle, combined
        step(LowLatency.inputs(96, 2048, experts, 8))
        torch.cuda.synchronize()
        for got, want in zip((held if isinstance(held, tuple) else (held,)), contents):
            same_bits(host(got), want, f"held {hold}, after a later step")
        del held


def thousand_calls_hold_no_memory_ll(buffer):
    mine = LowLatency.inputs(64, 1024, LowLatency.few_experts, 4)[rank]
    x, topk, weights = gpu(mine.x), gpu(mine.topk_idx), gpu(mine.topk_weights)

    def step():
        received, _, handle, _, _ = buffer.low_latency_dispatch(x, topk, MAX_TOKENS, LowLatency.few_experts,
                                                                use_fp8=False)
        buffer.low_latency_combine(received, topk, weights, handle)
    assert_no_memory_growth(step)


def low_latency_suite():
    LowLatency.experts, LowLatency.few_experts = 16 * num_ranks, 4 * num_ranks
    LowLatency.rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, 7168, num_ranks,
                                                                         LowLatency.experts)
    LowLatency.inputs = SeededInputs(LL_SEED, num_ranks)
    buffer = deep_ep.Buffer(GROUP, 0, LowLatency.rdma_bytes, low_latency_mode=True, num_qps_per_rank=16)
    on_buffer = [fp8_top8_hidden_7168_uneven_tokens_handle_items, fp8_round_scale_and_packed_ue8m0_scales,
                 bf16_zero_tokens_on_rank_1_zero_copy_and_out, hooks_two_micro_batches_in_flight,
                 async_finish_and_cumulative_stats, logfmt_combine_bf16_and_fp8_dispatch,
                 cuda_graph_captured_with_torch_replayed_with_new_inputs,
                 profile_shows_one_dispatch_and_one_combine_kernel, bad_inputs_raise_before_any_kernel_ll,
                 clean_low_latency_buffer_between_calls, thousand_calls_hold_no_memory_ll,
                 outputs_let_go_of_come_back_and_held_ones_keep_their_rows]
    cases = [functools.partial(case, buffer) for case in on_buffer] + [put_path_without_nvlink]
    return cases, buffer.destroy, "one node"


# ======================================================================================================
# Shrink mode (low latency): the last rank stops, the others mask it and go on

SHRINK_SEED = 29
SHRINK_TIMEOUT_S = 2.0
SHRINK_HIDDEN = 2048
SHRINK_TOPK = 8


class Shrink:
    victim = -1
    experts = 0
    live: Any = None          # the group of every rank but the victim
    inputs: SeededInputs


class Planned(NamedTuple):
    """One dispatch + combine, worked out before any rank makes it (host work between calls that takes
    the ranks different times must not get a live peer masked)."""

    expected: list            # every rank's reference dispatch result
    outputs: list             # every rank's expert outputs (the combine's x)
    routing: AllInputs        # the routing the combine's result is checked against
    x: Any                    # this rank's arguments, as tensors
    topk: Any
    weights: Any
    expert_x: Any


def plan(victim_away: bool = False) -> Planned:
    """The next inputs (every rank draws them, calling or not), and what a call on them must give: with
    ``victim_away`` the victim sends nothing and the live ranks' entries naming its experts count as -1."""
    inputs = Shrink.inputs(MAX_TOKENS, SHRINK_HIDDEN, Shrink.experts, SHRINK_TOPK)
    sent = inputs
    if victim_away:
        per_rank = Shrink.experts // num_ranks
        sent = AllInputs()
        for s, i in enumerate(inputs):
            if s == Shrink.victim:
                sent.append(RankInputs(i.x[:0], None, i.topk_idx[:0], i.topk_weights[:0]))
            else:
                names_victim = (i.topk_idx >= 0) & (i.topk_idx // per_rank == Shrink.victim)
                sent.append(i._replace(topk_idx=np.where(names_victim, -1, i.topk_idx)))
    expected = reference.low_latency_dispatch(sent.xs, sent.topk_idxs, Shrink.experts, MAX_TOKENS)
    outputs = expert_outputs(expected, Shrink.experts)
    mine = inputs[rank]
    return Planned(expected, outputs, sent, gpu(mine.x), gpu(mine.topk_idx), gpu(mine.topk_weights),
                   gpu(outputs[rank]))


def call_and_check(buffer, p: Planned, group) -> None:
    """``p``'s dispatch and combine right after a barrier of ``group`` (the ranks making it), checked."""
    torch.cuda.synchronize()
    dist.barrier(group=group)
    received, recv_count, handle, _, _ = buffer.low_latency_dispatch(p.x, p.topk, MAX_TOKENS, Shrink.experts)
    combined, _, _ = buffer.low_latency_combine(p.expert_x, p.topk, p.weights, handle)
    torch.cuda.synchronize()
    check_low_latency_received(received, recv_count, handle, p.expected[rank], Shrink.experts, SHRINK_HIDDEN, True)
    check_combined(combined, p.routing, p.outputs, Shrink.experts)


def check_mask(buffer, masked=()) -> None:
    status = torch.full((num_ranks,), -1, dtype=torch.int32, device="cuda")
    buffer.low_latency_query_mask_buffer(status)
    want = np.zeros(num_ranks, dtype=np.int32)
    want[list(masked)] = 1
    np.testing.assert_array_equal(host(status), want, err_msg=f"the mask rank {rank} sees")


def full_call(buffer) -> None:
    """Every rank makes a call: full results, nobody masked."""
    call_and_check(buffer, plan(), GROUP)
    check_mask(buffer)
    dist.barrier(group=GROUP)


def clean_and_call_with_every_rank(buffer) -> None:
    torch.cuda.synchronize()
    dist.barrier(group=GROUP)
    buffer.low_latency_clean_mask_buffer()
    check_mask(buffer)
    full_call(buffer)


def victim_stops_at_a_dispatch(buffer):
    """The victim makes no call for a while (its process waits at a gloo barrier): the live ranks' first call
    masks it and returns the results without it, the next one too; after a clean every rank is back."""
    full_call(buffer)
    masking, later = plan(victim_away=True), plan(victim_away=True)
    if rank != Shrink.victim:
        call_and_check(buffer, masking, Shrink.live)
        dist.barrier(group=Shrink.live)
        check_mask(buffer, {Shrink.victim})
        call_and_check(buffer, later, Shrink.live)
        check_mask(buffer, {Shrink.victim})
    dist.barrier(group=GROUP)
    clean_and_call_with_every_rank(buffer)


def victim_masked_by_hand(buffer):
    """Rank 0 masks the victim with ``low_latency_update_mask_buffer``; a call on the live ranks alone
    leaves it out on every live rank."""
    full_call(buffer)
    alone = plan(victim_away=True)
    if rank == 0:
        buffer.low_latency_update_mask_buffer(Shrink.victim, True)
        check_mask(buffer, {Shrink.victim})
    if rank != Shrink.victim:
        call_and_check(buffer, alone, Shrink.live)
        dist.barrier(group=Shrink.live)
        check_mask(buffer, {Shrink.victim})
    dist.barrier(group=GROUP)
    clean_and_call_with_every_rank(buffer)


def shrink_suite():
    Shrink.victim, Shrink.experts = num_ranks - 1, 8 * num_ranks
    Shrink.live = dist.new_group([r for r in range(num_ranks) if r != Shrink.victim])
    Shrink.inputs = SeededInputs(SHRINK_SEED, num_ranks)
    rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, SHRINK_HIDDEN, num_ranks, Shrink.experts)
    with environment(CUEP_TIMEOUT_S=str(SHRINK_TIMEOUT_S)):  # its kernels mask a peer silent this long
        buffer = deep_ep.Buffer(GROUP, 0, rdma_bytes, low_latency_mode=True, enable_shrink=True)
    cases = [functools.partial(case, buffer) for case in (victim_stops_at_a_dispatch, victim_masked_by_hand)]
    return cases, buffer.destroy, f"rank {Shrink.victim} stops"


# ======================================================================================================
# Ranks

SUITES = {"normal": normal_suite, "low_latency": low_latency_suite, "shrink": shrink_suite}


def case_name(case) -> str:
    return getattr(case, "func", case).__name__


def run_cases(cases) -> None:
    """Run the cases in order, ranks meeting between them; on a failure print it and end this rank with
    status 1, which makes torch.multiprocessing end the others."""
    for case in selected_cases(cases, case_name):
        dist.barrier(group=GROUP)
        try:
            case()
        except BaseException:  # noqa: BLE001 - any failure, even SystemExit, must end the job
            print(f"[rank {rank}] FAILED {case_name(case)}\n{traceback.format_exc()}", flush=True)
            sys.stderr.flush()
            os._exit(1)
        if rank == 0:
            print(f"[rank 0] ok {case_name(case)}", flush=True)


def run_rank(local_rank: int, world_size: int, suite: str, port: int) -> None:
    global rank, num_ranks, GROUP
    rank, num_ranks = local_rank, world_size
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_ranks)
    torch.cuda.set_device(rank % torch.cuda.device_count())
    GROUP = dist.new_group(list(range(num_ranks)))  # a gloo group, as frameworks pass one
    cases, teardown, layout = SUITES[suite]()
    run_cases(cases)
    teardown()
    dist.barrier(group=GROUP)
    print(f"[rank {rank}] torch worker ({suite}, {layout}) passed on {num_ranks} ranks", flush=True)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=sorted(SUITES), required=True)
    parser.add_argument("--num-ranks", type=int, required=True)
    args = parser.parse_args()
    os.environ["CUEP_SHARE_GPUS"] = "1"  # the ranks share the GPUs round-robin
    torch.multiprocessing.spawn(run_rank, args=(args.num_ranks, args.suite, free_port()), nprocs=args.num_ranks)


if __name__ == "__main__":
    main()
