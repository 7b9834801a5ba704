"""Every kernel family compiles for sm_80 and sm_90, in every variant, through the real NVRTC (+ nvJitLink
with libnvshmem_device.a for NVSHMEM families). No GPU needed."""

import pytest

from cuep.jit import build, compiler, toolchain
from cuep.kernels import FAMILIES

from .builds import VARIANTS, compiled
from .cubin import entry_symbols, function_resources

ELF_MAGIC = b"\x7fELF"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_compiles(family, arch, variant):
    spec, artifact = compiled(family, arch, variant)
    assert artifact.cubin.startswith(ELF_MAGIC), spec.name
    # Every entry of the spec resolves to its own kernel, and the build has no kernel besides them.
    assert spec.entries and list(artifact.symbols) == list(spec.entries), spec.name
    assert entry_symbols(artifact.cubin) == set(artifact.symbols.values()), spec.name
    if spec.uses_nvshmem:  # linked: the NVSHMEM device state the host library initialises is present
        assert b"nvshmemi_device_state" in artifact.cubin, spec.name


def test_variants_resolve_per_arch():
    assert FAMILIES["layout"].spec("sm_90", **VARIANTS["default"]).sm90_features
    fallback = FAMILIES["layout"].spec("sm_90", **VARIANTS["fallback"])
    assert not fallback.sm90_features and fallback.software_fp8 and fallback.name.endswith("sm_90.fallback")
    ampere = FAMILIES["layout"].spec("sm_80", **VARIANTS["aggressive_ptx"])
    assert not ampere.sm90_features and not ampere.aggressive_ptx and ampere.software_fp8
    ada = FAMILIES["layout"].spec("sm_89", **VARIANTS["default"])
    assert not ada.sm90_features and not ada.software_fp8


def test_aggressive_ptx_switch_changes_the_loads():
    _, default = compiled("layout", "sm_90", "default", keep_ptx=True)
    _, aggressive = compiled("layout", "sm_90", "aggressive_ptx", keep_ptx=True)
    assert "L1::no_allocate" in aggressive.ptx and "ld.volatile.global" not in aggressive.ptx
    assert "L1::no_allocate" not in default.ptx and "ld.volatile.global" in default.ptx


def test_bulk_copies_only_on_the_hopper_path():
    """The probe's bulk (TMA) copy is built on the Hopper path only, with no stub entry elsewhere; the
    intranode combine's bulk pushes too, with no trap left in the other builds."""
    from cuep.kernels import probe  # a benchmark-only family, compiled here whether or not it is registered

    def build_probe(arch, variant):
        spec = probe.spec(arch, **VARIANTS[variant])
        return compiler.compile_spec(compiler.compile_options(spec, None), None, keep_ptx=True)

    hopper = build_probe("sm_90", "default")
    assert "cp.async.bulk.shared::cluster.global" in hopper.ptx and "mbarrier.try_wait" in hopper.ptx
    assert list(hopper.symbols) == [probe.COPY_ENTRY, probe.BULK_ENTRY]
    for arch, variant in (("sm_90", "fallback"), ("sm_80", "default")):
        other = build_probe(arch, variant)
        assert "cp.async.bulk" not in other.ptx and "trap;" not in other.ptx, (arch, variant)
        assert list(other.symbols) == [probe.COPY_ENTRY], (arch, variant)
        assert entry_symbols(other.cubin) == {other.symbols[probe.COPY_ENTRY]}, (arch, variant)
    _, intranode = compiled("intranode", "sm_90", "default", keep_ptx=True)
    assert "cp.async.bulk.global.shared::cta" in intranode.ptx and "mbarrier.try_wait" in intranode.ptx
    for arch, variant in (("sm_90", "fallback"), ("sm_80", "default")):
        _, other = compiled("intranode", arch, variant, keep_ptx=True)
        assert "cp.async.bulk" not in other.ptx and "mbarrier" not in other.ptx and "trap;" not in other.ptx, \
            (arch, variant)


@pytest.mark.parametrize("arch", ["sm_70", "sm90", "gfx90a"])
def test_unsupported_arch_is_refused(arch):
    with pytest.raises(ValueError, match="arch"):
        FAMILIES["layout"].spec(arch)


def test_build_caches_and_cli(cache_dir, capsys):
    from cuep.cli import main
    spec = FAMILIES["layout"].spec("sm_80")
    entry, seconds = build(spec)
    assert seconds > 0 and (entry / "kernel.cubin").is_file() and (entry / "meta.json").is_file()
    assert build(spec) == (entry, 0.0)
    assert main(["compile", "--arch", "sm_80"]) == 0
    out = capsys.readouterr().out
    assert "layout" in out
    assert FAMILIES["low_latency"].spec("sm_80", receive_only=True).name in out  # the hooks' build too


def test_compile_error_names_spec_and_keeps_source(cache_dir, tmp_path, monkeypatch):
    from cuep.errors import CompileError
    from cuep.jit import library
    broken = tmp_path / "src"
    broken.mkdir()
    (broken / "layout.cu").write_text('extern "C" __global__ void k() { this is not C++; }\n')
    monkeypatch.setattr(compiler, "source_root", lambda: broken)
    monkeypatch.setattr(library, "source_root", lambda: broken)
    with pytest.raises(CompileError) as info:
        build(FAMILIES["layout"].spec("sm_90"))
    message = str(info.value)
    assert "layout" in message and "source kept at" in message
    kept = cache_dir / "v1" / "failed"
    assert any(p.name == "source.cu" for p in kept.rglob("*"))


def test_trace_switch_builds_the_stamping_variant(monkeypatch):
    plain = FAMILIES["low_latency"].spec("sm_90")
    monkeypatch.setenv("CUEP_TRACE", "1")
    traced = FAMILIES["low_latency"].spec("sm_90")
    assert ("trace", "1") in traced.defines and traced.name != plain.name
    nvshmem = toolchain.nvshmem()
    stamps = [compiler.compile_spec(compiler.compile_options(spec, nvshmem), nvshmem, keep_ptx=True).ptx
              .count("%globaltimer") for spec in (plain, traced)]
    assert stamps[1] > stamps[0]  # the plain build reads the timer for deadlines only


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_low_latency_receive_only_build_has_the_same_kernels_with_the_receive_alone(variant):
    """The hooks' build (``spec(receive_only=True)``) holds the family's kernels under the same symbols, so
    that a profile shows one dispatch and one combine as DeepEP's do, with the sends compiled out: each kernel
    at most half the whole build's code, none with a stack frame."""
    from .cubin import code_of
    whole_spec, whole = compiled("low_latency", "sm_90", variant)
    spec, receive = compiled("low_latency", "sm_90", variant, receive_only=True)
    assert ("receive_only", "1") in spec.defines and spec.name != whole_spec.name
    assert receive.symbols == whole.symbols
    whole_code, receive_code = code_of(whole.cubin), code_of(receive.cubin)
    resources = function_resources(receive.cubin)
    for symbol in receive.symbols.values():
        assert len(receive_code[f".text.{symbol}"]) * 2 < len(whole_code[f".text.{symbol}"]), symbol
        assert resources[symbol][1] == 0, f"{symbol}: a stack frame of {resources[symbol][1]} bytes"


def test_combine_pushes_in_bulk_on_few_sms_of_the_hopper_path_only():
    """combine_launch picks combine_bulk, with its shared memory, on at most BULK_PUSH_MAX_BLOCKS SMs of a Hopper
    build (which has the entry), and the warps' combine otherwise; the size fits a Hopper block's opt-in
    limit (227 KiB), and the compiled kernel's static_assert holds it to the device's layout."""
    from cuep.kernels import intranode
    most = intranode.BULK_PUSH_MAX_BLOCKS
    for grid in (1, 20, most):
        assert intranode.combine_launch(True, grid) == (intranode.COMBINE_BULK_ENTRY, intranode.BULK_PUSH_SHARED_BYTES)
        assert intranode.combine_launch(False, grid) == (intranode.COMBINE_ENTRY, 0)
    for grid in (most + 1, 132):
        assert intranode.combine_launch(True, grid) == (intranode.COMBINE_ENTRY, 0)
    assert 48 * 1024 < intranode.BULK_PUSH_SHARED_BYTES + 2048 <= 227 * 1024
    assert intranode.COMBINE_BULK_ENTRY in intranode.spec("sm_90").entries
    assert intranode.COMBINE_BULK_ENTRY not in intranode.spec("sm_80").entries
    assert intranode.COMBINE_BULK_ENTRY not in intranode.spec("sm_90", force_fallback=True).entries


@pytest.mark.parametrize("across_hosts", [False, True], ids=["one_host", "across_hosts"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_internode_kernels_keep_their_copies_in_registers(variant, across_hosts):
    """The internode kernels hold many bytes a lane in flight (the dispatch's row copies, kRowCopyBatch vectors;
    the combine's sums) in registers, up to the 128 a thread of their 512-thread blocks may take: none spills
    into a stack frame, where each step of a copy would wait on local memory as well."""
    spec, artifact = compiled("internode", "sm_90", variant, across_hosts=across_hosts)
    resources = function_resources(artifact.cubin)
    entries = entry_symbols(artifact.cubin)
    assert {name for name in entries if "internode4send" in name or "internode8dispatch" in name}, entries
    for name in entries:
        registers, frame = resources[name]
        assert registers <= 128 and frame == 0, f"{spec.name}: {name} takes {registers} registers, {frame} bytes of frame"
