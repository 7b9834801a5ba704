"""What keeps a first Buffer's compile short: only the families it uses, compiled at once, NVSHMEM's
collective headers left out -- none of it changing the generated code. No GPU needed."""

import logging
import os
import threading

import pytest

from cuep._log import jit_logger
from cuep.jit import build_all, compiler, library, toolchain
from cuep.kernels import FAMILIES, LOW_LATENCY_RECEIVE, buffer_specs

from .cubin import code_of

NVSHMEM_FAMILY = "barrier"  # the shortest NVSHMEM family: header cost, linking, little code


@pytest.mark.parametrize("nvl, rdma, families", [
    (1 << 20, 0, ["layout", "barrier", "intranode"]),
    (0, 1 << 20, ["layout", "barrier", "low_latency"]),
    (1 << 20, 1 << 20, ["layout", "barrier", "intranode", "low_latency"]),
    (0, 0, ["layout", "barrier"]),
])
def test_a_buffer_compiles_only_the_families_it_uses(nvl, rdma, families):
    specs = buffer_specs("sm_90", nvl, rdma)
    builds = [LOW_LATENCY_RECEIVE] if "low_latency" in families else []
    assert list(specs) == families + builds
    assert all(specs[family] == FAMILIES[family].spec("sm_90") for family in families)
    if builds:  # the hooks' receive-only build: its own spec, so its own compile and cache entry
        receive = specs[LOW_LATENCY_RECEIVE]
        assert receive == FAMILIES["low_latency"].spec("sm_90", receive_only=True)
        assert receive.family == "low_latency" and receive.name != specs["low_latency"].name
        assert receive.entries == specs["low_latency"].entries


def test_only_an_elastic_buffer_adds_the_elastic_family():
    assert list(buffer_specs("sm_90", 1 << 20, 0, elastic=True)) == ["layout", "barrier", "intranode", "elastic"]
    assert list(buffer_specs("sm_90", 1 << 20, 0, internode=True, elastic=True)) == [
        "layout", "barrier", "elastic", "internode"]
    assert "elastic" not in buffer_specs("sm_90", 1 << 20, 0, internode=True)


def test_nvshmem_families_leave_the_collective_headers_out():
    nvshmem = toolchain.nvshmem()
    guards = nvshmem.collective_guards()
    assert guards == tuple(guard for _, guard in toolchain.COLLECTIVE_HEADER_GUARDS)
    nvshmem_options = compiler.compile_options(FAMILIES[NVSHMEM_FAMILY].spec("sm_90"), nvshmem)
    assert all(f"{guard}=1" in nvshmem_options.describe_program() for guard in guards)  # so in the cache key
    plain_options = compiler.compile_options(FAMILIES["layout"].spec("sm_90"), None)
    assert plain_options.header_guards == ()


def test_a_release_with_other_guards_gets_the_full_headers(tmp_path):
    for header, guard in toolchain.COLLECTIVE_HEADER_GUARDS:
        path = tmp_path / "include" / header
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"#ifndef {guard}\n#define {guard}\n#endif\n")
    release = toolchain.Nvshmem(root=tmp_path, version=(9, 9, 9))
    assert len(release.collective_guards()) == len(toolchain.COLLECTIVE_HEADER_GUARDS)
    renamed = toolchain.COLLECTIVE_HEADER_GUARDS[-1]
    (tmp_path / "include" / renamed[0]).write_text("#ifndef SOMETHING_ELSE\n#define SOMETHING_ELSE\n#endif\n")
    toolchain._collective_guards.cache_clear()
    assert release.collective_guards() == ()


def _with_every_nvshmem_header(spec, nvshmem) -> bytes:
    """The compile as it was before the collective headers were left out."""
    from cuda.core import Linker, LinkerOptions, ObjectCode, Program, ProgramOptions
    options = compiler.compile_options(spec, nvshmem)
    kwargs = {**options.program_kwargs(), "define_macro": spec.macros()}
    source = (compiler.source_root() / f"{spec.family}.cu").read_text()
    obj = Program(source, "c++", options=ProgramOptions(**kwargs)).compile("cubin")
    linker = Linker(obj, ObjectCode.from_library(str(nvshmem.device_library)), options=LinkerOptions(arch=spec.arch))
    return bytes(linker.link("cubin").code)


def test_leaving_collectives_out_changes_no_code():
    nvshmem = toolchain.nvshmem()
    spec = FAMILIES[NVSHMEM_FAMILY].spec("sm_90")
    before = _with_every_nvshmem_header(spec, nvshmem)
    after = compiler.compile_spec(compiler.compile_options(spec, nvshmem), nvshmem).cubin
    assert any(name.startswith(".text._ZN4cuep") for name in code_of(after))  # a kernel of namespace cuep
    assert code_of(after) == code_of(before)


def test_concurrent_builds_match_serial_ones(cache_dir, monkeypatch):
    monkeypatch.setenv("CUEP_JIT_DISABLE_CACHE", "1")
    specs = [FAMILIES["layout"].spec("sm_80"), FAMILIES["layout"].spec("sm_90"), FAMILIES[NVSHMEM_FAMILY].spec("sm_90")]
    monkeypatch.setattr(library, "available_cores", lambda: len(specs))
    at_once = library._obtain_cubins(specs, None)
    one_by_one = [library._obtain_cubins([spec], None)[0] for spec in specs]
    assert at_once == one_by_one


class Lines(logging.Handler):
    """The INFO lines of one logger, whatever pytest's capture does with that logger."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_one_progress_line_per_compiled_family(cache_dir, monkeypatch):
    lines = Lines()
    monkeypatch.setattr(jit_logger(), "handlers", [*jit_logger().handlers, lines])
    specs = [FAMILIES["layout"].spec("sm_80"), FAMILIES["layout"].spec("sm_90")]
    library._obtain_cubins(specs, None)
    assert len(lines.lines) == len(specs)
    for spec in specs:
        assert any(line.startswith(f"cuep: compiling {spec.name} (first use") for line in lines.lines), spec.name
    lines.lines.clear()
    library._obtain_cubins(specs, None)
    assert lines.lines == [], "a warm start prints nothing"


def test_build_all_reports_every_spec(cache_dir):
    specs = [FAMILIES["layout"].spec("sm_80"), FAMILIES["layout"].spec("sm_90")]
    first = build_all(specs)
    assert all(entry is not None and (entry / "kernel.cubin").is_file() and seconds > 0 for entry, seconds in first)
    assert build_all(specs) == [(entry, 0.0) for entry, _ in first]


def test_the_first_failure_is_raised_after_every_job_ends(cache_dir, monkeypatch):
    from cuep.errors import CompileError
    specs = [FAMILIES["layout"].spec("sm_80"), FAMILIES["layout"].spec("sm_90")]
    finished = []

    def fail_sm80(job, announce):
        if job.spec.arch == "sm_80":
            raise CompileError("boom")
        finished.append(job.spec.name)
        return b"cubin"
    monkeypatch.setattr(library, "_produce", fail_sm80)
    with pytest.raises(CompileError, match="boom"):
        library._obtain_cubins(specs, None)
    assert finished == [specs[1].name]


def test_start_returns_while_the_compile_runs(cache_dir, monkeypatch):
    """Buffer() bootstraps NVSHMEM between start_libraries and its finish: the start must not wait."""
    import threading
    release, compiled = threading.Event(), []

    def slow_produce(job, announce):
        assert release.wait(30), "the test never released the compile"
        compiled.append(job.spec)
        return b"cubin"

    monkeypatch.setattr(library, "_produce", slow_produce)
    monkeypatch.setattr(library, "Library", lambda spec, cubin: (spec, cubin))
    spec = FAMILIES["layout"].spec("sm_90")
    library._loaded.pop(spec, None)
    finish = library.start_libraries([spec])
    assert compiled == []  # returned with the compile still held
    release.set()
    assert finish() == [(spec, b"cubin")] and compiled == [spec]
    library._loaded.pop(spec, None)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2,
                    reason="needs Linux thread affinity and at least two processors")
def test_compile_threads_spread_over_the_host_when_the_rank_is_bound_to_one_core():
    # mpirun binds each rank to a core; the compiling rank's threads must not share that one core.
    main_before = os.sched_getaffinity(0)
    one_core = {min(main_before)}
    os.sched_setaffinity(0, one_core)
    try:
        seen = {}

        def in_a_thread():
            library.widen_thread_affinity()
            seen["mask"] = os.sched_getaffinity(0)
        thread = threading.Thread(target=in_a_thread)
        thread.start()
        thread.join()
        assert len(seen["mask"]) > 1, seen
        assert os.sched_getaffinity(0) == one_core  # the rank's own thread keeps its binding
        assert library.available_cores() == os.cpu_count()
    finally:
        os.sched_setaffinity(0, main_before)
