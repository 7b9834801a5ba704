"""Every kernel entry's parameters match their ctypes mirror (a KernelArgs), which the launcher hands to
the driver as the entry's parameter bytes.

An entry takes either one struct by value (``const cuep::<Name> args``) or that struct's fields as
scalar parameters, in order (``args_a_b`` is field ``args.a.b``), where one struct parameter made NVRTC
compile the hot loops otherwise. Both are checked on a CPU machine, so a mirror that drifts fails here
rather than as garbage arguments on a GPU:

- each mirrored C++ struct's size and field offsets, by the compiler: the family's source is compiled
  (NVRTC, sm_90, no link) with the mirrors' ``static_assert``\\ s appended;
- each scalar entry's parameter names against its mirror's fields, in the source (their offsets and sizes
  against the compiled kernels' own parameter tables: ``tests/test_kernel_params.py``).
"""

import ctypes
import re

import pytest

from cuep.errors import CompileError
from cuep.jit import compiler, toolchain
from cuep.kernels import FAMILIES, common, status
from cuep.kernels.launcher import KernelArgs


WITH_STRUCTS = sorted(family for family, module in FAMILIES.items() if hasattr(module, "ARGUMENT_STRUCTS"))
# `__global__ void [__launch_bounds__(...)] name(parameters)`, in namespace cuep::<family> (as the entries are:
# tests/test_kernel_names.py checks the compiled names)
ENTRY = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)")
STRUCT_PARAMETER = re.compile(r"const\s+(?:__grid_constant__\s+)?(?:cuep::)?(\w+)\s+\w+")


def variant(family):
    return FAMILIES[family].spec("sm_90", force_fallback=False, aggressive_ptx=False)


def check_layouts(family, structs):
    spec = variant(family)
    nvshmem = toolchain.nvshmem() if spec.uses_nvshmem else None
    compiler.check_compiles(compiler.compile_options(spec, nvshmem),
                            "".join(struct.layout_asserts() for struct in structs))


def mirrored_structs(family):
    return [s for s in FAMILIES[family].ARGUMENT_STRUCTS if getattr(s, "cxx_name", None)]


@pytest.mark.parametrize("family", WITH_STRUCTS)
def test_mirrors_match_the_cxx_structs(family):
    structs = FAMILIES[family].ARGUMENT_STRUCTS
    assert structs and all(issubclass(s, KernelArgs) for s in structs), family
    check_layouts(family, mirrored_structs(family))


def test_a_mirror_that_drifted_fails_to_compile():
    layout_args = FAMILIES["layout"].LayoutArgs
    names = [name for name, _ in layout_args._fields_]
    first, second = names.index("num_tokens_per_expert"), names.index("num_tokens_per_rank")
    fields = list(layout_args._fields_)
    fields[first], fields[second] = fields[second], fields[first]  # two pointers swapped on the Python side

    class Drifted(KernelArgs):
        cxx_name = layout_args.cxx_name
        _fields_ = fields

    assert ctypes.sizeof(Drifted) == ctypes.sizeof(layout_args)  # the size cannot tell; the offsets do
    with pytest.raises(CompileError, match=r"LayoutArgs::num_tokens_per_expert: offset differs"):
        check_layouts("layout", [Drifted])


def entries(family):
    """``{cuep::<family>::name: [parameter declarations]}`` of every ``__global__`` function in
    ``cuda_src/<family>.cu``."""
    source = re.sub(r"//[^\n]*", "", (compiler.source_root() / f"{family}.cu").read_text())
    return {f"cuep::{family}::{name}": [p.strip() for p in parameters.split(",") if p.strip()]
            for name, parameters in ENTRY.findall(source)}


def mirror_of(family, entry):
    """The KernelArgs naming ``entry`` (``entry`` or ``entries``) among the family's ARGUMENT_STRUCTS."""
    found = [s for s in getattr(FAMILIES[family], "ARGUMENT_STRUCTS", ())
             if entry == getattr(s, "entry", None) or entry in getattr(s, "entries", ())]
    assert len(found) == 1, f"{family}.cu: {entry} is named by {len(found)} mirrors (want one)"
    return found[0]


def leaves(mirror, path="args", base=0):
    """``(parameter name, offset, size)`` of every scalar in ``mirror``, nested structs flattened."""
    for name, kind in mirror._fields_:
        offset = base + getattr(mirror, name).offset
        if isinstance(kind, type) and issubclass(kind, ctypes.Structure):
            yield from leaves(kind, f"{path}_{name}", offset)
        else:
            yield f"{path}_{name}", offset, ctypes.sizeof(kind)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_entry_takes_its_mirror(family):
    found = entries(family)
    assert found, f"no __global__ entry found in {family}.cu"
    names = {s.cxx_name for s in mirrored_structs(family)} if family in WITH_STRUCTS else set()
    for entry, parameters in found.items():
        by_value = len(parameters) == 1 and STRUCT_PARAMETER.fullmatch(parameters[0])
        if by_value:
            assert by_value.group(1) in names, f"{family}.cu: {entry} takes {by_value.group(1)}, mirrored by no " \
                                               f"struct of cuep.kernels.{family}.ARGUMENT_STRUCTS"
            assert not any(s.scalar_parameters for s in mirrored_structs(family) if s.cxx_name == by_value.group(1))
            continue
        declared = [re.findall(r"\w+", p)[-1] for p in parameters]
        mirrored = [name for name, _, _ in leaves(mirror_of(family, entry))]
        assert declared == mirrored, f"{family}.cu: {entry}'s parameters are not its mirror's fields in order"
        assert mirror_of(family, entry).scalar_parameters, \
            f"cuep.kernels.{family}: the mirror of {entry} must set scalar_parameters = True (the launcher passes it " \
            f"as a parameter buffer)"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_sees_the_shared_constants(family):
    macros = dict(FAMILIES[family].spec("sm_90").macros())
    for name, value in common.CONSTANTS.items():
        assert macros.get(f"CUEP_{name.upper()}") == str(value), (family, name)


def test_phase_codes_have_no_holes_and_a_name_each():
    codes = sorted(int(phase) for phase in status.Phase)
    assert codes == list(range(1, len(codes) + 1))
    assert set(status.PHASE_NAMES) == set(status.Phase)
    words = [status.TIMED_OUT, status.PEER, status.PHASE, status.OVERFLOW, status.BAD_EXPERT_IDS, status.ROUND_TOKENS,
             status.SELF_MASKED, status.BAD_EXPERT_ID_LOW, status.BAD_EXPERT_ID_HIGH, status.BAD_EXPERT_LIMIT,
             status.CALL_ORDER, status.CALL_ORDER_CALL, status.CALL_ORDER_PEER]
    assert sorted(words) == list(range(status.STATUS_WORDS))
    rules = sorted(int(rule) for rule in status.CallOrderRule)
    assert rules == list(range(1, len(rules) + 1)) and set(status.CALL_ORDER_RULES) == set(status.CallOrderRule)
    calls = sorted(int(call) for call in status.BadIdsCall)
    assert calls == list(range(1, len(calls) + 1)) and set(status.BAD_IDS_CALL_NAMES) == set(status.BadIdsCall)
