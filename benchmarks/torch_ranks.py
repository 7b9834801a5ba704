"""What the benchmarks that start one torch process per rank share (``torch.multiprocessing.spawn``, an NCCL or gloo
group on this host): a free port for the group's rendezvous, the backend module a run measures, the environment of a
run on DeepEP and the runs of each backend in turn, and the arguments that name both and the workload."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys


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


def deepep_environment(tree: str, unset: list[str]) -> dict[str, str]:
    """This process's environment for a run on DeepEP: the variables ``unset`` names taken out (a preload of
    another NVSHMEM, say; ``PYTHONPATH`` itself, which then holds the tree alone), then its ``tree`` (built in
    place) first on ``PYTHONPATH``."""
    dropped = set(unset)
    environment = {name: value for name, value in os.environ.items() if name not in dropped}
    environment["PYTHONPATH"] = os.pathsep.join([os.path.abspath(tree),
                                                 *filter(None, [environment.get("PYTHONPATH")])])
    return environment


def outputs_in_turn(commands: dict[str, tuple[list[str], dict | None, str | None]], runs: int,
                    what: str) -> dict[str, list[str]]:
    """Each backend's command (``{backend: (argv, environment or None for this one's, working folder or None)}``)
    run ``runs`` times, the backends in turn; each run's standard output, by backend. A run that fails ends this
    process with its output, naming ``what`` ran on which backend."""
    outputs: dict[str, list[str]] = {backend: [] for backend in commands}
    for _ in range(runs):
        for backend, (argv, env, cwd) in commands.items():
            done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"{what} on {backend} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
            outputs[backend].append(done.stdout)
    return outputs


def add_run_arguments(parser: argparse.ArgumentParser, tokens: int, experts: int) -> None:
    """``--backend`` (cuep or deepep), ``--num-ranks``, and the workload: ``--tokens`` per rank (default ``tokens``),
    ``--hidden``, ``--experts`` (default ``experts``), ``--topk``."""
    parser.add_argument("--backend", choices=["cuep", "deepep"], default="cuep")
    parser.add_argument("--num-ranks", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=tokens)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=experts)
    parser.add_argument("--topk", type=int, default=8)
