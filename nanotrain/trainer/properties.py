"""The read-only Trainer properties Lightning code reads (`trainer.max_steps`, ...)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    from torch.utils.data import DataLoader

    from nanotrain.module import NanoModule
    from nanotrain.strategies import Strategy
    from nanotrain.trainer.config import TrainerConfig
    from nanotrain.trainer.state import TrainState


# hooks in which `self.log` defaults to on_step=True (as in Lightning); None = inside a step
_STEP_HOOKS = {
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
}


class LightningTrainerProperties:
    """Mixin of the `nanotrain.Trainer`: the names and meanings of `lightning.Trainer`'s
    properties that LightningModules and their schedulers commonly read."""

    settings: TrainerConfig
    state: TrainState
    module: Any
    run_dir: Path | None
    _train_loader: Any
    strategy: Strategy
    _val_loader: Any
    _eval_loader: Any
    _current_fx: str | None
    loggers: Any
    training: bool
    validating: bool
    testing: bool

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far."""
        return self.state.global_step

    @property
    def current_epoch(self) -> int:
        """Index of the current pass over the training data."""
        return self.state.epoch

    @property
    def global_rank(self) -> int:
        """Rank of this process in the whole job."""
        return self.strategy.global_rank

    @property
    def local_rank(self) -> int:
        """Rank of this process on its node."""
        return self.strategy.local_rank

    @property
    def world_size(self) -> int:
        """Number of processes in the job."""
        return self.strategy.world_size

    @property
    def is_global_zero(self) -> bool:
        """True on the one process that writes logs and configs."""
        return self.strategy.is_global_zero

    @property
    def sanity_checking(self) -> bool:
        """Always False: nanotrain runs no sanity-check validation."""
        return False

    @property
    def lightning_module(self) -> NanoModule | None:
        """The module being trained (Lightning's name)."""
        return self.module

    @property
    def log_dir(self) -> Path | None:
        """The run directory (None before fit/validate starts)."""
        return self.run_dir

    @property
    def train_dataloader(self) -> DataLoader | None:
        """The training DataLoader of the running fit."""
        return self._train_loader

    @property
    def val_dataloader(self) -> DataLoader | None:
        """The validation DataLoader of the running fit/validate."""
        return self._val_loader

    @property
    def max_steps(self) -> int:
        """The step limit, -1 when there is none (as Lightning)."""
        return -1 if self.settings.max_steps is None else self.settings.max_steps

    @property
    def max_epochs(self) -> int:
        """The epoch limit, -1 when there is none (as Lightning)."""
        return -1 if self.settings.max_epochs is None else self.settings.max_epochs

    @property
    def num_training_batches(self) -> int | float:
        """Microbatches this process reads per training epoch (what Lightning counts as
        batches); inf before `fit` has built its loader."""
        if self.state.steps_per_epoch == 0:
            return math.inf
        return self.state.steps_per_epoch * self.num_microbatches

    @property
    def accumulate_grad_batches(self) -> int:
        """Microbatches per optimizer step on this process, as Lightning's: the
        `accumulate_grad_batches` setting, or what global_batch_size implies (resolved when
        a stage starts; before that, from the settings as given, 1 when they say nothing)."""
        return self.num_microbatches

    @property
    def estimated_stepping_batches(self) -> int | float:
        """Optimizer steps the whole `fit` will take: the smallest of `max_steps` and
        `max_epochs` × steps per epoch; inf when only `max_tokens` bounds training (the number
        of steps is then unknown). Valid from `configure_optimizers` on, as in Lightning.

        Raises:
            RuntimeError: read before `fit` built the training loader.
        """
        s, st = self.settings, self.state
        if st.steps_per_epoch == 0:
            raise RuntimeError(
                "estimated_stepping_batches is known once fit has built the training data "
                "loader (from configure_optimizers on)"
            )
        candidates = []
        if s.max_steps is not None:
            candidates.append(s.max_steps)
        if s.max_epochs is not None:
            candidates.append(s.max_epochs * st.steps_per_epoch)
        return min(candidates) if candidates else math.inf

    @property
    def num_val_batches(self) -> list[int]:
        """Validation batches per run on this process, one entry per loader (as Lightning);
        nanotrain's own validation loader has `limit_val_batches` applied already and its
        padding batches (which log nothing) are not counted."""
        from nanotrain.trainer.loaders import val_batch_limit

        loader = self._val_loader
        if loader is None:
            return []
        real = getattr(loader.batch_sampler, "num_real_batches", None)
        if real is not None:
            return [real]
        return [val_batch_limit(self.settings.limit_val_batches, len(loader))]

    @property
    def num_test_batches(self) -> list[int]:
        """Batches of the running `test` on this process (one entry), [] outside it."""
        loader = getattr(self, "_eval_loader", None)
        return [] if loader is None else [loader.batch_sampler.num_real_batches]

    @property
    def num_predict_batches(self) -> list[int]:
        """Batches of the running `predict` on this process (one entry), [] outside it."""
        return self.num_test_batches

    @property
    def num_nodes(self) -> int:
        """Always 1 as far as the module is concerned: ranks are counted by `world_size`."""
        return 1

    @property
    def num_devices(self) -> int:
        """Processes in the job (`world_size`)."""
        return self.strategy.world_size

    @property
    def logger(self) -> Any:
        """The first logger that can draw (a TensorBoard one), else the first logger; None on
        ranks other than 0 or without loggers."""
        drawing = [
            lg for lg in self.loggers if hasattr(getattr(lg, "experiment", None), "add_histogram")
        ]
        return (drawing or list(self.loggers) or [None])[0]

    def logs_per_step_by_default(self) -> bool:
        """Lightning's `self.log` default: on_step (not on_epoch) in `training_step` and the
        training batch hooks; on_epoch everywhere else."""
        in_step = self._current_fx is None or self._current_fx in _STEP_HOOKS
        return self.training and in_step and not (self.validating or self.testing)
