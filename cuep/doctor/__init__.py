"""``python -m cuep doctor [--transport ibgda|ibrc|ucx|libfabric]``: can NVSHMEM's transports work here?

Checks this host for what a transport needs (every transport when none is named): the NVIDIA driver and
its parameters, GPUDirect RDMA (nvidia_peermem or dma-buf), the RDMA NICs and their ports, GDRCopy and
the memlock limit, the installed NVSHMEM and the transports it ships, GPU-NIC affinity and GPU peer
access, and the ``NVSHMEM_*`` and ``CUEP_*`` variables in force. One line per check: ok, warn, fail or
unchecked, what it found, and what to change. Needs no GPU.

The same checks explain a failed NVSHMEM start (:func:`start_error_message`), so every rank's
:class:`~cuep.errors.CuepError` names the likely causes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .checks import (FAIL, OK, TRANSPORTS, UNCHECKED, WARN, Check, can_work, explicit_transport,
                     host_checks, requested_transport, transport_checks, transport_settings)
from .host import HostFacts, read_host

_MARKS = {OK: "ok", WARN: "warn", FAIL: "FAIL", UNCHECKED: "??"}
# The checks whose failure means a transport is absent, not merely misconfigured.
_TRANSPORT_PRESENCE = ("NVSHMEM plugin", "NICs")


def _line(check: Check) -> str:
    text = f"  [{_MARKS[check.verdict]:>4s}] {check.name}: {check.found}"
    return text + (f"\n         -> {check.change}" if check.change and check.verdict != OK else "")


def report(facts: HostFacts, transports: tuple[str, ...], environ: Mapping[str, str]) -> tuple[str, int]:
    """The doctor's report on ``transports`` and its exit status: 1 when the host cannot start NVSHMEM, or
    when a transport cannot work here that was named (``--transport``) or, with none named, that the
    environment asks for (``NVSHMEM_REMOTE_TRANSPORT``, ``NVSHMEM_IB_ENABLE_IBGDA``); else 0."""
    asked = transports[0] if len(transports) == 1 else explicit_transport(environ)
    lines = ["host (every job):"]
    host = host_checks(facts)
    lines += [_line(check) for check in host]
    host_works = can_work(host)
    failed = not host_works
    verdicts = []
    for transport in transports:
        checks = transport_checks(facts, transport)
        works = can_work(checks)
        lines.append(f"{transport} (across hosts):")
        lines += [_line(check) for check in checks]
        verdicts.append(f"{transport}: {'can work here' if works else 'cannot work here'}")
        failed |= transport == asked and not works
    lines.append(f"transport asked for: {transport_settings(environ)} -> {requested_transport(environ)}")
    lines.append("verdict: " + "; ".join(["one host: " + ("can work" if host_works else "cannot work"),
                                          *verdicts]))
    unchecked = [check.name for check in host if check.verdict == UNCHECKED]
    if unchecked:
        lines.append(f"not checked here: {', '.join(unchecked)}")
    return "\n".join(lines), int(failed)


def absent_transport_causes(facts: HostFacts, transport: str) -> list[Check]:
    """The failing checks that say ``transport`` cannot exist on this host at all: the installed NVSHMEM
    ships no plugin for it, or there is no NIC it can use. (A driver parameter or a missing GDRCopy may
    still let it start, so those are left to NVSHMEM.)"""
    return [check for check in transport_checks(facts, transport)
            if check.name in _TRANSPORT_PRESENCE and check.verdict == FAIL]


def absent_transport_message(rank: int, environ: Mapping[str, str], causes_by_rank: Mapping[int, str]) -> str:
    """What every rank says when the environment asks for a network transport that some rank's host
    cannot give (``causes_by_rank``: that rank's :func:`describe` of :func:`absent_transport_causes`)."""
    asked = requested_transport(environ)
    ranks_by_causes: dict[str, list[int]] = {}
    for other, causes in sorted(causes_by_rank.items()):
        ranks_by_causes.setdefault(causes, []).append(other)
    where = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {causes}"
                      for causes, ranks in ranks_by_causes.items())
    return (f"rank {rank}: NVSHMEM was not started: {transport_settings(environ)} asks for the {asked} transport, "
            f"which cannot work here ({where}). A job on a single host needs no NIC: set "
            f"NVSHMEM_REMOTE_TRANSPORT=none and leave NVSHMEM_IB_ENABLE_IBGDA unset. Run "
            f"`python -m cuep doctor --transport {asked}` for every check.")


def describe(checks: list[Check]) -> str:
    """Checks in one line: each one's name, what it found and what to change."""
    return "; ".join(f"{c.name}: {c.found}" + (f" ({c.change})" if c.change else "") for c in checks)


def start_error_message(rank: int, error: BaseException, environ: Mapping[str, str],
                        facts: HostFacts | None = None) -> str:
    """What a rank says when NVSHMEM fails to start: the error, the transport asked for, and the failing
    (else the warning) checks on this host, of that transport too where the environment named one, with
    ``python -m cuep doctor`` to run."""
    asked = explicit_transport(environ)
    facts = read_host(environ=environ) if facts is None else facts
    checks = host_checks(facts)
    if asked in TRANSPORTS:
        checks += transport_checks(facts, asked)
    causes = [c for c in checks if c.verdict == FAIL] or [c for c in checks if c.verdict == WARN]
    if causes:
        likely = f"Likely causes on this host: {describe(causes)}."
    else:
        likely = "The doctor finds nothing wrong with this host; NVSHMEM_DEBUG=INFO prints NVSHMEM's own reason."
    if asked is None:
        tried = "so NVSHMEM used its defaults (P2P on one host, ibrc to other hosts where a NIC is up)"
    else:
        tried = f"so NVSHMEM tried the {asked} transport"
    doctor = "python -m cuep doctor" + (f" --transport {asked}" if asked in TRANSPORTS else "")
    single_host = " A job on a single host needs no NIC: NVSHMEM_REMOTE_TRANSPORT=none." if asked in TRANSPORTS else ""
    return (f"rank {rank}: NVSHMEM could not start ({type(error).__name__}: {error}) with "
            f"{transport_settings(environ)}, {tried}. {likely} Run `{doctor}` for every check.{single_host}")


def main(transport: str | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Print the report (on ``transport``, or on every transport) and return the exit status."""
    environ = os.environ if environ is None else environ
    text, status = report(read_host(environ=environ), (transport,) if transport else TRANSPORTS, environ)
    print(text)
    return status


__all__ = ["Check", "HostFacts", "TRANSPORTS", "absent_transport_causes", "absent_transport_message", "describe",
           "explicit_transport", "main", "read_host", "report", "requested_transport", "start_error_message"]
