"""Kernels a profiler finds by name, as DeepEP's: every entry is a C++ kernel in namespace
``cuep::<family>``, and what one call launches shows one kernel whose name holds the call's word.

DeepEP's test helper (``bench_kineto`` in DeepEP V1's ``tests/utils.py``) requires exactly one line of
torch's profiler table (names cut at 100 characters) to contain ``dispatch`` and one ``combine`` for a
low-latency dispatch + combine, and with receive hooks it tells the send and receive launches of one
kernel apart by ``'::dispatch'`` / ``'::combine'`` in the trace's event names. The profiler shows each
kernel's demangled name, one table line per name. Here every family is compiled for real (NVRTC +
nvJitLink, sm_90, no GPU), each entry taken at the symbol the compile resolved it to, as the JIT loads
it, and demangled by the C++ runtime's ``__cxa_demangle``, as the profiler demangles it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import re

import pytest

from cuep.kernels import FAMILIES, barrier, internode, intranode, low_latency

from .builds import compiled

PROFILER_NAME_WIDTH = 100  # bench_kineto's max_name_column_width
WORDS = ("dispatch", "combine")

# What each call launches, in order, as cuep/modes/{low_latency,intranode,internode}.py launch it. A hooked
# low-latency call launches its one kernel twice (send, then receive phase, the latter from the receive-only
# build, under the same name), an internode call its round's kernels once per round: one name each either way.
CALLS = {
    "low-latency dispatch + combine": [low_latency.DISPATCH_ENTRY, low_latency.COMBINE_ENTRY],
    "low-latency dispatch": [low_latency.DISPATCH_ENTRY],
    "low-latency combine": [low_latency.COMBINE_ENTRY],
    "intranode dispatch": [intranode.StageArgs.entry, barrier.ENTRY, intranode.NotifyArgs.entry,
                           intranode.RoutingArgs.entry, intranode.PushArgs.entry],
    "intranode cached dispatch": [intranode.PushArgs.entry],
    "intranode combine": [intranode.COMBINE_ENTRY],
    "intranode combine on few SMs (bulk pushes)": [intranode.COMBINE_BULK_ENTRY],
    "internode dispatch": [barrier.ENTRY, internode.ScanArgs.entry, internode.CountsArgs.entry,
                           internode.NotifyArgs.entry, internode.SendArgs.entry, internode.PullArgs.entry],
    "internode cached dispatch": [barrier.ENTRY, internode.SendArgs.entry, internode.PullArgs.entry],
    "internode combine": [barrier.ENTRY, internode.PushArgs.entry, internode.ForwardArgs.entry,
                          internode.ReduceArgs.entry],
}


@functools.cache
def _demangler():
    """``abi::__cxa_demangle`` and ``free``, or ``None`` where no C++ runtime can be loaded."""
    try:
        runtime = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
        demangle, free = runtime.__cxa_demangle, ctypes.CDLL(None).free
    except (OSError, AttributeError):
        return None
    demangle.restype, demangle.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                                                             ctypes.POINTER(ctypes.c_int)]
    free.argtypes = [ctypes.c_void_p]
    return demangle, free


def demangle(symbol: str) -> str:
    functions = _demangler()
    if functions is None:
        pytest.skip("no C++ runtime (libstdc++) to demangle kernel names with")
    demangle_c, free = functions
    status = ctypes.c_int()
    text = demangle_c(symbol.encode(), None, None, ctypes.byref(status))
    assert status.value == 0 and text, f"{symbol} does not demangle (status {status.value})"
    try:
        return ctypes.string_at(text).decode()
    finally:
        free(text)


def family_of(entry: str) -> str:
    """``cuep::<family>::<kernel>`` -> ``<family>``."""
    match = re.fullmatch(r"cuep::(\w+)::\w+(<.*>)?", entry)
    assert match, f"{entry} is not named cuep::<family>::<kernel>"
    return match.group(1)


def shown_name(entry: str) -> str:
    """The demangled name of ``entry``'s kernel, as a profiler shows it."""
    spec, artifact = compiled(family_of(entry))
    assert entry in artifact.symbols, f"{entry} is not an entry of {spec.name} (its entries: {list(artifact.symbols)})"
    return demangle(artifact.symbols[entry])


def test_demangling_works():
    symbol = "_ZN4cuep11low_latency8dispatchENS_12DispatchArgsE"
    assert demangle(symbol) == "cuep::low_latency::dispatch(cuep::DispatchArgs)"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_entry_is_a_kernel_named_in_its_familys_namespace(family):
    spec, artifact = compiled(family)
    assert list(artifact.symbols) == list(spec.entries) and len(set(artifact.symbols.values())) == len(spec.entries)
    for entry in spec.entries:
        assert family_of(entry) == family
        name = shown_name(entry)
        base = entry.split("<")[0]  # a template's demangled arguments read as the compiler spells the types
        assert re.match(rf"(void )?{re.escape(base)}[<(]", name), f"{entry} shows as {name}"


@pytest.mark.parametrize("call", list(CALLS))
def test_a_call_shows_one_kernel_named_after_it(call):
    launched = CALLS[call]
    lines = sorted({shown_name(entry)[:PROFILER_NAME_WIDTH] for entry in launched})  # a table line per name
    for word in WORDS:
        with_word = [line for line in lines if word in line]
        if word in call:
            assert len(with_word) == 1, f"{call}: a profile would show {len(with_word)} kernels with '{word}': {lines}"
            assert f"::{word}" in with_word[0], f"{call}: '::{word}' is not in {with_word[0]} (a hooked call's trace)"
        else:
            assert not with_word, f"{call}: a profile would show kernels with '{word}': {with_word}"


@pytest.mark.parametrize("family", ["low_latency", "intranode", "internode"])
def test_every_entry_of_a_mode_is_in_a_call(family):
    """A new kernel of a mode needs its place in CALLS, and with it a name that keeps the calls' rules."""
    in_calls = {entry for launched in CALLS.values() for entry in launched}
    assert set(compiled(family)[0].entries) <= in_calls
