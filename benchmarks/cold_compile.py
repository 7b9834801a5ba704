"""The cold compile of a first normal + low-latency Buffer's kernels, no GPU needed.

    python benchmarks/cold_compile.py [--arch sm_90] [--repeats 2] [--families low_latency,internode]

Builds the families such a Buffer loads (:func:`cuep.kernels.buffer_specs`: layout, barrier, intranode,
low_latency and its hooks' receive-only build) concurrently into an empty cache directory, as a Buffer's
collective compile does, and prints the wall time and each build's compile time, ``--repeats`` times (a fresh
cache each time). ``--families`` builds those instead, one after another (each alone on the machine). The GPU
machine's figure also includes loading them; this one is the compile alone. Run from the repository root.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from cuep.jit import build_all
from cuep.kernels import FAMILIES, buffer_specs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--families", help="comma-separated families to build one at a time instead")
    args = parser.parse_args()
    if args.families:
        batches = [[FAMILIES[name].spec(args.arch)] for name in args.families.split(",")]
        what = "one family at a time"
    else:
        batches = [list(buffer_specs(args.arch, num_nvl_bytes=1, num_rdma_bytes=1).values())]
        what = "a first normal + low-latency Buffer"
    for _ in range(args.repeats):
        timings, wall = [], 0.0
        for specs in batches:
            with tempfile.TemporaryDirectory() as cache:
                os.environ["CUEP_CACHE_DIR"] = cache
                started = time.perf_counter()
                timings += zip(specs, build_all(specs))
                wall += time.perf_counter() - started
        families = ", ".join(f"{spec.name} {seconds:.1f} s" for spec, (_, seconds) in timings)
        print(f"cold compile of {what} ({args.arch}, {os.cpu_count()} CPUs): {wall:.1f} s wall; {families}")


if __name__ == "__main__":
    main()
