"""``python -m cuep.bench`` (under mpirun): cuep's kernels timed with CUDA events, beside an NCCL
all-to-all baseline moving the same tokens in the same run.

Bandwidth follows DeepEP's convention: bytes received per rank (its own share included) over time;
the NVLink figure counts only the bytes that crossed NVLink. Times are medians over ``--iters``
calls after ``--warmup``; every rank reports, rank 0 prints the mean over ranks of each median.
"""

from __future__ import annotations

import argparse

import numpy as np

from . import _deps

TUNE_SMS = [16, 24, 32, 48, 64, 96, 128]


def _median_us(fn, warmup: int, iters: int) -> float:
    cupy = _deps.cupy()
    for _ in range(warmup):
        fn()
    starts = [cupy.cuda.Event() for _ in range(iters)]
    ends = [cupy.cuda.Event() for _ in range(iters)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    ends[-1].synchronize()
    return float(np.median([cupy.cuda.get_elapsed_time(s, e) * 1e3 for s, e in zip(starts, ends)]))


class NcclAllToAll:
    """The baseline: tokens grouped by destination, then NCCL send/recv with every peer."""

    def __init__(self, comm):
        cupy = _deps.cupy()
        from cupy.cuda import nccl
        self.nccl, self.rank, self.num_ranks = nccl, comm.Get_rank(), comm.Get_size()
        uid = nccl.get_unique_id() if self.rank == 0 else None
        self.comm = nccl.NcclCommunicator(self.num_ranks, comm.bcast(uid, root=0), self.rank)
        self.stream = cupy.cuda.get_current_stream()

    def exchange(self, send, send_counts, recv, recv_counts) -> None:
        """Rows ``send[sum(send_counts[:p]) : ...]`` go to peer p; rows from p land likewise in ``recv``."""
        row_bytes = send.shape[1] * send.itemsize
        nccl = self.nccl
        nccl.groupStart()
        offset = 0
        for peer, count in enumerate(send_counts):
            self.comm.send(send.data.ptr + offset * row_bytes, count * row_bytes, nccl.NCCL_UINT8, peer,
                           self.stream.ptr)
            offset += count
        offset = 0
        for peer, count in enumerate(recv_counts):
            self.comm.recv(recv.data.ptr + offset * row_bytes, count * row_bytes, nccl.NCCL_UINT8, peer,
                           self.stream.ptr)
            offset += count
        nccl.groupEnd()


def _workload(rank: int, tokens: int, hidden: int, experts: int, topk: int):
    cupy = _deps.cupy()
    from ._checks import bf16_dtype
    rng = cupy.random.default_rng(1000 + rank)
    x = rng.standard_normal((tokens, hidden), dtype=cupy.float32).astype(bf16_dtype())
    scores = rng.random((tokens, experts), dtype=cupy.float32)
    topk_idx = cupy.argsort(-scores, axis=1)[:, :topk].astype(cupy.int64)
    weights = rng.random((tokens, topk), dtype=cupy.float32)
    return x, topk_idx, weights


def bench_normal(args) -> None:
    cupy, mpi = _deps.cupy(), _deps.mpi()
    import cuep
    from .config import Config
    comm = mpi.COMM_WORLD
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    hidden_bytes = args.hidden * 2
    nvl_bytes = Config().get_nvl_buffer_size_hint(hidden_bytes, num_ranks, args.tokens, args.topk)
    buffer = cuep.Buffer(comm, num_nvl_bytes=nvl_bytes)
    x, topk_idx, weights = _workload(rank, args.tokens, args.hidden, args.experts, args.topk)
    x_fp8 = cupy.random.default_rng(7).integers(0, 256, x.shape, dtype=cupy.uint8)
    scales = cupy.ones((args.tokens, args.hidden // 128), dtype=cupy.float32)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, args.experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights, **layout)
    num_recv = recv_x.shape[0]
    local_rows = int(per_rank.get()[rank])  # rows this rank sends itself = rows it receives from itself
    remote_rows = num_recv - local_rows

    results = {}
    for sms in args.sms:
        config = Config(num_sms=sms)
        results[("dispatch bf16 (cached)", sms)] = _median_us(
            lambda: buffer.dispatch(x, handle=handle, config=config), args.warmup, args.iters)
        results[("dispatch fp8 (cached)", sms)] = _median_us(
            lambda: buffer.dispatch((x_fp8, scales), handle=handle, config=config), args.warmup, args.iters)
        results[("dispatch bf16 (with layout sync)", sms)] = _median_us(
            lambda: buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights, config=config, **layout),
            args.warmup, args.iters)
        results[("combine bf16", sms)] = _median_us(
            lambda: buffer.combine(recv_x, handle, topk_weights=recv_w, config=config), args.warmup, args.iters)
        if rank == 0 and args.progress:
            print(f"  ... measured num_sms={sms}", flush=True)

    # NCCL baseline on the same routing: group rows by destination (glue), then all-to-all.
    nccl = NcclAllToAll(comm)
    dst_of = [cupy.nonzero(in_rank[:, r])[0] for r in range(num_ranks)]
    send_counts = [int(d.size) for d in dst_of]
    recv_counts = [int(c) for c in comm.alltoall(send_counts)]
    order = cupy.concatenate(dst_of)
    recv_buf = cupy.empty((sum(recv_counts), args.hidden), dtype=x.dtype)

    def nccl_dispatch():
        nccl.exchange(x[order], send_counts, recv_buf, recv_counts)

    combine_out = cupy.zeros((args.tokens, args.hidden), dtype=cupy.float32)

    def nccl_combine():
        back = cupy.empty((int(order.size), args.hidden), dtype=x.dtype)
        nccl.exchange(recv_buf, recv_counts, back, send_counts)
        combine_out.fill(0)
        cupy.add.at(combine_out, order, back.astype(cupy.float32))
        combine_out.astype(x.dtype)

    results[("nccl dispatch bf16", 0)] = _median_us(nccl_dispatch, args.warmup, args.iters)
    results[("nccl combine bf16", 0)] = _median_us(nccl_combine, args.warmup, args.iters)

    fp8_row_bytes = args.hidden + args.hidden // 128 * 4  # e4m3 bytes, then one float scale per 128
    bf16_bytes, fp8_bytes = num_recv * hidden_bytes, num_recv * fp8_row_bytes
    remote_bf16, remote_fp8 = remote_rows * hidden_bytes, remote_rows * fp8_row_bytes
    gathered = comm.gather(results, root=0)
    if rank != 0:
        buffer.destroy()
        return
    print(f"cuep normal mode: {num_ranks} ranks, {args.tokens} tokens/rank, hidden {args.hidden}, "
          f"top-{args.topk} of {args.experts} experts; {num_recv} rows received by rank 0 "
          f"({remote_rows} over NVLink)")
    print(f"{'operation':34s} {'SMs':>4s} {'median us':>10s} {'GB/s':>8s} {'NVLink GB/s':>12s}")
    mean_us = {key: float(np.mean([g[key] for g in gathered])) for key in results}
    for (name, sms), us in mean_us.items():
        total, remote = (fp8_bytes, remote_fp8) if "fp8" in name else (bf16_bytes, remote_bf16)
        print(f"{name:34s} {sms or '-':>4} {us:10.1f} {total / us / 1e3:8.1f} {remote / us / 1e3:12.1f}")
    if args.tune:
        for name in ("dispatch bf16 (cached)", "dispatch fp8 (cached)", "combine bf16"):
            sms, us = min(((s, u) for (n, s), u in mean_us.items() if n == name), key=lambda item: item[1])
            print(f"best for {name}: Config(num_sms={sms}) at {us:.1f} us")
    buffer.destroy()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cuep.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["normal"], default="normal")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--sms", type=lambda s: [int(v) for v in s.split(",")], default=[24],
                        help="comma-separated SM counts to measure")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--tune", action="store_true",
                        help=f"search SM counts {TUNE_SMS} and print the best Config per operation")
    parser.add_argument("--progress", action="store_true", help="print a line after each SM count")
    args = parser.parse_args(argv)
    if args.tune:
        args.sms, args.progress = TUNE_SMS, True
    bench_normal(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
