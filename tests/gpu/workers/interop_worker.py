"""GPU worker: torch and JAX arrays in and out, and the DeepEP API frameworks use (run under mpirun).

Each operation runs twice on the same inputs, once from CuPy arrays and once from the framework's
arrays (views of the same memory through DLPack, FP8 as ``float8_e4m3fn``), and the results must match
bit for bit. Then: the handle saved as torch tensors and passed back, ``is_sm90_compiled``,
``get_local_buffer_tensor``, the attributes frameworks read, and two inputs DeepEP refuses.
A framework that is not installed is skipped and named in the output.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX would take most of a shared GPU

import cupy
import numpy as np
from common import BF16, expect_error, random_topk, run_cases
from mpi4py import MPI

import cuep

comm = MPI.COMM_WORLD
rank, num_ranks = comm.Get_rank(), comm.Get_size()
MAX_TOKENS = 64
HIDDEN = 1024


def frameworks() -> dict:
    """``name -> (to_framework(cupy_array), to_fp8(cupy_uint8_array))`` for each installed framework."""
    found = {}
    try:
        import torch
        found["torch"] = (torch.from_dlpack, lambda a: torch.from_dlpack(a).view(torch.float8_e4m3fn))
    except ImportError:
        pass
    try:
        import jax
        import jax.numpy as jnp
        found["jax"] = (jax.dlpack.from_dlpack,
                        lambda a: jax.lax.bitcast_convert_type(jax.dlpack.from_dlpack(a), jnp.float8_e4m3fn))
    except ImportError:
        pass
    return found


def same(a, b) -> None:
    """Bit-for-bit equality of two results (arrays, tuples of arrays, lists, None)."""
    if isinstance(a, (tuple, list)):
        assert isinstance(b, (tuple, list)) and len(a) == len(b), (a, b)
        for x, y in zip(a, b):
            same(x, y)
    elif isinstance(a, cupy.ndarray):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        a, b = cupy.ascontiguousarray(a), cupy.ascontiguousarray(b)
        assert (a.view(np.uint8) == b.view(np.uint8)).all() if a.size else True
    else:
        assert a == b, (a, b)


def inputs(seed: int):
    rng = np.random.default_rng([5, seed, rank])
    experts = 8 * num_ranks
    topk = cupy.asarray(random_topk(rng, MAX_TOKENS - rank, experts, 4, 0.1))
    x = cupy.asarray(rng.standard_normal((topk.shape[0], HIDDEN)).astype(BF16))
    weights = cupy.asarray(rng.random(topk.shape, dtype=np.float32))
    x_fp8 = cupy.asarray(rng.integers(0, 256, (topk.shape[0], HIDDEN), dtype=np.uint8))
    scales = cupy.asarray(rng.random((topk.shape[0], HIDDEN // 128), dtype=np.float32))
    return experts, topk, x, weights, x_fp8, scales


def normal_mode_matches(buffer, convert, to_fp8):
    experts, topk, x, weights, x_fp8, scales = inputs(1)
    layout = buffer.get_dispatch_layout(topk, experts)[:4]
    same(buffer.get_dispatch_layout(convert(topk), experts)[:4], layout)
    args = dict(num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2])
    foreign = {k: convert(v) for k, v in args.items()}
    want = buffer.dispatch(x, topk_idx=topk, topk_weights=weights, **args)
    got = buffer.dispatch(convert(x), topk_idx=convert(topk), topk_weights=convert(weights), **foreign)
    same(got[:4], want[:4])
    recv_x, _, recv_weights, _, handle, _ = want
    same(buffer.dispatch((to_fp8(x_fp8), convert(scales)), **foreign)[:4],
         buffer.dispatch((x_fp8, scales), **args)[:4])
    saved = tuple(convert(a) for a in handle)  # how frameworks save a handle for backward
    same(buffer.combine(convert(recv_x), saved, topk_weights=convert(recv_weights))[:2],
         buffer.combine(recv_x, handle, topk_weights=recv_weights)[:2])
    same(buffer.dispatch(convert(x), handle=saved)[0], buffer.dispatch(x, handle=handle)[0])


def same_received_rows(got, want) -> None:
    """Low-latency dispatch results: counts, then each local expert's received rows (the rest is unwritten)."""
    same(got[1], want[1])
    for e, n in enumerate(want[1].get()):
        same([a[e, :n] for a in got[0]] if isinstance(got[0], tuple) else got[0][e, :n],
             [a[e, :n] for a in want[0]] if isinstance(want[0], tuple) else want[0][e, :n])


def low_latency_matches(buffer, convert):
    experts, topk, x, weights, *_ = inputs(2)
    for use_fp8 in (True, False):
        got = buffer.low_latency_dispatch(convert(x), convert(topk), MAX_TOKENS, experts, use_fp8=use_fp8)
        want = buffer.low_latency_dispatch(x, topk, MAX_TOKENS, experts, use_fp8=use_fp8)
        same_received_rows(got, want)
    received, handle = want[0], want[2]  # the last dispatch's BF16 rows stand in for expert outputs
    combined = buffer.low_latency_combine(received, topk, weights, handle)[0]
    same(buffer.low_latency_combine(convert(received), convert(topk), convert(weights), handle)[0], combined)


def outputs_go_to_torch_without_a_copy(buffer):
    import torch
    experts, topk, x, weights, *_ = inputs(3)
    tensor = torch.from_dlpack(x)
    # No public call shows whether cuep copied an input, so this asks the conversion every call makes.
    assert cuep._checks.as_device_array("f()", "x", tensor).data.ptr == tensor.data_ptr() == x.data.ptr
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, experts)
    recv_x = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                             topk_idx=topk, topk_weights=weights)[0]
    out = torch.from_dlpack(recv_x)
    assert out.dtype == torch.bfloat16 and out.data_ptr() == recv_x.data.ptr
    fp8 = torch.zeros((4, 128), dtype=torch.float8_e4m3fn, device=out.device)
    assert cuep._checks.as_device_array("f()", "x", fp8).data.ptr == fp8.data_ptr()


def api_that_frameworks_use(buffer):
    cc = cupy.cuda.Device().compute_capability
    assert cuep.Buffer.is_sm90_compiled() == (cc == "90" and os.environ.get("CUEP_FORCE_FALLBACK") != "1")
    assert (buffer.group_size, buffer.num_nvl_bytes, buffer.low_latency_mode) == (num_ranks, 64 << 20, True)
    assert buffer.num_rdma_bytes > 0 and cuep.Buffer.num_sms > 0
    whole = buffer.get_local_buffer_tensor(np.uint8)
    assert whole.shape == (buffer.num_nvl_bytes,)
    view = buffer.get_local_buffer_tensor(BF16, (4, 8), offset=256, use_rdma_buffer=True)
    assert view.shape == (4, 8) and view.dtype == BF16
    rdma = buffer.get_local_buffer_tensor(np.uint8, use_rdma_buffer=True)
    assert rdma.size == buffer.num_rdma_bytes and view.data.ptr == rdma.data.ptr + 256
    expect_error(ValueError, lambda: buffer.get_local_buffer_tensor(np.float32, buffer.num_nvl_bytes),
                 "a view larger than the buffer was accepted", match="NVL buffer has")


def bad_inputs_raise_before_any_kernel(buffer):
    experts, topk, x, weights, *_ = inputs(4)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    cases = [(dict(layout, topk_idx=topk), "pass topk_idx and topk_weights together"),
             (dict(layout, topk_idx=topk, topk_weights=weights, num_tokens_per_rank=per_rank[:-1]),
              "num_tokens_per_rank must be a contiguous")]
    for kwargs, message in cases:
        expect_error(ValueError, lambda kwargs=kwargs: buffer.dispatch(x, **kwargs), f"dispatch accepted {message!r}",
                     match=message)


def main() -> None:
    rdma = cuep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, HIDDEN, num_ranks, 8 * num_ranks)
    buffer = cuep.Buffer(comm, num_nvl_bytes=64 << 20, num_rdma_bytes=rdma, low_latency_mode=True)
    found = frameworks()
    cases = []
    for name, (convert, to_fp8) in found.items():
        cases += [(f"{name}: layout, BF16 and FP8 dispatch, combine, saved handle",
                   lambda c=convert, f=to_fp8: normal_mode_matches(buffer, c, f)),
                  (f"{name}: low-latency dispatch and combine", lambda c=convert: low_latency_matches(buffer, c))]
    if "torch" in found:
        cases.append(("outputs go to torch without a copy", lambda: outputs_go_to_torch_without_a_copy(buffer)))
    cases += [("the API frameworks use", lambda: api_that_frameworks_use(buffer)),
              ("bad inputs raise before any kernel", lambda: bad_inputs_raise_before_any_kernel(buffer))]
    run_cases(comm, cases)
    buffer.destroy()
    if rank == 0:
        missing = sorted({"torch", "jax"} - set(found))
        print(f"frameworks tested: {sorted(found)}; not installed: {missing}")
        print(f"interop worker passed on {num_ranks} ranks", flush=True)


if __name__ == "__main__":
    main()
