"""The eager decode step as DeepEP's ``tests/test_low_latency.py`` times it, on cuep.torch or on DeepEP, with the
host's share of it taken apart.

    python benchmarks/decode_step.py --num-ranks 4                                  # cuep.torch
    PYTHONPATH=/path/to/DeepEP python benchmarks/decode_step.py --backend deepep     # DeepEP V1, built in place

The step: an FP8 ``low_latency_dispatch`` with cumulative statistics, then a BF16 ``low_latency_combine`` of
per-expert outputs, 128 tokens per rank, hidden 7168, top-8 of 288 experts with a few ``-1`` choices (DeepEP's
test's workload; ``--use-logfmt`` combines in LogFMT, as its ``--use-logfmt``). Per rank, each over ``--steps``
steps after ``--warmup``, CUDA events around each step and no synchronisation between steps, as DeepEP's
``bench``:

- ``events``: DeepEP's figure, the mean of the per-step event spans (``avg_t``), and their minimum;
- ``host``: the host's wall time per step over the same loop (the calls and the two event records);
- ``dispatch``, ``combine``: the host's time inside each call;
- ``aligned``: ``events`` again, every rank starting together (a barrier and a device synchronisation first);
- ``synced``: the wall time of a step that ends with a device synchronisation;
- ``dispatch, paced``, ``combine, paced``: the host's time inside each call again, over ``--steps`` steps with a
  device synchronisation (not timed) every ``--sync-every`` steps, so that the GPU never falls far behind: what
  the calls themselves cost the host, without a launch that waits for room behind a backlog of queued work.

``--default-device cuda``: every rank first calls ``torch.set_default_device('cuda')``, as DeepEP's tests do.
``--profile``: rank 0 then prints where its host time goes (cProfile, by own and by cumulative time; it slows
every call).

``--beside-deepep PATH``: the comparison the docs quote. This script runs again, in turn, on cuep.torch and on the
DeepEP tree at ``PATH`` (built in place; put first on ``PYTHONPATH``, and ``--deepep-unset`` variables taken out of
its environment, such as a preload of another NVSHMEM), ``--processes`` times each, then prints every process's mean
of each row and the least of each backend. The host's figures move up to 2x between processes of one tree, more
than most changes move them, so the least of several processes in one command is what compares.

    python benchmarks/decode_step.py --num-ranks 1 --default-device cuda --steps 1000 --beside-deepep ../DeepEP

A step whose event span is near its host time is set by the host (the GPU idles between launches, and each
rank's kernels wait for the slowest rank's); one near the ``synced`` figure is set by the GPU. Rank 0 prints
the mean and the largest over ranks. One process per rank (``torch.multiprocessing``), one GPU each, an NCCL
group.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from torch_ranks import add_run_arguments, backend_module, deepep_environment, free_port, outputs_in_turn


def step_inputs(rank: int, tokens: int, hidden: int, num_experts: int, topk: int, num_ranks: int):
    generator = torch.Generator(device="cuda").manual_seed(1234 + rank)
    x = torch.randn((tokens, hidden), dtype=torch.bfloat16, device="cuda", generator=generator)
    scores = torch.randn((tokens, num_experts), dtype=torch.float32, device="cuda", generator=generator).abs() + 1
    topk_idx = torch.topk(scores, topk, dim=-1, largest=True, sorted=True)[1]
    topk_weights = torch.randn((tokens, topk), dtype=torch.float32, device="cuda", generator=generator).abs()
    for i in range(10):  # DeepEP's test drops a few choices
        topk_idx[(rank * 7 + i * 13) % tokens, (rank + i) % topk] = -1
    local = num_experts // num_ranks
    expert_x = torch.randn((local, num_ranks * tokens, hidden), dtype=torch.bfloat16, device="cuda",
                           generator=generator)
    stats = torch.zeros((local,), dtype=torch.int, device="cuda")
    return x, topk_idx, topk_weights, expert_x, stats


def run_rank(rank: int, args, port: int) -> None:
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.num_ranks)
    if args.default_device:  # as DeepEP's tests do (torch.set_default_device('cuda') in their init_dist)
        torch.set_default_device(args.default_device)
    group = dist.new_group(list(range(args.num_ranks)))
    module = backend_module(args.backend)
    rdma_bytes = module.Buffer.get_low_latency_rdma_size_hint(args.tokens, args.hidden, args.num_ranks, args.experts)
    buffer = module.Buffer(group, 0, rdma_bytes, low_latency_mode=True,
                           num_qps_per_rank=args.experts // args.num_ranks)
    x, topk_idx, topk_weights, expert_x, stats = step_inputs(rank, args.tokens, args.hidden, args.experts, args.topk,
                                                             args.num_ranks)
    inside = {"dispatch": 0.0, "combine": 0.0}

    def step() -> None:
        started = time.perf_counter()
        recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(
            x, topk_idx, args.tokens, args.experts, cumulative_local_expert_recv_stats=stats, use_fp8=True,
            async_finish=False, return_recv_hook=False)
        dispatched = time.perf_counter()
        buffer.low_latency_combine(expert_x, topk_idx, topk_weights, handle, use_logfmt=args.use_logfmt,
                                   return_recv_hook=False)
        inside["dispatch"] += dispatched - started
        inside["combine"] += time.perf_counter() - dispatched

    def timed(aligned: bool) -> tuple[float, float, float]:
        """DeepEP's bench: warm-up steps, then event pairs around each step, one synchronisation at the end;
        returns (mean event span, least span, host wall per step), in us."""
        torch.cuda.synchronize()
        for _ in range(args.warmup):
            step()
        if aligned:
            torch.cuda.synchronize()
            dist.barrier(group)
        inside.update(dispatch=0.0, combine=0.0)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps)]
        began = time.perf_counter()
        for start, end in zip(starts, ends):
            start.record()
            step()
            end.record()
        host = (time.perf_counter() - began) / args.steps * 1e6
        torch.cuda.synchronize()
        spans = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)][1:]  # DeepEP drops the first
        return sum(spans) / len(spans), min(spans), host

    def inside_per_step(suffix: str = "") -> dict[str, float]:
        """The host's time inside each call over the last ``args.steps`` steps, us per step, named ``call + suffix``."""
        return {name + suffix: seconds / args.steps * 1e6 for name, seconds in inside.items()}

    events, least, host = timed(aligned=False)
    unpaced = inside_per_step()
    aligned, _, _ = timed(aligned=True)
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(args.steps):
        step()
        torch.cuda.synchronize()
    synced = (time.perf_counter() - began) / args.steps * 1e6
    inside.update(dispatch=0.0, combine=0.0)
    for i in range(args.steps):
        step()
        if (i + 1) % args.sync_every == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    row = {"events": events, "least event span": least, "host": host, **unpaced, "aligned": aligned, "synced": synced,
           **inside_per_step(", paced")}
    rows = [None] * args.num_ranks
    dist.all_gather_object(rows, row, group=group)
    if rank == 0:
        print(f"decode step on {args.backend}{' (LogFMT combine)' if args.use_logfmt else ''}: {args.num_ranks} ranks, "
              f"{args.tokens} tokens, hidden {args.hidden}, "
              f"top-{args.topk} of {args.experts}; us per step, {args.steps} steps", flush=True)
        print(f"{'':18} {'mean':>8} {'max':>8}   per rank", flush=True)
        for name in row:
            values = [r[name] for r in rows]
            print(f"{name:18} {sum(values) / len(values):8.1f} {max(values):8.1f}   "
                  + " ".join(f"{v:7.1f}" for v in values), flush=True)
    if args.profile:  # where the host's time goes: cProfile over more steps (every rank steps, rank 0 profiles)
        import cProfile
        import pstats
        profiler = cProfile.Profile()
        if rank == 0:
            profiler.enable()
        for _ in range(args.steps * 4):
            step()
        profiler.disable()
        torch.cuda.synchronize()
        if rank == 0:
            stats = pstats.Stats(profiler)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(45)
    dist.barrier(group)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser, tokens=128, experts=288)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--default-device", default=None,
                        help="torch.set_default_device in every rank first (DeepEP's tests set 'cuda')")
    parser.add_argument("--use-logfmt", action="store_true", help="combine with use_logfmt=True, as DeepEP's test's "
                        "--use-logfmt does")
    parser.add_argument("--profile", action="store_true", help="rank 0 prints a cProfile of its steps' host time")
    parser.add_argument("--sync-every", type=int, default=20,
                        help="steps between the synchronisations of the paced rows (not timed)")
    parser.add_argument("--beside-deepep", metavar="PATH", default=None,
                        help="run on cuep.torch and on the DeepEP tree at PATH in turn, --processes times each, and "
                        "print each row's values and least")
    parser.add_argument("--processes", type=int, default=5, help="processes of each backend with --beside-deepep")
    parser.add_argument("--deepep-unset", nargs="*", default=[], metavar="VAR",
                        help="environment variables DeepEP's processes run without (with --beside-deepep)")
    args = parser.parse_args()
    if args.sync_every < 1:
        parser.error(f"--sync-every must be at least 1, got {args.sync_every}")
    if args.beside_deepep is not None:
        if args.processes < 1:
            parser.error(f"--processes must be at least 1, got {args.processes}")
        beside_deepep(args)
        return
    torch.multiprocessing.spawn(run_rank, args=(args, free_port()), nprocs=args.num_ranks)


def _rows(output: str, num_ranks: int) -> dict[str, float]:
    """Each row's mean over the ranks, from a run's printed table (a row: its name, the mean, the largest, then one
    value per rank)."""
    rows = {}
    for line in output.splitlines():
        parts = line.split()
        if len(parts) <= num_ranks + 2:
            continue
        try:
            values = [float(v) for v in parts[-(num_ranks + 2):]]
        except ValueError:
            continue
        rows[" ".join(parts[:-(num_ranks + 2)])] = values[0]
    return rows


def beside_deepep(args) -> None:
    """This script on cuep.torch and on DeepEP in turn, ``args.processes`` processes each; prints every process's
    row means, then the least of each backend."""
    workload = ["--num-ranks", str(args.num_ranks), "--tokens", str(args.tokens), "--hidden", str(args.hidden),
                "--experts", str(args.experts), "--topk", str(args.topk), "--warmup", str(args.warmup), "--steps",
                str(args.steps), "--sync-every", str(args.sync_every)]
    workload += ["--default-device", args.default_device] if args.default_device else []
    workload += ["--use-logfmt"] if args.use_logfmt else []
    environments = {"cuep": None, "deepep": deepep_environment(args.beside_deepep, args.deepep_unset)}
    commands = {backend: ([sys.executable, os.path.abspath(__file__), "--backend", backend, *workload], env, None)
                for backend, env in environments.items()}
    found = {backend: [_rows(output, args.num_ranks) for output in outputs]
             for backend, outputs in outputs_in_turn(commands, args.processes, "decode_step.py").items()}
    print(f"decode step, cuep.torch beside DeepEP ({args.beside_deepep}), {args.processes} processes each, in turn: "
          f"{args.num_ranks} ranks, {args.tokens} tokens, hidden {args.hidden}, top-{args.topk} of {args.experts}"
          f"{', LogFMT combine' if args.use_logfmt else ''}; us per step, each process's mean over the ranks")
    print(f"{'':18} {'cuep least':>10} {'DeepEP least':>12}   cuep | DeepEP")
    for name in found["cuep"][0]:
        values = {backend: [rows[name] for rows in runs] for backend, runs in found.items()}
        print(f"{name:18} {min(values['cuep']):10.1f} {min(values['deepep']):12.1f}   "
              + " ".join(f"{v:.1f}" for v in values["cuep"]) + " | "
              + " ".join(f"{v:.1f}" for v in values["deepep"]), flush=True)


if __name__ == "__main__":
    main()
