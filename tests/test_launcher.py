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
                                                 (33, 1, 1), (40, 1, 1), (48, 1, 1), (132, 1, 1)])
def test_the_intranode_push_and_combine_go_in_clusters_on_the_hopper_path_only(grid, push, combine):
    assert intranode.cluster_blocks(intranode.PUSH_CLUSTER, True, grid) == push
    assert intranode.cluster_blocks(intranode.COMBINE_CLUSTER, True, grid) == combine
    assert intranode.cluster_blocks(intranode.PUSH_CLUSTER, False, grid) == 1
    assert intranode.cluster_blocks(intranode.COMBINE_CLUSTER, False, grid) == 1


@pytest.mark.parametrize("grid, by_warp", [(1, 1), (8, 1), (20, 1), (24, 1), (25, 0), (32, 0), (132, 0)])
def test_the_cached_dispatch_deals_its_pushers_warp_by_warp_on_few_blocks_only(grid, by_warp):
    assert intranode.push_deal_by_warp(grid) == by_warp


def _launch(monkeypatch, fits: bool, grid: int = 24, cluster: int = 2) -> Launch:
    from cuep.kernels import launcher
    monkeypatch.setattr(launcher, "_fits_in_clusters", lambda *args: fits)
    monkeypatch.setattr(launcher, "_driver_function", lambda name, *argtypes: name)  # no driver on this machine

    class Functions:
        def function(self, name: str) -> int:
            return 0x1234
    return Launch(Functions(), "cuep::probe::entry", grid, 128, _OneInt(), shared_bytes=4096, cluster=cluster)


def test_a_grid_that_fits_in_clusters_is_launched_in_them(monkeypatch):
    launch = _launch(monkeypatch, fits=True)
    config = launch._config
    assert launch.cluster == 2 and launch._launch_ex == "cuLaunchKernelEx"
    assert (list(config.grid), list(config.block), config.shared_bytes, config.num_attrs) == ([24, 1, 1], [128, 1, 1],
                                                                                              4096, 1)
    attribute = _LaunchAttribute.from_address(config.attrs)
    assert attribute.id == 4 and list(attribute.value[:3]) == [2, 1, 1]  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION


def test_a_grid_that_does_not_fit_in_clusters_goes_block_by_block(monkeypatch):
    launch = _launch(monkeypatch, fits=False)
    assert launch.cluster == 1 and launch._config is None and launch._launch_ex is None


def test_a_driver_that_cannot_count_clusters_gets_a_warning_and_no_clusters(monkeypatch):
    from cuep.kernels import launcher
    invalid_value = 1  # CUDA_ERROR_INVALID_VALUE
    monkeypatch.setattr(launcher, "_driver_function", lambda name, *argtypes: lambda *args: invalid_value)
    launcher._resident_clusters.cache_clear()
    with pytest.warns(RuntimeWarning, match="cuKernelGetFunction returned CUresult 1; launching block by block"):
        assert launcher._resident_clusters(0x1234, 128, 0, 2, 0) == 0
    launcher._resident_clusters.cache_clear()
