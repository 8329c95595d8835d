"""`Trainer.test` and `Trainer.predict`, and the end of an epoch's logging (shared by the
training, validation and test loops)."""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
import torchmetrics
from lightning.pytorch.loops.evaluation_loop import _EvaluationLoop
from torch.utils.data import DataLoader, Sampler

from nanotrain.trainer.loaders import draw_as_lightning
from nanotrain.trainer.metric_book import MetricBook, ScopeValues, to_float
from nanotrain.trainer.predict_records import PredictRecords

if TYPE_CHECKING:
    from nanotrain.trainer import Trainer


def print_results(trainer: Trainer, metrics: dict[str, float], stage: str) -> None:
    """Lightning's results table of a `validate` or `test` run (`stage`), on rank 0."""
    if trainer.is_global_zero:
        _EvaluationLoop._print_results([metrics], stage)


def module_modes(module: torch.nn.Module) -> dict[str, bool]:
    """Each submodule's training flag, by name: what an evaluation run puts back afterwards,
    as Lightning does (a submodule the user put in eval mode, e.g. a frozen backbone with
    BatchNorm, stays so)."""
    return {name: sub.training for name, sub in module.named_modules()}


def restore_modes(module: torch.nn.Module, modes: dict[str, bool]) -> None:
    """Put back the training flags `module_modes` took."""
    for name, sub in module.named_modules():
        if name in modes:
            sub.training = modes[name]


def finish_epoch(trainer: Trainer, hook: str) -> dict[str, torch.Tensor]:
    """End a training epoch or a validation / test run, as Lightning does: the epoch values
    logged so far go into `trainer.callback_metrics` (a name logged with both flags also under
    its plain name, and `logger=False` ones too), then `hook` (e.g. "on_validation_epoch_end")
    runs and may log more, then the values are written to the loggers at the current step,
    published again, and Metric objects are reset. Returns the values written."""
    book = trainer.metric_book
    _publish_epoch(trainer, book, book.compute_epoch())
    trainer._call(hook)
    values = book.close_epoch()
    trainer.log_metrics(values.logger)
    _publish_epoch(trainer, book, values)
    trainer.progress_bar_metrics.update(values.prog_bar)
    return values.logger


def _publish_epoch(trainer: Trainer, book: MetricBook, values: ScopeValues) -> None:
    callback = {k: v.detach() for k, v in values.callback.items()}
    trainer.callback_metrics.update(callback)
    trainer.callback_metrics.update(book.unforked(callback))
    # as Lightning's `logged_metrics`, which reads the epoch values from the epoch-end hook on
    trainer.logged_metrics.update({k: v.detach() for k, v in values.logger.items()})


def evaluation_batch(
    trainer: Trainer, stage: str, step: Callable[..., Any], batch: Any, batch_idx: int
) -> Any:
    """One real batch of a validation or test run (`stage` "validation" or "test"), as
    Lightning's evaluation loop runs it: values logged from `on_<stage>_batch_start` to
    `on_<stage>_batch_end` are weighted by the batch's size (unless given a `batch_size`);
    then the batch's `on_step` values are written to the loggers (`write_evaluation_step`).
    Returns the step's output."""
    book = trainer.metric_book
    book.start_batch(batch)
    trainer._call(f"on_{stage}_batch_start", batch, batch_idx)
    output = step(trainer.module, batch, batch_idx)
    trainer._call(f"on_{stage}_batch_end", output, batch, batch_idx)
    book.end_batch()
    write_evaluation_step(trainer, book.close_step())
    return output


def write_evaluation_step(trainer: Trainer, values: ScopeValues) -> None:
    """One evaluation batch's `on_step` values, where Lightning puts them: the progress bar,
    `logged_metrics` and the loggers, the row at the number of batches this loader ran before
    (counted over every validation of a `fit`; without an `epoch` column), but not
    `callback_metrics` (Lightning's holds only the run's epoch values)."""
    trainer.progress_bar_metrics.update(values.prog_bar)
    loader = trainer._val_loader if trainer.validating else trainer._eval_loader
    row = getattr(loader, "batches_run", 0)  # the loader is rebuilt, so counts from 0, per stage
    loader.batches_run = row + 1
    if not values.logger:
        return
    trainer.logged_metrics.update({k: v.detach() for k, v in values.logger.items()})
    metrics = {k: to_float(v) for k, v in values.logger.items()}
    trainer.loggers.log_metrics(metrics, row)


def _defines(module: Any, name: str) -> bool:
    return getattr(type(module), name, None) is not getattr(pl.LightningModule, name, None)


class _EvalBatches(Sampler[list[int]]):
    """Batches of this shard's samples `index, index + count, ...`, in order, every sample of
    the set read once over all shards. Every shard yields the same number of batches (layouts
    whose forward is a collective across shards, e.g. expert parallelism, need that): a shard
    with fewer samples ends with padding batches, from `num_real_batches` on, whose outputs
    and logged values are discarded."""

    def __init__(self, length: int, batch_size: int, index: int, count: int) -> None:
        own = list(range(index, length, count))
        self.batches = [own[i : i + batch_size] for i in range(0, len(own), batch_size)]
        self.num_real_batches = len(self.batches)
        most = math.ceil(math.ceil(length / count) / batch_size)
        self.batches += [[own[0] if own else 0]] * (most - self.num_real_batches)

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _eval_loader(trainer: Trainer, source: Any, what: str) -> DataLoader:
    """This rank's share of `source` (a DataLoader or map-style Dataset), in order, every
    sample once, the DataLoader's batch size at a time (a shard's last real batch may be
    smaller; see `_EvalBatches` for the padding batches); see `loaders.evaluation_loader`."""
    from nanotrain.trainer.loaders import evaluation_loader

    def ordered(length: int, batch_size: int, shard: Any) -> _EvalBatches:
        return _EvalBatches(length, batch_size, shard.index, shard.count)

    return evaluation_loader(trainer, source, what, ordered)


@contextlib.contextmanager
def metrics_frozen(module: torch.nn.Module) -> Iterator[None]:
    """Run a padding batch: the torchmetrics `Metric` objects of `module` (updated inside the
    user's step, where nothing else can stop them) get back their states afterwards."""
    metrics = [m for m in module.modules() if isinstance(m, torchmetrics.Metric)]
    saved = [
        (m, {k: copy.deepcopy(getattr(m, k)) for k in m._defaults}, m._update_count, m._computed)
        for m in metrics
    ]
    try:
        yield
    finally:
        for metric, states, update_count, computed in saved:
            for name, value in states.items():
                setattr(metric, name, value)
            metric._update_count, metric._computed = update_count, computed


def padding_step(trainer: Trainer, step: Callable[..., Any], batch: Any, batch_idx: int) -> None:
    """Run `step(module, batch, batch_idx)` (a strategy's step) for a padding batch: its
    forward runs (it may be a collective), but what it logs goes nowhere and the module's Metric objects are left as they were."""
    kept = trainer._book
    trainer._book = MetricBook(lambda: trainer.strategy.root_device, kept._process_group)
    try:
        with metrics_frozen(trainer.module):
            step(trainer.module, batch, batch_idx)
        # computed as a real batch's are: `sync_dist` values reduce over the ranks, which all
        # enter that reduction
        trainer._book.close_step()
    finally:
        trainer._book = kept


def _source(trainer: Trainer, dataloaders: Any, hook: str, stage: str) -> Any:
    from nanotrain.trainer.loaders import data_source

    source = data_source(dataloaders, trainer.datamodule, trainer.module, hook)
    if source is None:
        raise ValueError(
            f"{stage} needs data: dataloaders=..., a datamodule with {hook}() or {hook}() on "
            f"{type(trainer.module).__name__}"
        )
    return source


def run_test(trainer: Trainer, dataloaders: Any, verbose: bool = True) -> list[dict[str, float]]:
    """Run `test_step` over the whole test data (each rank its share) with the model in eval
    mode and no gradients, emitting the test hooks; returns [metrics] (Lightning's shape: one
    dict per dataloader), the epoch values logged, reduced as in validation; `verbose` prints
    them as Lightning's table (rank 0).

    Raises:
        ValueError: the module has no `test_step` or there is no test data.
    """
    module = trainer.module
    if not _defines(module, "test_step"):
        raise ValueError(f"Trainer.test needs {type(module).__name__}.test_step(batch, batch_idx)")
    loader = _eval_loader(trainer, _source(trainer, dataloaders, "test_dataloader", "test"), "test")
    trainer._eval_loader = loader
    draw_as_lightning(loader)
    trainer._book = MetricBook(
        lambda: trainer.strategy.root_device, trainer.strategy.metric_process_group
    )
    trainer.testing = True
    modes = module_modes(module)
    module.eval()
    trainer._call("on_test_start")
    trainer._call("on_test_epoch_start")

    # every strategy's forward-only step (pipeline schedules included), on test_step
    def test_step(module: Any, batch: Any, batch_idx: int) -> Any:
        return trainer.strategy.validation_step(module, batch, batch_idx, "test_step")

    for batch_idx, batch in enumerate(loader):
        batch = trainer.strategy.batch_to_device(batch)
        if batch_idx >= loader.batch_sampler.num_real_batches:
            padding_step(trainer, test_step, batch, batch_idx)
            continue
        evaluation_batch(trainer, "test", test_step, batch, batch_idx)
    logged = finish_epoch(trainer, "on_test_epoch_end")
    trainer._call("on_test_end")
    restore_modes(module, modes)  # as Lightning: after the end hook
    trainer.testing = False
    metrics = {k: to_float(v) for k, v in logged.items()}
    if verbose:
        print_results(trainer, metrics, "test")
    return [metrics]


def run_predict(
    trainer: Trainer, dataloaders: Any, return_predictions: bool | None = None
) -> list[Any] | None:
    """Run `predict_step` over the whole predict data (each rank its share, in order) without
    gradients; returns this rank's outputs, one per batch (None outputs included), moved to
    the CPU as Lightning moves them, or None with `return_predictions=False`.
    `trainer.predict_loop` keeps what Lightning's BasePredictionWriter reads (`PredictRecords`).

    Raises:
        ValueError: the module has no `predict_step` and no `forward`, there is no data, or
            the strategy cannot predict (pipeline parallelism).
    """
    module = trainer.module
    loader = _eval_loader(
        trainer, _source(trainer, dataloaders, "predict_dataloader", "predict"), "predict"
    )
    trainer._eval_loader = loader
    draw_as_lightning(loader)
    trainer.predicting = True
    returning = return_predictions is not False
    records = trainer.predict_loop = PredictRecords()
    records.start(trainer.callbacks)
    module.eval()
    trainer._call("on_predict_start")
    trainer._call("on_predict_epoch_start")
    for batch_idx, batch in enumerate(loader):
        batch = trainer.strategy.batch_to_device(batch)
        if batch_idx >= loader.batch_sampler.num_real_batches:
            padding_step(trainer, trainer.strategy.predict_step, batch, batch_idx)
            continue
        # the dataset indices of the batch, as Lightning's index-recording batch sampler
        records.before_batch(loader.batch_sampler.batches[batch_idx])
        trainer._call("on_predict_batch_start", batch, batch_idx)
        output = trainer.strategy.predict_step(module, batch, batch_idx)
        trainer._call("on_predict_batch_end", output, batch, batch_idx)
        records.keep(output, returning)
    trainer._call("on_predict_epoch_end")
    outputs = records.predictions if returning else None
    records.end(returning)
    trainer._call("on_predict_end")
    trainer.predicting = False
    return outputs


class EvaluationMethods:
    """Mixin of `nanotrain.Trainer`: `test` and `predict` (setup, checkpoint, the loop above,
    teardown; `on_exception` on errors) with Lightning's signatures."""

    def test(
        self: Trainer,
        model: Any = None,
        dataloaders: Any = None,
        ckpt_path: str | None = None,
        verbose: bool = True,
        datamodule: Any = None,
        weights_only: bool | None = None,
    ) -> list[dict[str, float]]:
        """Run `test_step` once over the test data (`dataloaders`, else the datamodule's or
        the module's `test_dataloader()`); returns [metrics] and, with `verbose`, prints them,
        as Lightning. Lightning's signature and defaults: without `model`, the module of the
        last stage, and after a fit `ckpt_path` "best" (`nanotrain.trainer.call_forms`).
        See `run_test`."""
        run = functools.partial(run_test, verbose=verbose)
        return self._evaluate(run, "test", model, datamodule, dataloaders, ckpt_path, weights_only)

    def predict(
        self: Trainer,
        model: Any = None,
        dataloaders: Any = None,
        datamodule: Any = None,
        return_predictions: bool | None = None,
        ckpt_path: str | None = None,
        weights_only: bool | None = None,
    ) -> list[Any] | None:
        """Run `predict_step` over the predict data (`dataloaders`, else the datamodule's or
        the module's `predict_dataloader()`); returns this rank's outputs per batch (None with
        `return_predictions=False`), as Lightning, with Lightning's signature and defaults (see
        `test`). See `run_predict`."""
        run = functools.partial(run_predict, return_predictions=return_predictions)
        return self._evaluate(
            run, "predict", model, datamodule, dataloaders, ckpt_path, weights_only
        )

    def _evaluate(
        self: Trainer,
        run: Callable[[Trainer, Any], Any],
        stage: str,
        model: Any,
        datamodule: Any,
        loaders: Any,
        ckpt: Any,
        weights_only: bool | None,
    ) -> Any:
        from nanotrain.trainer.call_forms import (
            check_weights_only,
            data_arguments,
            default_ckpt_path,
            stage_module,
        )

        check_weights_only(weights_only)
        datamodule, loaders = data_arguments(stage, datamodule, loaders)
        module, given = stage_module(self, model, stage)
        ckpt = default_ckpt_path(self, stage, ckpt, given)
        try:
            self._setup(module, datamodule, stage, ckpt)
            if self._resume_path is not None:  # "last" with none: the weights as they are
                self._resume(self._resume_path, weights_only=True)
            return run(self, loaders)
        except BaseException as exc:
            if self.module is not None:
                self._call("on_exception", exc)
            raise
        finally:
            self._eval_loader = None
            self._teardown(stage)
