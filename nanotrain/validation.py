"""The Trainer's validation pass: one run over the validation data, metrics reduced and logged."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from nanotrain.metric_book import MetricBook

if TYPE_CHECKING:
    from nanotrain.trainer import Trainer


def run_validation(trainer: Trainer) -> dict[str, float]:
    """Run `validation_step` over (at most `limit_val_batches` of) the validation loader with
    the model in eval mode, emitting the validation hooks; log the reduced metrics at the
    current step and return them. Training-step metrics logged so far are kept aside."""
    module = trainer.module
    was_training = module.training
    train_book, trainer._book = (
        trainer._book,
        MetricBook(lambda: trainer.strategy.root_device, trainer.strategy.metric_process_group),
    )
    trainer.validating = True
    module.eval()
    trainer._call("on_validation_start")
    trainer._call("on_validation_epoch_start")
    limit = val_batch_limit(trainer.settings.limit_val_batches, len(trainer._val_loader))
    for batch_idx, batch in enumerate(trainer._val_loader):
        if batch_idx >= limit:
            break
        batch = trainer.strategy.batch_to_device(batch)
        output = trainer.strategy.validation_step(module, batch, batch_idx)
        trainer._call("on_validation_batch_end", output, batch, batch_idx)
    from nanotrain.evaluation_loops import finish_epoch

    logged = finish_epoch(trainer, "on_validation_epoch_end")
    trainer._book = train_book
    trainer._last_val_step = trainer.state.global_step
    module.train(was_training)
    trainer.validating = False
    trainer._call("on_validation_end")
    return {k: to_float(v) for k, v in logged.items()}


def val_batch_limit(limit: int | float | None, available: int) -> int:
    """Batches to run: all (None), a fraction (float <= 1) or a count (int), at most `available`."""
    if limit is None:
        return available
    if isinstance(limit, float) and limit <= 1.0:
        return max(1, int(available * limit)) if limit > 0 else 0
    return min(int(limit), available)


def to_float(value: Any) -> float:
    """A Python float from a tensor or number."""
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().item())
    return float(value)
