"""An intranode dispatch whose received rows are known beforehand (ElasticBuffer's cached dispatch, which repeats a
dispatch's routing with its top-k ids) sizes its outputs from them and never waits on the CPU, even for 0 rows;
otherwise a non-cached dispatch waits once, and one with num_worst_tokens never. Host only, no GPU."""

import itertools
import types

import numpy as np
import pytest

from cuep.modes import intranode

NUM_RANKS, HIDDEN, TOPK, EXPERTS, TOKENS = 2, 1024, 4, 8, 300
_addresses = itertools.count(0x1000, 0x1000)


class FakeArray:
    def __init__(self, shape, dtype=np.int32):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.strides = tuple(int(np.prod(self.shape[i + 1:])) * self.itemsize for i in range(len(self.shape)))
        self.data = types.SimpleNamespace(ptr=next(_addresses))


class FakeFront:
    def empty(self, shape, dtype):
        return FakeArray(shape, dtype)

    def storage(self, nbytes, dtype=None):
        return types.SimpleNamespace(ptr=next(_addresses))

    def readable_views(self, storage, regions):
        return [FakeArray(view.shape, view.dtype) for view in regions]


@pytest.fixture
def dispatch(monkeypatch):
    waits = []
    info = np.zeros(intranode.RECV_INFO_RANK_PREFIX + NUM_RANKS + 1 + EXPERTS // NUM_RANKS, np.int32)
    info[0] = 123

    def read_on_host(array, stream):
        waits.append(array)
        return info
    monkeypatch.setattr(intranode._interop, "read_on_host", read_on_host)
    monkeypatch.setattr(intranode, "launch", lambda *args, **kwargs: None)
    library = types.SimpleNamespace(spec=types.SimpleNamespace(sm90_features=True))  # what the launches' shapes read
    ctx = intranode.Context(library=library, rank=0, num_ranks=NUM_RANKS, buffer_ptr=0x10_0000, buffer_bytes=256 << 20,
                            peer_bases=FakeArray((NUM_RANKS,), np.uint64), status=FakeArray((13,)),
                            status_host_ptr=0x20_0000, next_row=FakeArray((NUM_RANKS + 1,)),
                            dispatch_state=FakeArray((intranode.STATE_WORDS,), np.uint64), device_sms=132,
                            timeout_ns=10**9, barrier=lambda stream: None, raise_if_failed=lambda: None,
                            front=FakeFront())

    def run(**options):
        outputs = intranode.dispatch(ctx, None, FakeArray((TOKENS, HIDDEN), np.uint16), None,
                                     FakeArray((TOKENS, TOPK), np.int64), FakeArray((TOKENS, TOPK), np.float32),
                                     FakeArray((TOKENS, NUM_RANKS), np.bool_), FakeArray((EXPERTS,)), EXPERTS, None,
                                     1, options.pop("num_worst_tokens", 0), 20, **options)
        return outputs, len(waits)
    return run


@pytest.mark.parametrize("known_rows", [0, 1, 700])
def test_known_rows_size_the_outputs_without_a_cpu_wait(dispatch, known_rows):
    (recv_x, _, recv_topk_idx, recv_topk_weights, per_expert, handle), waits = dispatch(known_rows=known_rows)
    assert waits == 0
    assert recv_x.shape[0] == recv_topk_idx.shape[0] == recv_topk_weights.shape[0] == handle.num_rows == known_rows
    assert per_expert == [] and handle.num_recv_tokens is None


def test_otherwise_a_dispatch_waits_once_or_with_worst_tokens_never(dispatch):
    (recv_x, *_), waits = dispatch()
    assert waits == 1 and recv_x.shape[0] == 123
    (recv_x, *_), waits = dispatch(num_worst_tokens=500)
    assert waits == 1 and recv_x.shape[0] == 500
