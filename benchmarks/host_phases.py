"""The host time of a low-latency dispatch and combine (CuPy API), phase by phase, and of the operations
they are made of (GPU, mpirun, one rank is enough).

    mpirun -np 1 python benchmarks/host_phases.py        # from the repository root, PYTHONPATH=.

Each figure is the median over 7 bursts of the host microseconds per call in a burst of 20 with no
sync (``cuep.bench_host.host_us``, as ``python -m cuep.bench --mode host``), beside the empty-launch
floor of the same run. A phase is timed by calling the code of that phase alone, the way the call
runs it, so the phases add up to about the whole call; ``--mode host`` gives the calls' figures.
"""

from __future__ import annotations

import cupy
from mpi4py import MPI

import cuep
from cuep import _checks, bench_host
from cuep.bench import _workload
from cuep.kernels.low_latency import DispatchArgs
from cuep.modes import low_latency

TOKENS, HIDDEN, EXPERTS, TOPK = 128, 7168, 256, 8


def main() -> None:
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

    def dispatch_build():
        return low_latency.dispatch(ctx, ctx.half, x, topk_idx, TOKENS, EXPERTS, None, None, True, False, False)

    handle = dispatch()[2]
    # Launched alone, calls still alternate buffer halves, as the kernels' protocol expects.
    launches = [low_latency.dispatch(ctx, half, x, topk_idx, TOKENS, EXPERTS, None, None, True, False, False)[4]
                for half in (0, 1)]
    launch = launches[0]
    turn = [0]

    def next_launch():
        turn[0] ^= 1
        return launches[turn[0]]

    stream = cupy.cuda.get_current_stream()
    expert_out = cupy.zeros((EXPERTS // num_ranks, num_ranks * TOKENS, HIDDEN), dtype=x.dtype)
    plan = next(iter(ctx.plans.values()))
    storage = cupy.cuda.alloc(plan.storage_bytes)
    view = plan.regions["recv_x"]
    scales_view = plan.regions["recv_scales"]
    rows = {
        "floor: empty kernel launch": lambda: empty((1,), (1,), ()),
        "low_latency_dispatch FP8, whole call": dispatch,
        "  its checks (ready, arrays, shapes, options)": dispatch_checks,
        "  its build (plan, outputs, handle, arguments, Launch)": dispatch_build,
        "  its launch through run_with_hook": lambda: buffer._run_low_latency(next_launch(), False, False, ()),
        "  its launch alone": lambda: next_launch()(stream),
        "low_latency_combine BF16, whole call": lambda: buffer.low_latency_combine(expert_out, topk_idx, weights,
                                                                                 handle),
        "  its checks (ready, arrays, shapes)": lambda: _checks.low_latency_combine_inputs(
            "low_latency_combine()", expert_out, topk_idx, weights, handle, None, num_ranks, low_latency.Handle),
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
    figures = {name: us(row) for name, row in rows.items()}
    if comm.Get_rank() == 0:
        floor = figures["floor: empty kernel launch"]
        print(f"host us per call, {num_ranks} rank(s), bursts of {bench_host.BURST}, median of {bench_host.BURSTS}; "
              f"LL {TOKENS} tokens x {HIDDEN}, top-{TOPK} of {EXPERTS}")
        for name, value in figures.items():
            print(f"{name:58s} {value:7.2f} us {value / floor:5.1f}x")


if __name__ == "__main__":
    main()
