"""The families that put over the network, built for ranks across hosts, link NVSHMEM's transfer code from
``libnvshmem_device.a``, IBGDA included, so that NVSHMEM chooses IBGDA or a proxy transport at run time;
built for one host, they inline NVSHMEM whole and call nothing (cuda_src/cuep/network.cuh). Read from
the linked cubins of the real NVRTC + nvJitLink build; no GPU needed."""

import pytest

from cuep.jit import compiler
from cuep.kernels import LOW_LATENCY_RECEIVE, NETWORK_FAMILIES, buffer_specs

from .builds import VARIANTS, compiled
from .cubin import code_of, symbol_names

# Mangled-name stems of the archive's transfer functions each network family reaches: the warp put, the
# fence and the signal (a non-fetching atomic).
TRANSFER_FUNCTIONS = ("nvshmemi_transfer_rma_nbi", "nvshmemi_transfer_fence", "nvshmemi_transfer_amo_nonfetch")
IBGDA_STATE = "nvshmemi_ibgda_device_state_d"  # compiled out when the headers drop IBGDA (all-device inlining)
MISSING_FROM_ARCHIVE = "put_signal"  # nvshmemi_transfer_put_signal_dispatch<...>: not in NVSHMEM 3.8's archive


def _relocated_symbols(cubin: bytes) -> set[str]:
    return {symbol for name, relocations in code_of(cubin).items() if name.startswith(".rela.")
            for _offset, _kind, symbol, _addend in relocations}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("family", NETWORK_FAMILIES)
def test_network_families_link_the_archive_transfer_code(family, variant):
    spec, artifact = compiled(family, "sm_90", variant, across_hosts=True)
    names = symbol_names(artifact.cubin)
    for stem in TRANSFER_FUNCTIONS:
        assert any(stem in name for name in names), (spec.name, stem)
    assert IBGDA_STATE in names, spec.name
    assert not any(MISSING_FROM_ARCHIVE in name for name in names | _relocated_symbols(artifact.cubin)), spec.name


@pytest.mark.parametrize("family", NETWORK_FAMILIES)
def test_one_host_builds_inline_nvshmem_and_call_nothing(family):
    """Built for one host, the kernels call none of the archive's transfer functions (such a call costs
    the NVLink path its registers): NVSHMEM's device code is compiled in."""
    spec, artifact = compiled(family, "sm_90")
    assert ("network", "1") not in spec.defines
    called = _relocated_symbols(artifact.cubin)
    assert not any(stem in symbol for stem in TRANSFER_FUNCTIONS for symbol in called), (spec.name, called)


def test_a_buffer_across_hosts_gets_the_network_builds():
    one_host = buffer_specs("sm_90", 1 << 20, 1 << 20, internode=True)
    across = buffer_specs("sm_90", 1 << 20, 1 << 20, internode=True, across_hosts=True)
    for build in (*NETWORK_FAMILIES, LOW_LATENCY_RECEIVE):  # the hooks' receive-only build goes with its family
        assert ("network", "1") in across[build].defines and ("network", "1") not in one_host[build].defines
    assert ("receive_only", "1") in across[LOW_LATENCY_RECEIVE].defines
    assert across["layout"] == one_host["layout"] and across["barrier"] == one_host["barrier"]


def test_no_kernel_calls_put_with_signal():
    """No kernel calls NVSHMEM's put-with-signal, whose transfer code the archive lacks; only the network
    header switches NVSHMEM's whole inlining, by build."""
    sources = list(compiler.source_root().rglob("*.cu")) + list(compiler.source_root().rglob("*.cuh"))
    assert sources
    for path in sources:
        text = path.read_text()
        assert "putmem_signal" not in text, path
        if path.stem in NETWORK_FAMILIES:
            assert "#if !CUEP_NETWORK\n#define NVSHMEM_ENABLE_ALL_DEVICE_INLINING" in text, path
        else:
            assert "NVSHMEM_ENABLE_ALL_DEVICE_INLINING" not in text or "CUEP_NETWORK" in text, path
