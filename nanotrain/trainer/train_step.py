"""The optimizer step of `nanotrain.Trainer`: one step's hook sequence and bookkeeping, and
the requests callbacks make during it (stop, skip this update).

Per optimizer step (Lightning's hooks at Lightning's points, with one step's microbatches as
one accumulation window; `batch_idx` counts microbatches as Lightning counts batches):

    on_train_step_start(microbatches, step_idx)                        (nanotrain's hook)
    → strategy.forward_backward, per microbatch i:
        on_train_batch_start(batch, batch_idx) → training_step(batch, batch_idx)
        → (i = 0: on_before_zero_grad(optimizer); optimizer_zero_grad(epoch, batch_idx, opt))
        → on_before_backward(loss) → backward → on_after_backward() (the last microbatch's
          gradients reduced across replicas) → on_train_batch_end (all but the last)
    → optimizer_step(epoch, batch_idx, optimizer, closure), whose optimizer.step(closure)
      runs, as Lightning's: the closure (returns the step's loss: forward and backward ran
      above) → on_before_optimizer_step(optimizer) (gradients not yet clipped; the step's
      norm known) → configure_gradient_clipping(optimizer, gradient_clip_val,
      gradient_clip_algorithm) (the clip measures the gradients as the hooks left them)
      → the strategy's update
    → global_step counts the step → lr_scheduler_step(scheduler, None) (step-interval ones;
      epoch-interval ones at the epoch's last step; each when Lightning's batch or epoch
      index + 1 is a multiple of its frequency)
    → on_train_batch_end(outputs, batch, batch_idx) of the last microbatch
    → log → on_train_step_end(outputs: StepOutput, microbatches, step_idx) → validation cadence

When neither the module nor a callback has any of Lightning's per-batch hooks, the strategy
runs its loop bare (gradients zeroed before it); under pp > 1 every microbatch's start hook
runs before the schedule and every end hook after the step (docs/lightning.md).

The optimizer the hooks receive is a `HookOptimizer`: its `step` and `zero_grad` go through
the strategy (fp32 masters, ZeRO shards, gradient buckets); everything else is the real
optimizer's (`param_groups`, `state`). Nothing here reads a device value on a step that does
not log (docs/performance.md).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.enums import GradClipAlgorithmType

from nanotrain.strategies.base import MicrobatchHooks, StepOutput
from nanotrain.trainer.hook_checks import overrides
from nanotrain.trainer.hook_optimizer import HookOptimizer

if TYPE_CHECKING:
    from nanotrain.trainer import Trainer


class TrainStepMethods:
    """Mixin of `nanotrain.Trainer`: the training step and the callbacks' control requests."""

    def request_stop(self: Trainer, exit_code: int = 0) -> None:
        """End training after the current step (final validation and end hooks still run).

        Every rank must request it at the same step (decide from reduced values). A non-zero
        `exit_code` (see `nanotrain.runtime.exit_codes`) says the run ended early for that reason;
        `trainer.exit_code` keeps the first one and `nanotrain fit` exits with it.
        """
        self.should_stop = True
        self.exit_code = self.exit_code or exit_code

    def request_skip_step(self: Trainer, when: torch.Tensor | None = None) -> None:
        """Discard this step's update; valid only inside `on_before_optimizer_step`.

        Args:
            when: None discards it outright (decided on the host). A 0-dim bool tensor on
                the device discards it only where the tensor is True, decided by the
                optimizer on the device with no host read; needs
                `trainer.strategy.can_skip_on_device` (a fused optimizer). Flags of several
                requests are OR-ed; `step_output.skip_flag` holds the result.
        """
        if when is None:
            self._skip_requested = True
            return
        if not self.strategy.can_skip_on_device:
            raise ValueError(
                "request_skip_step(when=...) needs an optimizer that can skip an update on the "
                "device (a fused one, e.g. LanguageModelModule(optimizer_impl='fused')) and no "
                "fp16 loss scaling; call request_skip_step() to skip on the host instead"
            )
        flag = when.reshape(()).bool()
        out = self.step_output
        out.skip_flag = flag if out.skip_flag is None else out.skip_flag | flag

    def _train_step(self: Trainer, microbatches: list[Any]) -> None:
        st, s = self.state, self.settings
        strategy, module = self.strategy, self.module
        step_idx, n = st.steps_in_epoch, len(microbatches)
        first = step_idx * n  # Lightning's batch_idx of the step's first microbatch
        last_step = step_idx + 1 == st.steps_per_epoch
        self._step_taken = False  # records of this step's start: `logged_step` = global_step
        self._call("on_train_step_start", microbatches, step_idx)
        optimizer = HookOptimizer(strategy, lambda: self._before_update(optimizer))
        window = _Window(self, optimizer, microbatches, first, last_step)
        in_loop = window.active and strategy.supports_microbatch_hooks
        if not in_loop:
            window.start_all()  # pipeline: every microbatch's start hook before the schedule
            window.zero_grad()
        hooks = window.hooks() if in_loop else None
        with strategy.precision.step_context():  # one cast of each weight for the step
            out = strategy.forward_backward(module, microbatches, first, hooks)
        if self._closure_optimizer:  # LBFGS: its closure runs the step again
            optimizer.rerun = lambda: self._rerun_step(window, microbatches, first, in_loop)
        out.grad_norm = strategy.clip_grad_norm_(None)  # measured before any clipping
        self._norm_is_current = True  # until a hook that may edit the gradients runs
        self.step_output = out
        self._skip_requested = False
        module.optimizer_step(st.epoch, first + n - 1, optimizer, optimizer.closure_for(out.loss))
        _check_stepped(module, optimizer)
        updated = not self._skip_requested
        self._skip_requested = False
        if out.skipped:
            st.skipped_steps += 1
        st.global_step += 1
        # Lightning's convention: this step's records (and the validation and epoch end after
        # it) are written at the steps completed before it, global_step - 1 (`logged_step`)
        self._step_taken = True
        # as Lightning: the schedulers step after the update (global_step counts it), the
        # epoch-interval ones at the epoch's last batch, before its end hooks
        if updated:
            self._step_scheduler("step", first + n - 1)
        if last_step:
            self._step_scheduler("epoch", st.epoch)
        st.steps_in_epoch += 1
        st.add_consumed(out.num_samples, out.num_tokens)  # on the device: no host read
        self._train_sampler.advance(s.micro_batch_size * n)
        self._publish_step_values()
        window.end_rest(out.loss)  # Lightning's on_train_batch_end of the last microbatch(es)
        log_step = st.global_step % s.log_every_n_steps == 0 or self._done()
        self.is_log_step = log_step
        if log_step:
            self._log_train(out)
        else:
            self.metric_book.clear()
        self._call("on_train_step_end", out, microbatches, step_idx)
        if log_step:  # what on_train_step_end logged is written with its step
            logged_in_hook = self.metric_book.close_step().logger
            if logged_in_hook:
                self.log_metrics(logged_in_hook)
        else:
            self.metric_book.clear()
        if self._val_loader is not None and self._val_check_due():
            self._run_validation()
        if updated:  # as Lightning: a plateau scheduler after the step's validation
            self._step_scheduler("step", first + n - 1, plateau=True)

    def _before_update(self: Trainer, optimizer: HookOptimizer) -> bool:
        """What Lightning runs inside `optimizer.step(closure)` after the closure:
        `on_before_optimizer_step` (where a callback may skip the update), then
        `configure_gradient_clipping`, with the Trainer's `gradient_clip_val` and
        `gradient_clip_algorithm` as Lightning passes them (None when not set). Returns whether
        the update is to be applied.

        As Lightning, the clip measures the norm of the gradients as the hooks left them: when
        a hook that may edit them ran (yours, not nanotrain's own), the norm is measured again
        (`step_output.grad_norm`, logged as train/grad_norm, is then that norm)."""
        s, out = self.settings, self.step_output
        self._call("on_before_optimizer_step", optimizer)
        if self._skip_requested:
            self.strategy.skip_step()
            out.skipped = True
            return False
        if _user_hook_ran(self, "on_before_optimizer_step"):
            out.grad_norm = self.strategy.clip_grad_norm_(None)
        # an override may edit the gradients before it calls clip_gradients
        self._norm_is_current = not _user_defined(self.module, "configure_gradient_clipping")
        algorithm = s.gradient_clip_algorithm
        if algorithm is not None:  # Lightning's type: GradClipAlgorithmType, a str enum
            algorithm = GradClipAlgorithmType(algorithm.lower())
        self.module.configure_gradient_clipping(optimizer, s.gradient_clip_val, algorithm)
        optimizer.skip_if = out.skip_flag
        return True

    def _rerun_step(
        self: Trainer, window: _Window, microbatches: list[Any], first: int, in_loop: bool
    ) -> torch.Tensor:
        """What Lightning's optimizer closure runs when the optimizer calls it again (LBFGS):
        per microbatch training_step, (i = 0) `on_before_zero_grad` and `optimizer_zero_grad`,
        `on_before_backward`, backward, `on_after_backward`; returns the loss. The step's
        output then holds this loss and grad norm (Lightning's outputs are the last call's)."""
        strategy = self.strategy
        if not in_loop:
            window.zero_grad()
        hooks = window.rerun_hooks() if in_loop else None
        with strategy.precision.step_context():
            again = strategy.forward_backward(self.module, microbatches, first, hooks)
        out = self.step_output
        out.loss, out.grad_norm = again.loss, strategy.clip_grad_norm_(None)
        self._norm_is_current = True
        return again.loss

    def _step_scheduler(self: Trainer, interval: str, index: int, plateau: bool = False) -> None:
        """Step an `interval` scheduler where Lightning does: when ``index + 1`` (`index`: the
        step's last batch index in the epoch, or the epoch) is a multiple of its frequency;
        a ReduceLROnPlateau only in the calls with `plateau` (after the step's validation,
        after the epoch's end hooks), with its monitored metric.

        Raises:
            ValueError: a strict plateau scheduler's metric is not in `callback_metrics`."""
        setup = self.strategy.optimizer_setup
        if setup is None or setup.scheduler is None or setup.scheduler.interval != interval:
            return
        config = setup.scheduler
        if (index + 1) % config.frequency or config.reduce_on_plateau != plateau:
            return
        metric = None
        if config.reduce_on_plateau:  # as Lightning: the monitored value, after validation
            metric = self.callback_metrics.get(config.monitor)
            if metric is None:
                if config.strict:
                    raise ValueError(
                        f"ReduceLROnPlateau conditioned on metric {config.monitor!r}, which is "
                        f"not available; available metrics are {sorted(self.callback_metrics)}. "
                        "Log it (e.g. self.log in validation_step) or change the monitor key "
                        "of the lr_scheduler dict (strict=False skips the update instead)"
                    )
                warnings.warn(
                    f"ReduceLROnPlateau conditioned on metric {config.monitor!r} which is not "
                    "available but strict is set to False: the learning rate is not updated",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return
        self.module.lr_scheduler_step(config.scheduler, metric)

    def clip_gradients(
        self: Trainer, gradient_clip_val: float | None, gradient_clip_algorithm: str | None
    ) -> None:
        """Clip this step's gradients as `LightningModule.clip_gradients` asks: "norm" (the
        default) scales them to a global norm of at most `gradient_clip_val` (the global norm
        over every shard: layout-independent), "value" clamps every element to
        ``[-gradient_clip_val, gradient_clip_val]``. None values take the Trainer's settings.

        Raises:
            ValueError: a value or algorithm that contradicts the Trainer's
                `gradient_clip_val` / `gradient_clip_algorithm` (as Lightning), or an unknown
                algorithm.
        """
        gradient_clip_algorithm = _agreeing(
            "gradient_clip_algorithm", self.settings.gradient_clip_algorithm,
            gradient_clip_algorithm,
        )  # fmt: skip
        gradient_clip_val = _agreeing(
            "gradient_clip_val", self.settings.gradient_clip_val, gradient_clip_val
        )
        algorithm = gradient_clip_algorithm or "norm"
        if algorithm not in ("norm", "value"):
            raise ValueError(
                f"gradient_clip_algorithm must be 'norm' or 'value', got {algorithm!r}"
            )
        if not gradient_clip_val:
            return
        if algorithm == "value":
            self.strategy.clip_grads_(self.step_output.grad_norm, clip_value=gradient_clip_val)
        elif self._norm_is_current:  # the gradients are as the step's norm was measured
            self.strategy.clip_grads_(self.step_output.grad_norm, max_norm=gradient_clip_val)
        else:  # as Lightning: the norm of the gradients as they are now
            self.strategy.clip_grad_norm_(gradient_clip_val)
        self._norm_is_current = False

    def _val_check_due(self: Trainer) -> bool:
        """Whether `val_check_interval` asks for validation after this step, as
        Lightning counts it: over the whole run without `check_val_every_n_epoch`, else within
        each epoch that `check_val_every_n_epoch` selects (in optimizer steps, not batches)."""
        st, s = self.state, self.settings
        every, per_epochs = s.val_check_interval, s.check_val_every_n_epoch
        if not every:
            return False
        if type(every) is float:  # a fraction of each epoch, counted in batches as Lightning
            n = self.num_microbatches
            k = max(1, int(st.steps_per_epoch * n * every))
            batches = st.steps_in_epoch * n  # the epoch's batches once this step is done
            return (st.epoch + 1) % per_epochs == 0 and batches // k > (batches - n) // k
        if per_epochs is None:
            return st.global_step % every == 0
        return (st.epoch + 1) % per_epochs == 0 and st.steps_in_epoch % every == 0

    def _publish_step_values(self: Trainer) -> None:
        """As Lightning: the step's `self.log` values are in `callback_metrics`,
        `progress_bar_metrics` and `logged_metrics` (`logger=True` ones, a value logged with
        on_step and on_epoch as `<name>_step`) every step, before its last
        `on_train_batch_end` (device tensors: no host read); the loggers get them on log steps
        only."""
        values = self.metric_book.read_step()
        if values.logger:
            self.logged_metrics.update(values.logger)
        if values.callback:  # every value, `logger=False` ones too (as Lightning)
            self.callback_metrics.update(values.callback)
            self.callback_metrics.update(self.metric_book.unforked(values.callback))
        if values.prog_bar:
            self.progress_bar_metrics.update(values.prog_bar)

    def _log_train(self: Trainer, out: StepOutput) -> None:
        st = self.state
        logged, prog, callback = self.metric_book.close_step()
        metrics = {
            "train/loss": out.loss,
            "train/grad_norm": out.grad_norm,
            "trainer/consumed_samples": st.consumed_samples,
        }
        if st.consumed_tokens:
            metrics["trainer/consumed_tokens"] = st.consumed_tokens
        metrics.update(out.metrics)
        metrics.update(logged)
        self.log_metrics(metrics)
        self.callback_metrics.update(callback)
        self.callback_metrics.update(self.metric_book.unforked(callback))
        self.progress_bar_metrics.update(prog)  # as Lightning: the module's values only


def _user_defined(obj: Any, hook: str) -> bool:
    """Whether `obj` has its own `hook` written outside nanotrain (which may edit the
    gradients; nanotrain's own hooks only read them)."""
    return overrides(obj, hook) and not _nanotrain_code(getattr(obj, hook))


def _nanotrain_code(function: Any) -> bool:
    """Whether `function` is nanotrain's own (it only reads gradients, never edits them)."""
    return getattr(function, "__module__", "").startswith("nanotrain.")


def _user_hook_ran(trainer: Trainer, hook: str) -> bool:
    """Whether `hook` of the module or of a callback is the user's (see `_user_defined`); the
    callbacks that define it come from the Trainer's dispatch table, kept across steps."""
    if _user_defined(trainer.module, hook):
        return True
    defining = trainer._callback_hooks.defining(trainer.callbacks, hook)
    return any(not _nanotrain_code(getattr(cb, hook)) for cb in defining)


def _check_stepped(module: Any, optimizer: HookOptimizer) -> None:
    """After the module's `optimizer_step`: Lightning's error for a closure never called. (An
    override that calls the closure but not `optimizer.step` skips the update, as under
    Lightning: the step still counts, and its gradients are dropped at the next zero_grad.)

    Raises:
        RuntimeError: naming the override and what to call instead.
    """
    if not optimizer.closure_ran:
        raise RuntimeError(
            f"{type(module).__name__}.optimizer_step did not call the optimizer closure (as "
            "Lightning, which refuses this too): call optimizer.step(closure=optimizer_closure), "
            "or optimizer_closure() to skip the update"
        )


def _agreeing(name: str, configured: Any, given: Any) -> Any:
    """`given` if set, else the Trainer's `configured` value; both set and different is
    Lightning's error."""
    if given is None:
        return configured
    if configured is not None and configured != given:
        raise ValueError(
            f"Trainer({name}={configured!r}) and clip_gradients({name}={given!r}) disagree; "
            "set only one of them"
        )
    return given


def lightning_outputs(output: Any, loss: torch.Tensor) -> dict[str, Any]:
    """What Lightning's `on_train_batch_end` gets as `outputs`: {"loss": the microbatch's
    share of the step's loss, detached (Lightning: loss / accumulate_grad_batches)} plus the
    other keys of a dict `training_step` returned."""
    extra = {k: v for k, v in output.items() if k != "loss"} if isinstance(output, Mapping) else {}
    return {"loss": loss.detach(), **extra}


class _Window:
    """Lightning's per-batch hooks of one optimizer step (its accumulation window), in
    Lightning's order: per microbatch i, `on_train_batch_start` → training_step → (i = 0:
    `on_before_zero_grad`, `optimizer_zero_grad`) → `on_before_backward` → backward →
    `on_after_backward` → `on_train_batch_end`, the last microbatch's end hook after the
    optimizer step. `active` is False when neither the module nor a callback has any of these
    hooks: the strategy's loop then runs without them (gradients zeroed before it)."""

    def __init__(
        self,
        trainer: Trainer,
        optimizer: HookOptimizer,
        batches: list[Any],
        first: int,
        last_step: bool,
    ) -> None:
        self.trainer, self.optimizer, self.batches = trainer, optimizer, batches
        self.first, self.last_step = first, last_step
        self.active = trainer._uses_window_hooks
        self._ended = 0  # microbatches whose end hook ran
        self._last_output: dict[str, Any] | None = None

    def hooks(self) -> MicrobatchHooks:
        """The hooks the strategy runs around each microbatch."""
        return MicrobatchHooks(
            start=self.start, before=self._before, after=self._after, end=self._end
        )

    def rerun_hooks(self) -> MicrobatchHooks:
        """The hooks of a microbatch run again by the optimizer's closure (LBFGS): as
        Lightning's closure, without the batch start and end hooks."""
        return MicrobatchHooks(start=_no_hook, before=self._before, after=self._after, end=_no_hook)

    def start(self, i: int, batch: Any) -> None:
        """`on_train_batch_start` of microbatch `i`."""
        t = self.trainer
        t._is_last_batch = self.last_step and i == len(self.batches) - 1
        if self.active:
            t._call("on_train_batch_start", batch, self.first + i)

    def start_all(self) -> None:
        """Every microbatch's start hook (when the strategy cannot run them one by one)."""
        for i, batch in enumerate(self.batches):
            self.start(i, batch)

    def zero_grad(self) -> None:
        """`on_before_zero_grad`, then `optimizer_zero_grad`, which zeroes the gradients."""
        t = self.trainer
        t._call("on_before_zero_grad", self.optimizer)
        t.module.optimizer_zero_grad(t.state.epoch, self.first, self.optimizer)

    def _before(self, i: int, objective: torch.Tensor) -> None:
        if i == 0:
            self.zero_grad()
        self.trainer._call("on_before_backward", objective)

    def _after(self) -> None:
        self.trainer._call("on_after_backward")

    def _end(self, i: int, output: Any, objective: torch.Tensor) -> None:
        outputs = lightning_outputs(output, objective)
        if i == len(self.batches) - 1:
            self._last_output = outputs  # its hook runs after the optimizer step
            return
        self.trainer._call("on_train_batch_end", outputs, self.batches[i], self.first + i)
        self._ended = i + 1

    def end_rest(self, step_loss: torch.Tensor) -> None:
        """The end hooks not run yet: the last microbatch's (after the optimizer step, as
        Lightning), or, when the strategy could not run them one by one, every microbatch's
        with the step's loss divided among them."""
        if not self.active:
            return
        n = len(self.batches)
        for i in range(self._ended, n):
            outputs = self._last_output if i == n - 1 and self._last_output else None
            if outputs is None:
                outputs = {"loss": (step_loss / n).detach()}
            self.trainer._call("on_train_batch_end", outputs, self.batches[i], self.first + i)


def _no_hook(*args: Any) -> None:
    """A hook that does nothing (see `_Window.rerun_hooks`)."""
