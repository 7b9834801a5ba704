"""One launch module per ``cuda_src`` family: its spec (with the constants it shares with its source),
its launch shape, and the ctypes mirrors of its entries' arguments (``ARGUMENT_STRUCTS``: each entry
takes one struct by value, or that struct's fields as scalars; either way it launches through
:mod:`cuep.kernels.launcher` with the mirror's bytes as its parameters)."""

from __future__ import annotations

from ..jit import KernelSpec
from . import barrier, elastic, internode, intranode, layout, low_latency, probe

FAMILIES = {"barrier": barrier, "elastic": elastic, "internode": internode, "intranode": intranode,
            "layout": layout, "low_latency": low_latency, "probe": probe}
"""Every family by name; ``probe`` (the benchmark's NVLink ceiling probe) is compiled by tools and tests
but never by a Buffer (see :func:`buffer_specs`)."""


NETWORK_FAMILIES = ("internode", "low_latency")
"""The families that send over NVSHMEM's network transports: built apart for ranks across hosts."""


# The name family_builds gives the low-latency family's receive-only build (the hooks' receives).
LOW_LATENCY_RECEIVE = "low_latency_receive"


def family_builds(family: str, arch: str, **options) -> dict[str, KernelSpec]:
    """Every build of ``family`` that a Buffer may load, by name, for ``arch`` and the family's ``options``:
    its spec under the family's name and, for the low-latency family, the receive-only build its hooks'
    receives launch (:data:`LOW_LATENCY_RECEIVE`)."""
    module = FAMILIES[family]
    builds = {family: module.spec(arch, **options)}
    if module is low_latency:
        builds[LOW_LATENCY_RECEIVE] = module.spec(arch, receive_only=True, **options)
    return builds


def buffer_specs(arch: str, num_nvl_bytes: int, num_rdma_bytes: int, internode: bool = False,
                 across_hosts: bool = False, elastic: bool = False) -> dict[str, KernelSpec]:
    """The families a Buffer of these sizes launches, by name, with their specs for ``arch``.

    The layout and barrier kernels serve every Buffer; the normal-mode family needs an NVLink buffer
    (``num_nvl_bytes > 0``): the internode family when the ranks span several nodes (``internode``),
    the intranode family otherwise, and with either, for an ``ElasticBuffer`` (``elastic``), the elastic family
    (DeepEP V2's layouts on the normal mode's rows); the low-latency family needs a low-latency region
    (``num_rdma_bytes > 0``, passed only for a ``low_latency_mode`` Buffer), and with it its receive-only
    build, which the hooks' receives launch (:func:`family_builds`).
    Compiling only these keeps a cold start to what the Buffer can use. ``across_hosts`` (ranks on
    several physical hosts) picks the network families' build that links NVSHMEM's transfer code
    (IBGDA included); on one host they inline NVSHMEM whole (``cuda_src/cuep/network.cuh``).
    """
    wanted = {"layout": True, "barrier": True, "intranode": num_nvl_bytes > 0 and not internode,
              "elastic": elastic and num_nvl_bytes > 0, "internode": num_nvl_bytes > 0 and internode,
              "low_latency": num_rdma_bytes > 0}
    options = {"across_hosts": across_hosts}
    return {name: spec for family, used in wanted.items() if used
            for name, spec in family_builds(family, arch, **(options if family in NETWORK_FAMILIES else {})).items()}


__all__ = ["FAMILIES", "LOW_LATENCY_RECEIVE", "NETWORK_FAMILIES", "barrier", "buffer_specs", "elastic", "family_builds",
           "internode", "intranode", "layout", "low_latency", "probe"]
