"""MetricBook: collects `self.log` values with Lightning's semantics.

Every logged name lives in one or both of two scopes:

- the *step* scope (``on_step=True``): values of one optimizer step, averaged over its
  microbatches (or reduced with ``reduce_fx``), or of one validation / test batch; the
  Trainer writes them on logging steps (after every validation / test batch);
- the *epoch* scope (``on_epoch=True``): values of a whole training epoch or validation / test
  run, reduced with ``reduce_fx`` and written once at its end.

A name logged with both flags is written as ``<name>_step`` and ``<name>_epoch`` (as Lightning
does). Means are weighted by each value's ``batch_size``: given, or inferred from the batch
running when it was logged (`start_batch`), as Lightning infers it. Values may be numbers,
tensors or torchmetrics ``Metric`` objects; a Metric logged for the epoch is computed at the
end of the epoch (synchronized over the data-parallel ``process_group``) and reset afterwards, one logged for the step contributes the value of its
last ``forward`` call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torchmetrics
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor

from nanotrain.trainer.step_values import StepAggregator


class WeightedMean(torchmetrics.MeanMetric):
    """`torchmetrics.MeanMetric` whose update never reads the device.

    MeanMetric checks every update for NaN on the host unless ``nan_strategy="disable"``, and
    with "disable" (torchmetrics 1.9) it drops the weights, so a batch-size-weighted mean
    becomes a plain mean of batch means. Here the weighted sums are added directly: a NaN
    simply shows in the result.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(nan_strategy="disable", **kwargs)

    def update(self, value: float | Tensor, weight: float | Tensor = 1.0) -> None:
        """Add `value` (any shape) with `weight` (broadcast to it) to the running sums."""
        value = torch.as_tensor(value, dtype=self.dtype, device=self.device)
        weight = torch.as_tensor(weight, dtype=self.dtype, device=self.device)
        self.mean_value += (value * torch.broadcast_to(weight, value.shape)).sum()
        self.weight += torch.broadcast_to(weight, value.shape).sum()


_AGGREGATORS: dict[str, type[torchmetrics.Metric]] = {
    "mean": WeightedMean,
    "sum": torchmetrics.SumMetric,
    "max": torchmetrics.MaxMetric,
    "min": torchmetrics.MinMetric,
}
# Lightning also accepts the torch reductions themselves as reduce_fx
_CALLABLE_REDUCE = {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}


def _scalar_on(value: Any, device: torch.device, name: str) -> Tensor:
    """`value` (a number or a one-element tensor) as a detached 0-dim float32 tensor on
    `device`; a tensor that already is one is returned as it is (no op on the step's path).

    Raises:
        ValueError: a tensor of more than one element.
    """
    if not isinstance(value, Tensor):
        value = torch.as_tensor(value)
    elif value.requires_grad:
        value = value.detach()
    if value.dim() != 0:
        if value.numel() != 1:
            raise ValueError(
                f"self.log({name!r}) needs a scalar (a number, a one-element tensor or a "
                f"torchmetrics Metric), got a tensor of shape {tuple(value.shape)}"
            )
        value = value.reshape(())
    if value.dtype != torch.float32 or value.device != device:
        value = value.to(device, torch.float32)
    return value


def reduce_name(reduce_fx: Any) -> str:
    """'mean' | 'sum' | 'max' | 'min' for a reduce_fx given as a string or torch function.

    Raises:
        ValueError: any other reduction.
    """
    name = _CALLABLE_REDUCE.get(reduce_fx, reduce_fx) if callable(reduce_fx) else reduce_fx
    if name not in _AGGREGATORS:
        raise ValueError(
            f"reduce_fx must be 'mean', 'sum', 'max' or 'min' (or torch.mean/sum/max/min), "
            f"got {reduce_fx!r}"
        )
    return name


@dataclass
class _Entry:
    """One name in one scope: an aggregator of plain values or a user's Metric object."""

    metric: torchmetrics.Metric | StepAggregator
    prog_bar: bool
    logger: bool
    user_metric: bool  # the user's own Metric: computed (epoch) or read (step), never updated


class _Scope:
    """Values logged under their names in one scope (step or epoch)."""

    def __init__(self) -> None:
        self.entries: dict[str, _Entry] = {}


class ScopeValues(NamedTuple):
    """The computed values of one scope, by where they go (as Lightning sorts them): the
    loggers (`logger=True`), the progress bar (`prog_bar=True`) and `callback_metrics`
    (every value, `logger=False` ones included). Device tensors."""

    logger: dict[str, Tensor]
    prog_bar: dict[str, Tensor]
    callback: dict[str, Tensor]


class MetricBook:
    """Holds the step scope and the epoch scope of `self.log` values.

    Args:
        device_fn: the device aggregators live on (called lazily).
        process_group: the data-parallel group `sync_dist=True` values and Metric objects are
            synchronized over (None: the default group).
    """

    def __init__(self, device_fn: Callable[[], torch.device], process_group: Any = None) -> None:
        self._device_fn = device_fn
        self._process_group = process_group
        self._step = _Scope()
        self._epoch = _Scope()
        self._forked: dict[str, str] = {}  # "<name>_step" / "<name>_epoch" -> "<name>"
        self._batch: Any = None  # the batch running now (`start_batch`), None between batches
        self._batch_size: int | None = None  # inferred from `_batch`, once per batch

    def start_batch(self, batch: Any) -> None:
        """A batch starts: epoch means of values logged without `batch_size` from now until
        `end_batch` are weighted by its size (Lightning's `extract_batch_size`: the first
        dimension of its first tensor)."""
        self._batch, self._batch_size = batch, None

    def end_batch(self) -> None:
        """The batch has ended: values logged from now on weigh 1 (as in Lightning's epoch-end
        hooks)."""
        self._batch, self._batch_size = None, None

    def _weight(self, batch_size: int | None, value: Any, on_epoch: bool, reduce: str) -> int:
        """The weight of one logged value, as Lightning's `_ResultCollection` picks it: the
        given `batch_size`, else the size already inferred for this batch, else (for a mean
        over the epoch of a plain value, inside a batch) the batch's inferred size, else 1."""
        if batch_size is not None:
            return batch_size
        if self._batch_size is not None:
            return self._batch_size
        if self._batch is None or not on_epoch or reduce != "mean":
            return 1
        # a Metric object is computed, not averaged (the Metric check is an ABC's: slow)
        if not isinstance(value, Tensor) and isinstance(value, torchmetrics.Metric):
            return 1
        self._batch_size = extract_batch_size(self._batch)
        return self._batch_size

    def log(
        self,
        name: str,
        value: Any,
        *,
        prog_bar: bool = False,
        logger: bool = True,
        sync_dist: bool = False,
        reduce_fx: Any = "mean",
        batch_size: int | None = None,
        on_step: bool = True,
        on_epoch: bool = False,
    ) -> None:
        """Record `value` under `name` in the step and/or epoch scope.

        Raises:
            ValueError: an unknown `reduce_fx`, a value that is not a scalar, or neither
                `on_step` nor `on_epoch`.
        """
        if not (on_step or on_epoch):
            raise ValueError(f"self.log({name!r}): on_step and on_epoch cannot both be False")
        reduce = reduce_name(reduce_fx)
        batch_size = self._weight(batch_size, value, on_epoch, reduce)
        both = on_step and on_epoch
        if both:
            self._forked.update({f"{name}_step": name, f"{name}_epoch": name})
        if on_step:
            step_name = f"{name}_step" if both else name
            self._add(self._step, step_name, value, prog_bar, logger, sync_dist, reduce, batch_size)
        if on_epoch:
            epoch_name = f"{name}_epoch" if both else name
            self._add(
                self._epoch, epoch_name, value, prog_bar, logger, sync_dist, reduce, batch_size
            )

    def _add(
        self,
        scope: _Scope,
        name: str,
        value: Any,
        prog_bar: bool,
        logger: bool,
        sync_dist: bool,
        reduce: str,
        batch_size: int,
    ) -> None:
        """Add one value (of weight `batch_size`, for a mean) to `name`'s aggregator (created
        on first use in this scope)."""
        # a tensor first: the Metric check is an ABC's, slower, and a step logs tensors
        if not isinstance(value, Tensor) and isinstance(value, torchmetrics.Metric):
            scope.entries[name] = _Entry(value, prog_bar, logger, user_metric=True)
            return
        entry = scope.entries.get(name)
        if entry is None or entry.user_metric:
            if scope is self._step:  # emptied every step: a light aggregator
                metric = StepAggregator(reduce, sync_dist, self._process_group)
            else:
                metric = self._aggregator(reduce, sync_dist)
            entry = scope.entries[name] = _Entry(metric, prog_bar, logger, user_metric=False)
        value = _scalar_on(value, self._device_fn(), name)
        metric = entry.metric
        weighted = (
            metric.takes_weight
            if type(metric) is StepAggregator
            else isinstance(metric, torchmetrics.MeanMetric)
        )
        if weighted:
            metric.update(value, weight=batch_size)
        else:
            metric.update(value)

    def _aggregator(self, reduce: str, sync_dist: bool) -> torchmetrics.Metric:
        # nan_strategy="disable": the default checks every update for NaN on the host (a
        # device sync per logged value per step); a NaN now simply shows in the result
        kwargs = {} if reduce == "mean" else {"nan_strategy": "disable"}
        return _AGGREGATORS[reduce](
            sync_on_compute=sync_dist, process_group=self._process_group, **kwargs
        ).to(self._device_fn())

    def _compute(self, entry: _Entry, epoch: bool) -> Tensor | None:
        metric = entry.metric
        if not entry.user_metric:
            return metric.compute()
        if not epoch:  # the value of the Metric's last forward(), as Lightning logs per step
            cached = getattr(metric, "_forward_cache", None)
            return None if cached is None else torch.as_tensor(cached).detach()
        # the Metric syncs itself on compute(); point it at the data-parallel group
        own_group = metric.process_group
        if own_group is None:
            metric.process_group = self._process_group
        try:
            return metric.compute().detach()
        finally:
            metric.process_group = own_group

    def _close(self, scope: _Scope, epoch: bool) -> ScopeValues:
        values = ScopeValues({}, {}, {})
        for name, entry in scope.entries.items():
            value = self._compute(entry, epoch)
            if value is None:
                continue
            values.callback[name] = value
            if entry.logger:
                values.logger[name] = value
            if entry.prog_bar:
                values.prog_bar[name] = value
        return values

    def unforked(self, values: dict[str, Tensor]) -> dict[str, Tensor]:
        """`values` of names logged with both flags under their plain name (as Lightning's
        `callback_metrics` also holds "loss" next to "loss_step" / "loss_epoch": the step
        value during the epoch, the epoch value at its end)."""
        return {self._forked[k]: v for k, v in values.items() if k in self._forked}

    def read_step(self) -> ScopeValues:
        """The step scope's values so far, without ending it (the aggregators cache what they
        computed until their next update)."""
        return self._close(self._step, epoch=False)

    def close_step(self) -> ScopeValues:
        """End the step scope: its values; start anew."""
        result = self._close(self._step, epoch=False)
        self._step = _Scope()
        return result

    def clear(self) -> None:
        """Drop everything logged in the step scope (a step that is not a logging step)."""
        self._step = _Scope()

    def has_epoch_values(self) -> bool:
        """Whether anything was logged for the epoch scope since it was last closed."""
        return bool(self._epoch.entries)

    def compute_epoch(self) -> ScopeValues:
        """The epoch scope's values without ending it: hooks logging at the end of the epoch
        add to the same scope before `close_epoch`."""
        return self._close(self._epoch, epoch=True)

    def close_epoch(self) -> ScopeValues:
        """End the epoch scope: compute its values, reset the Metric objects logged in it (as
        Lightning does at the end of an epoch) and start anew."""
        result = self._close(self._epoch, epoch=True)
        for entry in self._epoch.entries.values():
            if entry.user_metric:
                entry.metric.reset()
        self._epoch = _Scope()
        return result


def to_float(value: Any) -> float:
    """A Python float from a tensor or number."""
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().item())
    return float(value)
