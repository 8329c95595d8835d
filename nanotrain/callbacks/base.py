"""Callback: the hooks the Trainer emits, with what holds when each fires.

Hooks run on every rank, in the order the callbacks were registered; after all callbacks
the NanoModule's hook of the same name runs (without the `trainer, module` arguments), as in
Lightning. Lightning's hooks have Lightning's arguments and cadence (a training "batch" is
one microbatch, as Lightning counts batches under `accumulate_grad_batches`); the
step-level hooks nanotrain adds are `on_train_step_start` / `on_train_step_end`, once per
optimizer step with all its microbatches. A callback observes; it changes control flow only through
`trainer.request_stop()` (end training after the current step) and, inside
`on_before_optimizer_step`, `trainer.request_skip_step()` (drop this step's update).

Order for one `fit` (N steps, validation every V steps, E epochs):

    setup(stage="fit")
    on_fit_start
    on_train_start
      on_train_epoch_start
        on_train_step_start                                                     (per step)
          [per microbatch i: on_train_batch_start → training_step
             → (i = 0: on_before_zero_grad → optimizer_zero_grad)
             → on_before_backward → backward → on_after_backward
             → on_train_batch_end (the last microbatch's after the optimizer step)]
          → on_before_optimizer_step → configure_gradient_clipping → optimizer_step
          → on_train_batch_end (last microbatch) → on_train_step_end
        [every V steps] on_validation_start → on_validation_epoch_start
                        → (on_validation_batch_start, on_validation_batch_end per batch)
                        → on_validation_epoch_end
                        → on_validation_end
      [every `check_val_every_n_epoch` epochs] validation as above, then
      on_train_epoch_end                       (only when an epoch ran to completion)
    [final validation at the last step unless the last step just validated]
    on_train_end
    on_fit_end
    teardown(stage="fit")

On an exception anywhere in between: `on_exception`, then `teardown`, then the exception
propagates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from nanotrain.module import NanoModule
    from nanotrain.strategies.base import StepOutput
    from nanotrain.trainer import Trainer


class Callback:
    """Base class for callbacks; override the hooks you need. Every hook is a no-op here."""

    @property
    def state_key(self) -> str:
        """Key of this callback's state in a checkpoint; unique per class by default."""
        return type(self).__qualname__

    def setup(self, trainer: Trainer, module: NanoModule, stage: str) -> None:
        """Process groups exist and the model is built on its device; optimizers are not yet
        created and no checkpoint has been loaded. `stage` is "fit" or "validate"."""

    def teardown(self, trainer: Trainer, module: NanoModule, stage: str) -> None:
        """Last hook of `fit`/`validate`, also after an exception; loggers are still open."""

    def on_fit_start(self, trainer: Trainer, module: NanoModule) -> None:
        """Optimizers exist, a resumed checkpoint (if any) is loaded into model, optimizer,
        train state and callbacks; `trainer.global_step` is the step training resumes from."""

    def on_fit_end(self, trainer: Trainer, module: NanoModule) -> None:
        """Training and the final validation are done; no more steps will run."""

    def on_train_start(self, trainer: Trainer, module: NanoModule) -> None:
        """The training data loader is built; the first step has not started."""

    def on_train_end(self, trainer: Trainer, module: NanoModule) -> None:
        """The last optimizer step and the final validation have run."""

    def on_train_epoch_start(self, trainer: Trainer, module: NanoModule) -> None:
        """A pass over the training data starts (also when resuming mid-epoch)."""

    def on_train_epoch_end(self, trainer: Trainer, module: NanoModule) -> None:
        """A pass over the training data completed; `trainer.current_epoch` is still that
        epoch's index."""

    def on_train_step_start(
        self, trainer: Trainer, module: NanoModule, microbatches: list[Any], step_idx: int
    ) -> None:
        """nanotrain's step-level hook: before the first microbatch of one optimizer step.
        `microbatches` is this rank's list of them (already on the device); `step_idx` the
        step's index in the epoch. `.grad` still holds the previous step's gradients."""

    def on_train_batch_start(
        self, trainer: Trainer, module: NanoModule, batch: Any, batch_idx: int
    ) -> None:
        """Lightning's: before one microbatch's `training_step` (`batch` on the device,
        `batch_idx` its index in the epoch, counting microbatches as Lightning counts
        batches). Under pp > 1 every microbatch's runs before the pipeline schedule."""

    def on_before_zero_grad(
        self, trainer: Trainer, module: NanoModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """After the first microbatch's `training_step` of a step (as Lightning, at the start
        of an accumulation window), before the gradients are zeroed: `.grad` still holds the
        previous step's gradients (none before the first step). `optimizer` is the step's
        `HookOptimizer`. Under pp > 1 it runs before the schedule."""

    def on_before_backward(self, trainer: Trainer, module: NanoModule, loss: torch.Tensor) -> None:
        """Before each microbatch's backward. `loss` is the (unscaled) loss backward runs on:
        the microbatch's share of the step's mean loss. Not under pp > 1 or ZeRO-2."""

    def on_after_backward(self, trainer: Trainer, module: NanoModule) -> None:
        """After each microbatch's backward: `.grad` holds the gradients accumulated so far;
        after the step's last microbatch they are reduced across replicas (as under
        Lightning's DDP). Changing them here changes the update (e.g. zeroing a frozen
        layer's). Not under pp > 1 or ZeRO-2."""

    def on_before_optimizer_step(
        self, trainer: Trainer, module: NanoModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Gradients are accumulated over all microbatches and reduced across replicas, not
        yet clipped (as Lightning); `trainer.step_output` holds the step's global loss and grad
        norm. The optimizer has not stepped. `trainer.request_skip_step()` here discards this
        step's update; `trainer.request_skip_step(flag)` discards it where the 0-dim device
        tensor `flag` is True, without a host read (fused optimizers only)."""

    def on_train_batch_end(
        self, trainer: Trainer, module: NanoModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Lightning's: after one microbatch's backward; for the last microbatch of a step
        after the optimizer step. `outputs` is Lightning's: {"loss": the microbatch's share of
        the step's loss, detached, **the other keys of a dict training_step returned}. Under
        pp > 1 every microbatch's runs after the step, with the step's loss divided evenly."""

    def on_train_step_end(
        self,
        trainer: Trainer,
        module: NanoModule,
        outputs: StepOutput,
        microbatches: list[Any],
        step_idx: int,
    ) -> None:
        """nanotrain's step-level hook: the optimizer and the step-interval LR scheduler have
        stepped (the gradients are kept until the next step zeroes them),
        `trainer.global_step` counts this step, and the step's metrics are logged if this was
        a logging step (`trainer.is_log_step`). `outputs` is the step's `StepOutput` (global
        loss, grad norm, token and sample counts)."""

    def on_validation_start(self, trainer: Trainer, module: NanoModule) -> None:
        """The model is in eval mode and gradients are off; no validation batch has run."""

    def on_validation_epoch_start(self, trainer: Trainer, module: NanoModule) -> None:
        """Right after `on_validation_start`: a full pass over the validation data begins."""

    def on_validation_batch_start(
        self, trainer: Trainer, module: NanoModule, batch: Any, batch_idx: int
    ) -> None:
        """Before one validation batch's forward (`batch` on the device)."""

    def on_validation_batch_end(
        self, trainer: Trainer, module: NanoModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """One validation batch ran forward; `outputs` is what `validation_step` returned."""

    def on_validation_epoch_end(self, trainer: Trainer, module: NanoModule) -> None:
        """Every validation batch ran; `trainer.callback_metrics` holds the reduced validation
        metrics (averaged over all batches and ranks), already written to the loggers."""

    def on_validation_end(self, trainer: Trainer, module: NanoModule) -> None:
        """Validation is over; the model is back in train mode if it was training."""

    def on_exception(self, trainer: Trainer, module: NanoModule, exception: BaseException) -> None:
        """An exception escaped the loop; it propagates after every callback has seen it."""

    def on_save_checkpoint(
        self, trainer: Trainer, module: NanoModule, checkpoint: dict[str, Any]
    ) -> None:
        """A checkpoint dict has been assembled and is about to be written; may add keys."""

    def on_load_checkpoint(
        self, trainer: Trainer, module: NanoModule, checkpoint: dict[str, Any]
    ) -> None:
        """A checkpoint was read and loaded into model, optimizer and state."""

    def state_dict(self) -> dict[str, Any]:
        """State to save in checkpoints (plain Python values and tensors only)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
