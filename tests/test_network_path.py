"""The families that put over the network link NVSHMEM's transfer code from ``libnvshmem_device.a``, IBGDA
included, so that NVSHMEM chooses IBGDA or a proxy transport at run time (cuda_src/cuep/network.cuh).
Read from the linked cubins of the real NVRTC + nvJitLink build; no GPU needed."""

import pytest

from cuep.jit import compiler

from .builds import VARIANTS, compiled
from .cubin import code_of, symbol_names

NETWORK_FAMILIES = ("low_latency", "internode")
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
    spec, artifact = compiled(family, "sm_90", variant)
    names = symbol_names(artifact.cubin)
    for stem in TRANSFER_FUNCTIONS:
        assert any(stem in name for name in names), (spec.name, stem)
    assert IBGDA_STATE in names, spec.name
    assert not any(MISSING_FROM_ARCHIVE in name for name in names | _relocated_symbols(artifact.cubin)), spec.name


def test_network_families_compile_the_transfer_code_out_of_line():
    """No source defines NVSHMEM_ENABLE_ALL_DEVICE_INLINING (under NVRTC it compiles IBGDA out), and no
    kernel calls NVSHMEM's put-with-signal, whose transfer code the archive lacks."""
    sources = list(compiler.source_root().rglob("*.cu")) + list(compiler.source_root().rglob("*.cuh"))
    assert sources
    for path in sources:
        text = path.read_text()
        assert "#define NVSHMEM_ENABLE_ALL_DEVICE_INLINING" not in text, path
        assert "putmem_signal" not in text, path
