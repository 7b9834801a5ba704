"""tests/gpu/deepep_v1.py, the launcher of DeepEP's own tests, on the CPU: a stand-in test folder shaped like
DeepEP's (an ``init_dist`` that asks for NCCL and ``device_id``, a ``test_low_latency`` that this
repository also has a file of that name for, ranks started with ``torch.multiprocessing.spawn``) shows
that every spawned rank gets the patches: ``deep_ep`` is the target module, the group is gloo,
``set_device`` wraps round the GPU count, ``all_gather_into_tensor`` takes DeepEP's 3-D output, a
shrink-mode Buffer is made under the shorter kernel timeout."""

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.gpu import deepep_v1

LAUNCHER = Path(deepep_v1.__file__)

UTILS = '''
import os
import torch
import torch.distributed as dist


def init_dist(local_rank, num_local_ranks):
    dist.init_process_group(backend="nccl", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                            world_size=num_local_ranks, rank=local_rank, device_id=torch.device(f"cuda:{local_rank}"))
    torch.cuda.set_device(local_rank)
    return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(num_local_ranks)))
'''

TARGET = '''
import os


class Buffer:
    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24,
                 allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, use_fabric=False, explicitly_destroy=False,
                 enable_shrink=False, comm=None):
        self.timeout_at_init = os.environ.get("CUEP_TIMEOUT_S")
'''

STAND_IN = '''
import argparse
import os
import sys

import torch
import torch.distributed as dist

selected = []
torch.cuda.device_count = lambda: 1          # before deep_ep is imported: the launcher wraps these
torch.cuda.set_device = selected.append

import deep_ep                                 # noqa: E402
import test_low_latency                        # noqa: E402
from utils import init_dist                    # noqa: E402


def test_loop(local_rank, num_local_ranks, args):
    rank, num_ranks, group = init_dist(local_rank, num_local_ranks)
    assert dist.get_backend() == "gloo" and dist.get_backend(group) == "gloo"
    assert selected == [0], selected
    assert deep_ep.__name__ == "stand_in_target", deep_ep
    assert test_low_latency.ORIGIN == "stand-in", test_low_latency.__file__
    assert os.environ["CUEP_SHARE_GPUS"] == "1"
    gathered = torch.empty((num_ranks, 3, 2), dtype=torch.int64)
    dist.all_gather_into_tensor(gathered, torch.full((3, 2), rank), group=group)
    assert gathered[:, 2, 1].tolist() == list(range(num_ranks)), gathered
    shrinking = deep_ep.Buffer(group, enable_shrink=True)
    plain = deep_ep.Buffer(group, 0, 0, True)
    print(f"rank {rank}: {sys.argv[1:]} shrink Buffer made with CUEP_TIMEOUT_S={shrinking.timeout_at_init}, "
          f"other Buffers with {plain.timeout_at_init}, host waits with {os.environ.get('CUEP_TIMEOUT_S')}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--shrink-test", action="store_true")
    args = parser.parse_args()
    torch.multiprocessing.spawn(test_loop, args=(args.num_processes, args), nprocs=args.num_processes)
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_spawned_ranks_get_every_patch(tmp_path):
    pytest.importorskip("torch", reason="torch is not installed (the launcher runs torch tests)")
    for name, text in (("utils.py", UTILS), ("stand_in_target.py", TARGET), ("test_stand_in.py", STAND_IN),
                       ("test_low_latency.py", 'ORIGIN = "stand-in"\n')):
        (tmp_path / name).write_text(textwrap.dedent(text))
    env = {**os.environ, "MASTER_PORT": str(_free_port()), "CUEP_DEEPEP_MODULE": "stand_in_target",
           "CUEP_DEEPEP_SHRINK_TIMEOUT_S": "7"}
    env.pop("CUEP_TIMEOUT_S", None)
    env.pop("CUEP_SHARE_GPUS", None)
    done = subprocess.run([sys.executable, str(LAUNCHER), str(tmp_path), "test_stand_in.py", "--num-processes", "2",
                           "--shrink-test"], capture_output=True, text=True, env=env, timeout=300, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for rank in range(2):
        assert (f"rank {rank}: ['--num-processes', '2', '--shrink-test'] shrink Buffer made with CUEP_TIMEOUT_S=7, "
                f"other Buffers with 600, host waits with 600") in output, output


def test_gpu_index_wraps_round_the_gpu_count():
    assert [deepep_v1.gpu_index(i, 2) for i in range(5)] == [0, 1, 0, 1, 0]
    assert deepep_v1.gpu_index(3, 0) == 3 and deepep_v1.gpu_index(-1, 2) == -1
    pytest.importorskip("torch", reason="torch is not installed")
    assert deepep_v1.gpu_index("cuda:5", 4) == 1
    assert deepep_v1.gpu_index("cuda", 4) == "cuda"


def test_usage_without_arguments():
    done = subprocess.run([sys.executable, str(LAUNCHER)], capture_output=True, text=True, check=False)
    assert done.returncode != 0 and "usage:" in done.stderr, done.stderr
