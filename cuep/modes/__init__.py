"""One module per communication mode: its context, its Handle, its size hints and the kernel sequence
of each call. :class:`cuep.Buffer` checks arguments and streams, then hands each call to its mode."""

from __future__ import annotations

from typing import Callable

from .. import _deps, env
from ..jit import Library, start_libraries
from ..kernels import buffer_specs
from ..runtime import MpiGroup


def start_kernels(comm, device_id: int, num_nvl_bytes: int, num_low_latency_bytes: int
                  ) -> Callable[[], dict[str, Library]]:
    """Collective over ``comm``: start compiling (one rank per host, every family at once, in the
    background) or loading the kernel families a Buffer of these sizes uses; the returned call, once
    NVSHMEM is up, waits for them and loads them, by family name."""
    arch = f"sm_{_deps.cuda_core().Device(device_id).arch}"
    specs = buffer_specs(arch, num_nvl_bytes, num_low_latency_bytes)
    group = MpiGroup.by_host(comm, env.get("CUEP_COMPILE_TIMEOUT_S"))
    try:
        finish = start_libraries(list(specs.values()), group)
    except BaseException:
        group.close()
        raise

    def load() -> dict[str, Library]:
        try:
            return dict(zip(specs, finish()))
        finally:
            group.close()
    return load
