"""What every example does on a machine without a GPU: the job's first rank prints one line saying so, every
rank exits with status 1, and no traceback shows (``CUEP_EXAMPLE_TRACEBACK=1`` shows them)."""

from __future__ import annotations

import os
import sys
from typing import Callable

import cuep

# Where the launchers put a process's rank: torchrun, Open MPI, MPICH and other PMI launchers.
_RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


def first_rank() -> bool:
    """Whether this process is rank 0 of its job (or was started without a launcher)."""
    return all(int(os.environ.get(name, "0")) == 0 for name in _RANK_VARIABLES)


def run(main: Callable[[], None]) -> None:
    """Run an example's ``main``; a :class:`cuep.NoGPUError` ends it as this module's docstring says."""
    try:
        main()
    except cuep.NoGPUError as exc:
        if os.environ.get("CUEP_EXAMPLE_TRACEBACK"):
            raise
        if first_rank():
            print(f"{os.path.basename(sys.argv[0])}: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
