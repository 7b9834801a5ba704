"""Shared by the MPI workers: every rank's inputs from one seed, bit comparison, the checks that several
workers make (no memory growth, an error raised, a peer timing out), and running named cases on every
rank with the whole job aborted on the first failure.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import traceback
from typing import NamedTuple

import ml_dtypes
import numpy as np

from cuep.fp8 import dequantize

BF16 = np.dtype(ml_dtypes.bfloat16)


def bits(array) -> np.ndarray:
    """``array`` as NumPy, BF16 viewed as ``uint16``: compares bit for bit (NaNs and signed zeros too)."""
    array = np.asarray(array)
    return array.view(np.uint16) if array.dtype == BF16 else array


def random_topk(rng: np.random.Generator, num_tokens: int, num_experts: int, num_topk: int,
                masked_fraction: float = 0.0, dtype=np.int64) -> np.ndarray:
    """Top-k routing like a gate's: distinct experts per token, some entries masked to -1."""
    scores = rng.random((num_tokens, num_experts))
    topk = np.argsort(scores, axis=1)[:, :num_topk].astype(dtype)
    topk[rng.random(topk.shape) < masked_fraction] = -1
    return topk


class RankInputs(NamedTuple):
    """One rank's inputs: ``x`` `[num_tokens, hidden]` (BF16, or e4m3 bytes as ``uint8`` with ``scales``
    `[num_tokens, hidden // 128]` float32, else ``None``), ``topk_idx`` and ``topk_weights``
    `[num_tokens, num_topk]` (int64 with -1 entries, float32)."""

    x: np.ndarray
    scales: np.ndarray | None
    topk_idx: np.ndarray
    topk_weights: np.ndarray

    def on_gpu(self) -> RankInputs:
        """The same inputs as CuPy arrays (``None`` stays ``None``)."""
        import cupy
        return RankInputs(*(None if a is None else cupy.asarray(a) for a in self))


class AllInputs(list):
    """Every rank's :class:`RankInputs`, in rank order; the properties gather one field over the ranks,
    the way ``cuep.reference`` takes it."""

    @property
    def xs(self) -> list[np.ndarray]:
        return [i.x for i in self]

    @property
    def scales(self) -> list[np.ndarray] | None:
        return None if self[0].scales is None else [i.scales for i in self]

    @property
    def topk_idxs(self) -> list[np.ndarray]:
        return [i.topk_idx for i in self]

    @property
    def topk_weights(self) -> list[np.ndarray]:
        return [i.topk_weights for i in self]

    @property
    def num_tokens(self) -> list[int]:
        return [len(i.x) for i in self]

    def with_tokens(self, xs: list[np.ndarray]) -> AllInputs:
        """The same routing (top-k ids and weights) carrying new BF16 tokens ``xs[s]`` (no scales)."""
        return AllInputs(i._replace(x=x, scales=None) for i, x in zip(self, xs, strict=True))


class SeededInputs:
    """Makes every rank's inputs for one case after another, the same on every rank: rank ``s``'s
    inputs to the ``k``-th call draw from ``default_rng([seed, k, s])``, so a rank can compute what
    every other rank sends it, and a case's inputs depend only on how many calls came before it."""

    def __init__(self, seed: int, num_ranks: int):
        self.seed, self.num_ranks = seed, num_ranks
        self._calls = itertools.count()

    def __call__(self, num_tokens, hidden: int, num_experts: int, num_topk: int, masked: float = 0.1,
                 fp8: bool = False, route=None) -> AllInputs:
        """``num_tokens``: an int, or a function of the rank. ``fp8``: random e4m3 bytes and float32
        scales instead of BF16 normals. ``route``: applied to each rank's top-k ids after masking."""
        call = next(self._calls)
        inputs = AllInputs()
        for s in range(self.num_ranks):
            rng = np.random.default_rng([self.seed, call, s])
            tokens = num_tokens(s) if callable(num_tokens) else num_tokens
            if fp8:
                x = rng.integers(0, 256, (tokens, hidden), dtype=np.uint8)
                scales = rng.random((tokens, hidden // 128), dtype=np.float32)
            else:
                x, scales = rng.standard_normal((tokens, hidden)).astype(BF16), None
            topk = random_topk(rng, tokens, num_experts, num_topk, masked)
            if route is not None:
                topk = route(topk)
            inputs.append(RankInputs(x, scales, topk, rng.random((tokens, num_topk), dtype=np.float32)))
        return inputs


def assert_sum_close(got: np.ndarray, want: np.ndarray, magnitude: np.ndarray, across_nodes: bool) -> None:
    """A combined sum within 1e-2 (absolute and relative) of the reference's. Across nodes each node's
    partial is rounded to BF16 before its source adds the partials (as DeepEP's), so an element may also be
    off by that rounding: 2^-8 of the sum of the magnitudes (``magnitude``: the same combine of the absolute
    values)."""
    tolerance = 1e-2 + 1e-2 * np.abs(want) + (2.0 ** -8 * magnitude if across_nodes else 0.0)
    bad = np.abs(got - want) > tolerance
    assert not bad.any(), (f"{int(bad.sum())} of {bad.size} elements off, e.g. at {np.argwhere(bad)[0]}: "
                           f"{got[bad][:4]} against {want[bad][:4]} (tolerance {tolerance[bad][:4]})")


@contextlib.contextmanager
def environment(**values: str):
    """Set environment variables for the block (cuep reads them when a Buffer is made), then restore them."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def expect_error(error, call, what: str, match: str | None = None) -> BaseException:
    """Run ``call``, which must raise ``error`` with ``match`` in its message; return the exception.
    ``what`` says what went wrong if nothing is raised."""
    try:
        call()
    except error as exc:
        assert match is None or match in str(exc), (match, exc)
        return exc
    raise AssertionError(what)


def expect_peer_timeout(rank: int, call, what: str) -> BaseException:
    """``call`` must raise ``cuep.PeerTimeoutError`` naming this rank and rank 0 as the missing peer."""
    import cuep
    exc = expect_error(cuep.PeerTimeoutError, call, f"{what} without rank 0 did not time out")
    assert exc.peer == 0 and exc.rank == rank, exc
    return exc


def times_out_without_rank_0(comm, what: str, call) -> BaseException | None:
    """Ranks meet, then every rank but 0 runs ``call``, which must raise ``cuep.PeerTimeoutError`` naming
    itself and rank 0. Returns the exception (``None`` on rank 0)."""
    comm.Barrier()
    if comm.Get_rank() == 0:
        return None
    return expect_peer_timeout(comm.Get_rank(), call, what)


def rejoin(comm, buffer, behind: int = 1) -> None:
    """After rank 0 skipped ``behind`` device barriers that the others entered and gave up on: rank 0
    catches up (the others announced those barrier epochs before giving up), then every rank is at the
    same epoch."""
    comm.Barrier()
    if comm.Get_rank() == 0:
        for _ in range(behind):
            buffer.barrier()
    comm.Barrier()
    buffer.barrier()


def assert_no_memory_growth(step, calls: int = 1000, warmup: int = 20, slack_bytes: int = 1 << 20,
                            warmup_step=None, settle=None) -> None:
    """Run ``warmup_step`` (default ``step``) ``warmup`` times, then ``step`` ``calls`` times and
    ``settle`` (if given) once: the memory pool may not grow by more than ``slack_bytes``."""
    import cupy
    pool = cupy.get_default_memory_pool()
    for _ in range(warmup):
        (warmup_step or step)()
    cupy.cuda.Device().synchronize()
    before = pool.used_bytes()
    for _ in range(calls):
        step()
    cupy.cuda.Device().synchronize()
    if settle is not None:
        settle()
        cupy.cuda.Device().synchronize()
    assert pool.used_bytes() <= before + slack_bytes, (before, pool.used_bytes())


def selected_cases(cases: list, name_of) -> list:
    """The cases that ``CUEP_TEST_CASES`` (comma-separated case function names, ``name_of(case)``) selects, in
    their order; every case when it is unset. A name that matches no case is an error, not a silent skip."""
    selected = os.environ.get("CUEP_TEST_CASES")
    if not selected:
        return list(cases)
    wanted = [name.strip() for name in selected.split(",") if name.strip()]
    known = [name_of(case) for case in cases]
    unknown = [name for name in wanted if name not in known]
    if unknown or not wanted:
        raise ValueError(f"CUEP_TEST_CASES={selected!r} names no case of this worker: {unknown or selected!r}; "
                         f"its cases are {', '.join(known)}")
    return [case for case, name in zip(cases, known) if name in wanted]


def run_cases(comm, cases) -> None:
    """Run ``(name, fn)`` pairs in order; on any failure print it and abort every rank.

    Ranks meet between cases: checking a case against the reference takes each rank a different time
    on the host (tens of seconds apart at 8 ranks), which must not count against the next case's
    bounded waits on the device."""
    rank = comm.Get_rank()
    for name, case in cases:
        comm.Barrier()
        try:
            case()
        except BaseException:  # noqa: BLE001 - any failure, even SystemExit, must abort every rank
            print(f"[rank {rank}] FAILED {name}\n{traceback.format_exc()}", flush=True)
            sys.stderr.flush()
            comm.Abort(1)
        if rank == 0:
            print(f"[rank 0] ok {name}", flush=True)


def expert_outputs(expected, num_experts: int) -> list[np.ndarray]:
    """What every rank's experts output: its received rows (dequantised) scaled per expert, in BF16;
    zeros in the rows past each expert's count. Only the received rows are computed: at 8 ranks the
    full arrays are ~0.5 GB per rank, and every rank builds every rank's."""
    outputs = []
    for r, result in enumerate(expected):
        rows = result.recv_x
        out = np.zeros(rows.shape, dtype=BF16)
        for e, n in enumerate(result.recv_count):
            values = (dequantize(rows[e, :n], result.recv_scales[e, :n]) if rows.dtype == np.uint8
                      else rows[e, :n].astype(np.float32))
            out[e, :n] = (values * np.float32(1 + e / 8 + r)).astype(BF16)
        outputs.append(out)
    return outputs


class AbsoluteRows:
    """``|output|`` in float32, worked out only for the rows the reference combine reads."""

    def __init__(self, output):
        self.output, self.shape = output, output.shape

    def __getitem__(self, key):
        return np.abs(self.output[key].astype(np.float32))
