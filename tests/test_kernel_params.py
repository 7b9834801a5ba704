"""Each argument mirror matches the parameters of the entries it launches, as compiled.

The launcher hands a mirror to the driver as the entry's parameters, so the mirror must lay its fields
out exactly where the compiled entry reads them: one struct parameter at offset 0 of the mirror's size
(an entry taking its struct by value; the launcher passes a pointer to the mirror), or, where the
mirror sets ``scalar_parameters``, one parameter per leaf field, nested structs flattened (an entry
taking the fields as scalars, as the intranode and layout entries do; the launcher passes the mirror's
bytes as the parameter buffer). Each family is compiled (NVRTC, sm_90, default variant) and every
entry's parameter table is read from the cubin itself (:func:`tests.cubin.kernel_params`), under the
symbol the compile resolved the entry to. A mirror names its entries, by their qualified C++ names, with
``entry`` (one) or ``entries`` (several sharing its fields).
"""

import ctypes
import functools

import pytest

from cuep.kernels import FAMILIES
from cuep.kernels.launcher import KernelArgs

from .builds import compiled
from .cubin import entry_symbols, kernel_params


def named_entries(mirror) -> tuple[str, ...]:
    """The entries ``mirror`` launches: its ``entry`` and its ``entries``."""
    return ((mirror.entry,) if hasattr(mirror, "entry") else ()) + tuple(getattr(mirror, "entries", ()))


def mirrors_by_entry(family) -> dict[str, type]:
    """Each entry named by a mirror of ``family``'s ``ARGUMENT_STRUCTS``, with that mirror."""
    found = {}
    for mirror in getattr(FAMILIES[family], "ARGUMENT_STRUCTS", ()):
        for entry in named_entries(mirror):
            assert entry not in found, f"{family}: {entry} is named by {found[entry].__name__} and {mirror.__name__}"
            found[entry] = mirror
    return found


@functools.cache
def compiled_params(family) -> dict[str, list[tuple[int, int]]]:
    """``(offset, size)`` of each parameter of each kernel of ``family`` compiled for sm_90, under its entry
    name where the compile resolved an entry to it, else (a kernel no entry names) its symbol."""
    _, artifact = compiled(family)
    params = kernel_params(artifact.cubin)
    names = {symbol: entry for entry, symbol in artifact.symbols.items()}
    return {names.get(symbol, symbol): params[symbol] for symbol in entry_symbols(artifact.cubin)}


def leaf_params(mirror, base=0) -> list[tuple[int, int]]:
    """``(offset, size)`` of every leaf field of ``mirror`` in order, the fields of nested structs in place."""
    leaves = []
    for name, field_type, *_ in mirror._fields_:
        offset = base + getattr(mirror, name).offset
        if isinstance(field_type, type) and issubclass(field_type, ctypes.Structure):
            leaves += leaf_params(field_type, offset)
        else:
            leaves.append((offset, ctypes.sizeof(field_type)))
    return leaves


def first_difference(params, expected):
    return next((i for i, (a, b) in enumerate(zip(params, expected)) if a != b), min(len(params), len(expected)))


def check_mirror(entry, params, mirror):
    """``params`` (the compiled entry's) are the mirror's leaves if it sets ``scalar_parameters``, else its
    one struct by value; either way its bytes end where the last parameter does, so the buffer the
    launcher passes has the entry's size."""
    size = ctypes.sizeof(mirror)
    if getattr(mirror, "scalar_parameters", False):
        expected, form = leaf_params(mirror), "leaf fields"
    else:
        expected, form = [(0, size)], "one struct by value (scalar_parameters unset)"
    assert params == expected, (
        f"{entry}: its parameters (offset, size) are {params}; {mirror.__name__} gives {expected}, as {form} "
        f"(first difference at parameter {first_difference(params, expected)})")
    end = params[-1][0] + params[-1][1]
    assert size == end, f"{entry}: {mirror.__name__} is {size} bytes, its parameters end at byte {end}"


MIRRORED = [(family, entry, mirror) for family in sorted(FAMILIES) for entry, mirror in mirrors_by_entry(family).items()]


@pytest.mark.parametrize("family, entry, mirror", MIRRORED,
                         ids=[entry.replace("::", ".") for _, entry, _ in MIRRORED])
def test_mirror_matches_the_compiled_parameters(family, entry, mirror):
    params = compiled_params(family)
    assert entry in params, f"{mirror.__name__} names {entry}, which {family}'s sm_90 build does not have"
    check_mirror(entry, params[entry], mirror)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_entry_is_named_by_a_mirror(family):
    mirrored = mirrors_by_entry(family)
    unnamed = sorted(set(compiled_params(family)) - set(mirrored))
    assert not unnamed, (f"{family}: no mirror of cuep.kernels.{family}.ARGUMENT_STRUCTS names {unnamed} as its "
                         f"`entry` (or among its `entries`), so nothing checks what the launcher passes them")


def test_a_mirror_with_two_fields_swapped_is_caught():
    combine_args = FAMILIES["intranode"].CombineArgs
    fields = list(combine_args._fields_)
    names = [name for name, _ in fields]
    first, second = names.index("num_tokens"), names.index("x")
    fields[first], fields[second] = fields[second], fields[first]  # an int32 and a pointer, on the Python side

    entry = combine_args.entries[0]

    class Drifted(KernelArgs):
        cxx_name = combine_args.cxx_name
        entries = combine_args.entries
        scalar_parameters = combine_args.scalar_parameters
        _fields_ = fields

    assert ctypes.sizeof(Drifted) == ctypes.sizeof(combine_args)  # the size cannot tell; the offsets do
    params = compiled_params("intranode")[entry]
    check_mirror(entry, params, combine_args)
    with pytest.raises(AssertionError, match=r"cuep::intranode::combine: its parameters .* \(first difference at "
                                             r"parameter 7\)"):
        check_mirror(entry, params, Drifted)


def test_a_mirror_passed_the_wrong_way_is_caught():
    notify_args = FAMILIES["intranode"].NotifyArgs

    class ByValue(KernelArgs):  # the launcher would pass a pointer to it, where the entry takes scalars
        cxx_name = notify_args.cxx_name
        entry = notify_args.entry
        _fields_ = notify_args._fields_

    with pytest.raises(AssertionError, match=r"cuep::intranode::notify: .* as one struct by value"):
        check_mirror(notify_args.entry, compiled_params("intranode")[notify_args.entry], ByValue)
