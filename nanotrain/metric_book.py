"""MetricBook: collects `self.log` values and reduces them per step or per validation run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torchmetrics
from torch import Tensor

_AGGREGATORS: dict[str, type[torchmetrics.Metric]] = {
    "mean": torchmetrics.MeanMetric,
    "sum": torchmetrics.SumMetric,
    "max": torchmetrics.MaxMetric,
    "min": torchmetrics.MinMetric,
}


@dataclass
class _Entry:
    metric: torchmetrics.Metric
    prog_bar: bool
    logger: bool


class MetricBook:
    """Holds one torchmetrics aggregator per logged name for the current scope.

    A scope is one training step (values averaged over its microbatches) or one validation
    run (values averaged over all its batches). `sync_dist=True` entries are synchronized over
    `process_group` when the scope is closed, through torchmetrics' own distributed sync.
    """

    def __init__(self, device_fn: Callable[[], torch.device], process_group: Any = None) -> None:
        self._device_fn = device_fn
        self._process_group = process_group
        self._entries: dict[str, _Entry] = {}

    def log(
        self,
        name: str,
        value: Any,
        *,
        prog_bar: bool,
        logger: bool,
        sync_dist: bool,
        reduce_fx: str,
        batch_size: int | None,
    ) -> None:
        """Add one value to `name`'s aggregator (created on first use in this scope)."""
        entry = self._entries.get(name)
        if entry is None:
            # nan_strategy="disable": the default checks every update for NaN on the host (a
            # device sync per logged value per step); a NaN now simply shows in the result
            metric = _AGGREGATORS[reduce_fx](
                sync_on_compute=sync_dist,
                process_group=self._process_group,
                nan_strategy="disable",
            ).to(self._device_fn())
            entry = self._entries[name] = _Entry(metric, prog_bar, logger)
        value = torch.as_tensor(value, dtype=torch.float32).detach().to(self._device_fn())
        if isinstance(entry.metric, torchmetrics.MeanMetric):
            entry.metric.update(value, weight=batch_size if batch_size is not None else 1.0)
        else:
            entry.metric.update(value)

    def close(self) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """End the scope: return (values for loggers, values for the progress bar); reset."""
        logged: dict[str, Tensor] = {}
        prog: dict[str, Tensor] = {}
        for name, entry in self._entries.items():
            value = entry.metric.compute()
            if entry.logger:
                logged[name] = value
            if entry.prog_bar:
                prog[name] = value
        self._entries = {}
        return logged, prog

    def clear(self) -> None:
        """Drop everything logged in this scope."""
        self._entries = {}
