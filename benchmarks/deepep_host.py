"""DeepEP V1's host time per eager call, measured the way ``python -m cuep.bench --mode host`` measures cuep's:
the same calls (``cuep.bench_host._calls``), workload, bursts and floors, through DeepEP's own ``deep_ep``.

    python benchmarks/deepep_host.py --deepep /path/to/DeepEP --num-processes 2     # repository root, PYTHONPATH=.

``--deepep`` names a DeepEP V1 tree built in place (``python setup.py build_ext --inplace`` at its last V1
layout, commit 567632d). The ranks are processes of ``torch.multiprocessing``, not bound to cores (as
torchrun starts a framework's), handing DeepEP a gloo group as vLLM does (NCCL refuses two ranks on one GPU),
sharing the GPUs there are; DeepEP loads its own NVSHMEM, so run this without cuep's devkit preload. Run it
in the same command as ``mpirun -np N python -m cuep.bench --mode host``, on the same machine: host figures
only compare within one machine. DeepEP's one CPU wait (a dispatch with a layout waits for its counts)
happens inside its C++ and is not timed apart: that call's row holds it. ``--no-low-latency`` leaves out the
low-latency calls, for a build without NVSHMEM or a machine where its low-latency Buffer cannot start. At one
process only the layout and the low-latency calls run: DeepEP builds its normal-mode kernels for 2, 4 and 8
ranks.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from types import SimpleNamespace

from torch_ranks import free_port


def _rank(local_rank: int, num_processes: int, port: int, options: argparse.Namespace) -> None:
    sys.path.insert(0, os.path.abspath(options.deepep))
    import cupy
    import torch
    import torch.distributed as dist

    import deep_ep
    from cuep import bench_host
    from cuep.bench import _workload

    found = Path(getattr(deep_ep, "__file__", "") or "").resolve()
    if Path(options.deepep).resolve() not in found.parents:
        raise SystemExit(f"deepep_host.py: 'import deep_ep' found {found}, not the build under {options.deepep}")
    device = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    cupy.cuda.Device(device).use()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=local_rank, world_size=num_processes)
    group = dist.new_group(list(range(num_processes)))
    args = SimpleNamespace(tokens=options.tokens, hidden=options.hidden, experts=options.experts, topk=options.topk,
                           low_latency_tokens=options.low_latency_tokens)
    workload = tuple(torch.from_dlpack(a) for a in bench_host.workload_arrays(
        local_rank, args, lambda rank, tokens: _workload(rank, tokens, args.hidden, args.experts, args.topk)))
    hidden_bytes, nvl_bytes = args.hidden * 2, 0  # one process: the layout alone, which needs no buffer
    if num_processes > 1:
        nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, num_processes)
                        for config in (deep_ep.Buffer.get_dispatch_config(num_processes),
                                       deep_ep.Buffer.get_combine_config(num_processes)))
    rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(args.low_latency_tokens, args.hidden, num_processes,
                                                               args.experts)
    local_experts = args.experts // num_processes

    def make_buffer(nvl: int, rdma: int, low_latency: bool):
        if low_latency:
            return deep_ep.Buffer(group, 0, rdma_bytes, low_latency_mode=True, num_qps_per_rank=local_experts)
        return deep_ep.Buffer(group, nvl_bytes, 0)

    def synchronize() -> None:
        torch.cuda.synchronize()
        dist.barrier(group)

    rows = {"floor: empty kernel launch": {"DeepEP": bench_host.empty_launch_us()},
            "floor: one-element torch op": {"DeepEP": bench_host.torch_op_us()}}
    calls = bench_host._calls(make_buffer, lambda shape: torch.zeros(shape, dtype=torch.bfloat16, device="cuda"),
                              lambda data: data.view(torch.float8_e4m3fn), None, args, num_processes, workload,
                              with_low_latency=not options.no_low_latency, with_dispatch=num_processes > 1)
    gpu_bound: set[str] = set()
    rows.update(bench_host.time_apis({"DeepEP": calls}, synchronize, None, gpu_bound))
    every_rank: list = [None] * num_processes
    dist.all_gather_object(every_rank, (rows, gpu_bound))
    if local_rank == 0:
        print(f"DeepEP V1 host time per eager call ({deep_ep.__file__}): {num_processes} ranks, bursts of "
              f"{bench_host.BURST} calls without a sync, median of {bench_host.BURSTS} bursts; normal mode "
              f"{args.tokens} tokens x {args.hidden}, low latency {args.low_latency_tokens} tokens, {args.experts} "
              f"experts, top-{args.topk}; us per rank (ratio to the empty launch, mean over ranks)")
        bench_host.print_table([r for r, _ in every_rank], set().union(*(b for _, b in every_rank)),
                               {"DeepEP": "DeepEP V1"})
    dist.barrier(group)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepep", required=True, help="a DeepEP V1 tree built in place")
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--low-latency-tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--no-low-latency", action="store_true",
                        help="time the normal mode only (a build without NVSHMEM, or no NVSHMEM transport here)")
    options = parser.parse_args()
    import torch.multiprocessing
    torch.multiprocessing.spawn(_rank, args=(options.num_processes, free_port(), options),
                                nprocs=options.num_processes)


if __name__ == "__main__":
    main()
