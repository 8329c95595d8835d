"""`StepAggregator`: one optimizer step's values of one `self.log` name, reduced on the device.

The step scope of `MetricBook` takes a handful of values per step and is emptied after every
step, so it keeps its running sum (or max / min) as a plain tensor: a few microseconds of host
time per value, where a torchmetrics aggregator costs tens of microseconds per update and
about a millisecond to build. The epoch scope, which lives for a whole pass, keeps
torchmetrics aggregators.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

_OPS = {"mean": "SUM", "sum": "SUM", "max": "MAX", "min": "MIN"}


class StepAggregator:
    """Reduces the scalars logged under one name in one step with `reduce` ("mean",
    weighted by each value's weight; "sum"; "max"; "min").

    Args:
        reduce: the reduction (`metric_book.reduce_name`'s names).
        sync_dist: reduce over `process_group` too when computed (`self.log(sync_dist=True)`).
        process_group: the group of `sync_dist` (None: the default group).
    """

    def __init__(self, reduce: str, sync_dist: bool, process_group: Any = None) -> None:
        self.reduce, self.sync_dist, self.process_group = reduce, sync_dist, process_group
        self.takes_weight = reduce == "mean"
        self._total: Tensor | None = None
        self._weight = 0.0
        self._result: Tensor | None = None

    def update(self, value: Tensor, weight: float = 1.0) -> None:
        """Add a 0-dim float tensor `value` (with `weight`, for a mean)."""
        self._result = None
        if self.reduce == "mean":
            weight = float(weight)
            if weight != 1.0:
                value = value * weight
            self._weight += weight
        total = self._total
        if total is None:
            self._total = value
        elif self.reduce in ("mean", "sum"):
            self._total = total + value
        else:
            self._total = (torch.maximum if self.reduce == "max" else torch.minimum)(total, value)

    def compute(self) -> Tensor:
        """The reduced value (a 0-dim device tensor; all-reduced first under sync_dist);
        cached until the next update."""
        if self._result is None:
            if self._total is None:
                raise ValueError("StepAggregator.compute() before any update")
            self._result = self._reduced()
        return self._result

    def _reduced(self) -> Tensor:
        synced = self.sync_dist and dist.is_available() and dist.is_initialized()
        if self.reduce == "mean":
            if not synced:
                # one value of weight one (a plain per-step log): itself, with no device op
                return self._total if self._weight == 1.0 else self._total / self._weight
            # full_like fills on the device: no host-to-device copy, so no stream sync
            pair = torch.stack([self._total, torch.full_like(self._total, self._weight)])
            dist.all_reduce(pair, dist.ReduceOp.SUM, group=self.process_group)
            return pair[0] / pair[1]
        total = self._total.clone()
        if synced:
            dist.all_reduce(total, getattr(dist.ReduceOp, _OPS[self.reduce]), self.process_group)
        return total
