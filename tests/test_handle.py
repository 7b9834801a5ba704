"""The normal-mode handle as a flat tuple (what frameworks save for backward), without a GPU."""

import numpy as np
import pytest

from cuep import _checks
from cuep.modes.intranode import HANDLE_ARRAYS, Handle


def make_handle(num_recv=5, num_copies=7, num_tokens=4, num_ranks=2, num_rows=6):
    return Handle(num_tokens=num_tokens, num_rows=num_rows, num_recv_tokens=num_recv, num_send_copies=num_copies,
                  rank_prefix_matrix=np.ones((num_ranks, num_ranks), np.int32),
                  recv_info=np.arange(3 + num_ranks + 1 + 3, dtype=np.int32),
                  send_pos=np.full((num_tokens, num_ranks), -1, np.int32),
                  send_prefix=np.zeros((2, num_ranks), np.int32),
                  recv_src_idx=np.arange(num_rows, dtype=np.int32),
                  is_token_in_rank=np.zeros((num_tokens, num_ranks), bool))


@pytest.mark.parametrize("counts", [(5, 7), (None, None)])
def test_handle_round_trips_through_its_tuple(counts):
    handle = make_handle(*counts)
    items = tuple(handle)
    assert len(items) == len(handle) == len(HANDLE_ARRAYS)
    assert items[0] is handle.rank_prefix_matrix  # where DeepEP's users read it
    assert items[-1].dtype == np.int64 and list(items[-1]) == [-1 if c is None else c for c in counts]
    restored = Handle.from_arrays(dict(zip(HANDLE_ARRAYS, items)))
    assert (restored.num_tokens, restored.num_rows) == (handle.num_tokens, handle.num_rows)
    assert (restored.num_recv_tokens, restored.num_send_copies) == counts
    for name in HANDLE_ARRAYS[:-1]:
        assert getattr(restored, name) is getattr(handle, name)


def test_handle_arrays_that_do_not_fit_are_refused():
    arrays = dict(zip(HANDLE_ARRAYS, make_handle()))
    with pytest.raises(ValueError, match="do not fit together"):
        Handle.from_arrays({**arrays, "send_prefix": np.zeros((3, 2), np.int32)})
    with pytest.raises(ValueError, match="send_pos must be int32, got int64"):
        Handle.from_arrays({**arrays, "send_pos": arrays["send_pos"].astype(np.int64)})


def test_handle_must_be_a_handle_or_its_tuple():
    with pytest.raises(TypeError, match="handle must be a dispatch\\(\\)'s handle or the 7-item tuple"):
        _checks.normal_handle("combine()", (1, 2), 2)


@pytest.mark.parametrize("given, expected", [("float32", np.float32), (np.int64, np.int64), ("bfloat16", "bfloat16"),
                                             ("float8_e4m3fn", np.uint8)])
def test_view_dtypes(given, expected):
    want = _checks.bf16_dtype() if expected == "bfloat16" else np.dtype(expected)
    assert _checks.numpy_dtype("f()", given) == want


def test_view_dtype_from_torch_names():
    class FakeTorchDtype:  # torch dtypes print as torch.<name> and have is_floating_point
        is_floating_point = True

        def __init__(self, name):
            self.name = name

        def __str__(self):
            return f"torch.{self.name}"

    assert _checks.numpy_dtype("f()", FakeTorchDtype("bfloat16")) == _checks.bf16_dtype()
    assert _checks.numpy_dtype("f()", FakeTorchDtype("float8_e4m3fn")) == np.uint8
    assert _checks.numpy_dtype("f()", FakeTorchDtype("int32")) == np.int32
