"""The Trainer's validation: `Trainer.validate`, and the validation pass (one run over the
validation data, metrics reduced and logged) that it and fit's cadences run."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl

from nanotrain.trainer.call_forms import (
    check_weights_only,
    data_arguments,
    default_ckpt_path,
    stage_module,
)
from nanotrain.trainer.evaluation import (
    evaluation_batch,
    finish_epoch,
    module_modes,
    padding_step,
    print_results,
    restore_modes,
)
from nanotrain.trainer.loaders import draw_as_lightning
from nanotrain.trainer.metric_book import MetricBook, to_float

if TYPE_CHECKING:
    from nanotrain.module import NanoModule
    from nanotrain.trainer import Trainer


def run_validation(trainer: Trainer, lightning_has_it: bool = True) -> dict[str, float]:
    """Run `validation_step` over the validation loader with the model in eval mode, emitting
    the validation hooks; log the reduced metrics at the current step and return them.
    Training-step metrics logged so far are kept aside. `lightning_has_it`: the pass is one
    lightning.Trainer runs too, so it makes Lightning's global RNG draw (`draw_as_lightning`);
    nanotrain's own extra passes do not, so they never disturb the training RNG.

    The loader reads the same samples under any layout (`nanotrain.trainer.loaders.validation_loader`,
    which also applies `limit_val_batches`); each batch runs as `evaluation.evaluation_batch`
    (its `on_step` values written after it). Its padding batches (a shard with fewer samples
    than another, from `batch_sampler.num_real_batches` on) run the forward, which can be a
    collective, but what they log is discarded, the module's Metric objects are left as
    they were, and no batch hook sees them."""
    module = trainer.module
    modes = module_modes(module)
    new_book = lambda: MetricBook(  # noqa: E731
        lambda: trainer.strategy.root_device, trainer.strategy.metric_process_group
    )
    train_book, trainer._book = trainer._book, new_book()
    if lightning_has_it:  # a pass lightning.Trainer also runs: its RNG draw too
        draw_as_lightning(trainer._val_loader)
    trainer.validating = True
    # as Lightning: fit's validation is not training (`trainer.training` False from its start
    # hook to its end hook; callbacks ask `trainer.is_fitting` for "inside fit")
    training, trainer.training = trainer.training, False
    trainer.validation_is_extra = not lightning_has_it
    module.eval()
    trainer._call("on_validation_start")
    try:
        trainer._call("on_validation_epoch_start")
        loader = trainer._val_loader
        real = loader.batch_sampler.num_real_batches
        for batch_idx, batch in enumerate(loader):
            batch = trainer.strategy.batch_to_device(batch)
            if batch_idx >= real:
                padding_step(trainer, trainer.strategy.validation_step, batch, batch_idx)
                continue
            evaluation_batch(
                trainer, "validation", trainer.strategy.validation_step, batch, batch_idx
            )
        logged = finish_epoch(trainer, "on_validation_epoch_end")
        trainer._book = train_book
        trainer._last_val_step = trainer.state.global_step
        trainer._call("on_validation_end")
        restore_modes(module, modes)  # as Lightning: after the end hook, submodule by submodule
    finally:
        trainer.training = training
        trainer.validation_is_extra = False
    trainer.validating = False
    return {k: to_float(v) for k, v in logged.items()}


class ValidationMethods:
    """Mixin of `nanotrain.Trainer`: `validate` (setup, checkpoint, the pass above, teardown;
    `on_exception` on errors) with Lightning's signature, and the pass fit's cadences run."""

    def _run_validation(self, lightning_has_it: bool = True) -> dict[str, float]:
        """One validation pass; `lightning_has_it`=False for nanotrain's own extra passes
        (validate_at_start, the final one of fit), which leave the global RNG untouched."""
        return run_validation(self, lightning_has_it)

    def validate(
        self,
        model: NanoModule | None = None,
        dataloaders: Any = None,
        ckpt_path: str | Path | None = None,
        verbose: bool = True,
        datamodule: Any = None,
        weights_only: bool | None = None,
    ) -> list[dict[str, float]]:
        """Run one pass over the validation data; returns `[metrics]` (Lightning's shape: one
        dict per dataloader) with the epoch values logged, reduced over the ranks, and with
        `verbose` prints them on rank 0 as Lightning's results table. Lightning's signature
        and defaults: without `model`, the module of the last stage, and after a fit
        `ckpt_path` "best" (`nanotrain.trainer.call_forms`).

        Raises:
            ValueError: the module has no `validation_step` (as Lightning), or no
                validation data.
        """
        check_weights_only(weights_only)
        datamodule, dataloaders = data_arguments("validate", datamodule, dataloaders)
        module, given = stage_module(self, model, "validate")
        ckpt_path = default_ckpt_path(self, "validate", ckpt_path, given)
        try:
            if type(module).validation_step is pl.LightningModule.validation_step:
                raise ValueError(
                    f"Trainer.validate needs {type(module).__name__}.validation_step(batch, "
                    "batch_idx)"
                )
            self._setup(module, datamodule, "validate", ckpt_path)
            self._build_loaders("validate", None, dataloaders)
            if self._val_loader is None:
                raise ValueError(
                    "validate needs validation data: dataloaders=..., a datamodule with "
                    f"val_dataloader() or val_dataloader() on {type(module).__name__}"
                )
            if self._resume_path is not None:
                self._resume(self._resume_path, weights_only=True)
            self._make_run_dir()
            metrics = self._run_validation()
            if verbose:
                print_results(self, metrics, "validate")
            return [metrics]
        except BaseException as exc:
            if self.module is not None:
                self._call("on_exception", exc)
            raise
        finally:
            self._teardown("validate")
