"""Every argument and dependency error message, without a GPU."""

import sys

import numpy as np
import pytest

import cuep
from cuep import _checks, _deps, env
from cuep.errors import CallOrderError, CuepError, MissingDependencyError
from cuep.jit import toolchain
from cuep.kernels import status
from cuep.kernels.status import BadIdsCall
from cuep.runtime import world

CALL = "get_dispatch_layout()"


class HostArray:
    """Stands in for a device array in the shape/dtype checks, which read only metadata."""

    def __init__(self, array):
        self.dtype, self.ndim, self.shape = array.dtype, array.ndim, array.shape
        self.flags = array.flags


def test_topk_idx_dtype():
    with pytest.raises(TypeError, match=r"get_dispatch_layout\(\): topk_idx must be int32 or int64, got float32"):
        _checks.check_topk_idx(CALL, HostArray(np.zeros((4, 2), np.float32)), 8)


@pytest.mark.parametrize("dtype, columns", [(np.float32, 7168 // 128), (np.int32, 7168 // 512)])
def test_fp8_scales_float32_or_packed_ue8m0(dtype, columns):
    """DeepEP takes float32 scales, or DeepGEMM's packed UE8M0 exponents (int32, four per word), as SGLang passes."""
    _checks.check_fp8_scales(CALL, HostArray(np.zeros((5, columns), dtype)), 5, 7168)


@pytest.mark.parametrize("scales, hidden, error, message", [
    (np.zeros((5, 56), np.float64), 7168, TypeError,
     r"x scales must be float32 or int32 \(packed UE8M0\), got float64"),
    (np.zeros((5, 56), np.int32), 7168, ValueError, r"x scales must have shape \[5, 14\], got \(5, 56\)"),
    (np.zeros((5, 14), np.float32), 7168, ValueError, r"x scales must have shape \[5, 56\]"),
    (np.zeros((5, 5), np.int32), 640, ValueError, r"packed UE8M0 \(int32\) x scales need a hidden size that is a "
                                                  r"multiple of 512, got 640"),
])
def test_fp8_scales_of_another_kind_name_the_argument(scales, hidden, error, message):
    with pytest.raises(error, match=message):
        _checks.check_fp8_scales(CALL, HostArray(scales), 5, hidden)


def test_topk_idx_rank():
    with pytest.raises(ValueError, match=r"topk_idx must have shape \[num_tokens, num_topk\], got \(8,\)"):
        _checks.check_topk_idx(CALL, HostArray(np.zeros(8, np.int64)), 8)


def test_topk_idx_contiguity():
    strided = np.zeros((4, 8), np.int64)[:, ::2]
    with pytest.raises(ValueError, match="C-contiguous"):
        _checks.check_topk_idx(CALL, HostArray(strided), 8)


def test_topk_idx_needs_a_column():
    with pytest.raises(ValueError, match="num_topk >= 1"):
        _checks.check_topk_idx(CALL, HostArray(np.zeros((4, 0), np.int64)), 8)


@pytest.mark.parametrize("call, bad_id, message", [
    (BadIdsCall.LAYOUT, 8, r"get_dispatch_layout\(\) on rank 3: topk_idx held expert id 8, but num_experts=8 "
                           r"\(valid ids: -1 for none, 0..7\)"),
    (BadIdsCall.LOW_LATENCY, -3, r"low_latency_dispatch\(\)/low_latency_combine\(\) on rank 3: topk_idx held "
                                 r"expert id -3, but num_experts=8"),
    (BadIdsCall.LAYOUT, -(1 << 40) - 5, r"expert id -1099511627781, but"),  # an int64 id, both halves
    (BadIdsCall.LAYOUT, (1 << 33) + 1, r"expert id 8589934593, but"),
])
def test_expert_id_out_of_range(call, bad_id, message):
    """The words a kernel records for an out-of-range id (cuda_src/cuep/sync.cuh, record_bad_expert_id) raise
    in the Buffer's next call, naming the call, the argument and the id."""
    words = np.zeros(status.STATUS_WORDS, np.int32)
    status.raise_if_failed(words, 3, 1.0)  # nothing recorded: nothing raised
    bits = bad_id & 0xFFFFFFFFFFFFFFFF
    words[[status.BAD_EXPERT_IDS, status.BAD_EXPERT_LIMIT]] = int(call), 8
    words[[status.BAD_EXPERT_ID_LOW, status.BAD_EXPERT_ID_HIGH]] = np.array([bits & 0xFFFFFFFF, bits >> 32],
                                                                           np.uint32).view(np.int32)
    assert status.holds_a_record(words)
    with pytest.raises(ValueError, match=message):
        status.raise_if_failed(words, 3, 1.0)


def test_a_batch_past_a_one_round_dispatch_raises_naming_num_worst_tokens():
    """Across nodes a num_worst_tokens dispatch moves one round; its pull records the largest batch on every rank
    when that does not fit (cuda_src/internode.cu), and the next call raises it."""
    words = np.zeros(status.STATUS_WORDS, np.int32)
    words[status.ROUND_TOKENS] = 300
    assert status.holds_a_record(words)
    with pytest.raises(ValueError, match=r"num_worst_tokens .* one round, but a rank had 300 tokens"):
        status.raise_if_failed(words, 1, 1.0)


@pytest.mark.parametrize("rule, peer, message", [
    (status.CallOrderRule.IN_FLIGHT, -1, r"low-latency call 9 on rank 2: a send while two earlier low-latency calls"),
    (status.CallOrderRule.UNSENT, -1, r"call 9 on rank 2: a receive hook .* whose send never ran"),
    (status.CallOrderRule.RECEIVED, -1, r"call 9 on rank 2: a receive hook .* already received"),
    (status.CallOrderRule.OVERTAKEN, 3, r"call 9 on rank 2: a newer call of the peer reached"),
    (status.CallOrderRule.HANDLE_BUSY, -1, r"call 9 on rank 2: a combine sent while another combine of the same"),
])
def test_call_order_record_raises_naming_the_rule(rule, peer, message):
    """A broken low-latency call order (cuda_src/low_latency.cu, break_call_order) raises CallOrderError in
    the Buffer's next call, naming the rule, the call and (for an overtaking peer) the peer, before any timeout
    the same launch recorded on the device."""
    words = np.zeros(status.STATUS_WORDS, np.int32)
    words[[status.CALL_ORDER_CALL, status.CALL_ORDER_PEER]] = 9, peer
    assert not status.holds_a_record(words)  # the details land first
    words[status.CALL_ORDER] = int(rule)
    words[[status.TIMED_OUT, status.PEER, status.PHASE]] = 1, 0, 2
    with pytest.raises(CallOrderError, match=message) as error:
        status.raise_if_failed(words, 2, 1.0)
    assert (error.value.rank, error.value.call, error.value.peer) == (2, 9, peer)


def test_a_record_without_its_flag_is_still_being_written():
    """The details of a record land before its flag: until the flag does, there is nothing to raise."""
    words = np.zeros(status.STATUS_WORDS, np.int32)
    words[[status.BAD_EXPERT_ID_LOW, status.BAD_EXPERT_LIMIT, status.PEER, status.PHASE]] = 64, 64, 1, 2
    assert not status.holds_a_record(words)
    for flag in status.FLAG_WORDS:
        flagged = words.copy()
        flagged[flag] = 1
        assert status.holds_a_record(flagged), flag


@pytest.mark.parametrize("num_experts, error, message", [
    (6, ValueError, "positive multiple of the 4 ranks, got 6"),
    (0, ValueError, "positive multiple"),
    (8.0, TypeError, "num_experts must be an int, got float"),
])
def test_num_experts(num_experts, error, message):
    with pytest.raises(error, match=message):
        _checks.check_num_experts(CALL, num_experts, 4)


def test_host_array_is_refused():
    pytest.importorskip("cupy")
    with pytest.raises(TypeError, match="topk_idx must be a GPU array .* got numpy.ndarray"):
        _checks.as_device_array(CALL, "topk_idx", np.zeros((2, 2), np.int64))


def test_allocate_on_comm_stream_needs_event_and_async():
    with pytest.raises(ValueError, match="allocate_on_comm_stream=True needs previous_event and async_finish"):
        _checks.check_event_options(CALL, None, True, True)


@pytest.mark.parametrize("name, value", [("num_nvl_bytes", -1), ("num_nvl_bytes", 4096), ("num_rdma_bytes", 2.5)])
def test_buffer_sizes_checked_first(name, value):
    with pytest.raises((ValueError, TypeError), match=f"Buffer\\(\\): {name} must be"):
        cuep.Buffer(None, **{name: value})


def test_no_gpu_is_one_sentence():
    with pytest.raises(CuepError, match="cuep found no CUDA GPU: run on a machine with an NVIDIA GPU"):
        world.pick_device(0, 0)


def test_more_ranks_than_gpus_go_round_robin():
    assert world.pick_device(3, 4) == 3 and world.pick_device(3, 1) == 0 and world.pick_device(3, 2) == 1


def test_sharing_a_gpu_needs_the_option():
    assert world.check_gpu_sharing(["a", "b", "c"], share=False) == 1
    with pytest.raises(CuepError, match=r"ranks \[0, 2\] would share one GPU .*CUEP_SHARE_GPUS=1"):
        world.check_gpu_sharing(["a", "b", "a", "b"], share=False)
    assert world.check_gpu_sharing(["a", "a", "a", "b"], share=True) == 3


def test_missing_mpi_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)  # makes the import fail
    _deps.require.cache_clear()
    try:
        with pytest.raises(MissingDependencyError, match=r"pip install mpi4py mpich"):
            _deps.mpi()
    finally:
        _deps.require.cache_clear()


def write_nvshmem(root, version, device_library=True):
    include = root / "include" / "non_abi"
    include.mkdir(parents=True)
    major, minor, patch = version
    include.joinpath("nvshmem_version.h").write_text(
        f"#define NVSHMEM_VENDOR_MAJOR_VERSION {major}\n#define NVSHMEM_VENDOR_MINOR_VERSION {minor}\n"
        f"#define NVSHMEM_VENDOR_PATCH_VERSION {patch}\n")
    (root / "lib").mkdir()
    if device_library:
        (root / "lib" / "libnvshmem_device.a").write_bytes(b"!<arch>\n")
    return root


def test_nvshmem_too_old(tmp_path):
    root = write_nvshmem(tmp_path, (3, 4, 5))
    with pytest.raises(MissingDependencyError, match=r"NVSHMEM 3.4.5 .* is too old .*pip install 'nvidia-nvshmem-cu13>=3.5.21'"):
        toolchain.check_nvshmem(root, (3, 4, 5))


def test_nvshmem_headers_and_host_library_of_different_releases(tmp_path):
    root = write_nvshmem(tmp_path, (3, 8, 0))
    with pytest.raises(MissingDependencyError, match=r"headers \(3.8.0.*loaded host library \(3.4.5\) are different releases"):
        toolchain.check_nvshmem(root, (3, 4, 5))


def test_nvshmem_without_device_library(tmp_path):
    root = write_nvshmem(tmp_path, (3, 8, 0), device_library=False)
    with pytest.raises(MissingDependencyError, match="libnvshmem_device.a is missing"):
        toolchain.check_nvshmem(root, (3, 8, 0))


def test_installed_nvshmem_is_one_release():
    nvshmem = toolchain.nvshmem()
    assert nvshmem.version >= toolchain.MIN_NVSHMEM_VERSION and nvshmem.device_library.is_file()


@pytest.mark.parametrize("name, value, message", [
    ("CUEP_TIMEOUT_S", "ten", "CUEP_TIMEOUT_S='ten' is not a number of seconds"),
    ("CUEP_TIMEOUT_S", "-1", "must be a positive number of seconds"),
    ("CUEP_RANKS_PER_NODE", "two", "CUEP_RANKS_PER_NODE='two' is not a whole number"),
    ("CUEP_JIT_VERBOSE", "maybe", "CUEP_JIT_VERBOSE='maybe' is not a boolean"),
])
def test_bad_environment_value_names_the_variable(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        env.get(name)


def test_environment_defaults_and_parsing(monkeypatch):
    monkeypatch.delenv("CUEP_TIMEOUT_S", raising=False)
    assert env.get("CUEP_TIMEOUT_S") == 100.0
    monkeypatch.setenv("CUEP_TIMEOUT_S", "2.5")
    monkeypatch.setenv("CUEP_FORCE_FALLBACK", "yes")
    assert env.get("CUEP_TIMEOUT_S") == 2.5 and env.get("CUEP_FORCE_FALLBACK") is True


def test_import_touches_nothing():
    import subprocess
    code = ("import sys, cuep; heavy = [m for m in ('cupy', 'mpi4py.MPI', 'nvshmem.core', 'cuda.core') "
            "if m in sys.modules]; print(heavy)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"


def test_buffer_without_gpu_says_so():
    from tests.gpu.launch import gpu_count
    if gpu_count() > 0:
        pytest.skip("this machine has a GPU; the GPU tests create real Buffers")
    pytest.importorskip("mpi4py")
    with pytest.raises(CuepError, match="cuep found no CUDA GPU"):
        cuep.Buffer()


def test_topk_idx_rows_must_match_the_tokens():
    with pytest.raises(ValueError, match=r"topk_idx must have shape \[16, num_topk\], got \(15, 8\)"):
        _checks.check_topk_idx("dispatch()", HostArray(np.zeros((15, 8), np.int64)), 64, num_tokens=16)


def test_normal_mode_takes_at_most_32_experts_per_token():
    _checks.check_topk_idx("dispatch()", HostArray(np.zeros((4, 32), np.int64)), 64, 4,
                           max_topk=_checks.NORMAL_MAX_TOPK)
    with pytest.raises(ValueError, match=r"dispatch\(\): at most 32 experts per token, topk_idx has 33 columns"):
        _checks.check_topk_idx("dispatch()", HostArray(np.zeros((4, 33), np.int64)), 64, 4,
                               max_topk=_checks.NORMAL_MAX_TOPK)
    with pytest.raises(ValueError, match=r"combine\(\): at most 32 experts per token, topk_weights has 40 columns"):
        _checks.check_num_topk("combine()", "topk_weights", 40, _checks.NORMAL_MAX_TOPK)


def _ll_dispatch_check(x_shape=(4, 1024), topk_shape=(4, 8), max_tokens=128, num_experts=64, **options):
    import ml_dtypes
    x = np.zeros(x_shape, dtype=ml_dtypes.bfloat16)
    topk = np.zeros(topk_shape, dtype=np.int64)
    flags = {"use_fp8": True, "round_scale": False, "use_ue8m0": False, **options}
    _checks.check_low_latency_dispatch("low_latency_dispatch()", x, topk, max_tokens, num_experts, 4, 32, 1024,
                                       flags["use_fp8"], flags["round_scale"], flags["use_ue8m0"])


@pytest.mark.parametrize("kwargs, match", [
    ({"x_shape": (129, 1024), "topk_shape": (129, 8)}, "more than num_max_dispatch_tokens_per_rank=128"),
    ({"max_tokens": 2048}, r"num_max_dispatch_tokens_per_rank must be in \[1, 1024\]"),
    ({"x_shape": (4, 1000)}, "hidden size must be a positive multiple of 128"),
    ({"x_shape": (4, 640), "use_ue8m0": True, "round_scale": True}, "multiple of 512 with use_ue8m0"),
    ({"use_ue8m0": True}, "use_ue8m0=True needs use_fp8=True and round_scale=True"),
    ({"use_fp8": False, "round_scale": True}, "round_scale=True needs use_fp8=True"),
    ({"topk_shape": (4, 33)}, "at most 32 experts per token"),
    ({"num_experts": 66}, "num_experts must be a positive multiple of the 4 ranks"),
    ({"topk_shape": (5, 8)}, r"topk_idx must have shape \[4, num_topk\]"),
])
def test_low_latency_dispatch_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _ll_dispatch_check(**kwargs)


def test_low_latency_hook_and_async_exclude_each_other():
    with pytest.raises(ValueError, match="async_finish and return_recv_hook exclude each other"):
        _checks.check_hook_options("low_latency_combine()", True, True)
    _checks.check_hook_options("low_latency_combine()", False, True)
