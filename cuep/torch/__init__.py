"""DeepEP's module for torch frameworks: ``import cuep.torch as deep_ep``.

Frameworks written for DeepEP (vLLM, SGLang, Megatron-LM, torchtitan) build ``deep_ep.Buffer(group, ...)``
from a ``torch.distributed`` process group and exchange torch tensors; this module gives them that API
over cuep's kernels, with no MPI, no compiler and no build against torch. Processes started by
``torchrun``, ``torch.multiprocessing`` or Ray work as they are.

Exports DeepEP's names: :class:`Buffer`, :class:`Config`, :class:`EventOverlap`, :class:`EventHandle` and
``topk_idx_t`` (``torch.int64``); DeepEP V2's :class:`ElasticBuffer` and :class:`EPHandle` (one node so far),
whose presence frameworks test to pick their V2 path; and DeepEP V1's module paths: :mod:`cuep.torch.utils`
(``deep_ep.utils``) and :mod:`cuep.torch.buffer` (``deep_ep.buffer``). Made a process's ``deep_ep`` with
``sys.modules["deep_ep"] = cuep.torch``, every import DeepEP's users write resolves, to the same objects.
Importing it needs torch (a missing torch raises :class:`~cuep.errors.MissingDependencyError` saying what to
install).
"""

from __future__ import annotations

from .. import _deps
from ..config import Config
from . import buffer, utils
from ._buffer import Buffer, DispatchHandle, LowLatencyHandle
from .elastic import ElasticBuffer, EPHandle
from .event import EventHandle, EventOverlap

#: The dtype of top-k expert ids, as DeepEP's ``deep_ep.topk_idx_t``.
topk_idx_t = _deps.torch().int64

__all__ = ["Buffer", "Config", "DispatchHandle", "EPHandle", "ElasticBuffer", "EventHandle", "EventOverlap",
           "LowLatencyHandle", "buffer", "topk_idx_t", "utils"]
