"""Route a batch through a top-k gate and compute the dispatch layout on every rank (run under mpirun).

    mpirun -np 4 python examples/dispatch_layout.py --tokens 4096 --hidden 7168 --experts 256 --topk 8

Each rank: random hidden states -> gate logits (a CuPy matmul) -> top-k experts -> Buffer.get_dispatch_layout,
checked against cuep.reference; rank 0 then prints the traffic matrix (tokens each rank will send to each rank).
"""

from __future__ import annotations

import argparse

import cupy
import numpy as np
from mpi4py import MPI

import cuep
from cuep import reference
import no_gpu  # examples/no_gpu.py: a machine without a GPU gets one line, not tracebacks


def route(tokens: int, hidden: int, experts: int, topk: int, seed: int) -> cupy.ndarray:
    """Top-k experts per token from a random linear gate: `[tokens, topk]` int64 on the GPU."""
    rng = cupy.random.default_rng(seed)
    x = rng.standard_normal((tokens, hidden), dtype=cupy.float32)
    gate = rng.standard_normal((hidden, experts), dtype=cupy.float32) / np.sqrt(hidden)
    logits = x @ gate
    return cupy.argpartition(-logits, topk - 1, axis=1)[:, :topk].astype(cupy.int64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    args = parser.parse_args()

    comm = MPI.COMM_WORLD
    buffer = cuep.Buffer(comm)
    topk_idx = route(args.tokens, args.hidden, args.experts, args.topk, seed=buffer.rank)
    per_rank, per_node, per_expert, in_rank, event = buffer.get_dispatch_layout(topk_idx, args.experts)

    expected = reference.get_dispatch_layout(topk_idx.get(), args.experts, buffer.group_size,
                                             buffer.topology.ranks_per_node)
    matches = (np.array_equal(per_rank.get(), expected.num_tokens_per_rank)
               and np.array_equal(per_expert.get(), expected.num_tokens_per_expert)
               and np.array_equal(in_rank.get(), expected.is_token_in_rank))
    traffic = comm.gather(per_rank.get(), root=0)
    all_match = comm.allreduce(matches, op=MPI.LAND)
    if buffer.rank == 0:
        print(f"cuep {cuep.__version__}: {buffer.group_size} ranks on {buffer.topology.num_nodes} node(s), "
              f"{args.tokens} tokens/rank, top-{args.topk} of {args.experts} experts")
        print("tokens sent   " + " ".join(f"to r{j:<5d}" for j in range(buffer.group_size)))
        for i, row in enumerate(traffic):
            print(f"  from rank {i} " + " ".join(f"{n:8d}" for n in row))
        print("layout matches cuep.reference on every rank" if all_match else "LAYOUT MISMATCH")
    buffer.destroy()
    if not all_match:
        raise SystemExit(1)


if __name__ == "__main__":
    no_gpu.run(main)
