"""The one launch convention of every kernel family: a ctypes struct that mirrors the entry's
parameters, launched through one driver call (``cuLaunchKernel``, or ``cuLaunchKernelEx`` for clusters).

A :class:`KernelArgs` subclass lists an entry's parameters in order, with their C types. Where the
entry takes one ``const <Name>Args`` struct by value, the mirror lists that struct's fields and
:meth:`KernelArgs.layout_asserts` renders ``static_assert``\\ s pinning each field's offset and the
size; where it takes that struct's fields as scalars (``scalar_parameters``: the intranode and layout
entries, where a struct parameter made NVRTC schedule the hot loops differently), the mirror's bytes
are the entry's parameter space. ``tests/test_kernel_args.py`` checks the mirrors against the source
and ``tests/test_kernel_params.py`` against the compiled kernels' own parameter tables, so a mirror
that drifts fails on a CPU machine, not as garbage on a GPU.

:class:`Launch` binds a filled mirror to a kernel and a grid. It goes through CuPy's driver binding
of ``cuLaunchKernel``, which cost the least host time per launch of the ones we measured (the eager
decode path is host-bound): a struct taken by value goes as the one kernel parameter, scalars as the
parameter buffer (``CU_LAUNCH_PARAM_BUFFER_POINTER``). A launch in clusters of blocks (``cluster`` > 1)
goes through the driver's ``cuLaunchKernelEx`` instead, which CuPy does not bind. cuda.bindings' launches
cost 3x more host time on one machine than on another (docs/performance-log.md, v0.5.3), so it is called
through ctypes: one foreign call with a ``CUlaunchConfig`` mirror built once per :class:`Launch` (its host
time was not measured apart). The occupancy query that decides whether a grid fits in clusters takes the
same mirror.
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from typing import ClassVar, Protocol

from .. import _deps
from ..errors import CuepError


# cuLaunchKernel's `extra` keys (CU_LAUNCH_PARAM_*, cuda.h)
_PARAM_END, _PARAM_BUFFER_POINTER, _PARAM_BUFFER_SIZE = 0, 1, 2
_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4  # CUlaunchAttributeID (cuda.h)


class _LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute`` (cuda.h): an attribute id, then its value, a union of 64 bytes at offset 8."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` (cuda.h), ``cuLaunchKernelEx``'s first argument."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


@functools.cache
def _driver_function(name: str, *argtypes):
    """``name`` of the CUDA driver (libcuda, which CuPy has loaded already), through ctypes."""
    try:
        function = getattr(ctypes.CDLL("libcuda.so.1"), name)
    except (OSError, AttributeError) as exc:
        raise CuepError(f"cuep: a cluster launch needs {name} from the CUDA driver 12.0 or newer ({exc})") from None
    function.argtypes, function.restype = argtypes, ctypes.c_int
    return function


def _cluster_config(grid: int, block: int, shared_bytes: int, cluster: int) -> tuple[_LaunchConfig, _LaunchAttribute]:
    """A launch configuration of ``grid`` blocks in clusters of ``cluster``, and the attribute it points to (which
    must live as long as it)."""
    attribute = _LaunchAttribute(id=_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
    attribute.value[:3] = (cluster, 1, 1)
    config = _LaunchConfig(grid=(grid, 1, 1), block=(block, 1, 1), shared_bytes=shared_bytes,
                           attrs=ctypes.addressof(attribute), num_attrs=1)
    return config, attribute


def _check(status: int, call: str) -> None:
    if status:
        raise CuepError(f"cuep: {call} returned CUresult {status}")


@functools.cache
def _resident_clusters(kernel: int, block: int, shared_bytes: int, cluster: int, device_id: int) -> int:
    """How many clusters of ``cluster`` blocks of ``kernel`` (a CUkernel) the current device (``device_id``, the
    cache's key) holds at once (``cuOccupancyMaxActiveClusters``); 0, with a warning, where the driver cannot tell."""
    function, count = ctypes.c_void_p(), ctypes.c_int()
    config, _attribute = _cluster_config(cluster, block, shared_bytes, cluster)
    try:
        get_function = _driver_function("cuKernelGetFunction", ctypes.c_void_p, ctypes.c_void_p)
        _check(get_function(ctypes.byref(function), kernel), "cuKernelGetFunction")
        _check(_driver_function("cuOccupancyMaxActiveClusters", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(
            ctypes.byref(count), function, ctypes.byref(config)), "cuOccupancyMaxActiveClusters")
    except CuepError as exc:
        # Clusters only move where the blocks land: without an answer the kernel still runs, block by block.
        warnings.warn(f"{exc}; launching block by block instead of in clusters of {cluster}", RuntimeWarning,
                      stacklevel=4)
        return 0
    return count.value


def _fits_in_clusters(kernel: int, grid: int, block: int, shared_bytes: int, cluster: int) -> bool:
    """Whether the current device holds all ``grid`` blocks of ``kernel`` at once in clusters of ``cluster``: the
    kernels' blocks wait for each other, so a grid that does not fit so goes block by block."""
    return grid // cluster <= _resident_clusters(kernel, block, shared_bytes, cluster, _deps.cupy().cuda.Device().id)


class KernelArgs(ctypes.Structure):
    """Base of every argument mirror: a subclass lists the parameters of an entry, or the fields of the
    C++ struct ``cxx_name`` that the entry takes by value. The mirror of an entry's arguments names that
    entry, by its qualified C++ name, in ``entry`` (or several sharing its fields in ``entries``); the
    Python side refers to the entry by that name alone (:func:`entries_of`)."""

    cxx_name: ClassVar[str]
    #: The entry takes this struct's fields as scalar parameters rather than the struct by value.
    scalar_parameters: ClassVar[bool] = False

    @classmethod
    def layout_asserts(cls) -> str:
        """C++ ``static_assert``\\ s that ``cuep::<cxx_name>`` has this mirror's size and field offsets."""
        name = f"cuep::{cls.cxx_name}"
        lines = [f'static_assert(sizeof({name}) == {ctypes.sizeof(cls)}, "{name}: size differs from its Python '
                 f'mirror");']
        for field_name, *_ in cls._fields_:
            offset = getattr(cls, field_name).offset
            lines.append(f'static_assert(__builtin_offsetof({name}, {field_name}) == {offset}, "{name}::{field_name}: '
                         f'offset differs from its Python mirror");')
        return "\n".join(lines) + "\n"


def entries_of(mirrors) -> tuple[str, ...]:
    """Every entry that ``mirrors`` name (each one's ``entry``, then its ``entries``), in order: what a
    family's spec passes as :attr:`cuep.jit.KernelSpec.entries`."""
    names: list[str] = []
    for mirror in mirrors:
        names += ([mirror.entry] if hasattr(mirror, "entry") else []) + list(getattr(mirror, "entries", ()))
    assert len(set(names)) == len(names), f"an entry is named twice: {names}"
    return tuple(names)


class Functions(Protocol):
    """Where a launch finds its kernel (once, when the launch is made): a :class:`cuep.jit.Library`, or an
    object that stands in for one."""

    def function(self, name: str) -> int: ...


@functools.lru_cache(maxsize=None)
def _parameter_bytes(mirror: type[KernelArgs]) -> int:
    """Where a scalar mirror's last parameter ends: its size without the struct's tail padding."""
    name, kind = mirror._fields_[-1][:2]
    nested = isinstance(kind, type) and issubclass(kind, ctypes.Structure)
    return getattr(mirror, name).offset + (_parameter_bytes(kind) if nested else ctypes.sizeof(kind))


_OneParameter = ctypes.c_void_p * 1
_Extra = ctypes.c_void_p * 5


class Launch:
    """``entry`` of ``functions`` with its filled argument mirror and grid; call it with a CuPy stream.
    ``cluster`` > 1 launches the grid (a multiple of it) in clusters of that many blocks, which the GPU
    places together in one GPC (sm_90 and newer), where the GPU holds the whole grid in such clusters at
    once (the kernels' blocks wait for each other); else it launches block by block.

    The mirror is held by reference: a caller may change fields (e.g. the low-latency phases) and
    launch again."""

    __slots__ = ("entry", "function", "grid", "block", "shared_bytes", "args", "cluster", "_held", "_params",
                 "_extra", "_config", "_launch_ex", "_launch")

    def __init__(self, functions: Functions, entry: str, grid: int, block: int, args: KernelArgs,
                 shared_bytes: int = 0, cluster: int = 1):
        if cluster < 1 or grid % cluster:
            raise ValueError(f"{entry}: a grid of {grid} blocks does not split into clusters of {cluster}")
        self.entry, self.function = entry, functions.function(entry)
        self.grid, self.block, self.shared_bytes, self.args = grid, block, shared_bytes, args
        if cluster > 1 and not _fits_in_clusters(self.function, grid, block, shared_bytes, cluster):
            cluster = 1
        self.cluster, self._config, self._launch_ex = cluster, None, None
        self._launch = None  # CuPy's launchKernel, looked up on the first launch (a decode step launches twice)
        # The driver reads these arrays at each launch: they live as long as this object (`_held`).
        if args.scalar_parameters:  # `extra`: the parameter buffer and its size, then the end marker
            size = ctypes.c_size_t(_parameter_bytes(type(args)))
            extra = _Extra(_PARAM_BUFFER_POINTER, ctypes.addressof(args), _PARAM_BUFFER_SIZE, ctypes.addressof(size),
                           _PARAM_END)
            self._held, self._params, self._extra = (size, extra), 0, ctypes.addressof(extra)
        else:  # `kernelParams`: an array of one pointer, to the struct
            params = _OneParameter(ctypes.addressof(args))
            self._held, self._params, self._extra = params, ctypes.addressof(params), 0
        if cluster > 1:
            self._config, attribute = _cluster_config(grid, block, shared_bytes, cluster)
            self._held = (self._held, attribute)
            self._launch_ex = _driver_function("cuLaunchKernelEx", *(ctypes.c_void_p,) * 4)

    def __call__(self, stream) -> None:
        if self._config is not None:
            self._config.stream = stream.ptr
            status = self._launch_ex(ctypes.addressof(self._config), self.function, self._params, self._extra)
            if status:
                raise CuepError(f"cuep: launching {self.entry} (grid {self.grid} in clusters of {self.cluster}, "
                                f"block {self.block}, {self.shared_bytes} B shared) failed: "
                                f"{_deps.cupy().cuda.driver.CUDADriverError(status)}")
            return
        launch = self._launch
        if launch is None:
            launch = self._launch = _deps.cupy().cuda.driver.launchKernel
        try:
            launch(self.function, self.grid, 1, 1, self.block, 1, 1, self.shared_bytes, stream.ptr, self._params,
                   self._extra)
        except _deps.cupy().cuda.driver.CUDADriverError as exc:
            raise CuepError(f"cuep: launching {self.entry} (grid {self.grid}, block {self.block}, "
                            f"{self.shared_bytes} B shared) failed: {exc}") from None


def launch(functions: Functions, entry: str, stream, grid: int, block: int, args: KernelArgs,
           shared_bytes: int = 0, cluster: int = 1) -> None:
    """Launch once: ``Launch(...)(stream)``."""
    Launch(functions, entry, grid, block, args, shared_bytes, cluster)(stream)


_DEFAULT_SHARED_BYTES = 48 * 1024  # shared memory, static and dynamic, a block may take without opting in
_allowed_shared: dict[tuple[int, int], int] = {}  # (kernel handle, device) -> the bytes it was allowed


@functools.lru_cache(maxsize=None)
def _block_shared_bytes(device_id: int) -> int:
    return int(_deps.cupy().cuda.Device(device_id).attributes["MaxSharedMemoryPerBlockOptin"])


def block_shared_bytes() -> int:
    """The most shared memory, static and dynamic, a block may take on the current device once its kernel
    opted in (:func:`allow_shared_bytes`)."""
    return _block_shared_bytes(_deps.cupy().cuda.Device().id)


def allow_shared_bytes(functions: Functions, entry: str, shared_bytes: int, static_bytes: int = 0) -> None:
    """Let ``entry`` launch on the current device with ``shared_bytes`` of dynamic shared memory beside
    ``static_bytes`` of its own (past the 48 KiB a block gets without opting in); once per kernel, device
    and size.

    Raises:
        ValueError: more than a block of this GPU may have; CuepError: the driver refused.
    """
    if shared_bytes + static_bytes <= _DEFAULT_SHARED_BYTES:
        return
    cupy, driver = _deps.cupy(), _deps.cuda_driver()
    device = cupy.cuda.Device()
    handle = functions.function(entry)
    if _allowed_shared.get((handle, device.id), 0) >= shared_bytes:
        return
    limit = block_shared_bytes()
    if shared_bytes + static_bytes > limit:
        raise ValueError(f"{entry}: {shared_bytes} bytes of dynamic shared memory beside {static_bytes} of its own "
                         f"exceed the {limit} a block of this GPU may take")
    # The library's handles are CUkernels, whose attributes are set per device.
    (err,) = driver.cuKernelSetAttribute(driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                         shared_bytes, driver.CUkernel(handle), driver.CUdevice(device.id))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise CuepError(f"cuep: could not allow {entry} {shared_bytes} bytes of shared memory ({err})")
    _allowed_shared[(handle, device.id)] = shared_bytes
