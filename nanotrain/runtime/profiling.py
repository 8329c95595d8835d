"""Named ranges for profiler traces that cost nothing while no profiler records.

Strategies mark the parts of a step (forward, backward, gradient reduction, optimizer step,
and each pipeline stage's microbatches) with `named_range`. While a `torch.profiler` session
is recording, the range shows up in its trace under that name (TensorBoard, Perfetto, Chrome's
trace viewer); otherwise `named_range` returns a shared no-op context and the profiler's
record-function op is never called.
"""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function

__all__ = ["named_range", "profiler_recording"]

_NO_RANGE = contextlib.nullcontext()


def profiler_recording() -> bool:
    """True while a torch profiler (autograd or kineto) is recording events in this process."""
    return bool(torch._C._autograd._profiler_enabled())


def named_range(name: str) -> contextlib.AbstractContextManager:
    """A `torch.profiler.record_function(name)` range while a profiler records, else a no-op.

    Args:
        name: the label the range gets in the trace, e.g. "nanotrain/forward".
    """
    if profiler_recording():
        return record_function(name)
    return _NO_RANGE
