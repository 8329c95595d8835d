"""The optimizer step of `nanotrain.Trainer`: one step's hook sequence and bookkeeping, and
the requests callbacks make during it (stop, skip this update).

Per optimizer step:

    on_train_batch_start → out = strategy.forward_backward(microbatches)
    → strategy.clip_grad_norm_() → on_before_optimizer_step
    → strategy.optimizer_step(); lr_scheduler.step() → log → on_train_batch_end
    → validation cadence

Nothing here reads a device value on a step that does not log (docs/performance.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from nanotrain.strategies.base import StepOutput

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
        batch_idx = st.steps_in_epoch
        self._call("on_train_batch_start", microbatches, batch_idx)
        out = self.strategy.forward_backward(self.module, microbatches, batch_idx)
        out.grad_norm = self.strategy.clip_grad_norm_(s.gradient_clip_val)
        self.step_output = out
        self._skip_requested = False
        self._call("on_before_optimizer_step", self.strategy.optimizer)
        if self._skip_requested:
            self.strategy.skip_step()
            out.skipped = True
        else:
            self.strategy.optimizer_step(skip_if=out.skip_flag)
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
            setup.scheduler.scheduler.step()

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
