"""One launch module per ``cuda_src`` family: its spec, its launch geometry, its argument order."""

from . import barrier, intranode, layout, low_latency

FAMILIES = {"barrier": barrier, "intranode": intranode, "layout": layout, "low_latency": low_latency}

__all__ = ["FAMILIES", "barrier", "intranode", "layout", "low_latency"]
