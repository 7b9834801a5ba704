"""The host time of a low-latency dispatch and combine (CuPy API), phase by phase, and of the operations
they are made of (GPU, mpirun, one rank is enough).

    mpirun -np 1 python benchmarks/host_phases.py [--torch] [--no-gc] [--normal]   # PYTHONPATH=.

``--torch`` first imports torch and makes a cuep.torch Buffer beside (as ``--mode host`` does: a process
that holds torch has a far larger heap for the garbage collector); ``--no-gc`` turns the collector off
while timing; ``--normal`` adds the normal mode's calls (a 4096-token Buffer), with the phases of the
layout and of a cached FP8 dispatch.

Each figure is the median over 7 bursts of the host microseconds per call in a burst of 20 with no
sync (``cuep.bench_host.host_us``, as ``python -m cuep.bench --mode host``), beside the empty-launch
floor of the same run. A phase is timed by calling the code of that phase alone, the way the call
runs it, so the phases add up to about the whole call; ``--mode host`` gives the calls' figures.
"""

from __future__ import annotations

import argparse
import gc

import cupy
import numpy as np
from mpi4py import MPI

import cuep
from cuep import _checks, bench_host, fp8
from cuep.bench import _workload
from cuep.kernels.low_latency import DispatchArgs
from cuep.modes import low_latency

TOKENS, HIDDEN, EXPERTS, TOPK = 128, 7168, 256, 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", action="store_true", help="hold torch and a cuep.torch Buffer, as --mode host")
    parser.add_argument("--no-gc", action="store_true", help="garbage collector off while timing")
    parser.add_argument("--normal", action="store_true", help="also the normal mode's calls")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    num_ranks = comm.Get_size()
    device = cupy.cuda.Device()

    def synchronize() -> None:
        device.synchronize()
        comm.Barrier()

    def us(call) -> float:
        return bench_host.host_us(call, synchronize)

    x, topk_idx, weights = _workload(comm.Get_rank(), TOKENS, HIDDEN, EXPERTS, TOPK)
    hint = cuep.Buffer.get_low_latency_rdma_size_hint(TOKENS, HIDDEN, num_ranks, EXPERTS)
    buffer = cuep.Buffer(comm, 0, hint, low_latency_mode=True)
    resources, ctx = buffer._resources, buffer._resources.low_latency
    empty = cupy.RawKernel(bench_host._EMPTY_KERNEL, "cuep_bench_empty")
    call = "low_latency_dispatch()"

    def dispatch() -> tuple:
        return buffer.low_latency_dispatch(x, topk_idx, TOKENS, EXPERTS)

    def dispatch_checks() -> None:
        resources.low_latency_ready(call)
        a = _checks.as_device_array(call, "x", x)
        b = _checks.as_device_array(call, "topk_idx", topk_idx)
        _checks.check_low_latency_dispatch(call, a, b, TOKENS, EXPERTS, num_ranks, low_latency.MAX_TOPK,
                                           low_latency.MAX_TOKENS_PER_RANK, True, False, False)
        _checks.optional_vector(call, "cumulative_local_expert_recv_stats", None, None, 0)
        _checks.check_hook_options(call, False, False)

    def dispatch_known():
        return low_latency.checked_dispatch(call, ctx, x, topk_idx, TOKENS, EXPERTS, None, None, True, False, False)

    shape, *addresses = dispatch_known()

    def dispatch_build():
        return low_latency.dispatch(ctx, shape, *addresses)

    handle = dispatch()[2]
    # One launch, relaunched: each run is a new call, whose buffer the kernel picks.
    run = dispatch_build()[-1]
    both = low_latency.SEND_PHASE | low_latency.RECV_PHASE
    launch = run.launch

    stream = cupy.cuda.get_current_stream()
    expert_out = cupy.zeros((EXPERTS // num_ranks, num_ranks * TOKENS, HIDDEN), dtype=x.dtype)
    plan = next(iter(ctx.plans.values()))
    storage = cupy.cuda.alloc(plan.storage_bytes)
    view = plan.regions["recv_x"]
    scales_view = plan.regions["recv_scales"]
    rows = {
        "floor: empty kernel launch": lambda: empty((1,), (1,), ()),
        "low_latency_dispatch FP8, whole call": dispatch,
        "  its checks in full (a new signature), dispatch": dispatch_checks,
        "  its checks, the signature known (checked_dispatch)": dispatch_known,
        "  its build (plan, outputs, handle, arguments)": dispatch_build,
        "  its launch through run_with_hook": lambda: buffer._streams.run_with_hook(
            run, low_latency.SEND_PHASE, low_latency.RECV_PHASE, False, False, (), buffer._check_alive),
        "  its Run (phases set, then the launch)": lambda: run(stream, both),
        "  its launch alone": lambda: launch(stream),
        "low_latency_combine BF16, whole call": lambda: buffer.low_latency_combine(expert_out, topk_idx, weights,
                                                                                 handle),
        "  its checks in full (a new signature), combine": lambda: _checks.low_latency_combine_inputs(
            "low_latency_combine()", expert_out, topk_idx, weights, handle, None, num_ranks),
        "  its output (front.empty)": lambda: ctx.front.empty((TOKENS, HIDDEN), x.dtype),
        "parts: raise_if_failed (status words)": resources.raise_if_failed,
        "parts: as_device_array": lambda: _checks.as_device_array(call, "x", x),
        "parts: runtime.getDevice()": cupy.cuda.runtime.getDevice,
        "parts: get_current_stream()": cupy.cuda.get_current_stream,
        "parts: stream.is_capturing()": stream.is_capturing,
        "parts: x.data.ptr": lambda: x.data.ptr,
        "parts: x.flags.c_contiguous": lambda: x.flags.c_contiguous,
        "parts: (x.shape, x.dtype, x.strides)": lambda: (x.shape, x.dtype, x.strides),
        "parts: cupy.cuda.alloc": lambda: cupy.cuda.alloc(plan.storage_bytes),
        "parts: cupy.ndarray view, C order": lambda: cupy.ndarray(view.shape, view.dtype, storage + view.offset),
        "parts: cupy.ndarray view, strided": lambda: cupy.ndarray(scales_view.shape, scales_view.dtype,
                                                                  storage + scales_view.offset,
                                                                  strides=scales_view.strides),
        "parts: cupy.empty (recv_x shape)": lambda: cupy.empty(view.shape, view.dtype),
        "parts: DispatchArgs.from_buffer_copy": lambda: DispatchArgs.from_buffer_copy(plan.args),
        "parts: Launch()": lambda: low_latency.Launch(ctx, plan.entry, plan.grid, low_latency.NUM_THREADS,
                                                      launch.args, plan.shared_bytes),
    }
    held = []
    if args.torch:
        import torch

        import cuep.torch as deep_ep
        torch.cuda.set_device(device.id)
        held.append(deep_ep.Buffer(None, 0, hint, low_latency_mode=True, comm=comm))
    if args.normal:
        rows.update(_normal_rows(comm, num_ranks))
    if args.no_gc:
        gc.disable()
    figures = {name: us(row) for name, row in rows.items()}
    if comm.Get_rank() == 0:
        floor = figures["floor: empty kernel launch"]
        print(f"host us per call, {num_ranks} rank(s), bursts of {bench_host.BURST}, median of {bench_host.BURSTS}; "
              f"LL {TOKENS} tokens x {HIDDEN}, top-{TOPK} of {EXPERTS}")
        for name, value in figures.items():
            print(f"{name:58s} {value:7.2f} us {value / floor:5.1f}x")


def _normal_rows(comm, num_ranks: int) -> dict:
    """The normal mode's calls, whole, and the checks of a dispatch (4096 tokens x 7168, top-8 of 256)."""
    from cuep.config import Config
    tokens = 4096
    x, topk_idx, weights = _workload(comm.Get_rank(), tokens, HIDDEN, EXPERTS, TOPK)
    buffer = cuep.Buffer(comm, Config().get_nvl_buffer_size_hint(HIDDEN * 2, num_ranks, tokens), 0)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, EXPERTS)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=topk_idx, topk_weights=weights)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, **layout)
    from cuep.buffer import _layout_outputs
    from cuep.modes import intranode
    call, resources, front = "get_dispatch_layout()", buffer._resources, buffer._front
    stream = cupy.cuda.get_current_stream()
    regions, nbytes = _layout_outputs(num_ranks, 1, EXPERTS, tokens)
    per_rank, per_expert, in_rank = front.readable_views(front.storage(nbytes, regions[0].dtype), regions)

    def layout_checks() -> None:
        buffer._check_alive(call)
        ids = _checks.as_device_array(call, "topk_idx", topk_idx)
        _checks.check_topk_idx(call, ids, EXPERTS)
        _checks.check_num_experts(call, EXPERTS, num_ranks)
        _checks.check_event_options(call, None, False, False)

    x_fp8, scales = fp8.quantize(x)
    ctx = resources.intranode
    return {
        "get_dispatch_layout, whole call": lambda: buffer.get_dispatch_layout(topk_idx, EXPERTS),
        "  its checks (alive, topk_idx, num_experts, event options)": layout_checks,
        "  its outputs (one allocation, three views)": lambda: front.readable_views(
            front.storage(nbytes, regions[0].dtype), regions),
        "  its launch (the Buffer's LayoutLaunches: fields, the driver's launch)": lambda: resources.layout.launch(
            stream, topk_idx, EXPERTS, per_expert, per_rank, None, in_rank),
        "  the stream rule around it (CallStreams.run, nothing enqueued)": lambda: buffer._streams.run(
            None, False, False, lambda stream: ((), ())),
        "cached dispatch FP8, whole call": lambda: buffer.dispatch((x_fp8, scales), handle=handle),
        "  its checks (dispatch_arguments, FP8)": lambda: _checks.dispatch_arguments(
            "dispatch()", num_ranks, 1, intranode.MAX_EXPERTS, (x_fp8, scales), handle, None, None, None, None, None,
            None, 1, 0, None, False, False, intranode.Handle),
        "  its build and launch (intranode.cached_dispatch)": lambda: intranode.cached_dispatch(
            ctx, stream, x_fp8, scales, handle, cuep.Buffer.get_dispatch_config(num_ranks).num_sms),
        "  its two outputs (front.empty)": lambda: (front.empty((handle.num_rows, HIDDEN), np.uint8),
                                                    front.empty((handle.num_rows, HIDDEN // 128), np.float32)),
        "dispatch with a layout, whole call (its wait included)": lambda: buffer.dispatch(x, **layout),
        "cached dispatch BF16, whole call": lambda: buffer.dispatch(x, handle=handle),
        "  its checks (dispatch_arguments)": lambda: _checks.dispatch_arguments(
            "dispatch()", num_ranks, 1, intranode.MAX_EXPERTS, x, handle, None, None, None, None, None, None, 1, 0,
            None, False, False, intranode.Handle),
        "combine, whole call": lambda: buffer.combine(recv_x, handle),
        "parts: Buffer.get_dispatch_config": lambda: cuep.Buffer.get_dispatch_config(num_ranks),
        "parts: cupy.empty (4096 x 7168 bf16)": lambda: cupy.empty((tokens, HIDDEN), x.dtype),
    }


if __name__ == "__main__":
    main()
