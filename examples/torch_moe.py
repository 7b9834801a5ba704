"""A torch Mixture-of-Experts layer that trains through cuep, as DeepEP's README drives its Buffer (run under mpirun).

    mpirun -np 4 python examples/torch_moe.py --tokens 256 --hidden 512 --experts 16 --topk 4

DeepEP's "use in model training or inference prefilling" on cuep: a cached ``get_buffer()`` sized from the
dispatch and combine configs' size hints, then ``dispatch_forward`` / ``dispatch_backward`` /
``combine_forward`` / ``combine_backward``, here inside ``torch.autograd.Function``s so that autograd runs
the backward passes. The backward of a dispatch is a combine of the gradients (of the received rows and of
their top-k weights); the backward of a combine is a cached dispatch with the forward's handle.

The layer: router (a linear gate, top-k, softmax over the chosen logits) -> dispatch -> each local expert's
Linear on the rows that chose it, times the row's weight for it -> combine. Every rank checks the output and
the gradients (of the input, the router and its experts) against the same layer in plain torch on one GPU:
weights are seeded alike on every rank, so each rank recomputes the whole layer for its own tokens, and the
experts' gradients, which gather every rank's tokens, are summed over the ranks first. Then the layer's
tokens are dispatched once more as FP8 (``torch.float8_e4m3fn``) with the cached handle.

Interop: cuep takes torch tensors as they are (no copy) and returns CuPy arrays, which ``torch.from_dlpack``
views without a copy; FP8 comes back as ``uint8`` bytes: ``torch.from_dlpack(a).view(torch.float8_e4m3fn)``.
A handle iterates as a flat tuple of arrays; the autograd functions save it as tensors and pass those back.

Streams: cuep launches on CuPy's current stream, torch on its own current stream. Every cuep call here runs
inside ``cupy_on_torch_stream()``, which makes torch's current stream CuPy's too, so both order their work
on one stream. It is per thread, and autograd runs the backward on a thread of its own, so the backward
functions enter it too.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Optional, Tuple, Union

import cupy
import numpy as np
import torch
from mpi4py import MPI

import cuep
from cuep import EventOverlap, fp8
from moe_common import gpus_in_use

# bf16 sums of a few partial results agree with plain torch to ~1e-2 relative (the other examples' bound).
TOLERANCE = 2e-2

# The communication buffer, made by get_buffer() on first use and remade when it is too small.
_buffer: Optional[cuep.Buffer] = None


# ---------------------------------------------------------------------------------------------------------
# DeepEP's training/prefill functions, on cuep
def get_buffer(comm: MPI.Comm, hidden_bytes: int, num_tokens: int, num_topk: int) -> cuep.Buffer:
    """The Buffer for ``comm``, made on first use and made anew when a call needs more room.

    Collective, and every rank passes the same sizes (the buffer lives in symmetric memory). Unlike
    DeepEP's hint, cuep's grows with ``num_tokens``, the most tokens a rank sends in one call: its kernels
    have no ring buffer to cycle through. The first Buffer sizes the NVSHMEM heap (plus 256 MiB); set
    NVSHMEM_SYMMETRIC_SIZE before it if a later one will be much larger.
    """
    global _buffer
    num_ranks = comm.Get_size()
    num_nvl_bytes = num_rdma_bytes = 0
    for config in (cuep.Buffer.get_dispatch_config(num_ranks), cuep.Buffer.get_combine_config(num_ranks)):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks, num_tokens, num_topk),
                            num_nvl_bytes)
        num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks, num_tokens, num_topk),
                             num_rdma_bytes)  # 0 on one node
    if (_buffer is None or _buffer.comm != comm or _buffer.num_nvl_bytes < num_nvl_bytes
            or _buffer.num_rdma_bytes < num_rdma_bytes):
        if _buffer is not None:
            _buffer.destroy()
        _buffer = cuep.Buffer(comm, num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes)
    return _buffer


def get_hidden_bytes(x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Bytes of one token's row as the size hints count them (an FP8 row is sized as bf16)."""
    t = x[0] if isinstance(x, tuple) else x
    return t.size(1) * max(t.element_size(), 2)


def dispatch_forward(x, topk_idx, topk_weights, num_experts: int, previous_event: Optional[EventOverlap] = None):
    """The layout, then the dispatch, both on the communication stream (after ``previous_event``, else after
    the current stream's work). Returns ``(recv_x, recv_topk_idx, recv_topk_weights,
    num_recv_tokens_per_expert_list, handle, event)``; wait for ``event`` before using them."""
    per_rank, per_rdma_rank, per_expert, in_rank, previous_event = _buffer.get_dispatch_layout(
        topk_idx, num_experts, previous_event=previous_event, async_finish=True,
        allocate_on_comm_stream=previous_event is not None)
    # The CPU waits in here for the number of rows this rank receives (num_worst_tokens avoids it).
    return _buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=per_rank,
                            num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, previous_event=previous_event,
                            async_finish=True, allocate_on_comm_stream=True)


def dispatch_backward(grad_recv_x, grad_recv_topk_weights, handle):
    """The backward of a dispatch is a combine: each token's gradient is the sum of its copies'."""
    combined_grad_x, combined_grad_recv_topk_weights, event = _buffer.combine(
        grad_recv_x, handle, topk_weights=grad_recv_topk_weights, async_finish=True)
    return combined_grad_x, combined_grad_recv_topk_weights, event


def combine_forward(x, handle, previous_event: Optional[EventOverlap] = None):
    """Each received row back to its token's rank, summed there."""
    combined_x, _, event = _buffer.combine(x, handle, async_finish=True, previous_event=previous_event,
                                           allocate_on_comm_stream=previous_event is not None)
    return combined_x, event


def combine_backward(grad_combined_x, handle, previous_event: Optional[EventOverlap] = None):
    """The backward of a combine is a dispatch with the forward's handle (cached: no layout, no CPU wait)."""
    grad_x, _, _, _, _, event = _buffer.dispatch(grad_combined_x, handle=handle, async_finish=True,
                                                 previous_event=previous_event,
                                                 allocate_on_comm_stream=previous_event is not None)
    return grad_x, event


# ---------------------------------------------------------------------------------------------------------
# torch glue
@contextlib.contextmanager
def cupy_on_torch_stream():
    """Make torch's current stream CuPy's current stream in this block (and this thread): cuep launches on
    CuPy's, so its kernels are ordered with torch's."""
    with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        yield


def to_torch(array) -> Optional[torch.Tensor]:
    """A cuep output as a tensor on the same memory (a host NumPy array becomes a CPU tensor)."""
    if array is None:
        return None
    if isinstance(array, np.ndarray):
        return torch.from_numpy(array)
    return torch.from_dlpack(array)


class Dispatch(torch.autograd.Function):
    """dispatch_forward as an autograd op: ``(x, topk_weights, topk_idx, num_experts) -> (recv_x,
    recv_topk_idx, recv_topk_weights, handle)``; its backward is dispatch_backward."""

    @staticmethod
    def forward(ctx, x, topk_weights, topk_idx, num_experts):
        with cupy_on_torch_stream():
            recv_x, recv_topk_idx, recv_topk_weights, _, handle, event = dispatch_forward(
                x, topk_idx, topk_weights, num_experts)
            event.current_stream_wait()  # the outputs are written on the communication stream
            recv_x, recv_topk_idx, recv_topk_weights = map(to_torch, (recv_x, recv_topk_idx, recv_topk_weights))
            handle = tuple(to_torch(a) for a in handle)
        ctx.save_for_backward(*handle)
        ctx.mark_non_differentiable(recv_topk_idx)
        return recv_x, recv_topk_idx, recv_topk_weights, handle

    @staticmethod
    def backward(ctx, grad_recv_x, _grad_recv_topk_idx, grad_recv_topk_weights, _grad_handle):
        with cupy_on_torch_stream():
            grad_x, grad_topk_weights, event = dispatch_backward(
                grad_recv_x.contiguous(), grad_recv_topk_weights.contiguous(), ctx.saved_tensors)
            event.current_stream_wait()
            return to_torch(grad_x), to_torch(grad_topk_weights), None, None


class Combine(torch.autograd.Function):
    """combine_forward as an autograd op: ``(x, handle) -> combined_x``; its backward is combine_backward."""

    @staticmethod
    def forward(ctx, x, handle):
        with cupy_on_torch_stream():
            combined_x, event = combine_forward(x, handle)
            event.current_stream_wait()
            combined_x = to_torch(combined_x)
        ctx.save_for_backward(*handle)
        return combined_x

    @staticmethod
    def backward(ctx, grad_combined_x):
        with cupy_on_torch_stream():
            grad_x, event = combine_backward(grad_combined_x.contiguous(), ctx.saved_tensors)
            event.current_stream_wait()
            return to_torch(grad_x), None


# ---------------------------------------------------------------------------------------------------------
# The layer, and the same layer in plain torch
def seeded(shape, seed: int, device, dtype, scale: float = 1.0) -> torch.Tensor:
    """Normal values times ``scale`` from a CPU generator: the same on every rank and every GPU."""
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale
    return values.to(device=device, dtype=dtype)


def make_router(hidden: int, num_experts: int, device) -> torch.nn.Linear:
    router = torch.nn.Linear(hidden, num_experts, bias=False, device=device)
    with torch.no_grad():
        router.weight.copy_(seeded((num_experts, hidden), 1, device, torch.float32, hidden ** -0.5))
    return router


def make_expert(expert: int, hidden: int, device) -> torch.nn.Linear:
    linear = torch.nn.Linear(hidden, hidden, bias=False, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(seeded((hidden, hidden), 10_000 + expert, device, torch.bfloat16, hidden ** -0.5))
    return linear


def route(router: torch.nn.Linear, x: torch.Tensor, num_topk: int):
    """Top-k experts per token (`int64`) and the softmax of their logits (`float32`, differentiable)."""
    topk_logits, topk_idx = router(x.float()).topk(num_topk, dim=1)
    return topk_idx, topk_logits.softmax(dim=1)


def mix_experts(x, topk_idx, topk_weights, experts) -> torch.Tensor:
    """Per row, the FP32 sum over its top-k slots whose id indexes ``experts`` of weight * expert(row);
    other ids (-1, or experts elsewhere) add nothing."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e, expert in enumerate(experts):
        rows, slots = torch.nonzero(topk_idx == e, as_tuple=True)
        if rows.numel():
            out = out.index_add(0, rows, topk_weights[rows, slots].unsqueeze(1) * expert(x[rows]).float())
    return out


class MoELayer(torch.nn.Module):
    """Router -> dispatch -> local experts -> combine; rank ``r`` holds experts ``[r * E / R, (r + 1) * E / R)``."""

    def __init__(self, comm: MPI.Comm, hidden: int, num_experts: int, num_topk: int, max_tokens: int, device):
        super().__init__()
        self.comm, self.num_experts, self.num_topk, self.max_tokens = comm, num_experts, num_topk, max_tokens
        per_rank = num_experts // comm.Get_size()
        first = comm.Get_rank() * per_rank
        self.router = make_router(hidden, num_experts, device)
        self.experts = torch.nn.ModuleList(make_expert(e, hidden, device) for e in range(first, first + per_rank))
        self.last_dispatch = None  # (recv_x, handle) of the last forward, for the FP8 demonstration

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.size(0) > self.max_tokens:
            raise ValueError(f"MoELayer: at most {self.max_tokens} tokens per call, got {x.size(0)}")
        get_buffer(self.comm, get_hidden_bytes(x), self.max_tokens, self.num_topk)
        topk_idx, topk_weights = route(self.router, x, self.num_topk)
        recv_x, recv_topk_idx, recv_topk_weights, handle = Dispatch.apply(x, topk_weights, topk_idx,
                                                                          self.num_experts)
        self.last_dispatch = (recv_x.detach(), handle)
        expert_out = mix_experts(recv_x, recv_topk_idx, recv_topk_weights, self.experts)
        return Combine.apply(expert_out.to(torch.bfloat16), handle)


def grad_of(parameter: torch.nn.Parameter) -> torch.Tensor:
    """The parameter's gradient; zeros when no token reached it (autograd then leaves it ``None``)."""
    return parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """||got - expected|| / ||expected|| in float32 (0 when both are zero)."""
    got, expected = got.detach().float(), expected.detach().float()
    norm = float(expected.norm())
    return float((got - expected).norm()) / norm if norm else float(got.norm())


def check_layer(comm: MPI.Comm, layer: MoELayer, x0: torch.Tensor, grad_out: torch.Tensor) -> dict[str, float]:
    """Forward and backward through ``layer`` and through the same layer in plain torch; the relative error
    of the output and of every gradient, each the largest over the ranks."""
    x = x0.clone().requires_grad_()
    out = layer(x)
    out.backward(grad_out)

    hidden, device = x0.size(1), x0.device
    router = make_router(hidden, layer.num_experts, device)
    experts = [make_expert(e, hidden, device) for e in range(layer.num_experts)]
    x_ref = x0.clone().requires_grad_()
    topk_idx, topk_weights = route(router, x_ref, layer.num_topk)
    out_ref = mix_experts(x_ref, topk_idx, topk_weights, experts)
    out_ref.backward(grad_out.float())

    # An expert's gradient gathers every rank's tokens: sum the plain-torch ones over the ranks.
    expert_grads = torch.stack([grad_of(e.weight).float() for e in experts]).cpu().numpy()
    comm.Allreduce(MPI.IN_PLACE, expert_grads, op=MPI.SUM)
    first = comm.Get_rank() * len(layer.experts)
    expert_error = max((relative_error(grad_of(e.weight).cpu(), torch.from_numpy(expert_grads[first + i]))
                        for i, e in enumerate(layer.experts)), default=0.0)
    errors = {"output": relative_error(out, out_ref), "input grad": relative_error(x.grad, x_ref.grad),
              "router grad": relative_error(layer.router.weight.grad, router.weight.grad),
              "expert weight grads": expert_error}
    return {name: comm.allreduce(error, op=MPI.MAX) for name, error in errors.items()}


def check_fp8_dispatch(comm: MPI.Comm, x0: torch.Tensor, recv_x: torch.Tensor, handle) -> bool:
    """Dispatch ``x0`` again as FP8 with the cached handle; every rank must receive exactly its received
    bf16 rows' FP8 cast (a token's cast depends only on the token)."""
    with cupy_on_torch_stream():
        x_fp8, scales = fp8.quantize(cupy.from_dlpack(x0))  # uint8 e4m3 bytes, float32 scales
        x_fp8 = torch.from_dlpack(x_fp8).view(torch.float8_e4m3fn)
        (recv_fp8, recv_scales), event = combine_backward((x_fp8, torch.from_dlpack(scales)), handle)
        event.current_stream_wait()
        recv_fp8 = torch.from_dlpack(recv_fp8).view(torch.float8_e4m3fn)
        expected_fp8, expected_scales = map(torch.from_dlpack, fp8.quantize(cupy.from_dlpack(recv_x)))
        same = (torch.equal(recv_fp8.view(torch.uint8), expected_fp8)
                and torch.equal(torch.from_dlpack(recv_scales), expected_scales))
    return comm.allreduce(same, op=MPI.LAND)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=512, help="a multiple of 128 (FP8 scales per 128 channels)")
    parser.add_argument("--experts", type=int, default=16, help="experts over all ranks (a multiple of the ranks)")
    parser.add_argument("--topk", type=int, default=4)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    if args.hidden % 128 or args.experts % num_ranks:
        parser.error(f"--hidden must be a multiple of 128 and --experts of the {num_ranks} ranks")

    # Made at start-up (DeepEP: "you may call this function at the framework initialization"): the Buffer
    # picks this rank's GPU, and torch uses the same one.
    buffer = get_buffer(comm, args.hidden * 2, args.tokens, args.topk)
    torch.cuda.set_device(buffer.device_id)
    device = torch.device("cuda", buffer.device_id)
    with torch.cuda.stream(torch.cuda.Stream(device)):
        x0 = seeded((args.tokens, args.hidden), 100 + rank, device, torch.bfloat16)
        grad_out = seeded((args.tokens, args.hidden), 200 + rank, device, torch.bfloat16)
        layer = MoELayer(comm, args.hidden, args.experts, args.topk, args.tokens, device)
        errors = check_layer(comm, layer, x0, grad_out)
        fp8_ok = check_fp8_dispatch(comm, x0, *layer.last_dispatch)
        torch.cuda.current_stream().synchronize()
    num_gpus, _ = gpus_in_use(comm, buffer.device_id)
    passed = fp8_ok and all(error < TOLERANCE for error in errors.values())
    if rank == 0:
        print(f"cuep {cuep.__version__}, torch {torch.__version__}: MoE layer on {num_ranks} ranks "
              f"({num_gpus} GPU(s)), {args.tokens} tokens/rank, hidden {args.hidden}, top-{args.topk} of "
              f"{args.experts} experts")
        print("relative error vs plain torch on one GPU (largest over ranks; bf16 allows ~1e-2): "
              + ", ".join(f"{name} {error:.1e}" for name, error in errors.items()))
        print(f"FP8 cached dispatch (torch.float8_e4m3fn in and out): "
              f"{'received rows match' if fp8_ok else 'MISMATCH'}")
        print(f"torch MoE forward and backward match plain torch on {num_ranks} ranks" if passed
              else f"MISMATCH: torch MoE layer differs from plain torch (tolerance {TOLERANCE:.0e})")
    _buffer.destroy()
    if not passed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
