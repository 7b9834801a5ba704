"""What the benchmarks that start one torch process per rank share (``torch.multiprocessing.spawn``, an NCCL or gloo
group on this host): a free port for the group's rendezvous, and the backend module a run measures."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port of this host that nothing listens on now, for ``init_process_group``'s ``tcp://`` rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def backend_module(backend: str):
    """DeepEP's module as a run measures it: ``cuep.torch`` for ``"cuep"``, else DeepEP's own ``deep_ep`` (built in
    place and on ``PYTHONPATH``)."""
    if backend == "cuep":
        import cuep.torch
        return cuep.torch
    import deep_ep
    return deep_ep
