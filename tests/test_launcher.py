"""The launch convention's cluster path on a CPU: the ctypes mirrors of the driver's launch configuration, the grids
it refuses, and which intranode launches go in clusters."""

import ctypes

import pytest

from cuep.kernels import intranode
from cuep.kernels.launcher import KernelArgs, Launch, _LaunchAttribute, _LaunchConfig


def test_the_launch_configuration_has_the_driver_s_layout():
    # cuda.h (CUDA 12 and 13): CUlaunchConfig is seven unsigned ints, the stream, the attributes and their count;
    # CUlaunchAttribute is the id, padding to 8 bytes, then a union of 64 bytes.
    assert ctypes.sizeof(_LaunchConfig) == 56
    assert (_LaunchConfig.shared_bytes.offset, _LaunchConfig.stream.offset, _LaunchConfig.attrs.offset,
            _LaunchConfig.num_attrs.offset) == (24, 32, 40, 48)
    assert ctypes.sizeof(_LaunchAttribute) == 72 and _LaunchAttribute.value.offset == 8


class _OneInt(KernelArgs):
    cxx_name = "OneInt"
    _fields_ = [("value", ctypes.c_int)]


class _Functions:
    def function(self, name: str) -> int:
        raise AssertionError("the grid is checked before the kernel is looked up")


@pytest.mark.parametrize("grid, cluster", [(7, 2), (6, 4), (4, 0)])
def test_a_grid_that_does_not_split_into_clusters_is_refused(grid, cluster):
    with pytest.raises(ValueError, match=f"a grid of {grid} blocks does not split into clusters of {cluster}"):
        Launch(_Functions(), "cuep::probe::entry", grid, 128, _OneInt(), cluster=cluster)


@pytest.mark.parametrize("grid, push, combine", [(1, 1, 1), (8, 4, 2), (20, 4, 2), (24, 4, 2), (30, 1, 2), (32, 4, 2),
                                                 (33, 1, 1), (48, 4, 1), (64, 1, 1), (132, 1, 1)])
def test_the_intranode_push_and_combine_go_in_clusters_on_the_hopper_path_only(grid, push, combine):
    assert intranode.cluster_blocks(intranode.PUSH_CLUSTER, True, grid) == push
    assert intranode.cluster_blocks(intranode.COMBINE_CLUSTER, True, grid) == combine
    assert intranode.cluster_blocks(intranode.PUSH_CLUSTER, False, grid) == 1
    assert intranode.cluster_blocks(intranode.COMBINE_CLUSTER, False, grid) == 1
