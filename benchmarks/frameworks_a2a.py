"""The training frameworks' own DeepEP code, unchanged, on cuep.torch or on DeepEP: the forward and backward
of an MoE layer's token exchange at the frameworks' batch sizes, checked against the same layer in plain
torch on every rank, then timed.

    python benchmarks/frameworks_a2a.py --framework megatron --num-ranks 4 --tokens 4096,8192,32768
    python benchmarks/frameworks_a2a.py --framework torchtitan --num-ranks 4
    PYTHONPATH=/path/to/DeepEP python benchmarks/frameworks_a2a.py --backend deepep ...

- ``--framework megatron``: ``megatron.core.transformer.moe.fused_a2a`` from ``megatron-core`` on PyPI (the
  ``frameworks`` extra): ``set_deepep_num_sms``, ``fused_dispatch``, ``fused_combine``, ``async_finish`` off
  and on.
- ``--framework torchtitan``: ``torchtitan/distributed/deepep/deepep.py`` from the installed ``torchtitan``:
  0.2.2 on PyPI, its last version on DeepEP V1's ``Buffer``, or 0.3.0 and later, on DeepEP V2's
  ``ElasticBuffer`` (its compact, training path: ``get_buffer`` once for the largest ``--tokens``, then
  ``dispatch_tokens`` with ``num_tokens_per_rank``). Either way ``dispatch_tokens`` (dispatch and the
  expert-major permutation), ``combine_tokens``, ``sync_combine``, through its ``torch.ops.deepep`` ops and their
  autograd. The file is loaded from the installed package by its path, without the package's ``__init__``
  (which pulls in its training stack); not a line of it changes.

Nothing of either framework is copied here; both size their Buffer themselves, from the hints with no
token count. The layer: each rank routes its tokens to ``--topk`` experts with softmax probabilities; an
expert scales the rows it receives by its own factor (every expert's factor is known to every rank),
weighted by the token's probability for it; the combine sums the scaled rows back. The plain-torch layer
computes the same sums locally, so the check needs no communication: the output, the gradient of the input
and the gradient of the probabilities must match it for every token (the last within the bf16 rounding of
its terms: see ``assert_probability_gradient_close``). Then ``--iters`` forward + backward
passes are timed with CUDA events; rank 0 prints the median over iterations of the slowest rank, and two
memory figures, each the largest over the ranks: ``Buffer MiB``, the GPU memory outside torch's allocator that
the first pass took (the framework makes its Buffer there: NVSHMEM's heap and state for cuep, DeepEP's buffers
for DeepEP; the modules of kernels first loaded in that pass count too, alike on both backends), and ``pass MiB``, the most torch's allocator held during a timed pass beyond what it held before
(the outputs, gradients and any temporaries of the calls, the layer's own tensors alike on both backends).

``--breakdown`` profiles ``--iters`` more passes (``torch.profiler``, CUDA activity) and splits each pass's GPU
time: the communication library's kernels (cuep's or DeepEP's, by name), memory copies and sets, and every
other kernel (the layer's own: the expert, permutes, autograd), beside the pass's span and the time in it when
nothing ran (the GPU waiting for the host, or for a CPU wait); rank 0 then lists its longest kernels, each
communication kernel's time on every rank, and between which activities its GPU waited longest.
``--host-in-waits`` does the same with the host's activity profiled too (which slows the host), and lists for each
of those waits the host events that overlapped it: a wait spent in a synchronisation or an allocation shows as
that call, one spent in Python as the operator or autograd node it ran in. Nested events each count their whole
overlap, so the rows do not add up.

One process per rank (``torch.multiprocessing``), one GPU each (an NCCL group); ``--share-gpus`` puts every
rank on the GPUs there are, over a gloo group (cuep only: ``CUEP_SHARE_GPUS=1``; it proves results, not speed).
"""

from __future__ import annotations

import argparse
import bisect
import importlib.util
import os
import statistics
import sys

import torch
import torch.distributed as dist

from torch_ranks import free_port


def framework_module(framework: str, backend: str):
    """The framework's DeepEP module, with ``deep_ep`` bound to cuep.torch (``--backend cuep``) or to DeepEP."""
    if backend == "cuep":
        import cuep.torch
        sys.modules["deep_ep"] = cuep.torch
    if framework == "megatron":
        from megatron.core.transformer.moe import fused_a2a
        if not fused_a2a.HAVE_DEEP_EP:
            raise SystemExit(f"Megatron's fused_a2a found no DeepEP with --backend {backend}")
        return fused_a2a
    package = importlib.util.find_spec("torchtitan")
    if package is None:
        raise SystemExit("--framework torchtitan needs the torchtitan package: pip install --no-deps torchtitan "
                         "(0.2.2 for DeepEP V1's Buffer, 0.3.0 or later for V2's ElasticBuffer)")
    path = os.path.join(package.submodule_search_locations[0], "distributed", "deepep", "deepep.py")
    spec = importlib.util.spec_from_file_location("torchtitan_deepep", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def inputs(rank: int, tokens: int, hidden: int, num_experts: int, topk: int):
    """This rank's tokens, routing and output gradient, and every expert's factor (the same on every rank)."""
    gen = torch.Generator(device="cuda").manual_seed(1000 * rank + tokens + num_experts)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    scores = torch.randn(tokens, num_experts, device="cuda", generator=gen)
    top_scores, idx = scores.topk(topk, dim=1)
    probs = top_scores.softmax(dim=1)
    grad = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    factors = 1.0 + torch.arange(num_experts, device="cuda", dtype=torch.float32) / num_experts
    return x, idx, probs, grad, factors


def megatron_layer(fused_a2a, x, idx, probs, factors, num_experts, group, async_finish):
    """Dispatch, the experts, combine: Megatron's calls, as its token dispatcher makes them."""
    recv_x, recv_idx, recv_probs, _, handle = fused_a2a.fused_dispatch(x, idx, probs, num_experts, group,
                                                                       async_finish=async_finish)
    local_factors = factors.view(group.size(), -1)[group.rank()]
    weight = torch.where(recv_idx >= 0, local_factors[recv_idx.clamp(min=0)], 0.0)
    y = (recv_x.float() * (recv_probs * weight).sum(dim=1, keepdim=True)).to(torch.bfloat16)
    combined, _ = fused_a2a.fused_combine(y, group, handle, async_finish=async_finish)
    return combined


def torchtitan_layer(deepep, x, idx, probs, factors, num_experts, group):
    """torchtitan's calls, as its MoE layer makes them: tokens in expert-major order, one expert after another
    on its rows, the scores applied at combine (``score_before_experts=False`` on V1), then the combine's event.
    On V2 (``ElasticBuffer``) it passes the batch's token count, below the buffer's bound."""
    num_local = num_experts // group.size()
    if is_torchtitan_v2(deepep):  # its buffer made once for the largest batch (run_rank), as its dispatcher does
        rows, tokens_per_expert, state = deepep.dispatch_tokens(x, idx, probs, num_local, num_experts,
                                                                num_tokens_per_rank=x.shape[0])
    else:
        rows, tokens_per_expert, state = deepep.dispatch_tokens(x, idx, probs, num_local, num_experts, group,
                                                                score_before_experts=False)
    local_factors = factors.view(group.size(), -1)[group.rank()].to(rows.dtype)
    expert_of_row = torch.repeat_interleave(torch.arange(num_local, device=rows.device), tokens_per_expert.long(),
                                            output_size=rows.shape[0])
    combined = deepep.combine_tokens(rows * local_factors[expert_of_row].unsqueeze(1), state)
    deepep.sync_combine()
    return combined


def is_torchtitan_v2(deepep) -> bool:
    """Whether torchtitan's DeepEP module is its V2 one (on ``ElasticBuffer``)."""
    return hasattr(deepep, "ElasticBuffer")


def layer_of(framework: str, module, idx, factors, num_experts, group, async_finish: bool = False):
    """``layer(x, probs)``: the framework's MoE layer on ``module``."""
    if framework == "megatron":
        return lambda x, p: megatron_layer(module, x, idx, p, factors, num_experts, group, async_finish)
    return lambda x, p: torchtitan_layer(module, x, idx, p, factors, num_experts, group)


def memory_outside_torch() -> int:
    """Bytes of this GPU in use but not held by torch's allocator: the CUDA context, NCCL's communicators, and
    what a communication library took for itself (DeepEP's buffers, or NVSHMEM's heap, its own state and
    CuPy's pool for cuep). The difference across the framework's first pass is what its Buffer took."""
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def plain_layer(x, idx, probs, factors):
    """The same layer without communication: every token's weighted sum over its experts, locally."""
    return (x.float() * (probs * factors[idx]).sum(dim=1, keepdim=True)).to(torch.bfloat16)


def forward_backward(layer, x, probs, grad):
    """``layer(x, probs)``, then the gradients of ``(out * grad).sum()``: ``(out, x.grad, probs.grad)``."""
    x = x.detach().requires_grad_()
    probs = probs.detach().requires_grad_()
    out = layer(x, probs)
    out.backward(grad)
    return out.detach(), x.grad, probs.grad


COMMUNICATION_KERNELS = ("cuep", "deep_ep")  # the namespaces of the two backends' kernels


def is_communication_kernel(name: str) -> bool:
    return any(space in name.lower() for space in COMMUNICATION_KERNELS)


def gpu_ms_by_kind(profile, passes: int) -> tuple[tuple[float, ...], list[tuple[str, float, float]],
                                                  list[tuple[str, str, float]], list[tuple[float, float, str, str]]]:
    """Per pass, from a profile of ``passes`` passes: the GPU milliseconds of the communication library's
    kernels, of memory copies and sets and of every other kernel; the span from the first activity's start to
    the last one's end; and the time in that span when nothing ran (the GPU waiting for the host). Beside them,
    each kernel's calls and milliseconds per pass, the longest first; where the GPU waited: the
    milliseconds per pass with nothing running between one activity and the next, by their names, the
    longest first; and each such wait as ``(start_us, end_us, before, after)``."""
    totals = {"communication": 0.0, "copies": 0.0, "other": 0.0}
    by_name: dict[str, list[float]] = {}
    intervals = []
    for event in profile.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        kind = ("communication" if is_communication_kernel(event.name)
                else "copies" if event.name.lower().startswith(("memcpy", "memset")) else "other")
        ms = event.time_range.elapsed_us() / 1e3
        totals[kind] += ms
        calls_and_ms = by_name.setdefault(event.name, [0.0, 0.0])
        calls_and_ms[0] += 1
        calls_and_ms[1] += ms
        intervals.append((event.time_range.start, event.time_range.end, event.name))
    busy_us, covered_until, last_name = 0.0, None, ""
    gaps: dict[tuple[str, str], float] = {}
    gap_intervals = []
    for start, end, name in sorted(intervals):  # the union of the activities' intervals
        if covered_until is None or start > covered_until:
            if covered_until is not None:
                gaps[(last_name, name)] = gaps.get((last_name, name), 0.0) + start - covered_until
                gap_intervals.append((covered_until, start, last_name, name))
            busy_us += end - start
            covered_until, last_name = end, name
        elif end > covered_until:
            busy_us += end - covered_until
            covered_until, last_name = end, name
    span_us = (max(end for _, end, _ in intervals) - min(start for start, _, _ in intervals)) if intervals else 0.0
    kinds = tuple(totals[kind] / passes for kind in ("communication", "copies", "other"))
    kernels = sorted(((name, calls / passes, ms / passes) for name, (calls, ms) in by_name.items()),
                     key=lambda kernel: -kernel[2])
    waits = sorted(((before, after, us / 1e3 / passes) for (before, after), us in gaps.items()),
                   key=lambda wait: -wait[2])
    return (*kinds, span_us / 1e3 / passes, (span_us - busy_us) / 1e3 / passes), kernels, waits, gap_intervals


def host_in_waits(profile, gap_intervals: list, waits: list, passes: int, listed: int) -> list:
    """What the host was running while the GPU waited: for each of the ``listed`` longest kinds of wait (``waits``,
    by the activities around it), the host events (torch operators, autograd nodes, CUDA API calls) that
    overlapped those waits, with their overlap in milliseconds per pass, the longest first. A host blocked in a
    synchronisation or an allocation shows as that call; a host busy in Python shows as the operator or
    autograd node it was inside, or as nothing."""
    kinds = [(before, after) for before, after, _ in waits[:listed]]
    by_kind = {kind: sorted((start, end) for start, end, before, after in gap_intervals if (before, after) == kind)
               for kind in kinds}
    overlap: dict[tuple[str, str], dict[str, float]] = {kind: {} for kind in kinds}
    for event in profile.events():
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue
        start, end = event.time_range.start, event.time_range.end
        for kind, intervals in by_kind.items():
            first = bisect.bisect_left(intervals, (start, start)) - 1
            us = 0.0
            for gap_start, gap_end in intervals[max(first, 0):]:
                if gap_start >= end:
                    break
                us += max(0.0, min(end, gap_end) - max(start, gap_start))
            if us > 0:
                overlap[kind][event.name] = overlap[kind].get(event.name, 0.0) + us
    return [(before, after, sorted(((name, us / 1e3 / passes) for name, us in overlap[(before, after)].items()),
                                   key=lambda item: -item[1])) for before, after in kinds]


def print_kernels(tokens: int, num_experts: int, every_rank_kernels: list, listed: int) -> None:
    """Rank 0's ``listed`` longest kernels, then each communication kernel's milliseconds on every rank: a kernel
    that waits for its peers takes longer on the ranks that reach it first."""
    if not every_rank_kernels[0]:
        return
    print(f"rank 0's kernels, {tokens} tokens, {num_experts} experts (calls and ms per pass):", flush=True)
    for name, calls, ms in every_rank_kernels[0][:listed]:
        print(f"  {ms:8.3f} ms {calls:5.1f}x  {name[:100]}", flush=True)
    by_rank = [{name: ms for name, _, ms in kernels} for kernels in every_rank_kernels]
    names = sorted({name for kernels in by_rank for name in kernels if is_communication_kernel(name)},
                   key=lambda name: -max(kernels.get(name, 0.0) for kernels in by_rank))
    print("  communication kernels, ms per pass on ranks 0, 1, ...:", flush=True)
    for name in names:
        per_rank = " ".join(f"{kernels.get(name, 0.0):7.3f}" for kernels in by_rank)
        print(f"  {per_rank}  {name[:60]}", flush=True)


def print_waits(waits: list, listed: int) -> None:
    """Rank 0's ``listed`` longest waits of the GPU for the host: between which two activities nothing ran."""
    if waits:
        print("  where the GPU waited (rank 0, ms per pass): the activity before -> the one after", flush=True)
    for before, after, ms in waits[:listed]:
        print(f"  {ms:8.3f} ms  {before[:50]} -> {after[:50]}", flush=True)


def print_host_in_waits(host_waits: list, listed: int) -> None:
    """Rank 0's host events during each of its longest kinds of wait (:func:`host_in_waits`)."""
    if host_waits:
        print("  what the host ran while the GPU waited (rank 0, ms per pass overlapping the wait; nested events "
              "each count, so the rows do not add up):", flush=True)
    for before, after, events in host_waits:
        print(f"    {before[:40]} -> {after[:40]}:", flush=True)
        for name, ms in events[:listed]:
            print(f"      {ms:8.3f} ms  {name[:90]}", flush=True)


def assert_rows_close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    """Each row within ``rtol`` of the plain layer's, relative to the row's norm (bf16 rounding on each side)."""
    got, want = got.float(), want.float()
    error = (got - want).norm(dim=-1) / want.norm(dim=-1).clamp(min=1e-6)
    worst = int(error.argmax()) if error.numel() else 0
    if error.numel() and float(error[worst]) > rtol:
        raise AssertionError(f"{name}: row {worst} off by {float(error[worst]):.3g} of its norm (> {rtol})")


def assert_probability_gradient_close(name: str, got, want, x, idx, grad, factors) -> None:
    """Each entry of the probabilities' gradient, ``factor(e) * (x . grad)`` per (token, expert), within 2^-5
    of the size of that dot product's terms, ``factor(e) * |x * grad|_2``. A framework may form it in bf16
    (torchtitan scales the expert rows by the scores in bf16), whose rounding of each product leaves an error
    of that size however small the dot product comes out: a bound relative to the entry itself would fail
    tokens whose dot product nearly cancels. A wrong gradient is off by the terms' full size."""
    terms = (x.float() * grad.float()).norm(dim=1, keepdim=True) * factors[idx]
    excess = (got.float() - want.float()).abs() - (2.0 ** -8 * want.float().abs() + 2.0 ** -5 * terms)
    if excess.numel() and float(excess.max()) > 0:
        token = int(excess.max(dim=1).values.argmax())
        raise AssertionError(f"{name}: token {token}: {got[token].tolist()} against {want[token].tolist()}")


def run_rank(rank: int, args, port: int) -> None:
    num_gpus = torch.cuda.device_count()
    torch.cuda.set_device(rank % num_gpus)
    if args.share_gpus:
        os.environ["CUEP_SHARE_GPUS"] = "1"
    dist.init_process_group("gloo" if args.share_gpus else "nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=args.num_ranks)
    group = dist.new_group(list(range(args.num_ranks)))
    module = framework_module(args.framework, args.backend)
    if args.framework == "megatron":
        module.set_deepep_num_sms(args.sms)
    elif not is_torchtitan_v2(module):  # no setting of its own: the Buffer's class-wide count, as DeepEP's users set it
        module.Buffer.set_num_sms(args.sms)  # (on V2 torchtitan asks the buffer for V2's analytic count)
    dist.barrier(group)  # the group's own communicator exists before the memory is first read
    torch.cuda.synchronize()
    outside_before, buffer_mib = memory_outside_torch(), None
    if args.framework == "torchtitan" and is_torchtitan_v2(module):
        # torchtitan's DeepEP dispatcher makes its one buffer up front (init_buffer), for its configured
        # largest batch per rank; every dispatch passes the batch's own count.
        module.get_buffer(group, hidden=args.hidden, num_max_tokens_per_rank=max(args.tokens), num_topk=args.topk)
    rows, kernel_lists = [], []
    for num_experts in args.experts:
        for tokens in args.tokens:
            x, idx, probs, grad, factors = inputs(rank, tokens, args.hidden, num_experts, args.topk)
            want = forward_backward(lambda x, p: plain_layer(x, idx, p, factors), x.float(), probs, grad.float())
            # torchtitan's calls are always asynchronous (async_finish=True on the comm stream).
            for async_finish in ((False, True) if args.framework == "megatron" else (True,)):
                got = forward_backward(layer_of(args.framework, module, idx, factors, num_experts, group, async_finish),
                                       x, probs, grad)
                case = f"{tokens} tokens, {num_experts} experts, async_finish={async_finish}"
                assert_rows_close(f"{case}: output", got[0], want[0], rtol=2e-2)
                assert_rows_close(f"{case}: input gradient", got[1], want[1], rtol=2e-2)
                assert_probability_gradient_close(f"{case}: probability gradient", got[2], want[2], x, idx, grad,
                                                  factors)
                if buffer_mib is None:  # the framework made its Buffer in the first pass
                    torch.cuda.synchronize()
                    buffer_mib = (memory_outside_torch() - outside_before) / 2**20
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            allocated_before = torch.cuda.memory_allocated()
            times = []
            for i in range(args.warmup + args.iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                forward_backward(layer_of(args.framework, module, idx, factors, num_experts, group), x, probs, grad)
                end.record()
                end.synchronize()
                if i >= args.warmup:
                    times.append(start.elapsed_time(end))
            peak_mib = (torch.cuda.max_memory_allocated() - allocated_before) / 2**20
            kinds, kernels, waits, host_waits = (), [], [], []
            if args.breakdown or args.host_in_waits:
                activities = [torch.profiler.ProfilerActivity.CUDA]
                if args.host_in_waits:
                    activities.append(torch.profiler.ProfilerActivity.CPU)
                with torch.profiler.profile(activities=activities) as profile:
                    for _ in range(args.iters):
                        forward_backward(layer_of(args.framework, module, idx, factors, num_experts, group), x,
                                         probs, grad)
                    torch.cuda.synchronize()
                kinds, kernels, waits, gap_intervals = gpu_ms_by_kind(profile, args.iters)
                if args.host_in_waits:
                    host_waits = host_in_waits(profile, gap_intervals, waits, args.iters, args.kernels_listed)
            slowest = [None] * args.num_ranks
            dist.all_gather_object(slowest, (statistics.median(times), buffer_mib, peak_mib, *kinds), group=group)
            rows.append((tokens, num_experts, *(max(column) for column in zip(*slowest))))
            every_rank_kernels = [None] * args.num_ranks
            dist.all_gather_object(every_rank_kernels, kernels, group=group)
            kernel_lists.append((tokens, num_experts, every_rank_kernels, waits, host_waits))
            del x, idx, probs, grad, want, got
            torch.cuda.empty_cache()
    if rank == 0:
        sms = "ElasticBuffer, V2's analytic SMs" if args.framework == "torchtitan" and is_torchtitan_v2(module) \
            else f"Buffer.set_num_sms({args.sms})"
        print(f"{args.framework} on {args.backend}: {args.num_ranks} ranks, hidden {args.hidden}, top-{args.topk}, "
              f"{sms}; output and gradients match the plain-torch layer", flush=True)
        kind_columns = (f" {'comm ms':>8} {'copies ms':>9} {'other ms':>8} {'span ms':>8} {'idle ms':>8}"
                        if args.breakdown or args.host_in_waits else "")
        print(f"{'backend':8} {'tokens/rank':>11} {'experts':>7} {'fwd+bwd ms':>10} {'Buffer MiB':>10} "
              f"{'pass MiB':>9}{kind_columns}", flush=True)
        for tokens, num_experts, ms, buffer_mib, peak_mib, *kinds in rows:
            kind_values = "".join(f" {value:{width}.3f}" for value, width in zip(kinds, (8, 9, 8, 8, 8)))
            print(f"{args.backend:8} {tokens:11d} {num_experts:7d} {ms:10.3f} {buffer_mib:10.1f} {peak_mib:9.1f}"
                  f"{kind_values}", flush=True)
        for tokens, num_experts, every_rank_kernels, waits, host_waits in kernel_lists:
            print_kernels(tokens, num_experts, every_rank_kernels, args.kernels_listed)
            print_waits(waits, args.kernels_listed)
            print_host_in_waits(host_waits, args.kernels_listed)
    dist.barrier(group)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    parser.add_argument("--framework", choices=["megatron", "torchtitan"], default="megatron")
    parser.add_argument("--backend", choices=["cuep", "deepep"], default="cuep")
    parser.add_argument("--num-ranks", type=int, default=4)
    parser.add_argument("--tokens", type=ints, default=[4096, 8192, 32768], help="tokens per rank, comma-separated")
    parser.add_argument("--experts", type=ints, default=[64, 256], help="expert counts, comma-separated")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--sms", type=int, default=20, help="Buffer.set_num_sms (Megatron's default: 20)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--share-gpus", action="store_true", help="ranks share the GPUs there are (cuep only)")
    parser.add_argument("--breakdown", action="store_true",
                        help="profile --iters more passes: GPU time of the communication kernels and of the rest")
    parser.add_argument("--host-in-waits", action="store_true",
                        help="--breakdown with the host's activity profiled too (which slows the host): what the host "
                             "ran while the GPU waited")
    parser.add_argument("--kernels-listed", type=int, default=12,
                        help="with --breakdown or --host-in-waits, how many of rank 0's kernels, waits and (per "
                             "wait) host events to list, the longest first")
    args = parser.parse_args()
    if args.share_gpus and args.backend != "cuep":
        parser.error("--share-gpus runs cuep only: DeepEP needs a GPU per rank")
    torch.multiprocessing.spawn(run_rank, args=(args, free_port()), nprocs=args.num_ranks)


if __name__ == "__main__":
    main()
