"""The optimizer step of `nanotrain.Trainer`: one step's hook sequence and bookkeeping, and
the requests callbacks make during it (stop, skip this update).

Per optimizer step (Lightning's optimization hooks at Lightning's points, with one step's
microbatches as one accumulation window):

    on_train_batch_start
    → on_before_zero_grad(optimizer); optimizer_zero_grad(epoch, batch_idx, optimizer)
    → strategy.forward_backward(microbatches): per microbatch training_step,
      on_before_backward(loss), backward, on_after_backward() (the last one's gradients
      reduced across replicas)
    → on_before_optimizer_step(optimizer) (gradients not yet clipped; the step's norm known)
    → configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
    → optimizer_step(epoch, batch_idx, optimizer, closure) → strategy's update
    → lr_scheduler_step(scheduler, None) (step-interval schedulers)
    → log → on_train_batch_end → validation cadence

The optimizer the hooks receive is a `HookOptimizer`: its `step` and `zero_grad` go through
the strategy (fp32 masters, ZeRO shards, gradient buckets); everything else is the real
optimizer's (`param_groups`, `state`). Nothing here reads a device value on a step that does
not log (docs/performance.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch

from nanotrain.callbacks.base import Callback
from nanotrain.strategies.base import BackwardHooks, StepOutput
from nanotrain.trainer.hook_optimizer import HookOptimizer

if TYPE_CHECKING:
    from nanotrain.trainer import Trainer


#: the hooks that run around each microbatch's backward
BACKWARD_HOOKS = ("on_before_backward", "on_after_backward")


def backward_hooks_refusal(strategy: Any) -> str:
    """Why `strategy` cannot run `on_before_backward` / `on_after_backward`, and what to do."""
    return (
        f"on_before_backward / on_after_backward cannot run under {type(strategy).__name__} "
        "with this layout: under pipeline parallelism (pp > 1) backward runs per model chunk "
        "inside the schedule, and under ZeRO-2 the reduced gradients live in this rank's "
        "shards, not in .grad; move the code to on_before_optimizer_step (the step's gradients, "
        "reduced, before clipping), or train with pp=1 and zero_stage <= 1"
    )


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
        batch_idx = st.steps_in_epoch
        strategy, module = self.strategy, self.module
        self._call("on_train_batch_start", microbatches, batch_idx)
        optimizer = HookOptimizer(strategy)
        # Lightning zeroes at the start of each accumulation window, after this hook
        self._call("on_before_zero_grad", optimizer)
        module.optimizer_zero_grad(st.epoch, batch_idx, optimizer)
        out = strategy.forward_backward(module, microbatches, batch_idx, self._backward_hooks)
        out.grad_norm = strategy.clip_grad_norm_(None)  # measured before any clipping
        self.step_output = out
        self._skip_requested = False
        self._call("on_before_optimizer_step", optimizer)
        if self._skip_requested:
            strategy.skip_step()
            out.skipped = True
        else:
            clip_algorithm = "norm" if s.gradient_clip_val is not None else None
            module.configure_gradient_clipping(optimizer, s.gradient_clip_val, clip_algorithm)
            optimizer.skip_if = out.skip_flag
            module.optimizer_step(st.epoch, batch_idx, optimizer, lambda: out.loss)
            self._step_scheduler("step")
        self._skip_requested = False
        if out.skipped:
            st.skipped_steps += 1
        st.global_step += 1
        st.steps_in_epoch += 1
        st.add_consumed(out.num_samples, out.num_tokens)  # on the device: no host read
        self._train_sampler.advance(s.micro_batch_size * len(microbatches))
        log_step = st.global_step % s.log_every_n_steps == 0 or self._done()
        self.is_log_step = log_step
        if log_step:
            self._log_train(out)
        else:
            self.metric_book.clear()
        self._call("on_train_batch_end", out, microbatches, batch_idx)
        if log_step:  # what on_train_batch_end logged is written with its step
            logged_in_hook = self.metric_book.close()[0]
            if logged_in_hook:
                self.log_metrics(logged_in_hook)
        else:
            self.metric_book.clear()
        vci = s.val_check_interval
        if self._val_loader is not None and vci and st.global_step % vci == 0:
            self._run_validation()

    def _step_scheduler(self: Trainer, interval: str) -> None:
        setup = self.strategy.optimizer_setup
        if setup is None or setup.scheduler is None or setup.scheduler.interval != interval:
            return
        count = self.state.global_step if interval == "step" else self.state.epoch
        if (count + (1 if interval == "step" else 0)) % setup.scheduler.frequency == 0:
            self.module.lr_scheduler_step(setup.scheduler.scheduler, None)

    def clip_gradients(
        self: Trainer, gradient_clip_val: float | None, gradient_clip_algorithm: str | None
    ) -> None:
        """Clip this step's gradients as `LightningModule.clip_gradients` asks: "norm" (the
        default) scales them to a global norm of at most `gradient_clip_val` (the global norm
        over every shard: layout-independent), "value" clamps every element to
        ``[-gradient_clip_val, gradient_clip_val]``. None values take the Trainer's settings.

        Raises:
            ValueError: a value that contradicts `Trainer(gradient_clip_val=...)` (as
                Lightning), or an unknown algorithm.
        """
        configured = self.settings.gradient_clip_val
        if gradient_clip_val is None:
            gradient_clip_val = configured
        elif configured is not None and configured != gradient_clip_val:
            raise ValueError(
                f"Trainer(gradient_clip_val={configured}) and clip_gradients(gradient_clip_val="
                f"{gradient_clip_val}) disagree; set only one of them"
            )
        algorithm = gradient_clip_algorithm or "norm"
        if algorithm not in ("norm", "value"):
            raise ValueError(
                f"gradient_clip_algorithm must be 'norm' or 'value', got {algorithm!r}"
            )
        if not gradient_clip_val:
            return
        norm = self.step_output.grad_norm
        if algorithm == "norm":
            self.strategy.clip_grads_(norm, max_norm=gradient_clip_val)
        else:
            self.strategy.clip_grads_(norm, clip_value=gradient_clip_val)

    @property
    def _uses_backward_hooks(self: Trainer) -> bool:
        """Whether the module or a callback has `on_before_backward` / `on_after_backward`."""
        module_cls = type(self.module)
        for hook in BACKWARD_HOOKS:
            if getattr(module_cls, hook) is not getattr(pl.LightningModule, hook):
                return True
            if any(getattr(type(cb), hook) is not getattr(Callback, hook) for cb in self.callbacks):
                return True
        return False

    @property
    def _backward_hooks(self: Trainer) -> BackwardHooks | None:
        """`on_before_backward` / `on_after_backward` of the callbacks and the module, when any
        of them has one (None: nothing to call, the strategy's loop stays as it is)."""
        if not self._uses_backward_hooks:
            return None
        if not self.strategy.supports_backward_hooks:
            raise ValueError(backward_hooks_refusal(self.strategy))
        return BackwardHooks(
            before=lambda loss: self._call("on_before_backward", loss),
            after=lambda: self._call("on_after_backward"),
        )

    def _log_train(self: Trainer, out: StepOutput) -> None:
        st = self.state
        logged, prog = self.metric_book.close()
        metrics = {
            "train/loss": out.loss,
            "train/grad_norm": out.grad_norm,
            "trainer/epoch": st.fractional_epoch,
            "trainer/consumed_samples": st.consumed_samples,
        }
        if st.consumed_tokens:
            metrics["trainer/consumed_tokens"] = st.consumed_tokens
        metrics.update(out.metrics)
        metrics.update(logged)
        self.log_metrics(metrics)
        self.callback_metrics.update(self.metric_book.unforked(logged))
        self.progress_bar_metrics.update({"loss": out.loss, **prog})
