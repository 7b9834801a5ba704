"""cuep.torch, DeepEP V1's module for torch frameworks, on whatever GPUs the machine has (one is enough: the
ranks share it): the worker (workers/torch_worker.py) starts its ranks with torch.multiprocessing and joins
them in a gloo process group, with no mpirun and no mpi4py."""

import pytest

from .launch import WORKERS, run_python, torch_skip_reason

# (suite, ranks, ranks per node); ranks per node below the rank count: the internode mode on virtual nodes
RUNS = [("normal", 2, None), ("normal", 4, None), ("normal", 4, 2), ("low_latency", 2, None),
        ("low_latency", 4, None), ("shrink", 2, None), ("shrink", 4, None)]


def _id(run) -> str:
    suite, num_ranks, ranks_per_node = run
    if ranks_per_node:
        return f"internode-{num_ranks // ranks_per_node}x{ranks_per_node}"
    return f"{'intranode' if suite == 'normal' else suite}-{num_ranks}"


@pytest.mark.gpu
@pytest.mark.parametrize("suite,num_ranks,ranks_per_node", RUNS, ids=[_id(run) for run in RUNS])
def test_torch_front_matches_reference(suite, num_ranks, ranks_per_node):
    reason = torch_skip_reason()
    if reason:
        pytest.skip(reason)
    env = {"CUEP_RANKS_PER_NODE": str(ranks_per_node)} if ranks_per_node else {}
    output = run_python([str(WORKERS / "torch_worker.py"), "--suite", suite, "--num-ranks", str(num_ranks)], env=env)
    for rank in range(num_ranks):
        assert f"[rank {rank}] torch worker ({suite}," in output and f"passed on {num_ranks} ranks" in output, output
    assert output.count(f"passed on {num_ranks} ranks") == num_ranks, output
