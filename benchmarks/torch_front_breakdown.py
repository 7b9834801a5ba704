"""Where the host time of a low-latency call and of the layout goes, CuPy API against cuep.torch, piece by piece.

    mpirun -np 1 python benchmarks/torch_front_breakdown.py      # from the repository root, PYTHONPATH=.

``python -m cuep.bench --mode host`` gives each eager call's host time through both APIs; this splits the
low-latency dispatch and combine further: the CuPy API on CuPy arrays and on torch tensors (what reading a
torch tensor in place costs), cuep.torch's core call (its outputs from torch's allocator) and its front
(DeepEP's return values), then the single operations each path is made of, and the dispatch's phases
(checks, build, launch) through each API; the layout the same way, whole and in its phases. Each figure is
the median over 9 bursts of the host microseconds per call in a burst without a sync (as ``--mode host``).
"""

from __future__ import annotations

import cupy
import torch
from mpi4py import MPI

import cuep
import cuep.torch as deep_ep
from cuep import _checks, _interop, bench_host
from cuep.bench import _workload
from cuep.bench_host import BURST
from cuep.modes import low_latency
from cuep.torch.event import wrap

TOKENS, HIDDEN, EXPERTS, TOPK = 128, 7168, 256, 8


def host_us(call, burst: int = BURST) -> float:
    device = cupy.cuda.Device()
    return bench_host.host_us(call, device.synchronize, bursts=9, burst=burst)


def main() -> None:
    comm = MPI.COMM_WORLD
    num_ranks = comm.Get_size()
    x, topk_idx, weights = _workload(comm.Get_rank(), TOKENS, HIDDEN, EXPERTS, TOPK)
    hint = cuep.Buffer.get_low_latency_rdma_size_hint(TOKENS, HIDDEN, num_ranks, EXPERTS)
    cupy_buffer = cuep.Buffer(comm, 0, hint, low_latency_mode=True)
    torch_buffer = deep_ep.Buffer(None, 0, hint, low_latency_mode=True, comm=comm)
    tx, ttopk, tweights = (torch.from_dlpack(a) for a in (x, topk_idx, weights))
    local, rows = EXPERTS // num_ranks, num_ranks * TOKENS
    cupy_out = cupy.zeros((local, rows, HIDDEN), dtype=x.dtype)
    torch_out = torch.zeros((local, rows, HIDDEN), dtype=torch.bfloat16, device=tx.device)
    cupy_handle = cupy_buffer.low_latency_dispatch(x, topk_idx, TOKENS, EXPERTS)[2]
    torch_handle = torch_buffer.low_latency_dispatch(tx, ttopk, TOKENS, EXPERTS)[2]
    recv, _, core_handle, event, _ = torch_buffer._core.low_latency_dispatch(tx, ttopk, TOKENS, EXPERTS)
    storage = core_handle.core.storage  # the torch front hands out DeepEP's handle over the core's
    calls = {
        "dispatch: CuPy API, CuPy arrays": lambda: cupy_buffer.low_latency_dispatch(x, topk_idx, TOKENS, EXPERTS),
        "dispatch: CuPy API, torch tensors": lambda: cupy_buffer.low_latency_dispatch(tx, ttopk, TOKENS, EXPERTS),
        "dispatch: cuep.torch core": lambda: torch_buffer._core.low_latency_dispatch(tx, ttopk, TOKENS, EXPERTS),
        "dispatch: cuep.torch": lambda: torch_buffer.low_latency_dispatch(tx, ttopk, TOKENS, EXPERTS),
        "dispatch: cuep.torch core, then the EventOverlap": lambda: wrap(
            torch_buffer._core.low_latency_dispatch(tx, ttopk, TOKENS, EXPERTS)[3]),
        "combine: CuPy API, CuPy arrays": lambda: cupy_buffer.low_latency_combine(cupy_out, topk_idx, weights,
                                                                                  cupy_handle),
        "combine: CuPy API, torch tensors": lambda: cupy_buffer.low_latency_combine(torch_out, ttopk, tweights,
                                                                                    cupy_handle),
        "combine: cuep.torch": lambda: torch_buffer.low_latency_combine(torch_out, ttopk, tweights, torch_handle),
    }
    pieces = {
        "torch.empty on the GPU": lambda: torch.empty(1 << 20, dtype=torch.uint8, device=tx.device),
        "cupy.cuda.alloc": lambda: cupy.cuda.alloc(1 << 20),
        "one region view (cuep.torch)": lambda: torch_buffer._front.view(storage, (local, rows), cupy.int32, 4096),
        "raw Tensor.as_strided": lambda: storage.tensor.as_strided((local, rows), (rows, 1), 4096),
        "a torch tensor read in place (TensorView)": lambda: _interop.as_array(tx),
        "FP8 view of the received rows": lambda: recv[0].view(torch.float8_e4m3fn),
        "DeepEP's low-latency handle (made once per pooled allocation)": lambda: torch_buffer._front.export_handle(
            core_handle.core),
        "EventOverlap of a call": lambda: wrap(event),
    }
    pieces.update(_phases(cupy_buffer, torch_buffer, x, topk_idx, tx, ttopk))
    layout_calls, layout_pieces = _layout(comm, topk_idx, ttopk)
    calls.update(layout_calls)
    pieces.update(layout_pieces)
    for name, call in calls.items():
        print(f"{name:45s} {host_us(call):8.1f} us", flush=True)
    for name, call in pieces.items():
        print(f"{name:45s} {host_us(call, burst=200):8.2f} us", flush=True)


def _phases(cupy_buffer, torch_buffer, x, topk_idx, tx, ttopk) -> dict:
    """The low-latency dispatch's phases through each API, each timed alone as the call runs it: the checks
    (inputs read, signature known), the build (plan, outputs, handle, arguments) and the launch."""
    call = "low_latency_dispatch()"
    rows = {}
    for api, buffer, a, b in (("CuPy", cupy_buffer, x, topk_idx), ("torch", torch_buffer._core, tx, ttopk)):
        ctx, front = buffer._resources.low_latency, buffer._front

        def checks(buffer=buffer, a=a, b=b, ctx=ctx) -> tuple:
            buffer._resources.low_latency_ready(call)
            return low_latency.checked_dispatch(call, ctx, a, b, TOKENS, EXPERTS, None, None, True, False, False)

        shape, *addresses = checks()
        # One launch, relaunched: each run is a new call, whose buffer the kernel picks.
        run = low_latency.dispatch(ctx, shape, *addresses)[-1]

        def build(ctx=ctx, shape=shape, addresses=addresses):
            return low_latency.dispatch(ctx, shape, *addresses)

        plan = next(plan for key, plan in ctx.plans.items() if key[0] == "dispatch")
        storage = front.storage(plan.storage_bytes, plan.outputs[0].dtype)
        rows.update({
            f"{api}: checks (two inputs read, signature known)": checks,
            f"{api}: build (plan, pooled outputs, handle, arguments)": build,
            f"{api}: launch through run_with_hook": lambda buffer=buffer, run=run: buffer._streams.run_with_hook(
                run, low_latency.SEND_PHASE, low_latency.RECV_PHASE, False, False, (), buffer._check_alive),
            f"{api}: front.current_stream()": front.current_stream,
            f"{api}: front.storage": lambda front=front, plan=plan: front.storage(plan.storage_bytes,
                                                                                 plan.outputs[0].dtype),
            f"{api}: front.views of the outputs": lambda front=front, storage=storage, plan=plan: front.views(
                storage, plan.outputs),
            f"{api}: as_device_array(x)": lambda a=a: _checks.as_device_array(call, "x", a),
        })
    return rows


def _layout(comm, topk_idx, ttopk) -> tuple[dict, dict]:
    """``get_dispatch_layout`` whole through each API (and the CuPy API on a torch tensor, and cuep.torch's
    core), and its phases through each front, each timed alone as the call runs it."""
    num_ranks = comm.Get_size()
    nvl_bytes = cuep.Config().get_nvl_buffer_size_hint(HIDDEN * 2, num_ranks, TOKENS)
    cupy_buffer = cuep.Buffer(comm, nvl_bytes, 0)
    torch_buffer = deep_ep.Buffer(None, nvl_bytes, 0, comm=comm)
    core = torch_buffer._core
    calls = {
        "layout: CuPy API, CuPy array": lambda: cupy_buffer.get_dispatch_layout(topk_idx, EXPERTS),
        "layout: CuPy API, torch tensor": lambda: cupy_buffer.get_dispatch_layout(ttopk, EXPERTS),
        "layout: cuep.torch core": lambda: core.get_dispatch_layout(ttopk, EXPERTS),
        "layout: cuep.torch": lambda: torch_buffer.get_dispatch_layout(ttopk, EXPERTS),
    }
    from cuep.buffer import _layout_outputs
    regions, nbytes = _layout_outputs(num_ranks, 1, EXPERTS, TOKENS)
    call = "get_dispatch_layout()"
    pieces = {}
    for api, buffer, ids in (("CuPy", cupy_buffer, topk_idx), ("torch", core, ttopk)):
        front, resources = buffer._front, buffer._resources
        per_rank, per_expert, in_rank = front.readable_views(front.storage(nbytes, regions[0].dtype), regions)
        ids_read = _checks.as_device_array(call, "topk_idx", ids)
        stream = front.current_stream()

        def checks(buffer=buffer, ids=ids) -> None:
            buffer._check_alive(call)
            read = _checks.as_device_array(call, "topk_idx", ids)
            _checks.check_topk_idx(call, read, EXPERTS)
            _checks.check_num_experts(call, EXPERTS, num_ranks)
            _checks.check_event_options(call, None, False, False)

        pieces.update({
            f"layout {api}: checks (topk_idx read)": checks,
            f"layout {api}: outputs (front.storage, readable_views)": lambda front=front: front.readable_views(
                front.storage(nbytes, regions[0].dtype), regions),
            f"layout {api}: launch (LayoutLaunches)": lambda resources=resources, ids_read=ids_read, stream=stream,
                views=(per_expert, per_rank, None, in_rank): resources.layout.launch(stream, ids_read, EXPERTS, *views),
            f"layout {api}: stream rule (CallStreams.run, nothing enqueued)": lambda buffer=buffer: buffer._streams.run(
                None, False, False, lambda stream: ((), ())),
        })
    outputs = core.get_dispatch_layout(ttopk, EXPERTS)
    export = torch_buffer._front.export
    pieces.update({
        "layout torch: DeepEP's return values (exports, EventOverlap)": lambda: (
            export(outputs[0]), export(outputs[1]), export(outputs[2]), export(outputs[3]), wrap(outputs[4])),
    })
    return calls, pieces


if __name__ == "__main__":
    main()
