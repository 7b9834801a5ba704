"""One Mixture-of-Experts step on however many ranks you launch, checked and timed (run under mpirun).

    mpirun -np 4 python examples/moe_step.py [--tokens 4096 --hidden 7168 --experts 256 --topk 8]

Each rank: its tokens (bf16) -> a top-k gate -> Buffer.get_dispatch_layout -> Buffer.dispatch (each token
goes to every rank that holds one of its experts) -> the local experts' work on the rows received ->
Buffer.combine (the rows go back to their tokens' ranks and are summed there, in FP32). Every rank checks
its results against cuep.reference: the layout, the rows it received, their top-k ids and weights and the
per-expert counts exactly; the combined tokens within bf16 rounding. Rank 0 prints what moved and how long
dispatch and combine took.

The experts are a stand-in that fits any hidden size: expert ``e`` multiplies each channel of a row by its
own factor (a diagonal linear layer) and by the token's gate weight for ``e``; examples/moe_prefill.py runs
real matmuls. The timings are an example's: CUDA events around single calls on the current stream, the
median of a few calls after a warm-up (``python -m cuep.bench`` measures properly). Ranks that share a GPU
(CUEP_SHARE_GPUS=1) take turns on it: their results are checked, their timings say nothing about speed.
"""

from __future__ import annotations

import argparse

import cupy
import numpy as np
from mpi4py import MPI

import cuep
from cuep import reference
from moe_common import BF16, gate, gpus_in_use, tokens_of_rank
import no_gpu  # examples/no_gpu.py: a machine without a GPU gets one line, not tracebacks

WARMUP_CALLS, TIMED_CALLS = 2, 5


def expert_scales(num_experts: int, hidden: int) -> cupy.ndarray:
    """Every expert's per-channel factors, `[num_experts, hidden]` float32 in [0.5, 1.5), the same on every rank."""
    return 0.5 + cupy.random.default_rng(20_000).random((num_experts, hidden), dtype=cupy.float32)


def run_experts(rows, topk_ids, topk_weights, scales):
    """What a rank's experts send back for the rows they got: per row, the FP32 sum over its top-k slots
    whose id names one of ``scales``' experts (other ids, -1 included, add nothing) of weight * row * factors,
    rounded to bf16. NumPy or CuPy; the same rows give the same bits wherever they are computed."""
    xp = cupy.get_array_module(rows)
    values = rows.astype(xp.float32)
    out = xp.zeros(values.shape, dtype=xp.float32)
    for expert in range(scales.shape[0]):
        picked, slots = xp.nonzero(topk_ids == expert)
        if picked.size:
            out[picked] += topk_weights[picked, slots][:, None] * values[picked] * scales[expert]
    return out.astype(BF16)


def expected_combine(x, topk_idx, topk_weights, scales, num_ranks: int) -> np.ndarray:
    """This rank's combined tokens by cuep.reference.combine: the rows each rank's experts send back for
    this rank's tokens (computed here, as that rank computes them), summed per token in FP32."""
    xp = cupy.get_array_module(x)
    per_rank = scales.shape[0] // num_ranks
    owner = xp.where(topk_idx >= 0, topk_idx // per_rank, -1)
    values = x.astype(xp.float32)  # exact; run_experts computes in float32 either way
    rows, sources = [], []
    for r in range(num_ranks):
        tokens = xp.nonzero((owner == r).any(axis=1))[0]
        local_ids = xp.where(owner[tokens] == r, topk_idx[tokens] - r * per_rank, -1)
        out = run_experts(values[tokens], local_ids, topk_weights[tokens], scales[r * per_rank:(r + 1) * per_rank])
        rows.append(cupy.asnumpy(out))
        sources.append(np.stack([np.zeros(tokens.size, np.int64), cupy.asnumpy(tokens)], axis=1))
    combined, _ = reference.combine(rows, sources, [x.shape[0]])  # this rank is source 0 of a one-source call
    return combined[0]


def check_layout(layout, topk_idx, num_experts: int, num_ranks: int, ranks_per_node: int) -> list[str]:
    """``layout``: what get_dispatch_layout returned (host arrays, event left out) against the reference."""
    expected = reference.get_dispatch_layout(topk_idx, num_experts, num_ranks, ranks_per_node)
    names = ("num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert", "is_token_in_rank")
    return [f"get_dispatch_layout: {name} differs" for name, got, want in zip(names, layout, expected)
            if not (got is None and want is None) and not np.array_equal(got, want)]


def check_dispatch(rank: int, recv_x, recv_topk_idx, recv_topk_weights, per_expert_list, all_topk_idx,
                   all_topk_weights, num_experts: int, tokens_of) -> list[str]:
    """One rank's dispatch against cuep.reference.dispatch, exactly. ``all_topk_*``: every rank's routing
    (host); ``tokens_of(s)``: rank ``s``'s tokens, regenerated (NumPy or CuPy, like ``recv_x``)."""
    xp = cupy.get_array_module(recv_x)
    index_columns = [np.arange(len(t))[:, None] for t in all_topk_idx]  # only which rows arrive matters here
    want = reference.dispatch(index_columns, all_topk_idx, num_experts, topk_weights=all_topk_weights)[rank]
    problems = []
    if recv_x.shape[0] != len(want.recv_src):
        return [f"dispatch: rank {rank} received {recv_x.shape[0]} rows, expected {len(want.recv_src)}"]
    if not np.array_equal(cupy.asnumpy(recv_topk_idx), want.recv_topk_idx):
        problems.append(f"dispatch: rank {rank}'s received top-k ids differ")
    if not np.array_equal(cupy.asnumpy(recv_topk_weights), want.recv_topk_weights):
        problems.append(f"dispatch: rank {rank}'s received top-k weights differ")
    if list(per_expert_list) != list(want.num_recv_tokens_per_expert):
        problems.append(f"dispatch: rank {rank}'s per-expert counts {list(per_expert_list)} != "
                        f"{list(want.num_recv_tokens_per_expert)}")
    for source in range(len(all_topk_idx)):
        rows = np.nonzero(want.recv_src[:, 0] == source)[0]
        if rows.size == 0:
            continue
        # bf16 compared as its bits (uint16): exact, and CuPy indexes uint16 arrays
        sent = tokens_of(source).view(xp.uint16)[xp.asarray(want.recv_src[rows, 1])]
        same = (recv_x.view(xp.uint16)[xp.asarray(rows)] == sent).all(axis=1)
        if not bool(same.all()):
            first = int(rows[int(xp.nonzero(~same)[0][0])])
            problems.append(f"dispatch: rank {rank}'s row {first} should be token {want.recv_src[first, 1]} of "
                            f"rank {source} and is not")
    return problems


def check_combine(rank: int, combined, expected: np.ndarray) -> list[str]:
    """Within bf16 rounding: twice its bound (2^-8 relative: bf16 keeps 8 significant bits), plus 1e-5 of
    the largest value for the FP32 sums' order (the kernel may add the copies in another order)."""
    got = cupy.asnumpy(combined).astype(np.float32)
    bad = np.abs(got - expected) > 2.0 ** -7 * np.abs(expected) + 1e-5 * float(np.abs(expected).max(initial=0))
    if bad.any():
        token, channel = np.argwhere(bad)[0]
        return [f"combine: rank {rank}'s token {token} channel {channel} is {got[token, channel]}, expected "
                f"{expected[token, channel]} ({int(bad.any(axis=1).sum())} tokens off)"]
    return []


def median_us(call, barrier) -> float:
    """Median time of ``call`` on the GPU in microseconds, CUDA events around it on the current stream,
    over TIMED_CALLS after WARMUP_CALLS; ``barrier`` lines the ranks up before each call."""
    times = []
    for i in range(WARMUP_CALLS + TIMED_CALLS):
        barrier()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        call()
        end.record()
        end.synchronize()
        if i >= WARMUP_CALLS:
            times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256, help="experts over all ranks (a multiple of the ranks)")
    parser.add_argument("--topk", type=int, default=8)
    args = parser.parse_args()

    comm = MPI.COMM_WORLD
    num_ranks = comm.Get_size()
    hidden_bytes = args.hidden * BF16.itemsize
    configs = (cuep.Buffer.get_dispatch_config(num_ranks), cuep.Buffer.get_combine_config(num_ranks))
    nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden_bytes, num_ranks, args.tokens, args.topk) for c in configs)
    rdma_bytes = max(c.get_rdma_buffer_size_hint(hidden_bytes, num_ranks, args.tokens, args.topk) for c in configs)
    buffer = cuep.Buffer(comm, num_nvl_bytes=nvl_bytes, num_rdma_bytes=rdma_bytes)  # rdma: 0 on one node
    rank, per_rank = buffer.rank, args.experts // num_ranks

    # The step.
    x = tokens_of_rank(rank, args.tokens, args.hidden)
    topk_idx, topk_weights = gate(x, args.experts, args.topk, seed=30_000 + rank)  # a router unrelated to x's draw
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = \
        buffer.get_dispatch_layout(topk_idx, args.experts)
    layout = dict(num_tokens_per_rank=num_tokens_per_rank, num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
                  num_tokens_per_expert=num_tokens_per_expert, is_token_in_rank=is_token_in_rank)
    recv_x, recv_topk_idx, recv_topk_weights, per_expert_list, handle, _ = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, **layout)
    scales = expert_scales(args.experts, args.hidden)
    expert_out = run_experts(recv_x, recv_topk_idx, recv_topk_weights, scales[rank * per_rank:(rank + 1) * per_rank])
    combined, _, _ = buffer.combine(expert_out, handle)

    # The checks: every rank's routing is small, so the ranks share it; tokens each rank regenerates.
    all_topk_idx = comm.allgather(cupy.asnumpy(topk_idx))
    all_topk_weights = comm.allgather(cupy.asnumpy(topk_weights))
    problems = check_layout([None if a is None else cupy.asnumpy(a) for a in layout.values()], all_topk_idx[rank],
                            args.experts, num_ranks, buffer.topology.ranks_per_node)
    problems += check_dispatch(rank, recv_x, recv_topk_idx, recv_topk_weights, per_expert_list, all_topk_idx,
                               all_topk_weights, args.experts, lambda s: tokens_of_rank(s, args.tokens, args.hidden))
    problems += check_combine(rank, combined, expected_combine(x, topk_idx, topk_weights, scales, num_ranks))

    # Example timings of the step's two calls.
    dispatch_us = median_us(lambda: buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, **layout),
                            buffer.barrier)
    combine_us = median_us(lambda: buffer.combine(expert_out, handle), buffer.barrier)
    received_bytes = recv_x.shape[0] * hidden_bytes  # DeepEP's convention: bytes received, local share included

    report = comm.gather((recv_x.shape[0], received_bytes, dispatch_us, combine_us, problems), root=0)
    num_gpus, num_hosts = gpus_in_use(comm, buffer.device_id)
    if rank == 0:
        rows, sizes, dispatch_times, combine_times, problem_lists = zip(*report)
        print(f"cuep {cuep.__version__}: MoE step on {num_ranks} ranks ({num_gpus} GPU(s), {num_hosts} host(s)); "
              f"per rank {args.tokens} tokens, hidden {args.hidden} (bf16), top-{args.topk} of {args.experts} experts")
        print(f"dispatch: each rank receives {min(rows)}-{max(rows)} token rows, {min(sizes) / 1e6:.2f}-"
              f"{max(sizes) / 1e6:.2f} MB (DeepEP's convention: bytes received, local share included); "
              f"combine sends them back")
        for name, times in (("dispatch", dispatch_times), ("combine", combine_times)):
            rates = [size / (us * 1e3) for size, us in zip(sizes, times)]
            print(f"  {name:9s}{np.mean(times):10.1f} us {np.mean(rates):8.1f} GB/s per rank")
        print(f"  (mean over ranks of each one's median of {TIMED_CALLS} calls after {WARMUP_CALLS} warm-up ones, CUDA "
              f"events around each: an example's timing; python -m cuep.bench measures properly)")
        if num_gpus < num_ranks:
            print(f"  {num_ranks} ranks share {num_gpus} GPU(s) here (CUEP_SHARE_GPUS=1): they take turns on it, so "
                  f"these timings do not show speed")
        for problem in (p for ps in problem_lists for p in ps):
            print("MISMATCH " + problem)
        if not any(problem_lists):
            print(f"matches cuep.reference on {num_ranks} ranks: layout, received rows and top-k exactly, "
                  f"combined tokens within bf16 rounding")
    failed = comm.allreduce(bool(problems), op=MPI.LOR)
    buffer.destroy()
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    no_gpu.run(main)
