"""One launch module per ``cuda_src`` family: its spec, its launch geometry, its argument order."""

from . import barrier, intranode, layout

FAMILIES = {"barrier": barrier, "intranode": intranode, "layout": layout}

__all__ = ["FAMILIES", "barrier", "intranode", "layout"]
