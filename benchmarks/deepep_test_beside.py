"""DeepEP V1's own ``tests/test_low_latency.py`` on cuep.torch and on DeepEP itself, in turn, in one command, with
the figures it prints set side by side rank by rank: the comparison of the per-kernel lines and the eager step's
``avg_t`` that the docs quote.

    python benchmarks/deepep_test_beside.py --deepep ../DeepEP --num-processes 4 [--use-logfmt] [--runs 2]
    python benchmarks/deepep_test_beside.py --deepep ../DeepEP --deepep-unset LD_PRELOAD NVSHMEM_HOME -- --num-tokens 64

The test is DeepEP's (fetched into ``--tests``, ``.deepep/tests`` by default: ``python tests/gpu/deepep_v1.py fetch
/path/to/DeepEP``); cuep.torch runs it through ``tests/gpu/deepep_v1.py``, which binds ``import deep_ep`` to it, and
DeepEP runs it from the tests' folder with its tree (built in place, ``--deepep``) first on ``PYTHONPATH`` and the
``--deepep-unset`` variables taken out of its environment (a preload of another NVSHMEM, say). Arguments after
``--`` go to the test on both. The backends alternate, ``--runs`` times each; a run that fails stops the command
with its output.

Per figure and rank the table gives each run's value on each backend, then the mean of cuep's runs against the
mean of DeepEP's, and whether cuep's is at or below DeepEP's on every rank. The test's figures are its own:
``avg_t`` (``Dispatch + combine``) is the eager step with its host time, timed by CUDA events; the others are each
kernel's time in a profile (a whole dispatch and combine, then a hook's send and receive).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from torch_ranks import deepep_environment, outputs_in_turn

REPO_ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = REPO_ROOT / "tests" / "gpu" / "deepep_v1.py"
TEST = "test_low_latency.py"

# The test's lines, each with its rank, and the figures they carry (us), in the order the table prints them.
_NUMBER = r"([0-9.]+)"
LINES = (
    (re.compile(rf"\[rank (\d+)\] Dispatch \+ combine bandwidth: .*avg_t={_NUMBER} us"),
     ("dispatch + combine avg_t",)),
    (re.compile(rf"\[rank (\d+)\] Dispatch bandwidth: .*avg_t={_NUMBER} us \| Combine bandwidth: .*avg_t={_NUMBER} us"),
     ("dispatch", "combine")),
    (re.compile(rf"\[rank (\d+)\] Dispatch send/recv time: {_NUMBER} \+ {_NUMBER} us \| "
                rf"Combine send/recv time: {_NUMBER} \+ {_NUMBER} us"),
     ("dispatch send (hook)", "dispatch receive (hook)", "combine send (hook)", "combine receive (hook)")),
)
FIGURES = tuple(name for _, names in LINES for name in names)


def figures(output: str) -> dict[str, dict[int, float]]:
    """Each figure's value per rank in one run's output (a figure or rank the run did not print is absent)."""
    found: dict[str, dict[int, float]] = {}
    for line in output.splitlines():
        for pattern, names in LINES:
            match = pattern.search(line)
            if match:
                rank, *values = match.groups()
                for name, value in zip(names, values):
                    found.setdefault(name, {})[int(rank)] = float(value)
    return found


def commands(args, test_args: list[str]) -> dict[str, tuple[list[str], dict | None, str | None]]:
    """Each backend's command line, environment (``None``: this one) and working folder."""
    tests = Path(args.tests).resolve()
    return {
        "cuep": ([sys.executable, str(LAUNCHER), str(tests), TEST, *test_args], None, None),
        "deepep": ([sys.executable, str(tests / TEST), *test_args], deepep_environment(args.deepep, args.deepep_unset),
                   str(tests)),
    }


def table(runs: dict[str, list[dict[str, dict[int, float]]]]) -> list[str]:
    """The printed comparison of every figure both backends printed, rank by rank."""
    lines = [f"{'':26} {'rank':>4}   {'cuep runs':<20} {'DeepEP runs':<20} {'cuep':>7} {'DeepEP':>7}"]
    for name in FIGURES:
        ranks = sorted(set.intersection(*(set(run.get(name, {})) for backend in runs.values() for run in backend)))
        if not ranks:
            continue
        at_or_below = True
        for rank in ranks:
            values = {backend: [run[name][rank] for run in found] for backend, found in runs.items()}
            means = {backend: sum(v) / len(v) for backend, v in values.items()}
            at_or_below &= means["cuep"] <= means["deepep"]
            lines.append(f"{name:26} {rank:4}   {' '.join(f'{v:.2f}' for v in values['cuep']):<20} "
                         f"{' '.join(f'{v:.2f}' for v in values['deepep']):<20} {means['cuep']:7.2f} "
                         f"{means['deepep']:7.2f}")
        lines.append(f"{'':26} {'':4}   cuep's mean {'at or below' if at_or_below else 'ABOVE'} DeepEP's on "
                     f"{'every rank' if at_or_below else 'some rank'}")
    return lines


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    own, test_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepep", required=True, metavar="PATH", help="DeepEP V1's tree, built in place")
    parser.add_argument("--tests", default=str(REPO_ROOT / ".deepep" / "tests"),
                        help="DeepEP V1's tests/ folder, fetched (tests/gpu/deepep_v1.py fetch)")
    parser.add_argument("--num-processes", type=int, default=4, help="ranks (the test's --num-processes)")
    parser.add_argument("--use-logfmt", action="store_true", help="the test's --use-logfmt")
    parser.add_argument("--runs", type=int, default=2, help="runs of each backend, in turn")
    parser.add_argument("--deepep-unset", nargs="*", default=[], metavar="VAR",
                        help="environment variables DeepEP's runs go without")
    args = parser.parse_args(own)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    if not (Path(args.tests) / TEST).is_file():
        parser.error(f"--tests {args.tests} holds no {TEST} (fetch DeepEP V1's tests: python tests/gpu/deepep_v1.py "
                     f"fetch /path/to/DeepEP)")
    test_args = ["--num-processes", str(args.num_processes), *(["--use-logfmt"] if args.use_logfmt else []),
                 *test_args]
    runs = {backend: [figures(output) for output in outputs]
            for backend, outputs in outputs_in_turn(commands(args, test_args), args.runs, TEST).items()}
    print(f"DeepEP's {TEST} on cuep.torch beside DeepEP ({args.deepep}), {args.runs} run{'' if args.runs == 1 else 's'} each, in turn: "
          f"{' '.join(test_args)}; us")
    print("\n".join(table(runs)), flush=True)


if __name__ == "__main__":
    main()
