"""Every ``CUEP_*`` environment variable, declared once, read when used.

Each variable has a name, a type, a default and one line of documentation. Code reads a variable
through :func:`get` at the moment it needs it (never at import), so a test or a user can change it
between calls. A malformed value raises ``ValueError`` naming the variable and what was expected.
``python -m cuep info`` prints this table with the values in force, and docs/environment.md copies it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


def _parse_bool(name: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{name}={text!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def _parse_seconds(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"{name}={text!r} must be a positive number of seconds")
    return value


def _parse_microseconds(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number of microseconds") from None
    if not value >= 0:
        raise ValueError(f"{name}={text!r} must be zero or a positive number of microseconds")
    return value


def _parse_positive_int(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a whole number") from None
    if value <= 0:
        raise ValueError(f"{name}={text!r} must be a positive whole number")
    return value


def _parse_path(name: str, text: str) -> Path:
    if not text.strip():
        raise ValueError(f"{name} is set but empty; unset it or give a directory")
    return Path(text).expanduser()


@dataclass(frozen=True)
class EnvVar:
    """One ``CUEP_*`` variable: its parser turns the raw string into the typed value."""

    name: str
    type_name: str
    default: Any
    doc: str
    parse: Callable[[str, str], Any]
    group: str


_TABLE: tuple[EnvVar, ...] = (
    EnvVar("CUEP_CACHE_DIR", "path", Path("~/.cache/cuep").expanduser(),
           "where compiled kernels are cached on disk", _parse_path, "jit"),
    EnvVar("CUEP_JIT_VERBOSE", "bool", False,
           "log compile options, NVRTC output, timings and cache hits", _parse_bool, "jit"),
    EnvVar("CUEP_JIT_DISABLE_CACHE", "bool", False,
           "compile every kernel in every process, never reading or writing the disk cache",
           _parse_bool, "jit"),
    EnvVar("CUEP_JIT_DUMP", "bool", False,
           "keep the PTX beside each cached cubin, for reading the generated code", _parse_bool, "jit"),
    EnvVar("CUEP_JIT_LINEINFO", "bool", False,
           "compile with line information, for profilers and compute-sanitizer", _parse_bool, "jit"),
    EnvVar("CUEP_COMPILE_TIMEOUT_S", "seconds", 900.0,
           "how long ranks wait for the rank that compiles for their node", _parse_seconds, "jit"),
    EnvVar("CUEP_AGGRESSIVE_PTX", "bool", False,
           "read data used once with ld.global.nc.L1::no_allocate.L2::256B (sm_90 only)",
           _parse_bool, "kernels"),
    EnvVar("CUEP_FORCE_FALLBACK", "bool", False,
           "build the Ampere fallback path even on Hopper (to test it there)", _parse_bool, "kernels"),
    EnvVar("CUEP_NETWORK_BUILD", "bool", False,
           "build the network families for ranks across hosts (IBGDA linked) even on one host (to test it there)",
           _parse_bool, "kernels"),
    EnvVar("CUEP_TRACE", "bool", False,
           "build the low-latency kernels with per-block phase timestamps (python -m cuep.bench --trace)",
           _parse_bool, "kernels"),
    EnvVar("CUEP_RANKS_PER_NODE", "int", None,
           "treat this many consecutive ranks as one node (e.g. 2 on a 4-GPU host: 2 nodes x 2 GPUs)",
           _parse_positive_int, "runtime"),
    EnvVar("CUEP_INTERNODE_PUTS", "bool", False,
           "across nodes, stage every row and put it through NVSHMEM even to a peer this GPU addresses (virtual "
           "nodes on one host, one NVLink domain), which otherwise gets it written straight into its buffer: the "
           "network's path, to test or time it on one host; read when a Buffer is made", _parse_bool, "runtime"),
    EnvVar("CUEP_SHARE_GPUS", "bool", False,
           "let ranks share GPUs round-robin when a host shows fewer GPUs than it runs ranks (tests, not speed)",
           _parse_bool, "runtime"),
    EnvVar("CUEP_TIMEOUT_S", "seconds", 100.0,
           "how long a kernel or the host waits for a peer before raising PeerTimeoutError",
           _parse_seconds, "runtime"),
    EnvVar("CUEP_REUSE_OUTPUTS", "bool", True,
           "hand a low-latency call's outputs out again once the caller lets go of them (docs/low-latency.md); "
           "0 allocates them anew for every call; read when a Buffer is made", _parse_bool, "runtime"),
    EnvVar("CUEP_COMBINE_SPLIT_US", "microseconds", 20.0,
           "how long a low-latency combine that also receives, or a hook's combine send captured into a CUDA graph, "
           "looks for a late source's top-k weights before it sends the rows of a token it holds several experts of "
           "one by one (more bytes, BF16 even with LogFMT, no wait; docs/low-latency.md names the tokens that wait "
           "instead); 0: one look; "
           "read when a Buffer is made",
           _parse_microseconds, "runtime"),
    EnvVar("CUEP_COMBINE_HOOK_SPLIT_US", "microseconds", 0.0,
           "the same look in an eager hook's combine send (return_recv_hook; 0: one look, no wait; one captured into "
           "a CUDA graph looks for CUEP_COMBINE_SPLIT_US): time for the weights of peers that started with this rank "
           "to land, not for a late one (docs/low-latency.md has the trade); read when a Buffer is made",
           _parse_microseconds, "runtime"),
)

_BY_NAME = {var.name: var for var in _TABLE}


def table() -> tuple[EnvVar, ...]:
    """All variables, in documentation order."""
    return _TABLE


def get(name: str) -> Any:
    """The typed value of ``name`` now: the parsed environment value, or the default when unset."""
    var = _BY_NAME[name]
    raw = os.environ.get(name)
    if raw is None:
        return var.default
    return var.parse(name, raw)
