"""The Trainer's validation pass: one run over the validation data, metrics reduced and logged."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanotrain.trainer.loaders import draw_as_lightning, val_batch_limit
from nanotrain.trainer.metric_book import MetricBook, to_float

if TYPE_CHECKING:
    from nanotrain.trainer import Trainer


def run_validation(trainer: Trainer, lightning_has_it: bool = True) -> dict[str, float]:
    """Run `validation_step` over the validation loader with the model in eval mode, emitting
    the validation hooks; log the reduced metrics at the current step and return them.
    Training-step metrics logged so far are kept aside. `lightning_has_it`: the pass is one
    lightning.Trainer runs too, so it makes Lightning's global RNG draw (`draw_as_lightning`);
    nanotrain's own extra passes do not, so they never disturb the training RNG.

    The loader reads the same samples under any layout (`nanotrain.trainer.loaders.validation_loader`,
    which also applies `limit_val_batches`). Its padding batches (a shard with fewer samples
    than another, from `batch_sampler.num_real_batches` on) run the forward, which can be a
    collective, but what they log is discarded, the module's Metric objects are left as
    they were, and no batch hook sees them."""
    from nanotrain.trainer.evaluation import finish_epoch, padding_step

    module = trainer.module
    was_training = module.training
    new_book = lambda: MetricBook(  # noqa: E731
        lambda: trainer.strategy.root_device, trainer.strategy.metric_process_group
    )
    train_book, trainer._book = trainer._book, new_book()
    if lightning_has_it:  # a pass lightning.Trainer also runs: its RNG draw too
        draw_as_lightning(trainer._val_loader)
    trainer.validating = True
    module.eval()
    trainer._call("on_validation_start")
    trainer._call("on_validation_epoch_start")
    loader = trainer._val_loader
    real = getattr(loader.batch_sampler, "num_real_batches", None)
    limit = (
        val_batch_limit(trainer.settings.limit_val_batches, len(loader)) if real is None else None
    )
    for batch_idx, batch in enumerate(loader):
        if limit is not None and batch_idx >= limit:
            break
        batch = trainer.strategy.batch_to_device(batch)
        if real is not None and batch_idx >= real:
            padding_step(trainer, trainer.strategy.validation_step, batch, batch_idx)
            continue
        trainer._call("on_validation_batch_start", batch, batch_idx)
        output = trainer.strategy.validation_step(module, batch, batch_idx)
        trainer._call("on_validation_batch_end", output, batch, batch_idx)
    logged = finish_epoch(trainer, "on_validation_epoch_end")
    trainer._book = train_book
    trainer._last_val_step = trainer.state.global_step
    module.train(was_training)
    trainer.validating = False
    trainer._call("on_validation_end")
    return {k: to_float(v) for k, v in logged.items()}
