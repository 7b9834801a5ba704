"""The one launch convention of every kernel family: one argument struct, passed by value.

Each ``__global__`` entry of ``cuda_src`` takes a single ``const <Name>Args`` parameter. Its Python
mirror is a :class:`KernelArgs` subclass listing the same fields in the same order;
:meth:`KernelArgs.layout_asserts` renders the C++ ``static_assert``\\ s that pin every field's offset
and the struct's size, and ``tests/test_kernel_args.py`` compiles them against each family's source,
so a mirror that drifts fails on a CPU machine, not as garbage on a GPU.

:class:`Launch` is a filled struct bound to a kernel and a grid. It goes through CuPy's driver binding
of ``cuLaunchKernel`` with the struct's address as the one kernel parameter: the eager decode path is
host-bound, and that binding costs the least host time per launch of the ones we measured.
"""

from __future__ import annotations

import ctypes
from typing import ClassVar

from .. import _deps
from ..errors import CuepError
from ..jit import Library


class KernelArgs(ctypes.Structure):
    """Base of every argument struct: a subclass mirrors the C++ struct ``cxx_name`` field for field."""

    cxx_name: ClassVar[str]

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


class Launch:
    """``entry`` of ``library`` with its filled argument struct and grid; call it with a CuPy stream.

    The struct is held by reference: a caller may change fields (e.g. the low-latency phases) and
    launch again."""

    __slots__ = ("entry", "function", "grid", "block", "shared_bytes", "args", "_params")

    def __init__(self, library: Library, entry: str, grid: int, block: int, args: KernelArgs, shared_bytes: int = 0):
        self.entry, self.function = entry, library.function(entry)
        self.grid, self.block, self.shared_bytes, self.args = grid, block, shared_bytes, args
        # cuLaunchKernel's kernelParams: an array of one pointer, to the struct.
        self._params = (ctypes.c_void_p * 1)(ctypes.addressof(args))

    def __call__(self, stream) -> None:
        cupy = _deps.cupy()
        try:
            cupy.cuda.driver.launchKernel(self.function, self.grid, 1, 1, self.block, 1, 1, self.shared_bytes,
                                          stream.ptr, ctypes.addressof(self._params), 0)
        except cupy.cuda.driver.CUDADriverError as exc:
            raise CuepError(f"cuep: launching {self.entry} (grid {self.grid}, block {self.block}, "
                            f"{self.shared_bytes} B shared) failed: {exc}") from None


def launch(library: Library, entry: str, stream, grid: int, block: int, args: KernelArgs,
           shared_bytes: int = 0) -> None:
    """Launch once: ``Launch(...)(stream)``."""
    Launch(library, entry, grid, block, args, shared_bytes)(stream)
