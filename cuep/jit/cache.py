"""Cache keys and the on-disk store of compiled kernels. No CUDA calls: CPU tests cover all of it.

Key: SHA-256 over labelled, length-prefixed fields (see :func:`key_fields`), so no field can bleed
into its neighbour and a new field changes every key. A key input that cannot be read raises
:class:`UncacheableError`; the caller then compiles without the cache rather than drop the field.

Store: ``<root>/v1/<spec.name>.<key[:16]>/`` holding ``kernel.cubin``, ``source.cu`` (the exact
text compiled), optionally ``kernel.ptx``, and ``meta.json`` written last as the commit marker; it
also holds the symbol of each of the spec's entries (:attr:`Binary.symbols`), which the cubin alone
does not tell. An entry is built in ``<root>/v1/tmp/<uuid>/`` and renamed into place; the loser of
a race deletes its copy. :func:`load` never raises for a missing, partial or corrupt entry: it
returns ``None`` (after one warning and removal when the entry is corrupt) and the caller rebuilds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__
from .spec import KernelSpec

KEY_SCHEMA_VERSION = 2  # 2: meta.json holds the entries' symbols
STORE_LAYOUT = "v1"
_CUBIN, _SOURCE, _PTX, _META = "kernel.cubin", "source.cu", "kernel.ptx", "meta.json"

logger = logging.getLogger("cuep.jit")


class UncacheableError(RuntimeError):
    """An input of the key could not be read; the kernel must be compiled without the cache."""


# Digests already taken in this process, by what ``os.stat`` says of the files read: every family's key
# hashes the same source tree and NVSHMEM device library, which would otherwise be read once per family
# on every start.
_digests: dict[tuple, str] = {}


def _signature(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def digest_file(path: Path) -> str:
    try:
        memo = ("file", str(path), _signature(path))
        if memo not in _digests:
            _digests[memo] = hashlib.sha256(path.read_bytes()).hexdigest()
        return _digests[memo]
    except OSError as exc:
        raise UncacheableError(f"cannot read {path} for the cache key: {exc}") from exc


def digest_tree(root: Path) -> str:
    """Digest of every file under ``root``: relative path and bytes, in sorted order."""
    paths = sorted(p for p in root.rglob("*") if p.is_file())
    memo = ("tree", str(root), tuple((p.relative_to(root).as_posix(), *_signature(p)) for p in paths))
    if memo not in _digests:
        h = hashlib.sha256()
        for path in paths:
            for part in (path.relative_to(root).as_posix().encode(), path.read_bytes()):
                h.update(len(part).to_bytes(8, "little"))
                h.update(part)
        _digests[memo] = h.hexdigest()
    return _digests[memo]


def key_fields(spec: KernelSpec, source_root: Path, program_options: str, linker_options: str,
               toolchain_fields: dict[str, str]) -> dict[str, str]:
    """Every input that can change the compiled bytes, as labelled strings."""
    try:
        sources = digest_tree(source_root)
    except OSError as exc:
        raise UncacheableError(f"cannot read the kernel sources under {source_root}: {exc}") from exc
    return {
        "schema": str(KEY_SCHEMA_VERSION),
        "cuep": __version__,
        "sources": sources,
        "spec": repr(spec),
        "program_options": program_options,
        "linker_options": linker_options,
        **toolchain_fields,
    }


def cache_key(fields: dict[str, str]) -> str:
    h = hashlib.sha256()
    for label, value in fields.items():
        for part in (label.encode(), value.encode()):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
    return h.hexdigest()


@dataclass(frozen=True)
class Binary:
    """What a library is loaded from: the cubin, and the symbol in it of each entry of the spec (its
    qualified C++ name -> the name NVRTC lowered it to, e.g. ``cuep::low_latency::dispatch`` ->
    ``_ZN4cuep11low_latency8dispatchENS_12DispatchArgsE``)."""

    cubin: bytes
    symbols: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Artifact:
    """What a compile produces and the cache stores."""

    cubin: bytes
    source: str
    log: str
    seconds: float
    ptx: str | None = None
    symbols: dict[str, str] = field(default_factory=dict)  # as Binary.symbols

    @property
    def binary(self) -> Binary:
        return Binary(self.cubin, self.symbols)


def entry_dir(root: Path, spec: KernelSpec, key: str) -> Path:
    return root / STORE_LAYOUT / f"{spec.name}.{key[:16]}"


def _discard(path: Path, reason: str) -> None:
    logger.warning("cuep: discarding cache entry %s (%s); it will be rebuilt. "
                   "To clear the whole cache: rm -rf %s", path, reason, path.parent)
    shutil.rmtree(path, ignore_errors=True)


def _symbols(meta: dict, spec: KernelSpec) -> dict[str, str] | None:
    """The entries' symbols that ``meta`` holds, or ``None`` unless it holds exactly the spec's, as text."""
    symbols = meta.get("symbols")
    if not isinstance(symbols, dict) or sorted(symbols) != sorted(spec.entries):
        return None
    return symbols if all(isinstance(s, str) and s for s in symbols.values()) else None


def load(root: Path, spec: KernelSpec, key: str) -> Binary | None:
    """The cached cubin for ``key`` with its entries' symbols, or ``None`` when there is no complete,
    matching entry."""
    path = entry_dir(root, spec, key)
    if not path.is_dir():
        return None
    try:
        meta = json.loads((path / _META).read_text())
        cubin = (path / _CUBIN).read_bytes()
    except FileNotFoundError:
        _discard(path, "incomplete: no meta.json or kernel.cubin")
        return None
    except (OSError, ValueError) as exc:
        _discard(path, f"unreadable: {exc}")
        return None
    if meta.get("key") != key or meta.get("cubin_sha256") != hashlib.sha256(cubin).hexdigest():
        _discard(path, "its key or cubin digest disagrees with meta.json")
        return None
    symbols = _symbols(meta, spec)
    if symbols is None:
        _discard(path, "meta.json does not name the symbol of each of its entries")
        return None
    return Binary(cubin, symbols)


def store(root: Path, spec: KernelSpec, key: str, fields: dict[str, str], artifact: Artifact) -> Path:
    """Write an entry atomically; if another process won the race, keep theirs."""
    final = entry_dir(root, spec, key)
    staging = root / STORE_LAYOUT / "tmp" / uuid.uuid4().hex
    staging.mkdir(parents=True)
    try:
        (staging / _CUBIN).write_bytes(artifact.cubin)
        (staging / _SOURCE).write_text(artifact.source)
        if artifact.ptx is not None:
            (staging / _PTX).write_text(artifact.ptx)
        meta = {"key": key, "spec": spec.name, "fields": fields, "log": artifact.log,
                "seconds": round(artifact.seconds, 3), "symbols": artifact.symbols,
                "cubin_sha256": hashlib.sha256(artifact.cubin).hexdigest()}
        (staging / _META).write_text(json.dumps(meta, indent=1, sort_keys=True))
        try:
            os.rename(staging, final)
        except OSError:
            if not (final / _META).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
