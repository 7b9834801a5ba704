"""A GEMM beside a dispatch + combine, through cuep.torch or DeepEP V1: the measurement of ``python -m cuep.bench
--mode overlap`` on either backend, so that both run in one command on one machine.

    python benchmarks/overlap_a2a.py --num-ranks 4 --sms 8,24                                 # cuep.torch
    PYTHONPATH=/path/to/DeepEP python benchmarks/overlap_a2a.py --backend deepep --sms 8,24    # DeepEP V1 in place

Per rank: a cached BF16 dispatch and a combine (``async_finish``, on the Buffer's communication stream, waiting only
for an event taken before the GEMM, as a training step's ``previous_event``), beside a BF16 GEMM of 8192 x 7168 x 2048
(``torch.matmul``, sized for the whole GPU) on the compute stream. The communication is enqueued first, so its
kernels take their SMs and the GEMM's blocks fill the rest. For each SM count (``Buffer.set_num_sms``, then the
backend's own ``get_dispatch_config`` / ``get_combine_config`` as Megatron-LM sets them, and the handle of a dispatch
made with that config): the GEMM alone, the communication alone and both, timed in turn, iteration after iteration,
each from an idle GPU, after ``--warmup`` rounds. Rank 0 prints the medians of ``--iters`` iterations, means over
ranks. Workload as the bench's: ``--tokens`` per rank, hidden 7168, top-8 of 256 experts from random scores. One
process per rank (``torch.multiprocessing``), one GPU each, an NCCL group.

Unlike ``cuep.bench --mode overlap``, the Buffer is sized as Megatron-LM sizes it, by the backend's hint with no
token count (DeepEP's rings; cuep's fixed buffer, which a call of 4096 tokens crosses in rounds), and the GEMM is
never told the SMs the communication leaves, which torch's matmul cannot be told.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from torch_ranks import add_run_arguments, backend_module, free_port

from cuep.bench import OVERLAP_GEMM, interleaved_medians


def workload(rank: int, tokens: int, hidden: int, num_experts: int, topk: int):
    generator = torch.Generator(device="cuda").manual_seed(4321 + rank)
    x = torch.randn((tokens, hidden), dtype=torch.bfloat16, device="cuda", generator=generator)
    scores = torch.rand((tokens, num_experts), dtype=torch.float32, device="cuda", generator=generator)
    topk_idx = torch.topk(scores, topk, dim=-1, sorted=False)[1]
    topk_weights = torch.rand((tokens, topk), dtype=torch.float32, device="cuda", generator=generator)
    return x, topk_idx, topk_weights


def run_rank(rank: int, args, port: int) -> None:
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.num_ranks,
                            device_id=torch.device("cuda", rank % torch.cuda.device_count()))
    group = dist.new_group(list(range(args.num_ranks)))
    module = backend_module(args.backend)
    num_ranks, hidden_bytes = args.num_ranks, args.hidden * 2
    module.Buffer.set_num_sms(max(args.sms))  # DeepEP's hints grow with the SM count: sized for the largest
    nvl_bytes = max(module.Buffer.get_dispatch_config(num_ranks).get_nvl_buffer_size_hint(hidden_bytes, num_ranks),
                    module.Buffer.get_combine_config(num_ranks).get_nvl_buffer_size_hint(hidden_bytes, num_ranks))
    buffer = module.Buffer(group, nvl_bytes, 0, explicitly_destroy=True)
    x, topk_idx, topk_weights = workload(rank, args.tokens, args.hidden, args.experts, args.topk)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, args.experts)
    m, k, n = OVERLAP_GEMM
    a = torch.ones((m, k), dtype=torch.bfloat16, device="cuda")
    b = torch.ones((k, n), dtype=torch.bfloat16, device="cuda")
    out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()

    def once(run_gemm: bool, configs) -> tuple[float, float]:
        """(GEMM us, communication us) of one iteration from an idle GPU; ``configs`` None: no communication."""
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        comm_start, comm_end, gemm_start, gemm_end = events
        torch.cuda.synchronize()
        previous = module.Buffer.capture()
        comm_start.record()
        outputs = None
        if configs is not None:
            dispatch_config, combine_config = configs
            dispatched = buffer.dispatch(x, handle=handle, config=dispatch_config, previous_event=previous,
                                         async_finish=True)
            combined = buffer.combine(recv_x, handle, topk_weights=recv_weights, config=combine_config,
                                      previous_event=previous, async_finish=True)
            outputs = (dispatched, combined)
        gemm_start.record()
        if run_gemm:
            torch.matmul(a, b, out=out)
        gemm_end.record()
        if outputs is not None:
            with torch.cuda.stream(side):
                outputs[1][-1].current_stream_wait()
                comm_end.record(side)
        torch.cuda.synchronize()
        del outputs
        return (gemm_start.elapsed_time(gemm_end) * 1e3,
                comm_start.elapsed_time(comm_end) * 1e3 if configs is not None else 0.0)

    rows = []
    for sms in args.sms:
        module.Buffer.set_num_sms(sms)
        configs = (module.Buffer.get_dispatch_config(num_ranks), module.Buffer.get_combine_config(num_ranks))
        # DeepEP's handle holds its channels, one per two SMs: a cached dispatch takes the SM count it was made with.
        recv_x, _, recv_weights, _, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=topk_weights, config=configs[0])
        (gemm_alone, _), (_, comm_alone), (gemm_both, comm_both) = interleaved_medians(
            [lambda: once(True, None), lambda: once(False, configs), lambda: once(True, configs)],
            args.warmup, args.iters)
        rows.append((gemm_alone, comm_alone, comm_both, gemm_both))
    gathered = [None] * num_ranks
    dist.all_gather_object(gathered, rows, group=group)
    if rank == 0:
        print(f"overlap on {args.backend}: {num_ranks} ranks, {args.tokens} tokens/rank, hidden {args.hidden}, "
              f"top-{args.topk} of {args.experts}; cached BF16 dispatch + combine (async_finish) beside a BF16 GEMM "
              f"{m}x{k}x{n}; each row's variants timed in turn, medians of {args.iters}, means over ranks, us",
              flush=True)
        print(f"{'SMs':>4} {'GEMM alone':>10} {'comm alone':>10} | {'comm':>8} {'+':>6} {'GEMM':>8} {'+':>6}",
              flush=True)
        for i, sms in enumerate(args.sms):
            gemm_alone, comm_alone, comm_both, gemm_both = (statistics.fmean(g[i][j] for g in gathered)
                                                            for j in range(4))
            print(f"{sms:4d} {gemm_alone:10.1f} {comm_alone:10.1f} | {comm_both:8.1f} "
                  f"{comm_both / comm_alone - 1:6.1%} {gemm_both:8.1f} {gemm_both / gemm_alone - 1:6.1%}", flush=True)
    buffer.destroy()
    dist.barrier(group)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser, tokens=4096, experts=256)
    parser.add_argument("--sms", type=lambda s: [int(v) for v in s.split(",")], default=[24])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if any(sms <= 0 or sms % 2 for sms in args.sms):  # DeepEP runs a channel on each pair of SMs
        parser.error(f"--sms: each count must be a positive even number, not {args.sms}")
    torch.multiprocessing.spawn(run_rank, args=(args, free_port()), nprocs=args.num_ranks)


if __name__ == "__main__":
    main()
