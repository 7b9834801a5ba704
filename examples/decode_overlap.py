"""A decode step's MoE layer with two micro-batches: one computes while the other's tokens fly (run under mpirun).

    mpirun -np 4 python examples/decode_overlap.py --tokens 128 --hidden 2048 --experts 64 --topk 8

Each rank splits its batch in two micro-batches and sends both with Buffer.low_latency_dispatch(...,
return_recv_hook=True): the send phase returns at once and holds no SM. Then, per micro-batch, the
hook receives its tokens (FP8, per-expert layout), the local experts run (CuPy matmuls on the
dequantised rows, ``recv_count[e]`` rows each), and low_latency_combine's send phase returns them;
the second micro-batch's expert work overlaps the first one's combine traffic. The results are
checked against the same layer computed for this rank's tokens on one GPU.
"""

from __future__ import annotations

import argparse

import cupy
import ml_dtypes
import numpy as np
from mpi4py import MPI

import cuep
from cuep import fp8
from moe_common import expert_weight, gate, one_gpu_layer, worst_relative_error
import no_gpu  # examples/no_gpu.py: a machine without a GPU gets one line, not tracebacks

BF16 = np.dtype(ml_dtypes.bfloat16)


def run_local_experts(received, recv_count, first_expert: int, hidden: int) -> cupy.ndarray:
    """Each local expert's matmul on its first ``recv_count[e]`` rows, in the combine's layout."""
    data, scales = received
    out = cupy.zeros(data.shape, dtype=BF16)
    for e, rows in enumerate(recv_count.get().tolist()):
        if rows:
            tokens = fp8.dequantize(data[e, :rows], cupy.ascontiguousarray(scales[e, :rows]))
            out[e, :rows] = (tokens @ expert_weight(first_expert + e, hidden)).astype(BF16)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per rank, split in two micro-batches")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=8)
    args = parser.parse_args()

    comm = MPI.COMM_WORLD
    half = -(-args.tokens // 2)
    size = cuep.Buffer.get_low_latency_rdma_size_hint(half, args.hidden, comm.Get_size(), args.experts)
    buffer = cuep.Buffer(comm, 0, size, low_latency_mode=True)
    x = cupy.random.default_rng(buffer.rank).standard_normal((args.tokens, args.hidden), dtype=cupy.float32)
    x = x.astype(BF16)
    topk_idx, topk_weights = gate(x, args.experts, args.topk, seed=buffer.rank)
    batches = [slice(0, half), slice(half, args.tokens)]
    first_expert = buffer.rank * (args.experts // buffer.group_size)

    # Both micro-batches' tokens start flying; no SM is held while they do.
    sent = [buffer.low_latency_dispatch(x[b], topk_idx[b], half, args.experts, return_recv_hook=True)
            for b in batches]
    pending_combines = []
    for b, (received, recv_count, handle, _, recv_hook) in zip(batches, sent):
        recv_hook()  # this micro-batch's tokens are here (the other's may still be in flight)
        expert_out = run_local_experts(received, recv_count, first_expert, args.hidden)
        combined, _, combine_hook = buffer.low_latency_combine(expert_out, topk_idx[b], topk_weights[b], handle,
                                                               return_recv_hook=True)
        pending_combines.append((combined, combine_hook))
    outputs = []
    for combined, combine_hook in pending_combines:
        combine_hook()
        outputs.append(combined)
    output = cupy.concatenate(outputs).astype(cupy.float32)

    # The same layer on one GPU, from this rank's (FP8-rounded) tokens.
    expected = one_gpu_layer(fp8.dequantize(*fp8.quantize(x)), topk_idx, topk_weights, args.experts,
                             expert_output=lambda out: out.astype(BF16).astype(cupy.float32))
    worst = worst_relative_error(comm, output, expected)
    if buffer.rank == 0:
        print(f"cuep {cuep.__version__}: decode MoE layer on {buffer.group_size} ranks, {args.tokens} tokens/rank in "
              f"2 micro-batches, hidden {args.hidden}, top-{args.topk} of {args.experts} experts")
        print(f"max relative error vs one-GPU computation: {worst:.2e} "
              f"({'ok' if worst < 1e-2 else 'MISMATCH'}: bf16 partial sums allow ~4e-3)")
    buffer.destroy()
    if worst >= 1e-2:
        raise SystemExit(1)


if __name__ == "__main__":
    no_gpu.run(main)
