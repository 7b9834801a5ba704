"""Megatron-LM's own DeepEP code, unchanged, on cuep.torch or on DeepEP: the forward and backward of an MoE
layer's token exchange through ``megatron.core.transformer.moe.fused_a2a`` (``set_deepep_num_sms``,
``fused_dispatch``, ``fused_combine``; Megatron sizes its Buffer itself, from the hints with no token count),
at Megatron's batch sizes, checked against the same layer in plain torch on every rank, then timed.

    python benchmarks/megatron_fused_a2a.py --num-ranks 4 --tokens 4096,8192,32768 --experts 64,256
    PYTHONPATH=/path/to/DeepEP python benchmarks/megatron_fused_a2a.py --backend deepep ...

``megatron-core`` comes from PyPI (the ``frameworks`` extra); nothing of it is copied here. The layer: each
rank routes its tokens to ``--topk`` experts with softmax probabilities; an expert scales the rows it
receives by its own factor (every expert's factor is known to every rank), weighted by the token's
probability for it; the combine sums the scaled rows back. The plain-torch layer computes the same sums
locally, so the check needs no communication: the output, the gradient of the input and the gradient of
the probabilities (through DeepEP's combine of the per-row probability gradients) must match it for every
token, with ``async_finish`` off and on. Then ``--iters`` forward + backward passes are timed with CUDA
events; rank 0 prints the median over iterations of the slowest rank.

One process per rank (``torch.multiprocessing``), one GPU each (an NCCL group); ``--share-gpus`` puts every
rank on the GPUs there are, over a gloo group (cuep only: ``CUEP_SHARE_GPUS=1``; it proves results, not speed).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fused_a2a_module(backend: str):
    """Megatron's fused_a2a with ``deep_ep`` bound to cuep.torch (``--backend cuep``) or to DeepEP itself."""
    if backend == "cuep":
        import cuep.torch
        sys.modules["deep_ep"] = cuep.torch
    from megatron.core.transformer.moe import fused_a2a
    if not fused_a2a.HAVE_DEEP_EP:
        raise SystemExit(f"Megatron's fused_a2a found no DeepEP with --backend {backend}")
    return fused_a2a


def inputs(rank: int, tokens: int, hidden: int, num_experts: int, topk: int):
    """This rank's tokens, routing and output gradient, and every expert's factor (the same on every rank)."""
    gen = torch.Generator(device="cuda").manual_seed(1000 * rank + tokens + num_experts)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    scores = torch.randn(tokens, num_experts, device="cuda", generator=gen)
    top_scores, idx = scores.topk(topk, dim=1)
    probs = top_scores.softmax(dim=1)
    grad = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    factors = 1.0 + torch.arange(num_experts, device="cuda", dtype=torch.float32) / num_experts
    return x, idx, probs, grad, factors


def megatron_layer(fused_a2a, x, idx, probs, factors, num_experts, group, async_finish):
    """Dispatch, the experts, combine: Megatron's calls, as its token dispatcher makes them."""
    recv_x, recv_idx, recv_probs, _, handle = fused_a2a.fused_dispatch(x, idx, probs, num_experts, group,
                                                                       async_finish=async_finish)
    local_factors = factors.view(group.size(), -1)[group.rank()]
    weight = torch.where(recv_idx >= 0, local_factors[recv_idx.clamp(min=0)], 0.0)
    y = (recv_x.float() * (recv_probs * weight).sum(dim=1, keepdim=True)).to(torch.bfloat16)
    combined, _ = fused_a2a.fused_combine(y, group, handle, async_finish=async_finish)
    return combined


def plain_layer(x, idx, probs, factors):
    """The same layer without communication: every token's weighted sum over its experts, locally."""
    return (x.float() * (probs * factors[idx]).sum(dim=1, keepdim=True)).to(torch.bfloat16)


def forward_backward(layer, x, probs, grad):
    """``layer(x, probs)``, then the gradients of ``(out * grad).sum()``: ``(out, x.grad, probs.grad)``."""
    x = x.detach().requires_grad_()
    probs = probs.detach().requires_grad_()
    out = layer(x, probs)
    out.backward(grad)
    return out.detach(), x.grad, probs.grad


def assert_rows_close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    """Each row within ``rtol`` of the plain layer's, relative to the row's norm (bf16 rounding on each side)."""
    got, want = got.float(), want.float()
    error = (got - want).norm(dim=-1) / want.norm(dim=-1).clamp(min=1e-6)
    worst = int(error.argmax()) if error.numel() else 0
    if error.numel() and float(error[worst]) > rtol:
        raise AssertionError(f"{name}: row {worst} off by {float(error[worst]):.3g} of its norm (> {rtol})")


def run_rank(rank: int, args, port: int) -> None:
    num_gpus = torch.cuda.device_count()
    torch.cuda.set_device(rank % num_gpus)
    if args.share_gpus:
        os.environ["CUEP_SHARE_GPUS"] = "1"
    dist.init_process_group("gloo" if args.share_gpus else "nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=args.num_ranks)
    group = dist.new_group(list(range(args.num_ranks)))
    fused_a2a = fused_a2a_module(args.backend)
    fused_a2a.set_deepep_num_sms(args.sms)
    rows = []
    for num_experts in args.experts:
        for tokens in args.tokens:
            x, idx, probs, grad, factors = inputs(rank, tokens, args.hidden, num_experts, args.topk)
            want = forward_backward(lambda x, p: plain_layer(x, idx, p, factors), x.float(), probs, grad.float())
            for async_finish in (False, True):
                got = forward_backward(lambda x, p: megatron_layer(fused_a2a, x, idx, p, factors, num_experts, group,
                                                                   async_finish), x, probs, grad)
                for name, g, w in zip(("output", "input gradient", "probability gradient"), got, want):
                    assert_rows_close(f"{tokens} tokens, {num_experts} experts, async_finish={async_finish}: {name}",
                                      g, w, rtol=2e-2)
            times = []
            for i in range(args.warmup + args.iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                forward_backward(lambda x, p: megatron_layer(fused_a2a, x, idx, p, factors, num_experts, group,
                                                             False), x, probs, grad)
                end.record()
                end.synchronize()
                if i >= args.warmup:
                    times.append(start.elapsed_time(end))
            slowest = [None] * args.num_ranks
            dist.all_gather_object(slowest, statistics.median(times), group=group)
            rows.append((tokens, num_experts, max(slowest)))
            del x, idx, probs, grad, want, got
            torch.cuda.empty_cache()
    if rank == 0:
        print(f"Megatron fused_a2a on {args.backend}: {args.num_ranks} ranks, hidden {args.hidden}, top-{args.topk}, "
              f"set_deepep_num_sms({args.sms}); output and gradients match the plain-torch layer", flush=True)
        print(f"{'backend':8} {'tokens/rank':>11} {'experts':>7} {'fwd+bwd ms':>10}", flush=True)
        for tokens, num_experts, ms in rows:
            print(f"{args.backend:8} {tokens:11d} {num_experts:7d} {ms:10.3f}", flush=True)
    dist.barrier(group)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    parser.add_argument("--backend", choices=["cuep", "deepep"], default="cuep")
    parser.add_argument("--num-ranks", type=int, default=4)
    parser.add_argument("--tokens", type=ints, default=[4096, 8192, 32768], help="tokens per rank, comma-separated")
    parser.add_argument("--experts", type=ints, default=[64, 256], help="expert counts, comma-separated")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--sms", type=int, default=20, help="set_deepep_num_sms (Megatron's default: 20)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--share-gpus", action="store_true", help="ranks share the GPUs there are (cuep only)")
    args = parser.parse_args()
    if args.share_gpus and args.backend != "cuep":
        parser.error("--share-gpus runs cuep only: DeepEP needs a GPU per rank")
    torch.multiprocessing.spawn(run_rank, args=(args, free_port()), nprocs=args.num_ranks)


if __name__ == "__main__":
    main()
