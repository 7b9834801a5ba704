"""A Mixture-of-Experts layer for prefill or training, spread over the ranks (run under mpirun).

    mpirun -np 4 python examples/moe_prefill.py --tokens 2048 --hidden 2048 --experts 32 --topk 4

Each rank: tokens -> gate (top-k experts, softmax weights) -> Buffer.get_dispatch_layout ->
Buffer.dispatch -> each local expert's matmul on the tokens it received, scaled by the token's
weight for that expert -> Buffer.combine, which sums the partial outputs back at each token's rank.
The result is checked against the same layer computed for this rank's tokens on one GPU.
"""

from __future__ import annotations

import argparse

import cupy
import ml_dtypes
import numpy as np
from mpi4py import MPI

import cuep
from moe_common import expert_weight, gate, one_gpu_layer, worst_relative_error
import no_gpu  # examples/no_gpu.py: a machine without a GPU gets one line, not tracebacks

BF16 = np.dtype(ml_dtypes.bfloat16)


def local_experts(recv_x, recv_topk_idx, recv_weights, first_expert: int, hidden: int) -> cupy.ndarray:
    """Sum over the local experts a received token chose of weight * (token @ W_e), as bf16."""
    out = cupy.zeros(recv_x.shape, dtype=cupy.float32)
    tokens = recv_x.astype(cupy.float32)
    for local in range(int(recv_topk_idx.max()) + 1 if recv_topk_idx.size else 0):
        rows, slots = cupy.nonzero(recv_topk_idx == local)
        if rows.size:
            scale = recv_weights[rows, slots][:, None]
            out[rows] += scale * (tokens[rows] @ expert_weight(first_expert + local, hidden))
    return out.astype(BF16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--topk", type=int, default=4)
    args = parser.parse_args()

    comm = MPI.COMM_WORLD
    nvl_bytes = cuep.Config().get_nvl_buffer_size_hint(args.hidden * 2, comm.Get_size(), args.tokens, args.topk)
    # Across nodes (0 on one node): the network leg's buffer.
    rdma_bytes = cuep.Config().get_rdma_buffer_size_hint(args.hidden * 2, comm.Get_size(), args.tokens, args.topk)
    buffer = cuep.Buffer(comm, num_nvl_bytes=nvl_bytes, num_rdma_bytes=rdma_bytes)
    x = cupy.random.default_rng(buffer.rank).standard_normal((args.tokens, args.hidden), dtype=cupy.float32)
    x = x.astype(BF16)
    topk_idx, topk_weights = gate(x, args.experts, args.topk, seed=buffer.rank)

    per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, args.experts)
    recv_x, recv_topk_idx, recv_weights, per_expert_list, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights)
    first_expert = buffer.rank * (args.experts // buffer.group_size)
    expert_out = local_experts(recv_x, recv_topk_idx, recv_weights, first_expert, args.hidden)
    combined, _, _ = buffer.combine(expert_out, handle)

    expected = one_gpu_layer(x.astype(cupy.float32), topk_idx, topk_weights, args.experts)
    worst = worst_relative_error(comm, combined, expected)
    received = comm.gather(int(recv_x.shape[0]), root=0)
    if buffer.rank == 0:
        print(f"cuep {cuep.__version__}: MoE layer on {buffer.group_size} ranks, {args.tokens} tokens/rank, "
              f"hidden {args.hidden}, top-{args.topk} of {args.experts} experts")
        print(f"tokens received per rank: {received}; rank 0 experts got {per_expert_list}")
        print(f"max relative error vs one-GPU computation: {worst:.2e} "
              f"({'ok' if worst < 2e-2 else 'MISMATCH'}: bf16 partial sums allow ~1e-2)")
    buffer.destroy()
    if worst >= 2e-2:
        raise SystemExit(1)


if __name__ == "__main__":
    no_gpu.run(main)
