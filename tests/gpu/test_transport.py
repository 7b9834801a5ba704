"""What a host without an RDMA NIC tells about NVSHMEM's network transports: the doctor says so and that a
single host works, and asking for IBGDA there gives every rank the clear start error."""

from pathlib import Path

import pytest

from .launch import run_or_skip, run_python, skip_reason

ONE_HOST = {"NVSHMEM_REMOTE_TRANSPORT": "none", "NVSHMEM_IB_ENABLE_IBGDA": "0"}


def _skip_unless_no_nic() -> None:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    if any(Path("/sys/class/infiniband").glob("*")):
        pytest.skip("this host has RDMA devices: the no-NIC verdicts do not apply")


@pytest.mark.gpu
def test_doctor_on_a_gpu_host_without_a_nic():
    _skip_unless_no_nic()
    output = run_python(["-m", "cuep", "doctor"], env=ONE_HOST)
    assert "[  ok] NVIDIA driver" in output and "[  ok] GPU peer access" in output, output
    assert "no RDMA device in /sys/class/infiniband" in output and "one host: can work" in output, output
    output = run_python(["-m", "cuep", "doctor", "--transport", "ibgda"], env=ONE_HOST, expect_failure=True)
    assert "ibgda: cannot work here" in output, output


@pytest.mark.gpu
def test_ibgda_without_a_nic_raises_on_every_rank():
    _skip_unless_no_nic()
    run_or_skip("start_worker.py", 2, env={"NVSHMEM_REMOTE_TRANSPORT": "ibgda"}, expect="start error passed on 2 ranks")
