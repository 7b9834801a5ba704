"""The internode calls' sequence of kernels on the host, round by round (no GPU): a non-cached dispatch runs
as many rounds as the largest batch of any rank needs (the plan's word the CPU wait reads), a dispatch with
num_worst_tokens runs one, and a cached dispatch and a combine run their dispatch's rounds; each round's
kernels carry its index, the count of rounds and the round's tokens."""

import dataclasses
import itertools
import types

import numpy as np
import pytest

from cuep.modes import internode
from cuep.runtime.topology import Topology

RANKS_PER_NODE, NUM_NODES = 2, 2
HIDDEN, TOPK, EXPERTS = 1024, 8, 16
_addresses = itertools.count(0x1000, 0x1000)


class FakeArray:
    """What the mode reads of a device array: its address, shape and dtype."""

    def __init__(self, shape, dtype=np.int32):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.data = types.SimpleNamespace(ptr=next(_addresses))


class FakeFront:
    def empty(self, shape, dtype):
        return FakeArray(shape, dtype)

    def view(self, storage, shape, dtype, offset, strides=None):
        return FakeArray(shape, dtype)


def _context(nvl_bytes: int, rdma_bytes: int) -> internode.Context:
    topology = Topology(rank=1, num_ranks=RANKS_PER_NODE * NUM_NODES, local_rank=1, num_local_ranks=4,
                        ranks_per_node=RANKS_PER_NODE)
    return internode.Context(
        library=None, topology=topology, rdma=0x10_0000, nvl=0x20_0000,
        rdma_layout=internode.RdmaLayout.carve(rdma_bytes, topology.num_ranks, NUM_NODES),
        nvl_layout=internode.NvlLayout.carve(nvl_bytes), node_rdma=FakeArray((2,)), node_nvl=FakeArray((2,)),
        state=FakeArray((2,)), traffic=FakeArray((4,)), status=FakeArray((13,)), status_host_ptr=0x30_0000,
        device_sms=132, direct_peers=True, timeout_ns=10**9, barrier=lambda stream: None,
        raise_if_failed=lambda: None,
        front=FakeFront())


@pytest.fixture
def launched(monkeypatch):
    """Every launch as (kernel, round index, round count, round tokens); rounds are None for kernels without."""
    calls = []

    def record(library, entry, stream, grid, block, args):
        r = getattr(args, "round", None)
        calls.append((entry.split("::")[-1], *((r.index, r.count, r.tokens) if r is not None else (None,) * 3)))
    monkeypatch.setattr(internode, "launch", record)
    return calls


def _dispatch(ctx, num_tokens: int, largest_batch: int, num_worst_tokens: int = 0, monkeypatch=None,
              max_tokens_per_rank=None):
    plan_layout = internode.PlanLayout.create(ctx.topology.num_ranks, NUM_NODES, EXPERTS // ctx.topology.num_ranks)
    plan = np.zeros(plan_layout.words, np.int32)
    plan[[0, 1, internode.PlanLayout.MAX_TOKENS]] = 3 * num_tokens, 2 * num_tokens, largest_batch
    monkeypatch.setattr(internode._interop, "read_on_host", lambda array, stream: plan)
    x = FakeArray((num_tokens, HIDDEN), np.uint16)
    return internode.dispatch(ctx, None, x, None, FakeArray((num_tokens, TOPK), np.int64),
                              FakeArray((num_tokens, TOPK), np.float32), FakeArray((num_tokens, 4), np.bool_),
                              FakeArray((EXPERTS,)), EXPERTS, None, 1, num_worst_tokens, 20, 6, max_tokens_per_rank)


def _hinted_context(round_tokens: int) -> internode.Context:
    from cuep import Config
    config, num_ranks = Config(), RANKS_PER_NODE * NUM_NODES
    return _context(config.get_nvl_buffer_size_hint(2 * HIDDEN, num_ranks, round_tokens, TOPK, RANKS_PER_NODE),
                    config.get_rdma_buffer_size_hint(2 * HIDDEN, num_ranks, round_tokens, TOPK, RANKS_PER_NODE))


@pytest.mark.parametrize("num_tokens, largest_batch, rounds", [(300, 300, 3), (0, 300, 3), (300, 1000, 8),
                                                               (128, 128, 1), (0, 0, 1)])
def test_a_dispatch_runs_the_rounds_of_the_largest_batch(launched, monkeypatch, num_tokens, largest_batch, rounds):
    ctx = _hinted_context(128)
    *_, handle = _dispatch(ctx, num_tokens, largest_batch, monkeypatch=monkeypatch)
    assert [name for name, *_ in launched[:3]] == ["scan", "counts", "notify"]
    assert launched[3:] == [(name, r, rounds, 128) for r in range(rounds) for name in ("send", "dispatch")]
    assert (handle.round_tokens, handle.num_rounds) == (128, rounds)
    assert handle.unit_prefix.shape == (-(-num_tokens // 128) + 1, ctx.topology.num_ranks + NUM_NODES)

    launched.clear()  # a cached dispatch and a combine run the same rounds
    internode.dispatch(ctx, None, FakeArray((num_tokens, HIDDEN), np.uint16), None, None, None, None, None, EXPERTS,
                       handle, 1, 0, 20, 6)
    assert launched == [(name, r, rounds, 128) for r in range(rounds) for name in ("send", "dispatch")]
    launched.clear()
    internode.combine(ctx, None, FakeArray((handle.num_rows, HIDDEN), np.uint16), handle,
                      FakeArray((handle.num_rows, TOPK), np.float32), None, None, 20, 6)
    assert launched == [(name, r, rounds, 128) for r in range(rounds) for name in ("push", "forward", "combine")]


@pytest.mark.parametrize("largest_batch, rounds, tokens", [(1000, 2, 512), (1280, 2, 640), (1281, 3, 512),
                                                            (640, 1, 640), (100, 1, 128)])
def test_a_dispatch_splits_the_largest_batch_into_even_rounds(launched, monkeypatch, largest_batch, rounds, tokens):
    """Buffers of rounds of 640 tokens: the fewest rounds that take the batch, each of the fewest whole units of
    128 that do, instead of full rounds and a remainder; the handle keeps them for the cached dispatch and combine."""
    ctx = _hinted_context(640)
    *_, handle = _dispatch(ctx, 300, largest_batch, monkeypatch=monkeypatch)
    assert launched[3:] == [(name, r, rounds, tokens) for r in range(rounds) for name in ("send", "dispatch")]
    assert (handle.round_tokens, handle.num_rounds) == (tokens, rounds)
    launched.clear()
    internode.combine(ctx, None, FakeArray((handle.num_rows, HIDDEN), np.uint16), handle,
                      FakeArray((handle.num_rows, TOPK), np.float32), None, None, 20, 6)
    assert launched == [(name, r, rounds, tokens) for r in range(rounds) for name in ("push", "forward", "combine")]


def test_a_dispatch_with_num_worst_tokens_runs_one_round(launched, monkeypatch):
    """It makes no CPU wait, so whatever the batches (the kernels report one past the round on every rank)."""
    ctx = _hinted_context(128)
    *_, handle = _dispatch(ctx, 300, 1000, num_worst_tokens=4000, monkeypatch=monkeypatch)
    assert launched[3:] == [("send", 0, 1, 128), ("dispatch", 0, 1, 128)]
    assert handle.num_rounds == 1 and handle.num_rows == 4000


def test_a_dispatch_with_num_worst_tokens_and_a_bound_runs_its_even_rounds(launched, monkeypatch):
    """With max_tokens_per_rank, the rounds of the bound (whatever the batches), split evenly; each source on this
    rank's rail sends it at most its rounds' tokens, which the forwarding records hold."""
    ctx = _hinted_context(640)
    *_, handle = _dispatch(ctx, 300, 5000, num_worst_tokens=4000, monkeypatch=monkeypatch, max_tokens_per_rank=1000)
    assert launched[3:] == [(name, r, 2, 512) for r in range(2) for name in ("send", "dispatch")]
    assert (handle.num_rounds, handle.round_tokens, handle.num_rows) == (2, 512, 4000)
    assert handle.forward_pos.shape == (NUM_NODES * 2 * 512, RANKS_PER_NODE)


def test_a_buffer_below_one_round_is_refused_before_any_kernel(launched, monkeypatch):
    ctx = _context(1 << 30, internode.rdma_bytes_for(100 * internode.dispatch_row_bytes(2 * HIDDEN, 0, TOPK, 2), 4, 2))
    with pytest.raises(ValueError, match="num_rdma_bytes >= "):
        _dispatch(ctx, 300, 300, monkeypatch=monkeypatch)
    assert launched == []


@pytest.mark.parametrize("direct_peers", [True, False], ids=["direct_writes", "staged_puts"])
def test_sends_and_forwards_take_the_contexts_path_and_their_own_chunks(monkeypatch, direct_peers):
    """The send and the forward write straight to the peers NVSHMEM maps unless CUEP_INTERNODE_PUTS made the
    context ask for staged puts; each call's chunks are balanced over its warps."""
    kernel_args = {}
    monkeypatch.setattr(internode, "launch",
                        lambda library, entry, stream, grid, block, args: kernel_args.update({entry: args}))
    ctx = dataclasses.replace(_hinted_context(4096), direct_peers=direct_peers)
    *_, handle = _dispatch(ctx, 4096, 4096, monkeypatch=monkeypatch)
    internode.combine(ctx, None, FakeArray((handle.num_rows, HIDDEN), np.uint16), handle,
                      FakeArray((handle.num_rows, TOPK), np.float32), None, None, 20, 6)
    send, forward = kernel_args["cuep::internode::send"], kernel_args["cuep::internode::forward"]
    assert send.direct_peers == forward.direct_peers == int(direct_peers)
    # 2 nodes of 2 ranks, 20 SMs: the pull's 4 partitions and the forward's 2, each balanced over 320 warps
    assert (send.chunk_rows, forward.chunk_rows) == (internode.balanced_chunk_rows(6, 4096, 4, 20),
                                                     internode.balanced_chunk_rows(6, 4096, 2, 20)) == (26, 26)
