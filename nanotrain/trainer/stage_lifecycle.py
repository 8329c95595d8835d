"""What every stage (fit, validate, test, predict) does at its start and its end: attach the
module and the data, check the hooks, run the prepare / setup hooks and `configure_model`,
build the loaders; then the teardown hooks, the loggers finalized and the strategy released."""

from __future__ import annotations

from typing import Any

from nanotrain.module import NanoModule, adopt_lightning_module
from nanotrain.runtime.rng import set_deterministic
from nanotrain.trainer.accumulation_schedule import load_sampler_state
from nanotrain.trainer.hook_checks import (
    WINDOW_HOOKS,
    check_datamodule_hooks,
    check_hooks,
    overrides,
    uses_any_hook,
)
from nanotrain.trainer.lightning_args import check_accelerator
from nanotrain.trainer.lightning_tuner import refuse_tuner_callbacks
from nanotrain.trainer.loaders import build_loaders, limited_steps
from nanotrain.trainer.loggers import LoggerGroup
from nanotrain.trainer.metric_book import MetricBook
from nanotrain.trainer.step_signatures import adapt_steps, restore_steps


class StageLifecycleMethods:
    """Mixin of `nanotrain.Trainer`: set a stage up, build its loaders, tear it down."""

    def _setup(self, module: NanoModule, datamodule: Any, stage: str, ckpt_path: Any) -> None:
        module = adopt_lightning_module(module)
        s = self.settings
        self.strategy.setup_environment()
        check_accelerator(
            s.accelerator, self.strategy.root_device.type, type(self.strategy).__name__
        )
        if stage == "fit" and s.max_tokens is not None:
            if type(module).count_tokens is NanoModule.count_tokens:
                raise ValueError(
                    "max_tokens needs the module to count tokens: override "
                    f"{type(module).__name__}.count_tokens(batch), or use max_steps/max_epochs"
                )
        self.module, self.datamodule = module, datamodule
        adapt_steps(module)  # steps without batch_idx, as Lightning calls them (until teardown)
        self._interrupted = False
        # as Lightning: every stage (a second fit too) starts with no metrics
        self.callback_metrics, self.logged_metrics, self.progress_bar_metrics = {}, {}, {}
        # a Lightning hook this Trainer would not call is an error now, not a different run
        check_hooks(module, self.callbacks, self.strategy)
        refuse_tuner_callbacks(self.callbacks)
        check_datamodule_hooks(datamodule)
        self._uses_window_hooks = uses_any_hook(module, self.callbacks, WINDOW_HOOKS)
        module.trainer = self
        if datamodule is not None:
            datamodule.trainer = self
        self._plan_run_dir(ckpt_path, stage)
        self._seed()
        set_deterministic(s.deterministic)
        self._book = MetricBook(
            lambda: self.strategy.root_device, self.strategy.metric_process_group
        )
        # as Lightning: the datamodule's prepare_data, then the module's, on local rank 0
        module_prepares = overrides(module, "prepare_data")
        if datamodule is not None or module_prepares:
            if self.strategy.local_rank == 0:
                if datamodule is not None:
                    datamodule.prepare_data()
                if module_prepares:
                    module.prepare_data()
            self.strategy.barrier()
        if datamodule is not None:
            datamodule.setup(stage)
        # Lightning's order: the setup hooks, then configure_model
        self._call("setup", stage)
        self.strategy.setup_module(module)

    def _build_loaders(self, stage: str, train_loader: Any, val_loader: Any) -> None:
        from nanotrain.data.sampler import ResumableBatchList

        loaders = build_loaders(self, stage, train_loader, val_loader)
        self._train_loader, self._train_sampler, self._val_loader = loaders
        if stage == "fit":
            self.strategy.check_step_microbatches(self.num_microbatches)
            sampler = self._train_sampler
            if isinstance(sampler, ResumableBatchList):  # counted in the DataLoader's batches
                steps = len(sampler) // self.num_microbatches
            else:
                samples_per_step = self.settings.micro_batch_size * self.num_microbatches
                steps = len(sampler) // samples_per_step
            self.state.steps_per_epoch = limited_steps(
                self.settings.limit_train_batches, steps, self.num_microbatches
            )

    def _load_sampler_state(self, data_state: dict[str, Any]) -> None:
        """Load the training sampler's checkpointed state (see `load_sampler_state`)."""
        load_sampler_state(self, data_state)

    def _your_loggers(self) -> LoggerGroup:
        """The Lightning loggers you passed, on the rank that writes (none elsewhere)."""
        return LoggerGroup(self._user_loggers if self.is_global_zero else [])

    def _teardown(self, stage: str) -> None:
        self._restore_global_seed()  # first: whatever fails below, the next stage starts clean
        if self.datamodule is not None:  # as Lightning: the datamodule's, then the hooks'
            self.datamodule.teardown(stage)
        if self.module is not None:
            restore_steps(self.module)
            self._call("teardown", stage)
        self.loggers.finalize()
        self.loggers = self._your_loggers()  # as Lightning: yours stay readable
        self._step_taken = False  # validate/test after fit log at global_step, as Lightning
        self._train_loader = self._val_loader = None
        self.strategy.teardown()
