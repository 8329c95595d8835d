"""The read-only Trainer properties Lightning code reads (`trainer.max_steps`, ...)."""

from __future__ import annotations

import builtins
import contextlib
import math
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.types import LRSchedulerConfig

from nanotrain.trainer.lightning_args import launched_sizes

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
    callbacks: list[Any]
    _preempted: bool

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far."""
        return self.state.global_step

    @property
    def current_epoch(self) -> int:
        """Index of the current pass over the training data; after `fit` ended an epoch
        midway (its `on_train_epoch_end` ran), the next one's, as Lightning counts (the
        checkpoint keeps the data position: a resume continues the cut epoch)."""
        return self.state.epoch + (1 if self._epoch_cut_short else 0)

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
    def log_dir(self) -> str | None:
        """As Lightning's: the first Lightning logger's `log_dir` when you passed one that has
        it (e.g. a TensorBoardLogger), else the run directory (None before fit/validate)."""
        first = self._user_loggers[0] if self._user_loggers else None
        folder = getattr(first, "log_dir", None)  # Lightning reads the first logger only
        if folder is not None:
            return str(folder)
        return None if self.run_dir is None else str(self.run_dir)

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
    def fast_dev_run(self) -> int | bool:
        """As Lightning's: False, True (for 1) or the number of batches of a dev run."""
        n = self.settings.fast_dev_run
        return True if n == 1 else n

    @property
    def limit_train_batches(self) -> int | float:
        """Lightning's value: the limit set (overfit_batches' when that is on), else 1.0."""
        limit = self.settings.limit_train_batches
        return 1.0 if limit is None else limit

    @property
    def overfit_batches(self) -> int | float:
        """Lightning's value: the overfit_batches setting (0: off)."""
        return self.settings.overfit_batches

    @property
    def reload_dataloaders_every_n_epochs(self) -> int:
        """Lightning's value: reload the DataLoaders every this many epochs (0: never)."""
        return self.settings.reload_dataloaders_every_n_epochs

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

    @accumulate_grad_batches.setter
    def accumulate_grad_batches(self, factor: int) -> None:
        """Change the factor at an epoch's start, in `on_train_epoch_start`, as Lightning's
        GradientAccumulationScheduler does (`accumulation_schedule.set_accumulation`)."""
        from nanotrain.trainer.accumulation_schedule import set_accumulation

        set_accumulation(self, factor)

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
        """Validation batches per run on this process, one entry per loader, as Lightning
        counts them (`limit_val_batches` and `drop_last` applied); set when fit / validate
        builds its loaders and kept after it ([] before, or without validation data)."""
        return getattr(self, "_num_val_batches", [])

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
        """Nodes of the job as torchrun launched it (1 without torchrun)."""
        return launched_sizes()[1]

    @property
    def num_devices(self) -> int:
        """Processes (devices) per node, as torchrun launched them (1 without torchrun)."""
        return launched_sizes()[0]

    @property
    def device_ids(self) -> list[int]:
        """The device indices of this node's processes (0 .. num_devices - 1)."""
        return list(range(self.num_devices))

    @property
    def node_rank(self) -> int:
        """Index of this process's node (torchrun's GROUP_RANK, else NODE_RANK, else 0)."""
        return int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")))

    @property
    def accelerator(self) -> Accelerator:
        """Lightning's accelerator object for the strategy's device type (CUDA or CPU)."""
        if self.strategy.root_device.type == "cuda":
            return CUDAAccelerator()
        return CPUAccelerator()

    @property
    def scaler(self) -> Any:
        """The fp16 precision plugin's gradient scaler (None under other precisions)."""
        return getattr(self.strategy.precision, "scaler", None)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int] | None:
        """What a `DistributedSampler` of this process takes: its data-parallel share
        (`num_replicas` replicas, this one `rank`), as Lightning gives it; None without a
        process group (one process, as Lightning's single-device strategy)."""
        if not torch.distributed.is_initialized():
            return None
        shard = self.strategy.data_shard()
        return {"num_replicas": shard.count, "rank": shard.index}

    @property
    def min_epochs(self) -> int:
        """0: nanotrain has no lower bound on training (the argument is refused); Lightning's
        value when it is not given."""
        return 0

    @property
    def min_steps(self) -> None:
        """None: nanotrain has no lower bound on training (the argument is refused)."""
        return None

    @property
    def val_dataloaders(self) -> DataLoader | None:
        """The validation DataLoader of the running fit/validate (Lightning's plural name)."""
        return self._val_loader

    @property
    def test_dataloaders(self) -> DataLoader | None:
        """The DataLoader of the running `test`, None outside it."""
        return self._eval_loader if self.testing else None

    @property
    def predict_dataloaders(self) -> DataLoader | None:
        """The DataLoader of the running `predict`, None outside it."""
        return self._eval_loader if self.predicting else None

    @property
    def num_sanity_val_batches(self) -> list[int]:
        """[0] with a validation loader ([] without): nanotrain runs no sanity check."""
        return [] if self._val_loader is None else [0]

    @property
    def model(self) -> NanoModule | None:
        """The module being trained (nanotrain wraps no model around it)."""
        return self.module

    @property
    def optimizers(self) -> list[Any]:
        """The optimizer of the running fit, as a one-element list ([] before
        `configure_optimizers` ran); in manual optimization every optimizer, in order."""
        setup = self.strategy.optimizer_setup
        if setup is not None and setup.manual_optimizers is not None:
            return list(setup.manual_optimizers)  # manual optimization: each one
        return [] if setup is None else [setup.optimizer]

    @property
    def lr_scheduler_configs(self) -> list[LRSchedulerConfig]:
        """The LR scheduler with its interval and frequency as Lightning's `LRSchedulerConfig`
        ([] without one). As in Lightning, a callback may replace, add or clear the entry
        (`StochasticWeightAveraging` swaps in its SWALR): the Trainer then steps that one."""
        setup = self.strategy.optimizer_setup
        if setup is not None and setup.manual_schedulers is not None:  # the module steps them
            return [LRSchedulerConfig(sched) for sched in setup.manual_schedulers]
        if setup is None:
            return []
        configs = SchedulerConfigs(setup)
        if setup.scheduler is None:
            return configs
        sched = setup.scheduler
        configs.extend_quietly(
            LRSchedulerConfig(
                sched.scheduler,
                interval=sched.interval,
                frequency=sched.frequency,
                reduce_on_plateau=sched.reduce_on_plateau,
                monitor=sched.monitor,
                strict=sched.strict,
            )  # fmt: skip
        )
        return configs

    @property
    def precision(self) -> str:
        """The precision name, e.g. "32-true" or "bf16-mixed"."""
        return self.strategy.precision.name

    @property
    def precision_plugin(self) -> Any:
        """The `nanotrain.precision` plugin the strategy applies."""
        return self.strategy.precision

    @property
    def default_root_dir(self) -> str:
        """The root folder of run directories (`<root>/<name>/version_N`)."""
        return self.settings.default_root_dir

    @property
    def ckpt_path(self) -> str | None:
        """The checkpoint the running (or last) stage loaded, None when it started fresh."""
        path = getattr(self, "_resume_path", None)
        return None if path is None else str(path)

    @property
    def checkpoint_callbacks(self) -> list[Any]:
        """The ModelCheckpoint callbacks, in order."""
        return self._callbacks_of("ModelCheckpoint")

    @property
    def checkpoint_callback(self) -> Any:
        """The first ModelCheckpoint callback, or None."""
        return next(iter(self.checkpoint_callbacks), None)

    @property
    def early_stopping_callbacks(self) -> list[Any]:
        """The EarlyStopping callbacks, in order."""
        return self._callbacks_of("EarlyStopping")

    @property
    def early_stopping_callback(self) -> Any:
        """The first EarlyStopping callback, or None."""
        return next(iter(self.early_stopping_callbacks), None)

    @property
    def progress_bar_callback(self) -> Any:
        """The ProgressBar callback, or None."""
        return next(iter(self._callbacks_of("ProgressBar")), None)

    def _callbacks_of(self, class_name: str) -> list[Any]:
        # by class name along the MRO: this room does not import the callbacks
        return [
            cb for cb in self.callbacks if any(c.__name__ == class_name for c in type(cb).__mro__)
        ]

    @property
    def gradient_clip_val(self) -> float | None:
        """The Trainer's `gradient_clip_val` setting."""
        return self.settings.gradient_clip_val

    @property
    def gradient_clip_algorithm(self) -> GradClipAlgorithmType:
        """The Trainer's `gradient_clip_algorithm` as Lightning's enum (a str; "norm" when not set)."""
        return GradClipAlgorithmType(self.settings.gradient_clip_algorithm or "norm")

    @property
    def val_check_interval(self) -> int | None:
        """Validate every this many optimizer steps (None: at epoch ends only)."""
        return self.settings.val_check_interval

    @property
    def check_val_every_n_epoch(self) -> int | None:
        """Validate at the end of every this many epochs (None: not at epoch ends)."""
        return self.settings.check_val_every_n_epoch

    @property
    def log_every_n_steps(self) -> int:
        """Write training scalars every this many optimizer steps."""
        return self.settings.log_every_n_steps

    @property
    def limit_val_batches(self) -> int | float:
        """The `limit_val_batches` setting (1.0, all of it, when not set)."""
        limit = self.settings.limit_val_batches
        return 1.0 if limit is None else limit

    @property
    def num_sanity_val_steps(self) -> int:
        """Always 0: nanotrain runs no sanity-check validation."""
        return 0

    @property
    def enable_validation(self) -> bool:
        """Whether the running fit has validation data and a `validation_step`."""
        return self._val_loader is not None

    @property
    def evaluating(self) -> bool:
        """True inside validate or test (and fit's validation runs)."""
        return self.validating or self.testing

    @property
    def is_last_batch(self) -> bool:
        """True while the last training batch of the epoch runs (Lightning's meaning: the
        data loader has no batch left after this one)."""
        return getattr(self, "_is_last_batch", False)

    @property
    def received_sigterm(self) -> bool:
        """Whether a preemption signal (SIGTERM by default) asked this fit to stop."""
        return self._preempted

    @property
    def interrupted(self) -> bool:
        """Whether the last stage ended by an exception or a preemption signal."""
        return getattr(self, "_interrupted", False) or self._preempted

    @property
    def logger(self) -> Any:
        """The first logger that can draw (a TensorBoard one), else the first logger; None on
        ranks other than 0 or without loggers."""
        drawing = [
            lg for lg in self.loggers if hasattr(getattr(lg, "experiment", None), "add_histogram")
        ]
        return (drawing or list(self.loggers) or [None])[0]

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on global rank 0 only (Lightning's `trainer.print`)."""
        if self.is_global_zero:
            builtins.print(*args, **kwargs)

    @contextlib.contextmanager
    def init_module(self, empty_init: bool | None = None) -> Iterator[None]:
        """Lightning's `with trainer.init_module():` — build a model under the strategy's
        model-init context (the precision plugin casts it when fit starts). `empty_init` is
        accepted and has no effect."""
        with self.strategy.model_init_context():
            yield

    @property
    def _accelerator_connector(self) -> Any:
        """Not a nanotrain Trainer attribute: Lightning's `Tuner(trainer).scale_batch_size`
        reads it first, so it is refused here, naming Lightning's Tuner (`lightning_tuner`)."""
        from lightning.pytorch.callbacks import BatchSizeFinder

        from nanotrain.trainer.lightning_tuner import TunerRefusal, tuner_refusal

        raise TunerRefusal(tuner_refusal(BatchSizeFinder))

    def logs_per_step_by_default(self) -> bool:
        """Lightning's `self.log` default: on_step (not on_epoch) in `training_step` and the
        training batch hooks; on_epoch everywhere else."""
        in_step = self._current_fx is None or self._current_fx in _STEP_HOOKS
        return self.training and in_step and not (self.validating or self.testing)


class SchedulerConfigs(list):
    """`trainer.lr_scheduler_configs` in automatic optimization: a list of at most one
    `LRSchedulerConfig` whose changes (`[0] = ...`, `append`, `clear`) become the scheduler
    the Trainer steps (`OptimizerSetup.scheduler`), as changing Lightning's list does."""

    def __init__(self, setup: Any) -> None:
        super().__init__()
        self._setup = setup

    def extend_quietly(self, config: LRSchedulerConfig) -> None:
        """Hold `config` without writing it back (it is the setup's own)."""
        super().append(config)

    def _write_back(self) -> None:
        from nanotrain.strategies.optimizers import SchedulerConfig

        if len(self) > 1:
            raise ValueError(
                "nanotrain trains with one LR scheduler: lr_scheduler_configs can hold one"
            )
        if not self:
            self._setup.scheduler = None
            return
        c = self[0]
        self._setup.scheduler = SchedulerConfig(
            c.scheduler, interval=c.interval, frequency=c.frequency, monitor=c.monitor,
            strict=c.strict, reduce_on_plateau=c.reduce_on_plateau,
        )  # fmt: skip

    def __setitem__(self, index: Any, value: Any) -> None:
        super().__setitem__(index, value)
        self._write_back()

    def append(self, value: Any) -> None:
        """Add a scheduler config (the Trainer steps it)."""
        super().append(value)
        self._write_back()

    def clear(self) -> None:
        """Remove the scheduler (the Trainer steps none)."""
        super().clear()
        self._write_back()
