"""DeepEP V2's ``ElasticBuffer`` on cuep.torch beside cuep's V1 path and NCCL, in one command: the same tokens
(``--tokens`` per rank, hidden ``--hidden``, top-``--topk`` of ``--experts``, uniform random routing, BF16 or
``--fp8``) dispatched and combined by

- ``elastic compact`` and ``elastic expand``: ``ElasticBuffer.dispatch`` / ``combine`` at V2's analytic SM count
  (``get_theoretical_num_sms``, ``prefer_overlap_with_compute`` on) or ``--sms``;
- ``expand, 1 sum``: the expanded layout on a buffer made with ``allow_multiple_reduction=False`` (each expanded
  row goes back alone; its combine takes no weights);
- ``v1``: ``Buffer.get_dispatch_layout`` + ``dispatch`` / ``combine`` at ``--v1-sms`` (24, DeepEP's test's best);
- ``nccl``: ``torch.distributed.all_to_all_single`` of the same rows each way (each token once per rank).

Each is timed over ``--iters`` calls with CUDA events after a barrier (median over calls of the slowest rank);
GB/s is DeepEP's convention: the bytes of the rows a rank receives (dispatch) or sends back (combine) over the
time. One process per rank (``torch.multiprocessing``), one GPU each, an NCCL group; across nodes, virtual ones
with ``CUEP_RANKS_PER_NODE`` (both cuep paths then run the internode mode)::

    python benchmarks/elastic_a2a.py --num-ranks 4 --tokens 4096
    CUEP_RANKS_PER_NODE=1 python benchmarks/elastic_a2a.py --num-ranks 2 --tokens 4096
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

from torch_ranks import free_port


def timed(fn, iters: int, group) -> float:
    """Median seconds of ``fn()`` over ``iters`` calls, the slowest rank's per call."""
    times = []
    for _ in range(iters):
        dist.barrier(group)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        t = torch.tensor([start.elapsed_time(end) / 1e3], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        times.append(t.item())
    return statistics.median(times)


def run_rank(rank: int, args, port: int) -> None:
    import cuep.torch as deep_ep
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.num_ranks,
                            device_id=torch.device("cuda", rank))
    group = dist.new_group(list(range(args.num_ranks)))
    torch.manual_seed(rank)
    T, H, K, E = args.tokens, args.hidden, args.topk, args.experts
    x = torch.randn(T, H, dtype=torch.bfloat16, device="cuda")
    scores = torch.rand(T, E, device="cuda")
    weights, idx = torch.topk(scores, K, dim=-1)
    weights = weights.float()
    if args.fp8:
        amax = x.float().view(T, H // 128, 128).abs().amax(-1).clamp(min=1e-4)
        sf = amax / 448.0
        x_in = ((x.float().view(T, H // 128, 128) / sf.unsqueeze(-1)).view(T, H).to(torch.float8_e4m3fn), sf)
    else:
        x_in = x
    row_bytes = H * (1 if args.fp8 else 2)

    results = {}

    def run_elastic(elastic, expand: bool):
        recv, _, recv_w, handle, _ = elastic.dispatch(x_in, topk_idx=idx, topk_weights=weights, num_experts=E,
                                                      num_sms=sms, do_expand=expand)
        rows = (recv[0] if isinstance(recv, tuple) else recv).shape[0]
        y = torch.randn(rows, H, dtype=torch.bfloat16, device="cuda")
        d = timed(lambda: elastic.dispatch(x_in, topk_idx=idx, topk_weights=weights, num_experts=E, num_sms=sms,
                                           do_expand=expand), args.iters, group)
        # Each lane's weight comes back only from a rank's sum of its lanes (V2's rule).
        back_weights = recv_w if elastic.allow_multiple_reduction else None
        c = timed(lambda: elastic.combine(y, handle, topk_weights=back_weights), args.iters, group)
        return handle.num_recv_tokens, d, c

    for multiple_reduction, rows in ((True, (("elastic compact", False), ("elastic expand", True))),
                                     (False, (("expand, 1 sum", True),))):
        elastic = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=T, hidden=H, num_topk=K,
                                        allow_multiple_reduction=multiple_reduction, explicitly_destroy=True)
        sms = args.sms or elastic.get_theoretical_num_sms(E, K)
        for name, expand in rows:
            results[name] = run_elastic(elastic, expand)
        elastic.destroy()

    hints = deep_ep.Buffer.get_dispatch_config(args.num_ranks)  # V1's buffers, as its users size them
    v1 = deep_ep.Buffer(group, hints.get_nvl_buffer_size_hint(H * 2, args.num_ranks),
                        hints.get_rdma_buffer_size_hint(H * 2, args.num_ranks), explicitly_destroy=True)
    dispatch_config, combine_config = (deep_ep.Config(args.v1_sms, 8, 256, 8, 128) for _ in range(2))

    def v1_dispatch():
        per_rank, per_node, per_expert, in_rank, _ = v1.get_dispatch_layout(idx, E)
        return v1.dispatch(x_in, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node,
                           is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
                           topk_weights=weights, config=dispatch_config)
    recv, _, recv_w, _, handle, _ = v1_dispatch()
    rows = (recv[0] if isinstance(recv, tuple) else recv).shape[0]
    y = torch.randn(rows, H, dtype=torch.bfloat16, device="cuda")
    results["v1"] = (rows, timed(v1_dispatch, args.iters, group),
                     timed(lambda: v1.combine(y, handle, topk_weights=recv_w, config=combine_config), args.iters,
                           group))
    v1.destroy()

    # NCCL: the same rows each way, each token once per destination rank.
    dest = (idx // (E // args.num_ranks))
    in_rank = torch.zeros(T, args.num_ranks, dtype=torch.bool, device="cuda")
    in_rank.scatter_(1, dest, True)
    send_counts = in_rank.sum(0)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_split, recv_split = send_counts.tolist(), recv_counts.tolist()
    send_rows = torch.cat([x[in_rank[:, r]] for r in range(args.num_ranks)])
    recv_rows = torch.empty(sum(recv_split), H, dtype=torch.bfloat16, device="cuda")
    nccl = timed(lambda: dist.all_to_all_single(recv_rows, send_rows, recv_split, send_split, group=group),
                 args.iters, group)
    results["nccl"] = (sum(recv_split), nccl, timed(
        lambda: dist.all_to_all_single(send_rows, recv_rows, send_split, recv_split, group=group), args.iters, group))

    received = torch.tensor([results["v1"][0]], device="cuda")
    dist.all_reduce(received, op=dist.ReduceOp.MIN, group=group)
    if rank == 0:
        print(f"{args.num_ranks} ranks, {T} tokens per rank, hidden {H}, top-{K} of {E}, "
              f"{'FP8' if args.fp8 else 'BF16'} dispatch; elastic at {sms} SMs, v1 at {args.v1_sms} SMs")
        print(f"{'path':<16} {'dispatch us':>12} {'GB/s':>7} {'combine us':>11} {'GB/s':>7}")
        for name, (rows, d, c) in results.items():
            d_bytes = rows * (row_bytes if name != "nccl" else H * 2)
            print(f"{name:<16} {d * 1e6:12.1f} {d_bytes / d / 1e9:7.1f} {c * 1e6:11.1f} {rows * H * 2 / c / 1e9:7.1f}")
    dist.barrier(group)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-ranks", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--fp8", action="store_true", help="FP8 dispatch (data and per-128-channel scales)")
    parser.add_argument("--sms", type=int, default=0, help="elastic SMs (0: V2's analytic count)")
    parser.add_argument("--v1-sms", type=int, default=24)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.multiprocessing.spawn(run_rank, args=(args, free_port()), nprocs=args.num_ranks)


if __name__ == "__main__":
    main()
