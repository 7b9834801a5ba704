"""The cold compile of a first normal + low-latency Buffer's kernels, no GPU needed.

    python benchmarks/cold_compile.py [--arch sm_90] [--repeats 2]      # from the repository root

Builds the families such a Buffer loads (:func:`cuep.kernels.buffer_specs`: layout, barrier, intranode,
low_latency) concurrently into an empty cache directory, as a Buffer's collective compile does, and
prints the wall time and each family's compile time, ``--repeats`` times (a fresh cache each time).
The GPU machine's figure also includes loading them; this one is the compile alone.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from cuep.jit import build_all
from cuep.kernels import buffer_specs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    specs = list(buffer_specs(args.arch, num_nvl_bytes=1, num_rdma_bytes=1).values())
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache:
            os.environ["CUEP_CACHE_DIR"] = cache
            started = time.perf_counter()
            results = build_all(specs)
            wall = time.perf_counter() - started
        families = ", ".join(f"{spec.family} {seconds:.1f} s" for spec, (_, seconds) in zip(specs, results))
        print(f"cold compile of a first normal + low-latency Buffer ({args.arch}, {os.cpu_count()} CPUs): "
              f"{wall:.1f} s wall; {families}")


if __name__ == "__main__":
    main()
