"""Cache keys and the on-disk store (no GPU, no CUDA calls except where a compile is the point)."""

import json
import logging
import os
import shutil

import pytest

from cuep.jit import cache, compiler, library
from cuep.kernels import FAMILIES

SPEC = FAMILIES["layout"].spec("sm_90")


def key_for(source_root, spec=SPEC):
    options = compiler.compile_options(spec, None)
    fields = cache.key_fields(spec, source_root, options.describe_program(), options.describe_linker(),
                              library._toolchain_fields(spec, None))
    return cache.cache_key(fields)


@pytest.fixture
def sources(tmp_path):
    copy = tmp_path / "cuda_src"
    shutil.copytree(compiler.source_root(), copy)
    return copy


def test_same_inputs_same_key(sources):
    assert key_for(sources) == key_for(sources)
    assert key_for(sources) == key_for(compiler.source_root())


def test_one_byte_of_a_header_changes_the_key(sources):
    before = key_for(sources)
    header = sources / "cuep" / "ptx.cuh"
    header.write_bytes(header.read_bytes() + b" ")
    assert key_for(sources) != before


def test_a_rewrite_of_the_same_size_changes_the_key(sources):
    # Keys are memoised per process by file size and modification time; a rewrite moves the time.
    before = key_for(sources)
    header = sources / "cuep" / "ptx.cuh"
    text = header.read_bytes()
    stat = header.stat()
    header.write_bytes(text[:-1] + (b"\n" if text[-1:] != b"\n" else b" "))
    os.utime(header, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert key_for(sources) != before


def test_spec_and_options_change_the_key(sources, monkeypatch):
    base = key_for(sources)
    assert key_for(sources, FAMILIES["layout"].spec("sm_90", force_fallback=True)) != base
    monkeypatch.setenv("CUEP_JIT_LINEINFO", "1")
    assert key_for(sources) != base


def test_fields_are_length_prefixed():
    assert cache.cache_key({"a": "bc"}) != cache.cache_key({"ab": "c"})


SYMBOLS = {entry: f"_Z_symbol_of_{i}" for i, entry in enumerate(SPEC.entries)}


def artifact(cubin=b"\x7fELF-fake", symbols=SYMBOLS):
    return cache.Artifact(cubin=cubin, source="// src", log="", seconds=0.1, symbols=symbols)


def test_store_then_load_round_trip(tmp_path):
    path = cache.store(tmp_path, SPEC, "k" * 64, {"schema": "1"}, artifact())
    assert path == cache.entry_dir(tmp_path, SPEC, "k" * 64)
    assert cache.load(tmp_path, SPEC, "k" * 64) == cache.Binary(b"\x7fELF-fake", SYMBOLS)
    assert json.loads((path / "meta.json").read_text())["spec"] == SPEC.name
    assert not any((tmp_path / "v1" / "tmp").iterdir()), "staging directory left behind"


def test_missing_entry_is_none(tmp_path):
    assert cache.load(tmp_path, SPEC, "0" * 64) is None


@pytest.mark.parametrize("damage", ["drop_meta", "corrupt_cubin", "bad_json", "no_symbols", "a_symbol_missing"])
def test_damaged_entry_is_discarded(tmp_path, damage, caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("cuep.jit"), "propagate", True)  # let caplog see it
    path = cache.store(tmp_path, SPEC, "d" * 64, {}, artifact())
    meta = json.loads((path / "meta.json").read_text())
    if damage == "drop_meta":
        (path / "meta.json").unlink()
    elif damage == "corrupt_cubin":
        (path / "kernel.cubin").write_bytes(b"garbage")
    elif damage == "bad_json":
        (path / "meta.json").write_text("{not json")
    elif damage == "no_symbols":  # as an entry written before meta.json held them
        del meta["symbols"]
        (path / "meta.json").write_text(json.dumps(meta))
    else:
        meta["symbols"].popitem()
        (path / "meta.json").write_text(json.dumps(meta))
    assert cache.load(tmp_path, SPEC, "d" * 64) is None
    assert not path.exists()
    assert "rm -rf" in caplog.text


def test_race_loser_keeps_the_winner(tmp_path):
    first = cache.store(tmp_path, SPEC, "r" * 64, {}, artifact(b"winner"))
    second = cache.store(tmp_path, SPEC, "r" * 64, {}, artifact(b"loser"))
    assert first == second and cache.load(tmp_path, SPEC, "r" * 64).cubin == b"winner"


def test_a_build_keeps_each_entrys_symbol_with_its_cubin(cache_dir):
    entry, _ = library.build(SPEC)
    meta = json.loads((entry / "meta.json").read_text())
    assert list(meta["symbols"]) == list(SPEC.entries)
    assert all(symbol.startswith("_ZN4cuep6layout") for symbol in meta["symbols"].values())  # mangled, namespaced
    assert cache.load(cache_dir, SPEC, meta["key"]) == cache.Binary((entry / "kernel.cubin").read_bytes(),
                                                                    meta["symbols"])


def test_the_entries_and_the_schema_are_in_the_key(sources, monkeypatch):
    from dataclasses import replace
    base = key_for(sources)
    assert key_for(sources, replace(SPEC, entries=SPEC.entries[:1])) != base
    monkeypatch.setattr(cache, "KEY_SCHEMA_VERSION", cache.KEY_SCHEMA_VERSION - 1)
    assert key_for(sources) != base


def test_unreadable_key_input_compiles_without_cache(cache_dir, monkeypatch, caplog):
    def unreadable(*args, **kwargs):
        raise cache.UncacheableError("cannot read a header")
    monkeypatch.setattr(cache, "key_fields", unreadable)
    entry, seconds = library.build(SPEC)
    assert entry is None and seconds > 0
    assert not cache_dir.exists() or not any(cache_dir.rglob("kernel.cubin"))


def test_disable_cache_writes_nothing(cache_dir, monkeypatch):
    monkeypatch.setenv("CUEP_JIT_DISABLE_CACHE", "1")
    assert library.build(SPEC)[0] is None
    assert not cache_dir.exists()


def test_leaving_nvshmem_headers_out_is_in_the_key(sources):
    from dataclasses import replace

    from cuep.jit import toolchain
    nvshmem = toolchain.nvshmem()
    spec = FAMILIES["barrier"].spec("sm_90")
    trimmed = compiler.compile_options(spec, nvshmem)
    assert trimmed.header_guards, "this NVSHMEM's collective headers should be left out"
    full = replace(trimmed, header_guards=())

    def key(options):
        return cache.cache_key(cache.key_fields(spec, sources, options.describe_program(), options.describe_linker(),
                                                library._toolchain_fields(spec, nvshmem)))
    assert key(trimmed) != key(full)
