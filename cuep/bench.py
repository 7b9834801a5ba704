"""``python -m cuep.bench`` (under mpirun): cuep's kernels timed with CUDA events, beside an NCCL
all-to-all baseline moving the same tokens in the same run.

Bandwidth follows DeepEP's convention: bytes received per rank (its own share included) over time;
the NVLink figure counts only the bytes that crossed NVLink; across nodes (the internode mode, or virtual
nodes with ``CUEP_RANKS_PER_NODE``) the last figure is instead the bytes that crossed a node boundary,
one row per (token, other node). Times are medians over ``--iters`` calls after ``--warmup``; every rank
reports, rank 0 prints the mean over ranks of each median. Where ranks share a GPU (``CUEP_SHARE_GPUS``)
NCCL cannot run, and a line says so in place of the baseline.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from . import _deps
from .kernels.common import fp8_row_bytes
from .kernels import low_latency as low_latency_kernels
from .kernels.probe import COPY_BATCHES

TUNE_SMS = [16, 24, 32, 48, 64, 96, 128]
BACK_TO_BACK = 20  # low-latency graph replays timed as one run
TRACE_SAMPLES = 50
# Trace points of cuda_src/low_latency.cu, index -> label, in the order a block passes them (defined,
# with the indices the kernels stamp, in cuep/kernels/low_latency.py).
DISPATCH_TRACE = dict(low_latency_kernels.DISPATCH_TRACE.values())
COMBINE_TRACE = dict(low_latency_kernels.COMBINE_TRACE.values())


def _times_us(fn, warmup: int, iters: int, phases: int = 1) -> np.ndarray:
    """``[iters, phases]`` microseconds: ``fn(mark)`` runs one iteration and calls ``mark()`` after each
    of its first ``phases - 1`` phases (events are recorded around every phase)."""
    cupy = _deps.cupy()
    for _ in range(warmup):
        fn(lambda: None)
    events = [[cupy.cuda.Event() for _ in range(phases + 1)] for _ in range(iters)]
    for marks in events:
        recorded = iter(marks[1:-1])
        marks[0].record()
        fn(lambda: next(recorded).record())
        marks[-1].record()
    events[-1][-1].synchronize()
    return np.array([[cupy.cuda.get_elapsed_time(a, b) * 1e3 for a, b in zip(marks, marks[1:])] for marks in events])


def _median_us(fn, warmup: int, iters: int) -> float:
    return float(np.median(_times_us(lambda _: fn(), warmup, iters)))


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


def nccl_baseline(comm, rows, in_rank):
    """NCCL all-to-all of the same routing: ``(dispatch, combine)`` callables. Dispatch gathers each
    destination's ``rows`` (glue) and exchanges them; combine sends them back and sums them per token."""
    cupy = _deps.cupy()
    nccl = NcclAllToAll(comm)
    dst_of = [cupy.nonzero(in_rank[:, r])[0] for r in range(comm.Get_size())]
    send_counts = [int(d.size) for d in dst_of]
    recv_counts = [int(c) for c in comm.alltoall(send_counts)]
    order = cupy.concatenate(dst_of)
    received = cupy.empty((sum(recv_counts), rows.shape[1]), dtype=rows.dtype)
    combined = cupy.zeros((rows.shape[0], rows.shape[1]), dtype=cupy.float32)

    def dispatch():
        nccl.exchange(rows[order], send_counts, received, recv_counts)

    def combine():
        back = cupy.empty((int(order.size), rows.shape[1]), dtype=rows.dtype)
        nccl.exchange(received, recv_counts, back, send_counts)
        combined.fill(0)
        cupy.add.at(combined, order, back.astype(cupy.float32))
        combined.astype(rows.dtype)

    return dispatch, combine


def _ranks_share_gpus(comm, device_id: int) -> bool:
    """Collective: whether two ranks of ``comm`` run on one GPU (the Buffer allowed it: ``CUEP_SHARE_GPUS``)."""
    from .runtime import world
    return world.check_gpu_sharing(comm.allgather(world.gpu_identity(device_id)), share=True) > 1


def _workload(rank: int, tokens: int, hidden: int, experts: int, topk: int):
    cupy = _deps.cupy()
    from ._checks import bf16_dtype
    rng = cupy.random.default_rng(1000 + rank)
    x = rng.standard_normal((tokens, hidden), dtype=cupy.float32).astype(bf16_dtype())
    scores = rng.random((tokens, experts), dtype=cupy.float32)
    topk_idx = cupy.argsort(-scores, axis=1)[:, :topk].astype(cupy.int64)
    weights = rng.random((tokens, topk), dtype=cupy.float32)
    return x, topk_idx, weights


def _token_in_rank(topk_idx, num_experts: int, num_ranks: int):
    """`[num_tokens, num_ranks]` bool: whether a token chose an expert of each rank (-1 entries none)."""
    cupy = _deps.cupy()
    owner = cupy.where(topk_idx >= 0, topk_idx // (num_experts // num_ranks), -1)
    return cupy.stack([(owner == r).any(axis=1) for r in range(num_ranks)], axis=1)


def bench_normal(args) -> None:
    cupy, mpi = _deps.cupy(), _deps.mpi()
    import cuep
    from .config import Config
    comm = mpi.COMM_WORLD
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    hidden_bytes = args.hidden * 2
    if args.round_tokens:
        round_tokens, sizing = args.round_tokens, f"rounds of {args.round_tokens} tokens"
    elif args.fixed_buffer:
        round_tokens, sizing = None, "fixed, as frameworks size them"
    else:
        round_tokens, sizing = args.tokens, "one round of the tokens"
    nvl_bytes = Config().get_nvl_buffer_size_hint(hidden_bytes, num_ranks, round_tokens, args.topk)
    rdma_bytes = Config().get_rdma_buffer_size_hint(hidden_bytes, num_ranks, round_tokens, args.topk)  # 0 on one node
    buffer = cuep.Buffer(comm, num_nvl_bytes=nvl_bytes, num_rdma_bytes=rdma_bytes)
    if rank == 0:
        print(f"NVL buffer: {nvl_bytes / 2**20:.1f} MiB, RDMA buffer: {rdma_bytes / 2**20:.1f} MiB ({sizing})",
              flush=True)
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
    if args.sms is None:
        args.sms = sorted({buffer.get_dispatch_config(num_ranks).num_sms, buffer.get_combine_config(num_ranks).num_sms})
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
        # The same calls replayed from CUDA graphs, BACK_TO_BACK between one pair of events: the GPU's time
        # per call without the host's launch and the per-call events (the comm-stream hops stay). A third as
        # many runs as eager iterations: 10 runs of 20 calls by default.
        graphs = _Graphs()
        for name, call in (("dispatch bf16 (cached)", lambda: buffer.dispatch(x, handle=handle, config=config)),
                           ("dispatch fp8 (cached)", lambda: buffer.dispatch((x_fp8, scales), handle=handle,
                                                                             config=config)),
                           ("combine bf16", lambda: buffer.combine(recv_x, handle, topk_weights=recv_w,
                                                                   config=config))):
            graph = graphs.capture(call)
            with graphs.stream:
                runs = _times_us(lambda _, g=graph: [graphs.launch(g) for _ in range(BACK_TO_BACK)], 1,
                                 max(1, args.iters // 3))
            results[(f"graph x{BACK_TO_BACK}: {name}", sms)] = float(np.median(runs)) / BACK_TO_BACK
        graphs.stream.synchronize()
        if rank == 0 and args.progress:
            print(f"  ... measured num_sms={sms}", flush=True)

    shared_gpu = _ranks_share_gpus(comm, buffer.device_id)
    if not shared_gpu:
        nccl_dispatch, nccl_combine = nccl_baseline(comm, x, in_rank)
        results[("nccl dispatch bf16", 0)] = _median_us(nccl_dispatch, args.warmup, args.iters)
        results[("nccl combine bf16", 0)] = _median_us(nccl_combine, args.warmup, args.iters)

    topology = buffer.topology
    across_nodes = topology.num_nodes > 1
    if across_nodes:
        # Rank 0's figures, as for the rows received: the copies it puts across node boundaries.
        from .reference import cross_node_copies
        remote_rows = cross_node_copies(topk_idx.get(), args.experts, num_ranks, topology.ranks_per_node, rank)
        own_node = slice(topology.node * topology.ranks_per_node, (topology.node + 1) * topology.ranks_per_node)
        tokens_per_rank = per_rank.get()
        flat_rows = int(tokens_per_rank.sum() - tokens_per_rank[own_node].sum())
    fp8_row = fp8_row_bytes(args.hidden)
    bf16_bytes, fp8_bytes = num_recv * hidden_bytes, num_recv * fp8_row
    remote_bf16, remote_fp8 = remote_rows * hidden_bytes, remote_rows * fp8_row
    gathered = comm.gather(results, root=0)
    if rank != 0:
        buffer.destroy()
        return
    if across_nodes:
        print(f"cuep internode mode: {topology.num_nodes} nodes x {topology.ranks_per_node} ranks, {args.tokens} "
              f"tokens/rank, hidden {args.hidden}, top-{args.topk} of {args.experts} experts; {num_recv} rows "
              f"received by rank 0; it sends {remote_rows} rows across nodes per call ({remote_bf16 / 1e6:.1f} MB "
              f"BF16, {remote_fp8 / 1e6:.1f} MB FP8), one per (token, other node), where a flat all-to-all sends "
              f"{flat_rows}")
        last_column = "net GB/s"
    else:
        print(f"cuep normal mode: {num_ranks} ranks, {args.tokens} tokens/rank, hidden {args.hidden}, "
              f"top-{args.topk} of {args.experts} experts; {num_recv} rows received by rank 0 "
              f"({remote_rows} over NVLink)")
        last_column = "NVLink GB/s"
    print(f"{'operation':34s} {'SMs':>4s} {'median us':>10s} {'GB/s':>8s} {last_column:>12s}")
    mean_us = {key: float(np.mean([g[key] for g in gathered])) for key in results}
    for (name, sms), us in mean_us.items():
        total, remote = (fp8_bytes, remote_fp8) if "fp8" in name else (bf16_bytes, remote_bf16)
        print(f"{name:34s} {sms or '-':>4} {us:10.1f} {total / us / 1e3:8.1f} {remote / us / 1e3:12.1f}")
    if shared_gpu:
        print("nccl baseline: not run, ranks share a GPU here (NCCL refuses two ranks on one device); "
              "these timings are of time-sliced ranks and do not show speed")
    if args.tune:
        for name in ("dispatch bf16 (cached)", "dispatch fp8 (cached)", "combine bf16"):
            sms, us = min(((s, u) for (n, s), u in mean_us.items() if n == name), key=lambda item: item[1])
            print(f"best for {name}: Config(num_sms={sms}) at {us:.1f} us")
    buffer.destroy()


OVERLAP_GEMM = (8192, 7168, 2048)  # M, K, N of the compute stream's GEMM per rank (issue 27's expert GEMM)


def interleaved_medians(measures, warmup: int, iters: int) -> list[tuple[float, ...]]:
    """The median of each timing of each of ``measures`` (calls that run one iteration and return a tuple of
    timings), run in turn, iteration after iteration, ``warmup`` rounds first untimed: a GPU whose speed drifts
    during the run slows all of them alike, so comparisons between them hold (docs/performance-log.md, session 55)."""
    samples = [[] for _ in measures]
    for i in range(warmup + iters):
        for taken, measure in zip(samples, measures):
            sample = measure()
            if i >= warmup:
                taken.append(sample)
    return [tuple(float(np.median(timings)) for timings in zip(*taken)) for taken in samples]


def _gemm(cupy):
    """``run()``, one GEMM of :data:`OVERLAP_GEMM` on the current stream, and its label: BF16 where CuPy's
    matmul takes it, else FP16 (the same tensor cores and bytes)."""
    from ._checks import bf16_dtype
    m, k, n = OVERLAP_GEMM
    for dtype, label in ((bf16_dtype(), "bf16"), (cupy.float16, "fp16")):
        try:
            a = cupy.ones((m, k), dtype=dtype)
            b = cupy.ones((k, n), dtype=dtype)
            out = cupy.empty((m, n), dtype=dtype)
            cupy.matmul(a, b, out=out)
        except (TypeError, ValueError, NotImplementedError, cupy.cuda.cublas.CUBLASError):
            continue
        return (lambda: cupy.matmul(a, b, out=out)), f"{label} GEMM {m}x{k}x{n}"
    raise RuntimeError("cuep.bench --mode overlap: CuPy's matmul takes neither bfloat16 nor float16 here")


def _gemm_sm_target(cupy):
    """``set(sms)``: size CuPy's cuBLAS GEMMs on this device for ``sms`` SMs (0: the whole GPU), through
    ``cublasSetSmCountTarget`` on CuPy's handle. cuBLAS otherwise sizes a GEMM's grid for every SM, and
    its blocks queue behind the SMs the communication holds; DeepGEMM's ``num_sms`` does this for a
    training step's expert GEMMs."""
    import ctypes
    from cuda.pathfinder import load_nvidia_dynamic_lib
    cublas = ctypes.CDLL(load_nvidia_dynamic_lib("cublas").abs_path)
    set_target = cublas.cublasSetSmCountTarget
    set_target.argtypes, set_target.restype = (ctypes.c_void_p, ctypes.c_int), ctypes.c_int
    handle = cupy.cuda.device.get_cublas_handle()

    def set_sms(sms: int) -> None:
        status = set_target(handle, sms)
        if status != 0:
            raise RuntimeError(f"cublasSetSmCountTarget({sms}) returned status {status}")
    return set_sms


def bench_overlap(args) -> None:
    """Dispatch + combine (cached dispatch, then combine, both ``async_finish`` on the comm stream) beside a
    GEMM on the compute stream, per SM budget: each alone, then together; each one's slowdown. The GEMM
    runs twice beside the communication: sized for the whole GPU (cuBLAS's default), and told the SMs
    the communication leaves (``cublasSetSmCountTarget``), as an expert GEMM given ``num_sms`` is."""
    cupy, mpi = _deps.cupy(), _deps.mpi()
    import cuep
    from .config import Config
    comm = mpi.COMM_WORLD
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    hidden_bytes = args.hidden * 2
    nvl_bytes = Config().get_nvl_buffer_size_hint(hidden_bytes, num_ranks, args.tokens, args.topk)
    rdma_bytes = Config().get_rdma_buffer_size_hint(hidden_bytes, num_ranks, args.tokens, args.topk)
    buffer = cuep.Buffer(comm, num_nvl_bytes=nvl_bytes, num_rdma_bytes=rdma_bytes)
    x, topk_idx, weights = _workload(rank, args.tokens, args.hidden, args.experts, args.topk)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, args.experts)
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights,
                                                      num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                      num_tokens_per_expert=per_expert)
    gemm, gemm_label = _gemm(cupy)
    set_gemm_sms = _gemm_sm_target(cupy)
    device_sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    compute = cupy.cuda.get_current_stream()
    comm_stream = buffer.get_comm_stream()

    def timed(run_gemm: bool, config) -> tuple[float, float]:
        """(GEMM us, communication us) of one iteration, each on its own stream, started together: the
        calls wait for an event taken before the GEMM (DeepEP's previous_event), not for the GEMM."""
        ready = cuep.Buffer.capture()
        comm_stream.wait_event(ready.event)
        comm_start = comm_stream.record()
        # The communication is enqueued first, as a training step issues it before the expert GEMM: its
        # kernels take their SMs, and the GEMM's blocks fill the rest.
        outputs = None  # held until the comm stream is done with them
        if config is not None:
            outputs = (buffer.dispatch(x, handle=handle, config=config, previous_event=ready, async_finish=True),
                       buffer.combine(recv_x, handle, topk_weights=recv_w, config=config, previous_event=ready,
                                      async_finish=True))
        comm_end = comm_stream.record()
        gemm_start = compute.record()  # after the host enqueued the communication, which the GEMM does not wait for
        if run_gemm:
            gemm()
        gemm_end = compute.record()
        compute.wait_event(comm_end)
        gemm_end.synchronize()
        comm_end.synchronize()
        del outputs
        return (cupy.cuda.get_elapsed_time(gemm_start, gemm_end) * 1e3,
                cupy.cuda.get_elapsed_time(comm_start, comm_end) * 1e3)

    def variant(run_gemm: bool, config, gemm_sms: int = 0):
        """One iteration of ``timed`` with the GEMM told ``gemm_sms`` SMs (0: all), for interleaved_medians."""
        def measure() -> tuple[float, float]:
            set_gemm_sms(gemm_sms)
            try:
                return timed(run_gemm, config)
            finally:
                set_gemm_sms(0)
        return measure

    sms_list = args.sms or [24, buffer.get_combine_config(num_ranks).num_sms]
    if max(sms_list) >= device_sms:
        raise ValueError(f"--sms: every count must leave the GEMM SMs of the {device_sms} this GPU has")
    rows = []
    for sms in sms_list:
        config, rest = Config(num_sms=sms), device_sms - sms
        (gemm_alone, _), (_, comm_alone), (gemm_whole, comm_whole), (gemm_rest_alone, _), (gemm_rest, comm_rest) = \
            interleaved_medians([variant(True, None), variant(False, config), variant(True, config),
                                 variant(True, None, rest), variant(True, config, rest)], args.warmup, args.iters)
        rows.append((gemm_alone, comm_alone, comm_whole, gemm_whole, gemm_rest_alone, comm_rest, gemm_rest))
        if rank == 0 and args.progress:
            print(f"  ... measured num_sms={sms}", flush=True)
    gathered = comm.gather(rows, root=0)
    buffer.destroy()
    if rank != 0:
        return
    print(f"cuep overlap: {num_ranks} ranks, {args.tokens} tokens/rank, hidden {args.hidden}, top-{args.topk} of "
          f"{args.experts} experts; cached BF16 dispatch + combine (async_finish, comm stream) beside a "
          f"{gemm_label} (compute stream); each row's variants timed in turn, medians of {args.iters}, means over "
          f"ranks. Slowdowns against each one alone on the whole GPU, in the same row.")
    print(f"{'SMs':>4s} {'GEMM alone':>10s} {'comm alone':>11s} | {'GEMM sized for the whole GPU':^38s} | "
          f"{'GEMM told the other SMs (cuBLAS SM target)':^56s}")
    print(f"{'':4s} {'us':>10s} {'us':>11s} | {'comm us':>9s} {'slowdown':>9s} {'GEMM us':>9s} {'slowdown':>8s} | "
          f"{'GEMM alone':>10s} {'comm us':>9s} {'slowdown':>9s} {'GEMM us':>9s} {'slowdown':>8s}")
    for i, sms in enumerate(sms_list):
        gemm_alone, comm_alone, comm_whole, gemm_whole, gemm_rest_alone, comm_rest, gemm_rest = (
            float(np.mean([g[i][j] for g in gathered])) for j in range(7))
        print(f"{sms:4d} {gemm_alone:10.1f} {comm_alone:11.1f} | {comm_whole:9.1f} {comm_whole / comm_alone - 1:9.1%} "
              f"{gemm_whole:9.1f} {gemm_whole / gemm_alone - 1:8.1%} | {gemm_rest_alone:10.1f} "
              f"{comm_rest:9.1f} {comm_rest / comm_alone - 1:9.1%} {gemm_rest:9.1f} {gemm_rest / gemm_alone - 1:8.1%}")


def bench_ceiling(args) -> None:
    """What the dispatch's and combine's row copies reach with no protocol around them (the probe
    family, ``cuda_src/probe.cu``), for the benchmark's routing, beside the full operations' NVLink
    rates from ``--mode normal``: the difference is what staging, flags and reduction cost. Pull is the
    normal dispatch's pattern, push the normal combine's and the low-latency kernels' (``--tokens 128``
    gives their volume); rows of BF16 and of FP8 with scales; on Hopper each also through the bulk-copy
    unit (TMA, ``cuep::probe::bulk_copy``); each "synced", after a device barrier per launch, which is
    what one call that must first agree with its peers can reach; and the push "awaited", each launch
    ending only once its peers' rows have landed, the floor of any call that pushes and uses what it
    received (a combine with neither landing handshake nor reduction).

    The probe runs on its own NVSHMEM world and symmetric memory (no Buffer): it overwrites every
    rank's probe buffer. A peer that stops answering makes a synced or awaited launch record a
    timeout, raised here as :class:`~cuep.errors.PeerTimeoutError` instead of a time."""
    cupy, mpi = _deps.cupy(), _deps.mpi()
    from . import env
    from ._status import StatusWords
    from .jit import get_libraries
    from .kernels import barrier as barrier_kernel
    from .kernels import probe as probe_kernel
    from .kernels.status import Status
    from .runtime import MpiGroup, NodeGroup, discover_topology
    from .runtime import world
    from .runtime.regions import Regions, SymmetricMemory
    comm = mpi.COMM_WORLD
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    _, topk_idx, _ = _workload(rank, args.tokens, args.hidden, args.experts, args.topk)
    sent = [int(count) for count in _token_in_rank(topk_idx, args.experts, num_ranks).sum(axis=0).get()]
    received = [int(c) for c in comm.alltoall(sent)]  # rows pulled from each peer = rows pushed back to it
    bf16_row, fp8_row = args.hidden * 2, fp8_row_bytes(args.hidden)
    max_rows = max(comm.allgather(max(received)))

    # The probe's world: the barrier's signals, then each rank's probe buffer, in symmetric memory.
    group = MpiGroup(comm)
    topology = discover_topology(group)
    device_id = world.choose_device(group, topology)
    probe_bytes = probe_kernel.buffer_bytes(num_ranks, max_rows, bf16_row)
    regions = Regions.carve(barrier_kernel.signal_bytes(num_ranks), probe_bytes, 0)
    world.init_world(group, topology, regions.total_bytes, device_id)
    arch = f"sm_{_deps.cuda_core().Device(device_id).arch}"
    probe_library, barrier_library = get_libraries(
        [probe_kernel.spec(arch), barrier_kernel.spec(arch)],
        NodeGroup(group, topology.local_rank, env.get("CUEP_COMPILE_TIMEOUT_S")))
    memory = SymmetricMemory(regions)  # zeroed: the probe's flags start at 0 on every rank
    device_sms = cupy.cuda.Device(device_id).attributes["MultiProcessorCount"]
    peer_bases = cupy.asarray(np.array(memory.peer_addresses(regions.nvl_offset, num_ranks, rank), dtype=np.uint64))
    status, timeout_s = StatusWords(), env.get("CUEP_TIMEOUT_S")
    state = cupy.zeros(probe_kernel.STATE_WORDS, dtype=cupy.uint64)
    next_row = cupy.zeros(num_ranks + 1, dtype=cupy.int32)
    barrier_epoch = cupy.zeros(1, dtype=cupy.uint64)
    prefix = cupy.asarray(np.concatenate([[0], np.cumsum(received)]).astype(np.int32))
    cupy.cuda.Device(device_id).synchronize()  # the arrays above are zeroed (SymmetricMemory zeroed its own)
    remote_rows = sum(received) - received[rank]
    copy_warps = probe_kernel.WARPS_PER_BLOCK if args.copy_warps is None else args.copy_warps
    results = {}
    stream = cupy.cuda.Stream(non_blocking=True)
    bulk_modes = (False, True) if probe_library.spec.sm90_features else (False,)
    # (pull, bulk, synced, awaited) per row size. synced puts a device barrier before each launch, as a
    # real call must agree with its peers before it writes into their buffers; unsynced launches overlap
    # one launch's tail with the next one's start. awaited pushes end only when every peer's rows have
    # landed, which any call that pushes must wait for before its results can be used.
    kinds = [(pull, bulk, False, False) for pull in (True, False) for bulk in bulk_modes]
    kinds += [(True, False, True, False), (False, False, True, False), (False, False, False, True)]
    if args.push_only:
        kinds = [kind for kind in kinds if not kind[0]]
    copies = [(pull, row_bytes, bulk, synced, awaited) for row_bytes in (bf16_row, fp8_row)
              for pull, bulk, synced, awaited in kinds]
    for pull, row_bytes, bulk, synced, awaited in copies:
        name = ("pull" if pull else "push") + (" (TMA)" if bulk else "") + (" synced" if synced else "") + \
            (" awaited" if awaited else "")
        probe_args = probe_kernel.ProbeArgs(
            peer_bases=peer_bases.data.ptr, rank_prefix=prefix.data.ptr, rank=rank, num_ranks=num_ranks,
            row_bytes=row_bytes, max_rows=max_rows, pull=pull, awaited=awaited, copy_warps=copy_warps,
            copy_batch=args.copy_batch, bulk_chunk_bytes=args.bulk_chunk_bytes, bulk_stages=args.bulk_stages,
            state=state.data.ptr,
            next_row=next_row.data.ptr, status=Status(status.device.data.ptr, status.host_ptr),
            timeout_ns=int(timeout_s * 1e9))

        def launch(sms, bulk=bulk, synced=synced, probe_args=probe_args):
            if synced:
                barrier_kernel.launch(barrier_library, stream, memory.control, rank, num_ranks, barrier_epoch,
                                      timeout_s, status.device, status.host_ptr)
            probe_kernel.launch(probe_library, stream, probe_args, min(sms, device_sms), probe_bytes, bulk)

        for sms in args.sms or TUNE_SMS:
            cupy.cuda.Device().synchronize()  # every rank starts together: nothing of the last size in flight
            comm.Barrier()
            with stream:
                us = _median_us(lambda: [launch(sms) for _ in range(BACK_TO_BACK)], args.warmup,
                                args.iters) / BACK_TO_BACK
            status.raise_recorded(rank, timeout_s)  # a peer that never arrived: no time to report
            results[(name, row_bytes, sms)] = us
    gathered = comm.gather(results, root=0)
    stream.synchronize()
    memory.free()  # collective; after a timeout, left to the bounded teardown at exit
    if rank != 0:
        return
    print(f"cuep NVLink ceiling probe: {num_ranks} ranks, the routing of --mode normal ({args.tokens} tokens/rank, "
          f"top-{args.topk} of {args.experts}); rank 0 exchanges {sum(received)} rows ({remote_rows} over NVLink); "
          f"per launch over {BACK_TO_BACK} back to back; {copy_warps} copying warps a block, warp copies "
          f"{args.copy_batch} vectors a lane, bulk copies {args.bulk_stages} x {args.bulk_chunk_bytes} bytes a warp")
    print(f"{'copy':18s} {'row bytes':>9s} {'SMs':>4s} {'us':>8s} {'GB/s':>8s} {'NVLink GB/s':>12s}")
    for key in results:
        us = float(np.mean([g[key] for g in gathered]))
        name, row_bytes, sms = key
        print(f"{name:18s} {row_bytes:9d} {sms:4d} {us:8.1f} {sum(received) * row_bytes / us / 1e3:8.1f} "
              f"{remote_rows * row_bytes / us / 1e3:12.1f}")


def _phase_labels(row: str, phases: int) -> tuple[str, ...]:
    """Labels of a low-latency row's timed phases: a hook step's four, a hooked call's send and receive, a
    step's dispatch and combine, or none for one call."""
    if phases == 4:
        return "d send", "d recv", "c send", "c recv"
    if phases == 2:
        return ("send", "recv") if "hook" in row else ("dispatch", "combine")
    return ("",)


class _Graphs:
    """CUDA graphs captured on one stream; what each capture returned is kept (its graph writes there)."""

    def __init__(self):
        cupy = _deps.cupy()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.kept: list = []

    def capture(self, call):
        with self.stream:
            self.stream.begin_capture()
            self.kept.append(call())
            graph = self.stream.end_capture()
        return graph

    def launch(self, graph) -> None:
        graph.launch(self.stream)


def _trace_row(trace, points: dict[int, str]) -> np.ndarray:
    """``[points, 3]`` of the launch that just stamped ``trace``: the earliest, median and latest block
    reaching each point, in us after its first block entered the kernel; NaN where no block got there."""
    stamps = trace.get().astype(np.int64)
    start = stamps[stamps > 0].min()
    row = np.full((len(points), 3), np.nan)
    for i, point in enumerate(points):
        reached = stamps[:, point][stamps[:, point] > 0]
        if reached.size:
            row[i] = np.array([reached.min(), np.median(reached), reached.max()]) - start
    return row / 1e3


def _trace_launch(trace, graphs: "_Graphs", graph, points: dict[int, str]) -> np.ndarray:
    """:func:`_trace_row`'s medians over TRACE_SAMPLES launches, each the last of BACK_TO_BACK replays
    (so it runs as in a decode loop)."""
    samples = []
    for _ in range(TRACE_SAMPLES):
        with graphs.stream:
            for _ in range(BACK_TO_BACK - 1):
                graphs.launch(graph)
            trace.fill(0)
            graphs.launch(graph)
            samples.append(_trace_row(trace, points))
    return np.median(np.stack(samples), axis=0)


def _trace_receive(trace, graphs: "_Graphs", send_graph, recv_graph, points: dict[int, str], comm,
                   before=None) -> np.ndarray:
    """:func:`_trace_row`'s medians over TRACE_SAMPLES hook receives, each launched once every rank's send
    completed: the receive's own work. ``before``: run on the stream just before each receive (DeepEP's test
    calls its hooks after a large GEMM, which leaves the caches to the GEMM's data)."""
    samples = []
    for _ in range(TRACE_SAMPLES):
        with graphs.stream:
            graphs.launch(send_graph)
            graphs.stream.synchronize()
            comm.Barrier()
            if before is not None:
                before()
            trace.fill(0)
            graphs.launch(recv_graph)
            samples.append(_trace_row(trace, points))
    return np.median(np.stack(samples), axis=0)


def _print_trace(name: str, points: dict[int, str], per_rank: list[np.ndarray]) -> None:
    print(f"trace: {name} (us after the first block entered the kernel; mean over ranks of medians over "
          f"{TRACE_SAMPLES} launches)")
    print(f"  {'point':32s} {'first block':>12s} {'median':>8s} {'last block':>11s}")
    stacked = np.stack(per_rank)
    reached = (~np.isnan(stacked)).sum(axis=0)  # ranks whose blocks got to each point
    mean = np.where(reached > 0, np.nansum(stacked, axis=0) / np.maximum(reached, 1), np.nan)
    for (_, label), (first, median, last) in zip(points.items(), mean):
        if np.isnan(median):  # a point this launch never passes: a hook's receive passes no point of the send
            continue
        print(f"  {label:32s} {first:12.2f} {median:8.2f} {last:11.2f}")


def bench_low_latency(args) -> None:
    cupy, mpi = _deps.cupy(), _deps.mpi()
    import cuep
    from ._checks import bf16_dtype
    comm = mpi.COMM_WORLD
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    tokens, hidden, experts = args.tokens, args.hidden, args.experts
    buffer = cuep.Buffer(comm, 0, cuep.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, num_ranks, experts),
                         low_latency_mode=True)
    x, topk_idx, weights = _workload(rank, tokens, hidden, experts, args.topk)
    _, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, tokens, experts)
    expert_out = cupy.random.default_rng(5).standard_normal(
        (experts // num_ranks, num_ranks * tokens, hidden), dtype=cupy.float32).astype(bf16_dtype())

    def dispatch():
        return buffer.low_latency_dispatch(x, topk_idx, tokens, experts)

    def combine():
        return buffer.low_latency_combine(expert_out, topk_idx, weights, handle)

    def combine_logfmt():
        return buffer.low_latency_combine(expert_out, topk_idx, weights, handle, use_logfmt=True)

    def dispatch_send():
        return buffer.low_latency_dispatch(x, topk_idx, tokens, experts, return_recv_hook=True)

    def combine_send():
        return buffer.low_latency_combine(expert_out, topk_idx, weights, handle, return_recv_hook=True)

    def both(mark):
        received = dispatch()
        mark()
        buffer.low_latency_combine(expert_out, topk_idx, weights, received[2])

    def hooked(send):
        def run(mark):
            hook = send()[-1]
            mark()
            hook()
        return run

    def hook_step(mark):
        """A decode step through hooks, as a user's loop runs it: each send, then its receive."""
        received = dispatch_send()
        mark()
        received[-1]()
        mark()
        hook = buffer.low_latency_combine(expert_out, topk_idx, weights, received[2], return_recv_hook=True)[-1]
        mark()
        hook()

    runs = {"dispatch fp8": (lambda _: dispatch(), 1), "combine bf16": (lambda _: combine(), 1),
            "combine logfmt": (lambda _: combine_logfmt(), 1), "dispatch + combine": (both, 2),
            "dispatch hook (send | recv)": (hooked(dispatch_send), 2),
            "combine hook (send | recv)": (hooked(combine_send), 2),
            "hook step": (hook_step, 4)}
    times = {name: _times_us(fn, args.warmup, args.iters, phases) for name, (fn, phases) in runs.items()}

    # The same calls replayed from CUDA graphs (how decode engines run them): no Python in the loop.
    graphs = _Graphs()
    dispatch_graph, combine_graph = graphs.capture(dispatch), graphs.capture(combine)
    logfmt_graph = graphs.capture(combine_logfmt)
    send_graph = graphs.capture(dispatch_send)
    recv_graph = graphs.capture(lambda: graphs.kept[-1][-1]())  # the hook of the send just captured
    combine_send_graph = graphs.capture(combine_send)
    combine_recv_graph = graphs.capture(lambda: graphs.kept[-1][-1]())
    step_graph = graphs.capture(lambda: both(lambda: None))  # a whole decode step in one graph
    hook_step_graph = graphs.capture(lambda: hook_step(lambda: None))
    scratch = cupy.zeros(1, dtype=cupy.int32)
    floor_graph = graphs.capture(lambda: cupy.add(scratch, 1, out=scratch))  # one tiny kernel: the timing floor
    with graphs.stream:
        times["graph: one empty kernel"] = _times_us(lambda _: graphs.launch(floor_graph), args.warmup, args.iters)
        # Back-to-back replays between one pair of events: per-call kernel time without the event and
        # launch floor (what a profiler's kernel duration shows), for comparing with such figures.
        for name, graph in (("dispatch fp8", dispatch_graph), ("combine bf16", combine_graph)):
            runs = _times_us(lambda _, g=graph: [graphs.launch(g) for _ in range(BACK_TO_BACK)], args.warmup,
                             max(1, args.iters // BACK_TO_BACK))
            times[f"graph x{BACK_TO_BACK}: {name}"] = runs / BACK_TO_BACK
        times["graph: dispatch fp8"] = _times_us(lambda _: graphs.launch(dispatch_graph), args.warmup, args.iters)
        times["graph: combine bf16"] = _times_us(lambda _: graphs.launch(combine_graph), args.warmup, args.iters)
        times["graph: combine logfmt"] = _times_us(lambda _: graphs.launch(logfmt_graph), args.warmup, args.iters)
        for name, send_g, recv_g in (("graph: dispatch hook (send | recv)", send_graph, recv_graph),
                                     ("graph: combine hook (send | recv)", combine_send_graph, combine_recv_graph)):
            times[name] = _times_us(lambda mark, s=send_g, r=recv_g: (graphs.launch(s), mark(), graphs.launch(r)),
                                    args.warmup, args.iters, 2)
        times["graph: dispatch + combine step"] = _times_us(lambda _: graphs.launch(step_graph), args.warmup,
                                                            args.iters)
        times["graph: hook step"] = _times_us(lambda _: graphs.launch(hook_step_graph), args.warmup, args.iters)
        graphs.stream.synchronize()
    buffer.barrier()  # raises what the timed kernels recorded (a peer that timed out): then no time is honest
    traces = {}
    if args.trace:
        trace = buffer.get_low_latency_trace()
        traces = {"dispatch": _trace_launch(trace, graphs, dispatch_graph, DISPATCH_TRACE),
                  "combine": _trace_launch(trace, graphs, combine_graph, COMBINE_TRACE),
                  "dispatch receive": _trace_receive(trace, graphs, send_graph, recv_graph, DISPATCH_TRACE, comm),
                  "combine receive": _trace_receive(trace, graphs, combine_send_graph, combine_recv_graph,
                                                    COMBINE_TRACE, comm)}
        # DeepEP's test's GEMM: two float32 8192 x 8192 matrices multiplied.
        lhs = cupy.random.default_rng(7).standard_normal((8192, 8192), dtype=cupy.float32)
        traces["dispatch receive after a GEMM"] = _trace_receive(trace, graphs, send_graph, recv_graph,
                                                                 DISPATCH_TRACE, comm, lambda: lhs @ lhs)
        del lhs

    in_rank = _token_in_rank(topk_idx, experts, num_ranks)
    fp8_rows = cupy.zeros((tokens, fp8_row_bytes(hidden)), dtype=cupy.uint8)
    nccl_dispatch, _ = nccl_baseline(comm, fp8_rows, in_rank)
    _, nccl_combine = nccl_baseline(comm, x, in_rank)
    times["nccl dispatch fp8"] = _times_us(lambda _: nccl_dispatch(), args.warmup, args.iters)
    times["nccl combine bf16"] = _times_us(lambda _: nccl_combine(), args.warmup, args.iters)

    # DeepEP's convention: every (token, expert) selection counts one message (FP8 + scales + 16 header
    # bytes); a combine counts BF16 rows, LogFMT's too.
    selections = int((topk_idx >= 0).sum())
    dispatch_bytes, combine_bytes = selections * (fp8_row_bytes(hidden) + 16), selections * hidden * 2
    gathered = comm.gather(times, root=0)
    gathered_traces = comm.gather(traces, root=0)
    buffer.destroy()
    if rank != 0:
        return
    print(f"cuep low-latency mode: {num_ranks} ranks, {tokens} tokens/rank, hidden {hidden}, top-{args.topk} of "
          f"{experts} experts; {args.iters} iterations; means over ranks")
    print(f"{'operation':34s} {'phase':>8s} {'median us':>10s} {'worst rank':>10s} {'p99 us':>8s} {'p99/med':>8s} "
          f"{'GB/s':>7s}")
    for name in times:
        per_rank = np.stack([g[name] for g in gathered])  # [ranks, iters, phases]
        phases = per_rank.shape[2]
        labels = _phase_labels(name, phases)
        if phases > 1:  # the whole step too: what a user's loop pays per iteration
            per_rank = np.concatenate([per_rank, per_rank.sum(axis=2, keepdims=True)], axis=2)
            labels = (*labels, "step")
        for phase, label in enumerate(labels):
            median = float(np.mean(np.median(per_rank[:, :, phase], axis=1)))
            p99 = float(np.mean(np.percentile(per_rank[:, :, phase], 99, axis=1)))
            worst = float(np.max(np.median(per_rank[:, :, phase], axis=1)))
            moved = combine_bytes if ("combine" in name and "+" not in name) or label == "combine" else dispatch_bytes
            gbps = (f"{moved / median / 1e3:7.1f}" if "hook" not in name and "step" not in name and label != "step"
                    and "empty" not in name else "      -")
            print(f"{name:34s} {label:>8s} {median:10.1f} {worst:10.1f} {p99:8.1f} {p99 / median:8.2f} {gbps}")
    if args.trace:
        print("(times above are of the CUEP_TRACE build)")
        _print_trace("dispatch fp8", DISPATCH_TRACE, [g["dispatch"] for g in gathered_traces])
        _print_trace("combine bf16", COMBINE_TRACE, [g["combine"] for g in gathered_traces])
        _print_trace("dispatch fp8 hook receive, after every send completed", DISPATCH_TRACE,
                     [g["dispatch receive"] for g in gathered_traces])
        _print_trace("combine bf16 hook receive, after every send completed", COMBINE_TRACE,
                     [g["combine receive"] for g in gathered_traces])
        _print_trace("dispatch fp8 hook receive, after every send completed and a GEMM", DISPATCH_TRACE,
                     [g["dispatch receive after a GEMM"] for g in gathered_traces])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cuep.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["normal", "low_latency", "ceiling", "overlap", "host"], default="normal",
                        help="ceiling: the intranode row copies alone, on the normal mode's routing; overlap: "
                             "dispatch + combine beside a GEMM on the compute stream, each one's slowdown; host: "
                             "host time per eager call, CuPy API beside cuep.torch (cuep.bench_host)")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per rank (default 4096 normal, 128 low latency)")
    parser.add_argument("--low-latency-tokens", type=int, default=128,
                        help="--mode host: tokens per rank of the low-latency calls")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--sms", type=lambda s: [int(v) for v in s.split(",")], default=None,
                        help="comma-separated SM counts to measure (default: Buffer.num_sms, DeepEP's 20)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=None,
                        help="timed iterations (default 30 normal, 1000 low latency: p99 needs many)")
    parser.add_argument("--tune", action="store_true",
                        help=f"search SM counts {TUNE_SMS} and print the best Config per operation")
    parser.add_argument("--fixed-buffer", action="store_true",
                        help="normal mode: size the buffers as frameworks do, from the hints with no token count "
                             "(no larger than DeepEP's), so that a call takes several rounds; by default the buffers "
                             "take --tokens in one round")
    parser.add_argument("--round-tokens", type=int, default=None,
                        help="normal mode: size the buffers for rounds of this many source tokens, so that a call "
                             "of --tokens takes ceil(tokens / round tokens) rounds (what each round costs)")
    parser.add_argument("--progress", action="store_true", help="print a line after each SM count")
    parser.add_argument("--copy-warps", type=int, default=None,
                        help="ceiling: warps of each block that copy (default all 16; the combine's pushers: 8)")
    parser.add_argument("--copy-batch", type=int, default=4, choices=COPY_BATCHES,
                        help="ceiling: 16-byte vectors each lane of a warp copy has in flight (the kernels': 4)")
    parser.add_argument("--bulk-chunk-bytes", type=int, default=1024, help="ceiling: bytes of each bulk (TMA) copy")
    parser.add_argument("--bulk-stages", type=int, default=2,
                        help="ceiling: chunks of shared memory each warp's bulk copies cycle through")
    parser.add_argument("--push-only", action="store_true", help="ceiling: the push copies only")
    parser.add_argument("--trace", action="store_true",
                        help="low latency: build the kernels with CUEP_TRACE and print when blocks reach each phase")
    args = parser.parse_args(argv)
    low_latency = args.mode == "low_latency"
    if args.round_tokens is not None and (args.fixed_buffer or args.round_tokens <= 0):
        parser.error("--round-tokens takes a positive count and excludes --fixed-buffer")
    if args.trace:
        if not low_latency:
            parser.error("--trace applies to --mode low_latency")
        os.environ["CUEP_TRACE"] = "1"
    args.tokens = args.tokens or (128 if low_latency else 4096)
    args.iters = args.iters or (1000 if low_latency else 30)
    if args.tune:
        args.sms, args.progress = TUNE_SMS, True
    if args.mode == "host":
        from .bench_host import bench_host
        bench_host(args, lambda rank, tokens: _workload(rank, tokens, args.hidden, args.experts, args.topk))
        return 0
    {"normal": bench_normal, "low_latency": bench_low_latency, "ceiling": bench_ceiling,
     "overlap": bench_overlap}[args.mode](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
