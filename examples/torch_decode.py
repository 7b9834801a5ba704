"""A decode step's MoE layer on cuep.torch's low-latency mode, two micro-batches overlapped, captured once in a
CUDA graph (run by torchrun).

    torchrun --nproc-per-node 4 examples/torch_decode.py --tokens 64 --hidden 2048 --experts 32 --topk 8

DeepEP's "use in inference decoding" on ``cuep.torch``: ``get_buffer(group, num_max_dispatch_tokens_per_rank,
hidden, num_experts)``, then ``low_latency_dispatch`` / ``low_latency_combine`` with ``return_recv_hook=True``,
as a DeepEP user writes them; the one line that names cuep is the import.

The step, for each rank's batch of two micro-batches of ``--tokens`` tokens: the router picks each token's top-k
experts; both micro-batches' dispatches are sent (a send returns at once and holds no SM while the tokens fly,
as FP8 e4m3 with a float32 scale per 128 channels); the shared expert runs on the whole batch meanwhile; then per
micro-batch the hook receives its tokens, laid out per local expert, the local experts run on them (dequantise,
one batched matmul, rows past each expert's count left out) and the combine's send takes their outputs back;
last, the combine hooks receive both micro-batches' weighted sums. No step reads a count on the host, so the
whole step is captured once with ``torch.cuda.graph`` (after one eager run, as torch asks) and replayed with new
tokens copied into the captured input. Every rank checks the eager run and every replay against the same layer
in plain torch on one GPU, whose tokens go through the same per-128-channel FP8 cast.

Process group: torchrun's environment, NCCL when every local rank has a GPU of its own, else gloo with
``CUEP_SHARE_GPUS=1`` (ranks share the GPUs round-robin, which NCCL refuses; results are checked, speed is not).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import cuep
from cuep.torch import Buffer  # with DeepEP: from deep_ep import Buffer
import no_gpu  # examples/no_gpu.py: a machine without a GPU gets one line, not tracebacks

# The experts' BF16 outputs and each rank's BF16 partial sum round to ~2^-8 relative; the norm-relative error
# of the step stays near 4e-3.
TOLERANCE = 1e-2

# ---------------------------------------------------------------------------------------------------------
# DeepEP's decoding functions

# The communication buffer, made at the first get_buffer() and made again when a call needs more room.
_buffer: Buffer | None = None


def get_buffer(group: dist.ProcessGroup, num_max_dispatch_tokens_per_rank: int, hidden: int,
               num_experts: int) -> Buffer:
    """The low-latency Buffer for ``group``; collective (call it at start-up too)."""
    global _buffer
    num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, group.size(),
                                                           num_experts)
    if (_buffer is None or _buffer.group != group or not _buffer.low_latency_mode
            or _buffer.num_rdma_bytes < num_rdma_bytes):
        if num_experts % group.size():
            raise ValueError(f"get_buffer(): {num_experts} experts do not split evenly over {group.size()} ranks")
        if _buffer is not None:
            _buffer.destroy()  # collective: every rank asks for the same sizes
        _buffer = Buffer(group, 0, num_rdma_bytes, low_latency_mode=True,
                         num_qps_per_rank=num_experts // group.size(), explicitly_destroy=True)
    return _buffer


def low_latency_dispatch(hidden_states: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                         num_experts: int):
    """Send the tokens to the ranks of their experts; the returned ``hook()`` receives them. CUDA-graph capturable."""
    recv_hidden_states, recv_expert_count, handle, event, hook = \
        _buffer.low_latency_dispatch(hidden_states, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                     async_finish=False, return_recv_hook=True)
    return recv_hidden_states, recv_expert_count, handle, event, hook


def low_latency_combine(hidden_states: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                        handle: tuple):
    """Send the expert outputs back; the returned ``hook()`` receives and sums them. CUDA-graph capturable."""
    combined_hidden_states, event_overlap, hook = \
        _buffer.low_latency_combine(hidden_states, topk_idx, topk_weights, handle, async_finish=False,
                                    return_recv_hook=True)
    return combined_hidden_states, event_overlap, hook


# ---------------------------------------------------------------------------------------------------------
# The layer


def seeded(shape, seed: int, device, dtype, scale: float = 1.0) -> torch.Tensor:
    """Normal values times ``scale`` from a CPU generator: the same on every rank and every GPU."""
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale
    return values.to(device=device, dtype=dtype)


def expert_weight(expert: int, hidden: int, device) -> torch.Tensor:
    """Expert ``expert``'s (a global id) `[hidden, hidden]` bf16 weight, ``out = x @ w``: the same on every rank."""
    return seeded((hidden, hidden), 10_000 + expert, device, torch.bfloat16, hidden ** -0.5)


def dequantize(x_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`[..., hidden]` e4m3 values times their `[..., hidden // 128]` float32 scales, as float32."""
    blocks = x_fp8.float().unflatten(-1, (-1, 128))
    return (blocks * scales.unsqueeze(-1)).flatten(-2)


class DecodeMoE:
    """Router, shared expert and this rank's experts ``[r * E / R, (r + 1) * E / R)`` of a decode MoE layer."""

    def __init__(self, group: dist.ProcessGroup, hidden: int, num_experts: int, num_topk: int,
                 num_tokens_per_batch: int, device):
        self.num_experts, self.num_topk, self.num_tokens_per_batch = num_experts, num_topk, num_tokens_per_batch
        self.gate = seeded((num_experts, hidden), 1, device, torch.float32, hidden ** -0.5)
        self.shared = seeded((hidden, hidden), 2, device, torch.bfloat16, hidden ** -0.5)
        per_rank = num_experts // group.size()
        first = group.rank() * per_rank
        self.experts = torch.stack([expert_weight(e, hidden, device) for e in range(first, first + per_rank)])
        # Row i of each local expert's received block: is it one of its recv_count rows?
        self.row_index = torch.arange(group.size() * num_tokens_per_batch, device=device)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts (`int64`) and the softmax of their logits (`float32`)."""
        topk_logits, topk_idx = (x.float() @ self.gate.T).topk(self.num_topk, dim=1)
        return topk_idx, topk_logits.softmax(dim=1)

    def shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.shared

    def local_experts(self, recv_x: tuple[torch.Tensor, torch.Tensor], recv_count: torch.Tensor) -> torch.Tensor:
        """Each local expert on the rows it received: `[num_local_experts, num_ranks * tokens, hidden]` bf16, in the
        dispatch's layout. Rows past ``recv_count[e]`` hold no token: they enter as zeros (the combine skips
        them), and no count is read on the host."""
        x_fp8, scales = recv_x
        received = (self.row_index < recv_count.unsqueeze(1)).unsqueeze(2)
        rows = torch.where(received, dequantize(x_fp8, scales), 0.0)
        return torch.bmm(rows.to(torch.bfloat16), self.experts)

    def step(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decode step on ``x`` `[2 * tokens, hidden]` bf16, two micro-batches overlapped. Returns the layer's
        output (`float32`) and the routing ``(topk_idx, topk_weights)``."""
        topk_idx, topk_weights = self.route(x)
        n = self.num_tokens_per_batch
        batches = [slice(0, n), slice(n, 2 * n)]
        # Both micro-batches' tokens start flying; no SM is held while they do.
        sent = [low_latency_dispatch(x[b], topk_idx[b], n, self.num_experts) for b in batches]
        shared = self.shared_expert(x)  # runs while the tokens fly
        pending = []
        for b, (recv_x, recv_count, handle, _, hook) in zip(batches, sent):
            hook()  # this micro-batch's tokens are here (the other's may still be in flight)
            expert_out = self.local_experts(recv_x, recv_count)
            combined, _, combine_hook = low_latency_combine(expert_out, topk_idx[b], topk_weights[b], handle)
            pending.append((combined, combine_hook))
        outputs = []
        for combined, combine_hook in pending:
            combine_hook()
            outputs.append(combined)
        return torch.cat(outputs).float() + shared.float(), topk_idx, topk_weights


# ---------------------------------------------------------------------------------------------------------
# Checks


def per_token_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` `[num_tokens, hidden]` as e4m3 with one float32 scale per token and 128 channels: each block is
    multiplied by ``448 / amax`` (``amax`` its largest magnitude, at least 1e-4) and rounded to the nearest
    e4m3. Returns ``(x_fp8, scales)``, `float8_e4m3fn` and `[num_tokens, hidden // 128]` `float32`."""
    blocks = x.float().unflatten(-1, (-1, 128))
    amax = blocks.abs().amax(dim=-1).clamp(min=1e-4)
    return (blocks * (448.0 / amax).unsqueeze(-1)).to(torch.float8_e4m3fn).flatten(-2), amax / 448.0


def plain_layer(layer: DecodeMoE, experts: torch.Tensor, x: torch.Tensor, topk_idx: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
    """The step on one GPU in plain torch: every expert (``experts`` `[num_experts, hidden, hidden]`) on the
    FP8-cast tokens that chose it, the weighted FP32 sum, plus the shared expert."""
    tokens = dequantize(*per_token_cast_to_fp8(x)).to(torch.bfloat16)
    out = layer.shared_expert(x).float()
    for e in range(layer.num_experts):
        rows, slots = torch.nonzero(topk_idx == e, as_tuple=True)
        if rows.numel():
            out.index_add_(0, rows, topk_weights[rows, slots].unsqueeze(1) * (tokens[rows] @ experts[e]).float())
    return out


def worst_relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """||got - expected|| / ||expected||, the largest over the ranks (computed where the backend works)."""
    error = torch.tensor([float((got - expected).norm() / expected.norm().clamp(min=1e-30))], dtype=torch.float64)
    error = error.cuda() if dist.get_backend() == "nccl" else error
    dist.all_reduce(error, op=dist.ReduceOp.MAX)
    return float(error.item())


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
    parser.add_argument("--tokens", type=int, default=64, help="tokens per micro-batch per rank (two micro-batches)")
    parser.add_argument("--hidden", type=int, default=2048, help="a multiple of 128 (FP8 scales per 128 channels)")
    parser.add_argument("--experts", type=int, default=32, help="experts over all ranks (a multiple of the ranks)")
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--replays", type=int, default=5, help="graph replays, each on new tokens")
    args = parser.parse_args()
    group = init_distributed()
    rank, num_ranks = group.rank(), group.size()
    if args.hidden % 128 or args.experts % num_ranks or not 0 < args.topk <= args.experts:
        parser.error(f"--hidden must be a multiple of 128, --experts of the {num_ranks} ranks, and --topk at most "
                     f"--experts")

    get_buffer(group, args.tokens, args.hidden, args.experts)  # at start-up, as DeepEP advises
    device = torch.device("cuda", torch.cuda.current_device())
    layer = DecodeMoE(group, args.hidden, args.experts, args.topk, args.tokens, device)
    experts = torch.stack([expert_weight(e, args.hidden, device) for e in range(args.experts)])  # for plain torch

    def new_tokens(step: int) -> torch.Tensor:
        return seeded((2 * args.tokens, args.hidden), 1000 * step + rank, device, torch.bfloat16)

    # One eager step on a side stream (torch.cuda.graph's warm-up), checked.
    x = new_tokens(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out, topk_idx, topk_weights = layer.step(x)
    torch.cuda.current_stream().wait_stream(side)
    errors = [worst_relative_error(out, plain_layer(layer, experts, x, topk_idx, topk_weights))]

    # The whole step captured once, then replayed on new tokens copied into the captured input.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out, graph_topk_idx, graph_topk_weights = layer.step(x)
    for replay in range(1, args.replays + 1):
        x.copy_(new_tokens(replay))
        graph.replay()
        errors.append(worst_relative_error(graph_out, plain_layer(layer, experts, x, graph_topk_idx,
                                                                  graph_topk_weights)))
    torch.cuda.synchronize()

    passed = all(error < TOLERANCE for error in errors)
    if rank == 0:
        print(f"torch {torch.__version__}, {dist.get_backend()} group: decode MoE layer on {num_ranks} ranks "
              f"({torch.cuda.device_count()} GPU(s) visible), 2 micro-batches of {args.tokens} tokens/rank, hidden "
              f"{args.hidden}, top-{args.topk} of {args.experts} experts, FP8 dispatch with receive hooks")
        print(f"relative error vs plain torch (largest over ranks; bf16 partials allow ~4e-3): eager "
              f"{errors[0]:.1e}, CUDA graph replays " + ", ".join(f"{error:.1e}" for error in errors[1:]))
        print(f"torch decode step (hooks, CUDA graph) matches plain torch on {num_ranks} ranks" if passed
              else f"MISMATCH: torch decode step differs from plain torch (tolerance {TOLERANCE:.0e})")
    del graph
    _buffer.destroy()
    dist.destroy_process_group()
    if not passed:
        raise SystemExit(1)


if __name__ == "__main__":
    no_gpu.run(main)
