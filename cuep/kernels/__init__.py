"""One launch module per ``cuda_src`` family: its spec, its launch geometry, its argument order."""

from . import barrier, layout

FAMILIES = {"barrier": barrier, "layout": layout}

__all__ = ["FAMILIES", "barrier", "layout"]
