"""Trainer: one fixed loop for every strategy, emitting Lightning-named hook events.

Here: the Trainer's construction and the state it keeps, what modules and callbacks read of
it, hook dispatch, `fit` and `log_metrics`. The loop over epochs is in
`nanotrain.trainer.epoch_loop`, one optimizer step's hooks and bookkeeping in
`nanotrain.trainer.train_step`, a stage's setup and teardown in
`nanotrain.trainer.stage_lifecycle`, `validate` and the validation pass in
`nanotrain.trainer.validation`, test/predict in `nanotrain.trainer.evaluation`, checkpoint
methods in `nanotrain.trainer.checkpoint_methods`.

The loop never asks how the job is parallelized: the strategy answers every layout question
(`data_shard`, `reduce`, `clip_grad_norm_`, state dicts).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.model_summary import summarize
from torch.utils.data import DataLoader

from nanotrain.callbacks.base import Callback
from nanotrain.callbacks.checkpoint import ModelCheckpoint
from nanotrain.callbacks.defaults import with_defaults
from nanotrain.callbacks.timer import Timer
from nanotrain.module import NanoModule
from nanotrain.precision import Precision, resolve_precision
from nanotrain.runtime.collective_errors import explain_timeout
from nanotrain.runtime.exit_codes import EXIT_PREEMPTED
from nanotrain.strategies import Strategy, resolve_strategy
from nanotrain.strategies.base import StepOutput
from nanotrain.trainer.accumulation_schedule import check_accumulation_schedule
from nanotrain.trainer.call_forms import check_weights_only, data_arguments
from nanotrain.trainer.checkpoint_methods import CheckpointMethods
from nanotrain.trainer.config import TrainerConfig
from nanotrain.trainer.epoch_loop import EpochLoopMethods
from nanotrain.trainer.evaluation import EvaluationMethods, finish_epoch
from nanotrain.trainer.finetuning_checks import check_finetuning
from nanotrain.trainer.hook_dispatch import CallbackHooks
from nanotrain.trainer.hook_optimizer import check_closure_optimizer, needs_closure
from nanotrain.trainer.lightning_args import setting_names, unknown_setting_error
from nanotrain.trainer.loggers import user_loggers
from nanotrain.trainer.manual import ManualMethods, check_manual
from nanotrain.trainer.metric_book import MetricBook, to_float
from nanotrain.trainer.predict_records import PredictRecords
from nanotrain.trainer.preemption import PreemptionWatch, stop_if_preempted
from nanotrain.trainer.properties import LightningTrainerProperties
from nanotrain.trainer.run_setup import RunSetupMethods
from nanotrain.trainer.stage_lifecycle import StageLifecycleMethods
from nanotrain.trainer.state import TrainState
from nanotrain.trainer.swa_support import FitLoopView, check_swa
from nanotrain.trainer.train_step import TrainStepMethods
from nanotrain.trainer.validation import ValidationMethods


class Trainer(
    LightningTrainerProperties,
    StageLifecycleMethods,
    EpochLoopMethods,
    TrainStepMethods,
    ValidationMethods,
    EvaluationMethods,
    CheckpointMethods,
    RunSetupMethods,
    ManualMethods,
):
    """Runs `fit`, `validate`, `test` and `predict` for a `NanoModule` (or a plain
    LightningModule) under any `Strategy`.

    Args: see `TrainerConfig` for every number (steps, batch sizes, cadences, seeding);
    they are validated at construction and kept as given in `requested_settings`; each stage
    resolves those the data decides (batch sizes, shuffle, seed) into `settings`. Besides
    those:
        strategy: a Strategy instance or "auto" | "single" | "ddp".
        callbacks: callbacks, run in this order at every hook, added to the defaults
            (`nanotrain.callbacks.defaults`; one of the same class replaces the default).
        logger: as Lightning's: True (the loggers named in `loggers`), False (none), or a
            `lightning.pytorch.loggers.Logger` / a list of them (TensorBoardLogger, CSVLogger,
            WandbLogger, MLFlowLogger, ...); written by global rank 0 only.
        config: the resolved config to save as `config.yaml` in the run directory (the CLI
            passes the whole YAML); by default the trainer's own arguments and the module's
            and datamodule's hyperparameters.
        precision: a name ("32-true", "bf16-mixed", "bf16-true", "16-mixed",
            "transformer-engine", "fp8-emulated", "fp4-emulated") or a `nanotrain.precision`
            plugin; handed to the strategy, which applies it (docs/precision.md).
    """

    is_nanotrain = True  # lets NanoModule tell this Trainer from lightning's

    def __init__(
        self,
        strategy: Strategy | str = "auto",
        callbacks: list[Callback] | None = None,
        config: dict[str, Any] | None = None,
        logger: Any = True,
        precision: Precision | str = "32-true",
        **settings: Any,
    ) -> None:
        for name in settings.keys() - TrainerConfig.__dataclass_fields__.keys():
            raise unknown_setting_error(name, setting_names(TrainerConfig))
        # as given; `settings` gets each stage's resolved batch sizes, shuffle and seed
        self.requested_settings = TrainerConfig(**settings)
        self.strategy = resolve_strategy(strategy, self.requested_settings.accelerator)
        self.strategy.precision = resolve_precision(precision)
        self.requested_settings.precision = self.strategy.precision.name
        self.settings = copy.deepcopy(self.requested_settings)
        s = self.settings
        self.callbacks: list[Callback] = with_defaults(
            list(callbacks or []), s.enable_checkpointing, s.enable_progress_bar, s.enable_monitors
        )
        if s.fast_dev_run:  # as Lightning: a dev run writes no logs
            logger = False
        if s.max_time is not None and not any(isinstance(cb, Timer) for cb in self.callbacks):
            self.callbacks.insert(_before_savers(self.callbacks), Timer(s.max_time, "step"))
        self._use_named_loggers, self._user_loggers = user_loggers(logger)
        self._user_config = config
        self.state = TrainState()
        self.module: NanoModule | None = None
        self.datamodule: Any = None
        self.run_dir: Path | None = None
        self._resume_path: Path | None = None
        self._preemption: PreemptionWatch | None = None
        self.loggers = self._your_loggers()  # as Lightning: yours, outside a stage
        self.step_output: StepOutput | None = None
        self.callback_metrics: dict[str, torch.Tensor] = {}
        self.logged_metrics: dict[str, torch.Tensor] = {}  # the last values sent to loggers
        self._interrupted = False
        self._is_last_batch = False
        self._uses_window_hooks = False  # see hook_checks.WINDOW_HOOKS
        self._closure_optimizer = False  # the optimizer's step needs a closure (LBFGS)
        self._callback_hooks = CallbackHooks()
        self.progress_bar_metrics: dict[str, torch.Tensor] = {}
        self.training = False
        # from the start of `fit` to its end (Lightning's `trainer.state.fn == "fit"`): what
        # callbacks ask when they mean "inside fit" (`training` is False in fit's validation)
        self.is_fitting = False
        # during a validation pass lightning.Trainer would not run (fit's final one,
        # validate_at_start): ModelCheckpoint and EarlyStopping do not act on it
        self.validation_is_extra = False
        self._epoch_cut_short = False  # fit ended an epoch midway: see `current_epoch`
        self.validating = False
        self.testing = False
        self.predicting = False
        # what Lightning's BasePredictionWriter reads of a running predict
        self.predict_loop = PredictRecords()
        self.fit_loop = FitLoopView(self)  # what Lightning's StochasticWeightAveraging touches
        self._current_fx: str | None = None  # the hook running now (for self.log defaults)
        self._eval_loader: DataLoader | None = None
        self.should_stop = False
        self.exit_code = 0  # why fit ended early, see nanotrain.runtime.exit_codes (0: normally)
        self._skip_requested = False
        # whether the step now ending logs (read by callbacks in on_train_batch_end)
        self.is_log_step = False
        # from a step's update until the next step or epoch starts: see `logged_step`
        self._step_taken = False
        self._train_loader: DataLoader | None = None
        self._train_sampler: Any = None
        self._val_loader: DataLoader | None = None
        self._last_val_step = -1
        self._book: MetricBook | None = None
        self._fit_sources: tuple[Any, Any] = (None, None)  # fit's loaders, for a reload
        self._manual = False  # the module's automatic_optimization is False (see manual.py)
        # the factor a GradientAccumulationScheduler run was saved with (accumulation_schedule)
        self._resumed_accumulation: int | None = None
        self._last_reload_epoch = 0
        # PL_GLOBAL_SEED as the running stage found it (None: unset), to put back at its end
        self._seed_env_saved = False
        self._seed_env_before: str | None = None

    # -- properties modules and callbacks read (LightningModule relies on several) -------------
    @property
    def checkpoint_dir(self) -> Path:
        """`<run_dir>/checkpoints`, where checkpoints of this run go."""
        if self.run_dir is None:
            raise RuntimeError("the run directory exists only once fit/validate has started")
        return self.run_dir / "checkpoints"

    @property
    def _preempted(self) -> bool:
        return self.exit_code == EXIT_PREEMPTED

    @property
    def metric_book(self) -> MetricBook:
        """Where `self.log` values of the current step or validation run are collected."""
        if self._book is None:
            raise RuntimeError("self.log is only available inside fit/validate")
        return self._book

    @property
    def logged_step(self) -> int:
        """The step the records written now carry, as Lightning writes them: the number of
        optimizer steps completed before the current one (Lightning's
        `fit_loop.epoch_loop._batches_that_stepped`), so the first step's records are at 0.
        From a step's update until the next step or epoch starts (the step's own values, the
        validation after it, the end of the epoch it completes, and what `fit` writes after its
        last step) `global_step` already counts that step, so this is `global_step - 1`;
        before a step, before the first one and outside `fit` (validate, test) it is
        `global_step`. Callbacks that pass `step=` to `log_metrics` use this value. In
        manual optimization it counts batches instead (`state.batches_stepped`), as
        Lightning's rows do there: a batch may take several optimizer steps."""
        done = self.state.batches_stepped if self._manual else self.state.global_step
        return done - 1 if self._step_taken else done

    @property
    def num_microbatches(self) -> int:
        """Microbatches per optimizer step on this process (gradient accumulation). Before a
        stage has resolved the batch sizes: accumulate_grad_batches, else 1 (or, when both
        batch sizes were given, global ÷ (micro × data-parallel size))."""
        s = self.settings
        if s.micro_batch_size is None or s.global_batch_size is None:
            return s.accumulate_grad_batches or 1
        return s.global_batch_size // (s.micro_batch_size * self.strategy.data_shard().count)

    # -- hook dispatch ---------------------------------------------------------------------
    def _call(self, hook: str, *args: Any) -> None:
        module = self.module
        previous, self._current_fx = self._current_fx, hook
        if hook == "on_exception":
            self._interrupted = True
        try:
            # as Lightning, over the live list; a callback whose hook is its base's no-op is
            # not called
            self._callback_hooks.call(self.callbacks, hook, self, module, *args)
            module_hook = getattr(module, hook, None)
            if callable(module_hook) and hook not in ("on_exception",):
                if module_hook(*args) == -1 and hook == "on_train_batch_start":
                    raise ValueError(
                        f"{type(module).__name__}.on_train_batch_start returned -1, which makes "
                        "Lightning skip the rest of the epoch; nanotrain does not: stop training "
                        "with self.trainer.should_stop = True (or a callback's "
                        "trainer.request_stop()) instead"
                    )
        finally:
            self._current_fx = previous

    # -- fit -----------------------------------------------------------------------------------
    def fit(
        self,
        model: NanoModule,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: Any = None,
        ckpt_path: str | Path | None = None,
        weights_only: bool | None = None,
    ) -> None:
        """Train `model` until max_steps, max_epochs or max_tokens (whichever comes first).
        Lightning's signature, positional and keyword (`nanotrain.trainer.call_forms`).

        Args:
            model: the module to train (a NanoModule or a plain LightningModule).
            train_dataloaders / val_dataloaders: a DataLoader or Dataset; without them the
                datamodule's, else the module's own `train_dataloader()` /
                `val_dataloader()`, as in Lightning. A datamodule in the first place is the
                datamodule (`fit(model, dm)`, as Lightning).
            datamodule: a LightningDataModule; its DataLoaders are read with their batch size
                and their sampler's order, resumably and shared out over the data-parallel
                replicas (`nanotrain.trainer.loaders`).
            ckpt_path: resume from this checkpoint, or "last" for the newest of this experiment.
            weights_only: None or True (checkpoints are always read without unpickling code).

        Raises:
            ValueError: a datamodule and dataloaders both, weights_only=False.
        """
        check_weights_only(weights_only)
        datamodule, train_dataloaders, val_dataloaders = data_arguments(
            "fit", datamodule, train_dataloaders, val_dataloaders
        )
        module = model
        self.settings.check_stopping_rule()
        try:
            self.is_fitting, self._epoch_cut_short = True, False
            self._setup(module, datamodule, "fit", ckpt_path)
            self._fit_sources = (train_dataloaders, val_dataloaders)
            self._build_loaders("fit", train_dataloaders, val_dataloaders)
            self._last_reload_epoch = self.state.epoch
            self._manual = not self.module.automatic_optimization
            if self._manual:
                check_manual(self)  # before the strategy parses several optimizers
            check_accumulation_schedule(self)
            check_finetuning(self)
            check_swa(self)
            self.strategy.setup_optimizers(module)
            if not self._manual:
                check_closure_optimizer(self.strategy)
            self._closure_optimizer = not self._manual and needs_closure(self.strategy.optimizer)
            if self._resume_path is not None:
                self._resume(self._resume_path)
            self._make_run_dir()
            if self.settings.enable_model_summary and self.is_global_zero:
                # Lightning's summary runs `example_input_array` through its own Trainer's
                # batch hooks when the module has one; detached, it uses the module's own
                attached, module._trainer = module._trainer, None
                try:
                    print(summarize(module, max_depth=1))
                finally:
                    module._trainer = attached
            self._preemption = PreemptionWatch(self.settings.preemption_signals).install()
            self._call("on_fit_start")
            self.training = True  # the module's modes stay as you set them (as Lightning)
            self._call("on_train_start")
            first_step = self.state.global_step
            at_start = self.settings.validate_at_start and not self.global_step
            if at_start and self._val_loader is not None:
                self._run_validation(lightning_has_it=False)
            self._train_loop()
            # a signal in the last step, when its flag is read a step late (CUDA, several
            # ranks): still save and stop with "preempted"
            stop_if_preempted(self, self._preemption, final=True)
            # what fit writes from here belongs to its last step (as that step's epoch end)
            self._step_taken = self.state.global_step > 0
            stepped = self.state.global_step > first_step  # a second fit may run no step
            cut_short = self.state.steps_in_epoch > 0 and stepped and not self._preempted
            if cut_short:
                # stopped mid-epoch (max_steps, max_tokens, should_stop): as Lightning, the
                # epoch's end hooks still run (the data position stays, for an exact resume)
                finish_epoch(self, "on_train_epoch_end")
            elif self.metric_book.has_epoch_values():  # write what the epoch logged
                self.log_metrics(self.metric_book.close_epoch()[0])
            last_validated = self._last_val_step == self.state.global_step
            if self._val_loader is not None and not last_validated and not self._preempted:
                self._run_validation(lightning_has_it=False)
            self._epoch_cut_short = cut_short  # as Lightning: from here the epoch counts as done
            self._call("on_train_end")  # as Lightning: still training in both
            self._call("on_fit_end")
            self.training = False
        except BaseException as exc:
            if self.module is not None:
                self._call("on_exception", exc)
            stalled = explain_timeout(exc, self.strategy)  # name the collective and group
            if stalled is not None:
                raise stalled from exc
            raise
        finally:
            self.training = self.is_fitting = False
            if self._preemption is not None:
                self._preemption.uninstall()
            self._teardown("fit")

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Write scalars to the loggers (rank 0) and remember them in `callback_metrics`.
        Call on every rank; only rank 0 writes.

        As Lightning's `LoggerConnector.log_metrics`: without `step`, a logged "step" value is
        the step; else the record is written at `logged_step` (the first optimizer step's
        values at 0) with an `epoch` column (`current_epoch`) added. An explicit `step` is
        used as given, without the `epoch` column."""
        values = {k: to_float(v) for k, v in metrics.items() if v is not None}
        as_tensors = {k: torch.tensor(v) for k, v in values.items()}
        self.callback_metrics.update(as_tensors)
        self.logged_metrics.update(as_tensors)
        if not values:  # as Lightning: nothing logged, no record
            return
        if step is None:
            if "step" in values:
                step = int(values.pop("step"))
            else:
                values.setdefault("epoch", self.current_epoch)
                step = self.logged_step
        self.loggers.log_metrics(values, step)


def _before_savers(callbacks: list[Any]) -> int:
    """The index before the checkpoint callbacks at the list's end (Lightning runs them last)."""
    index = len(callbacks)
    while index and isinstance(callbacks[index - 1], ModelCheckpoint):
        index -= 1
    return index
