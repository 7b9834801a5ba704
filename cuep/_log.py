"""The ``cuep`` loggers. A handler to stderr is attached on first use, never at import."""

from __future__ import annotations

import logging

from . import env


def jit_logger() -> logging.Logger:
    """``cuep.jit``: one line per cold compile; with ``CUEP_JIT_VERBOSE`` also options and cache hits."""
    logger = logging.getLogger("cuep.jit")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.DEBUG if env.get("CUEP_JIT_VERBOSE") else logging.INFO)
    return logger
