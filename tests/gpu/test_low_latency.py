"""Low-latency dispatch/combine on 2 and 4 GPUs against cuep.reference (cases in workers/low_latency_worker.py)."""

import pytest

from .launch import run_or_skip


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_low_latency_matches_reference(num_ranks):
    run_or_skip("low_latency_worker.py", num_ranks, expect=f"low-latency worker passed on {num_ranks} ranks")


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks, calls", [(2, 100), (4, 100), (8, 40)])
def test_low_latency_pressure_with_fresh_routing(num_ranks, calls):
    """Every call checked against the reference on the host, whose cost grows with the ranks."""
    run_or_skip("low_latency_worker.py", num_ranks, "--pressure", str(calls),
                expect=f"low-latency pressure: {calls} calls checked; passed on {num_ranks} ranks")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["CUEP_FORCE_FALLBACK", "CUEP_AGGRESSIVE_PTX", "CUEP_NETWORK_BUILD",
                                     "CUEP_NETWORK_BUILD+CUEP_FORCE_FALLBACK",
                                     "CUEP_NETWORK_BUILD+CUEP_AGGRESSIVE_PTX"])
def test_low_latency_fallback_and_aggressive_ptx_builds(variant):
    """The other builds: Ampere's fallback, aggressive PTX, and the build for ranks across hosts (NVSHMEM's
    transfer code linked, IBGDA included) alone and with each of those, all on one host."""
    env = {name: "1" for name in variant.split("+")}
    run_or_skip("low_latency_worker.py", 2, env=env, expect="low-latency worker passed on 2 ranks")
