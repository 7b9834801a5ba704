"""A torch Mixture-of-Experts layer that trains through cuep.torch, written as for DeepEP (run by torchrun).

    torchrun --nproc-per-node 4 examples/torch_moe.py --tokens 256 --hidden 512 --experts 16 --topk 4

This is DeepEP's "use in model training or inference prefilling" on ``cuep.torch``, DeepEP V1's module on
torch tensors: ``get_buffer()``, ``get_hidden_bytes()``, ``dispatch_forward`` / ``dispatch_backward`` /
``combine_forward`` / ``combine_backward`` and ``Buffer.set_num_sms(24)``, as a DeepEP user writes them. The
one line that names cuep is the import (``from deep_ep import Buffer, EventOverlap`` for DeepEP); the Buffer
is sized from DeepEP's hints with no token count, and any batch goes through it.

The functions run inside ``torch.autograd.Function``s, so autograd calls the backward passes: the backward of
a dispatch is a combine of the gradients (of the received rows and of their top-k weights), the backward of a
combine is a dispatch cached on the forward's handle. The layer: a router (linear gate, top-k, softmax over the
chosen logits) -> dispatch -> each local expert's Linear on the rows that chose it, times the row's weight for
it -> combine. Every rank checks the output and the gradients of the input, the router and its experts against
the same layer in plain torch on one GPU: weights are seeded alike on every rank, so each rank recomputes the
whole layer for its own tokens, and the plain experts' gradients, which gather every rank's tokens, are summed
over the ranks with ``torch.distributed``. Then the tokens go again as FP8 (``torch.float8_e4m3fn`` and float32
scales per 128 channels) in a dispatch cached on the forward's handle; each rank must receive exactly the FP8
cast of the BF16 rows it received in the forward.

Process group: torchrun's environment, NCCL when every local rank has a GPU of its own, else gloo with
``CUEP_SHARE_GPUS=1`` (ranks share the GPUs round-robin, which NCCL refuses; results are checked, speed is not).
cuep bootstraps over any backend: it needs no MPI.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import cuep
from cuep.torch import Buffer, EventOverlap  # with DeepEP: from deep_ep import Buffer, EventOverlap
import no_gpu  # examples/no_gpu.py: a machine without a GPU gets one line, not tracebacks

# bf16 sums of a few partial results agree with plain torch to ~1e-2 relative.
TOLERANCE = 2e-2

# ---------------------------------------------------------------------------------------------------------
# DeepEP's training / prefill functions

# The communication buffer, made at the first get_buffer() and made again if a later call asks for more room.
_buffer: Buffer | None = None

# SMs of the dispatch and combine kernels, for every Buffer: the rest of the GPU stays with the GEMMs.
Buffer.set_num_sms(24)


def get_buffer(group: dist.ProcessGroup, hidden_bytes: int) -> Buffer:
    """The Buffer for ``group``, sized from both configs' hints; collective (call it at start-up too).

    The hints take no token count: the kernels move any batch through the Buffer in rounds.
    """
    global _buffer
    num_nvl_bytes, num_rdma_bytes = 0, 0
    for config in (Buffer.get_dispatch_config(group.size()), Buffer.get_combine_config(group.size())):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), num_nvl_bytes)
        num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), num_rdma_bytes)  # 0 on one node

    if (_buffer is None or _buffer.group != group or _buffer.num_nvl_bytes < num_nvl_bytes
            or _buffer.num_rdma_bytes < num_rdma_bytes):
        if _buffer is not None:
            _buffer.destroy()  # collective: every rank asks for the same sizes
        _buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes, explicitly_destroy=True)
    return _buffer


def get_hidden_bytes(x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> int:
    """Bytes of one token's row as the size hints count them (an FP8 row is counted at two bytes a channel)."""
    t = x[0] if isinstance(x, tuple) else x
    return t.size(1) * max(t.element_size(), 2)


def dispatch_forward(x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], topk_idx: torch.Tensor,
                     topk_weights: torch.Tensor, num_experts: int, previous_event: EventOverlap | None = None) \
        -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor, list[int], tuple,
                 EventOverlap]:
    """Count what goes where, then send each token to the ranks of its experts; both on the communication
    stream, after ``previous_event`` if given (else after the current stream's work). Wait for the returned
    event before reading the outputs."""
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, previous_event = \
        _buffer.get_dispatch_layout(topk_idx, num_experts, previous_event=previous_event, async_finish=True,
                                    allocate_on_comm_stream=previous_event is not None)
    # The CPU waits in here for the number of rows this rank receives (num_worst_tokens would avoid it).
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event = \
        _buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=num_tokens_per_rank,
                         num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
                         num_tokens_per_expert=num_tokens_per_expert, previous_event=previous_event,
                         async_finish=True, allocate_on_comm_stream=True)
    return recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event


def dispatch_backward(grad_recv_x: torch.Tensor, grad_recv_topk_weights: torch.Tensor, handle: tuple) \
        -> tuple[torch.Tensor, torch.Tensor, EventOverlap]:
    """A dispatch's backward is a combine: a token's gradient is the sum of its copies' gradients, and each
    top-k weight's gradient comes back from the rank that holds its expert."""
    combined_grad_x, combined_grad_recv_topk_weights, event = \
        _buffer.combine(grad_recv_x, handle, topk_weights=grad_recv_topk_weights, async_finish=True)
    return combined_grad_x, combined_grad_recv_topk_weights, event


def combine_forward(x: torch.Tensor, handle: tuple, previous_event: EventOverlap | None = None) \
        -> tuple[torch.Tensor, EventOverlap]:
    """Send each received row back to its token's rank and sum the copies there."""
    combined_x, _, event = _buffer.combine(x, handle, async_finish=True, previous_event=previous_event,
                                           allocate_on_comm_stream=previous_event is not None)
    return combined_x, event


def combine_backward(grad_combined_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], handle: tuple,
                     previous_event: EventOverlap | None = None) \
        -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], EventOverlap]:
    """A combine's backward is a dispatch cached on the forward's handle (no layout, no CPU wait)."""
    grad_x, _, _, _, _, event = _buffer.dispatch(grad_combined_x, handle=handle, async_finish=True,
                                                 previous_event=previous_event,
                                                 allocate_on_comm_stream=previous_event is not None)
    return grad_x, event


# ---------------------------------------------------------------------------------------------------------
# Autograd


class MoEDispatch(torch.autograd.Function):
    """``(x, topk_idx, topk_weights, num_experts) -> (recv_x, recv_topk_idx, recv_topk_weights, handle)``;
    the backward is :func:`dispatch_backward`."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, num_experts):
        recv_x, recv_topk_idx, recv_topk_weights, _, handle, event = dispatch_forward(x, topk_idx, topk_weights,
                                                                                      num_experts)
        event.current_stream_wait()  # the outputs are written on the communication stream
        ctx.handle = handle
        ctx.mark_non_differentiable(recv_topk_idx)
        return recv_x, recv_topk_idx, recv_topk_weights, handle

    @staticmethod
    def backward(ctx, grad_recv_x, _grad_recv_topk_idx, grad_recv_topk_weights, _grad_handle):
        if grad_recv_topk_weights is not None:
            grad_recv_topk_weights = grad_recv_topk_weights.contiguous()
        grad_x, grad_topk_weights, event = dispatch_backward(grad_recv_x.contiguous(), grad_recv_topk_weights,
                                                             ctx.handle)
        event.current_stream_wait()
        return grad_x, None, grad_topk_weights, None


class MoECombine(torch.autograd.Function):
    """``(x, handle) -> combined_x``; the backward is :func:`combine_backward`."""

    @staticmethod
    def forward(ctx, x, handle):
        combined_x, event = combine_forward(x, handle)
        event.current_stream_wait()
        ctx.handle = handle
        return combined_x

    @staticmethod
    def backward(ctx, grad_combined_x):
        grad_x, event = combine_backward(grad_combined_x.contiguous(), ctx.handle)
        event.current_stream_wait()
        return grad_x, None


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
    """Expert ``expert`` (a global id): a bias-free bf16 Linear, the same wherever it is made."""
    linear = torch.nn.Linear(hidden, hidden, bias=False, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(seeded((hidden, hidden), 10_000 + expert, device, torch.bfloat16, hidden ** -0.5))
    return linear


def route(router: torch.nn.Linear, x: torch.Tensor, num_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts (`int64`) and the softmax of their logits (`float32`, differentiable)."""
    topk_logits, topk_idx = router(x.float()).topk(num_topk, dim=1)
    return topk_idx, topk_logits.softmax(dim=1)


def mix_experts(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, experts) -> torch.Tensor:
    """Per row, the FP32 sum over its top-k slots whose id indexes ``experts`` of weight * expert(row); other ids
    (-1, or experts held elsewhere) add nothing."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e, expert in enumerate(experts):
        rows, slots = torch.nonzero(topk_idx == e, as_tuple=True)
        if rows.numel():
            out = out.index_add(0, rows, topk_weights[rows, slots].unsqueeze(1) * expert(x[rows]).float())
    return out


class MoELayer(torch.nn.Module):
    """Router -> dispatch -> local experts -> combine; rank ``r`` holds experts ``[r * E / R, (r + 1) * E / R)``."""

    def __init__(self, group: dist.ProcessGroup, hidden: int, num_experts: int, num_topk: int, device):
        super().__init__()
        self.group, self.num_experts, self.num_topk = group, num_experts, num_topk
        per_rank = num_experts // group.size()
        first = group.rank() * per_rank
        self.router = make_router(hidden, num_experts, device)
        self.experts = torch.nn.ModuleList(make_expert(e, hidden, device) for e in range(first, first + per_rank))
        self.last_dispatch = None  # (recv_x, handle) of the last forward, for the FP8 dispatch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        get_buffer(self.group, get_hidden_bytes(x))
        topk_idx, topk_weights = route(self.router, x, self.num_topk)
        recv_x, recv_topk_idx, recv_topk_weights, handle = MoEDispatch.apply(x, topk_idx, topk_weights,
                                                                             self.num_experts)
        self.last_dispatch = (recv_x.detach(), handle)
        expert_out = mix_experts(recv_x, recv_topk_idx, recv_topk_weights, self.experts)
        return MoECombine.apply(expert_out.to(torch.bfloat16), handle)


# ---------------------------------------------------------------------------------------------------------
# Checks


def all_reduce(values: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``values`` reduced over every rank, computed where the backend works (the GPU for NCCL, else the CPU)."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    reduced = values.detach().to(device).clone()
    dist.all_reduce(reduced, op=op)
    return reduced.to(values.device)


def grad_of(parameter: torch.nn.Parameter) -> torch.Tensor:
    """The parameter's gradient; zeros when no token reached it (autograd then leaves it ``None``)."""
    return parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """||got - expected|| / ||expected|| in float32 (||got|| when ``expected`` is zero)."""
    got, expected = got.detach().float(), expected.detach().float()
    norm = float(expected.norm())
    return float((got - expected).norm()) / norm if norm else float(got.norm())


def check_layer(layer: MoELayer, x0: torch.Tensor, grad_out: torch.Tensor) -> dict:
    """Forward and backward through ``layer`` and through the same layer in plain torch: the relative error of
    the output and of every gradient, each the largest over the ranks."""
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

    # An expert's gradient gathers every rank's tokens: sum the plain ones over the ranks.
    expert_grads = all_reduce(torch.stack([grad_of(e.weight).float() for e in experts]))
    first = layer.group.rank() * len(layer.experts)
    expert_error = max((relative_error(grad_of(e.weight), expert_grads[first + i])
                        for i, e in enumerate(layer.experts)), default=0.0)
    errors = {"output": relative_error(out, out_ref), "input grad": relative_error(x.grad, x_ref.grad),
              "router grad": relative_error(layer.router.weight.grad, router.weight.grad),
              "expert weight grads": expert_error}
    worst = all_reduce(torch.tensor(list(errors.values()), dtype=torch.float64), dist.ReduceOp.MAX)
    return dict(zip(errors, worst.tolist()))


def per_token_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` `[num_tokens, hidden]` as e4m3 with one float32 scale per token and 128 channels: each block is
    multiplied by ``448 / amax`` (``amax`` its largest magnitude, at least 1e-4) and rounded to the nearest
    e4m3. Returns ``(x_fp8, scales)``, `[num_tokens, hidden]` `float8_e4m3fn` and `[num_tokens, hidden // 128]`
    `float32`, ``x ~ x_fp8 * scales`` per block."""
    num_tokens, hidden = x.shape
    blocks = x.float().view(num_tokens, hidden // 128, 128)
    amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
    x_fp8 = (blocks * (448.0 / amax).unsqueeze(2)).to(torch.float8_e4m3fn).view(num_tokens, hidden)
    return x_fp8, amax / 448.0


def check_fp8_dispatch(x0: torch.Tensor, recv_x: torch.Tensor, handle: tuple) -> bool:
    """Dispatch ``x0`` again as FP8, cached on the forward's handle: on every rank the received FP8 rows and
    scales must be, bit for bit, the cast of the BF16 rows it received (a token's cast depends on it alone)."""
    (recv_fp8, recv_scales), event = combine_backward(per_token_cast_to_fp8(x0), handle)
    event.current_stream_wait()
    expected_fp8, expected_scales = per_token_cast_to_fp8(recv_x)
    same = (recv_fp8.dtype == torch.float8_e4m3fn and torch.equal(recv_fp8.view(torch.uint8),
                                                                  expected_fp8.view(torch.uint8))
            and torch.equal(recv_scales, expected_scales))
    return bool(all_reduce(torch.tensor([int(not same)])).item() == 0)


# ---------------------------------------------------------------------------------------------------------


def init_distributed() -> dist.ProcessGroup:
    """torchrun's process group, on GPU ``LOCAL_RANK % device count``: NCCL when every local rank has a GPU of
    its own, else gloo with ``CUEP_SHARE_GPUS=1`` (NCCL refuses two ranks on one GPU)."""
    local_rank, local_world_size = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if torch.cuda.device_count() == 0:
        raise cuep.NoGPUError("torch found no CUDA GPU: run on a machine with an NVIDIA GPU, its driver and a CUDA "
                              "build of torch")
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if torch.cuda.device_count() >= local_world_size:
        dist.init_process_group("nccl")
    else:
        os.environ["CUEP_SHARE_GPUS"] = "1"  # read when the Buffer is made
        dist.init_process_group("gloo")
    return dist.group.WORLD


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=512, help="a multiple of 128 (FP8 scales per 128 channels)")
    parser.add_argument("--experts", type=int, default=16, help="experts over all ranks (a multiple of the ranks)")
    parser.add_argument("--topk", type=int, default=4)
    args = parser.parse_args()
    group = init_distributed()
    rank, num_ranks = group.rank(), group.size()
    if args.hidden % 128 or args.experts % num_ranks or not 0 < args.topk <= args.experts:
        parser.error(f"--hidden must be a multiple of 128, --experts of the {num_ranks} ranks, and --topk at most "
                     f"--experts")

    # Made at start-up, as DeepEP advises (bf16 rows); the layer's calls find it ready.
    get_buffer(group, args.hidden * 2)
    device = torch.device("cuda", torch.cuda.current_device())
    x0 = seeded((args.tokens, args.hidden), 100 + rank, device, torch.bfloat16)
    grad_out = seeded((args.tokens, args.hidden), 200 + rank, device, torch.bfloat16)
    layer = MoELayer(group, args.hidden, args.experts, args.topk, device)
    errors = check_layer(layer, x0, grad_out)
    fp8_ok = check_fp8_dispatch(x0, *layer.last_dispatch)
    torch.cuda.synchronize()

    passed = fp8_ok and all(error < TOLERANCE for error in errors.values())
    if rank == 0:
        print(f"torch {torch.__version__}, {dist.get_backend()} group: MoE layer on {num_ranks} ranks "
              f"({torch.cuda.device_count()} GPU(s) visible), {args.tokens} tokens/rank, hidden {args.hidden}, "
              f"top-{args.topk} of {args.experts} experts, {Buffer.get_dispatch_config(num_ranks).num_sms} SMs")
        print("relative error vs plain torch on one GPU (largest over ranks; bf16 allows ~1e-2): "
              + ", ".join(f"{name} {error:.1e}" for name, error in errors.items()))
        print(f"FP8 cached dispatch (torch.float8_e4m3fn in and out): "
              f"{'received rows and scales match the cast bit for bit' if fp8_ok else 'MISMATCH'}")
        print(f"torch MoE forward and backward match plain torch on {num_ranks} ranks" if passed
              else f"MISMATCH: torch MoE layer differs from plain torch (tolerance {TOLERANCE:.0e})")
    _buffer.destroy()
    dist.destroy_process_group()
    if not passed:
        raise SystemExit(1)


if __name__ == "__main__":
    no_gpu.run(main)
