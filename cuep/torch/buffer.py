"""DeepEP V1's ``deep_ep.buffer`` path: :class:`Buffer` and the names DeepEP's module imports there.

Its imports are absolute, so that this module is right also when Python loads it as ``deep_ep.buffer`` for
a process that made ``cuep.torch`` its ``deep_ep`` (``sys.modules["deep_ep"] = cuep.torch``): the names
are the same objects as ``cuep.torch``'s, not a second copy of the classes.
"""

from cuep.config import Config
from cuep.torch._buffer import Buffer, DispatchHandle, LowLatencyHandle
from cuep.torch.event import EventHandle, EventOverlap
from cuep.torch.utils import check_nvlink_connections

__all__ = ["Buffer", "Config", "DispatchHandle", "EventHandle", "EventOverlap", "LowLatencyHandle",
           "check_nvlink_connections"]
