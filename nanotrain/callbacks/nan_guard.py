"""NaNGuard: keep a non-finite loss or gradient from reaching the weights."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import torch

from nanotrain.callbacks.base import Callback
from nanotrain.exit_codes import EXIT_NONFINITE

if TYPE_CHECKING:
    from nanotrain.module import NanoModule
    from nanotrain.trainer import Trainer

log = logging.getLogger(__name__)

_ACTIONS = ("skip", "stop")


class NaNGuard(Callback):
    """Checks every step's global loss and grad norm before the optimizer steps.

    A step whose loss (or, with `check_grad_norm`, grad norm before clipping) is NaN or
    infinite is a *bad step*. Its update is always discarded, then:

    - action="skip": training goes on with the next batch; the step still counts
      (`trainer.global_step` and the consumed data move on, `trainer.state.skipped_steps`
      grows).
    - action="stop": a checkpoint of the last good state is written to
      `<run_dir>/checkpoints/nan-step-<N>` (N: the bad step's number) and training ends
      after this step with an error-level log message saying why and where the checkpoint is;
      `trainer.exit_code` becomes `EXIT_NONFINITE` (3), which `nanotrain fit` exits with.

    With either action, `max_consecutive` bad steps in a row also stop training (with a
    checkpoint and the same exit code). Loss and grad norm are global values from the strategy, identical on every
    rank, so every rank takes the same decision.

    Logged at each bad step: nan_guard/skipped_steps (bad steps so far) and
    nan_guard/consecutive.

    Reading the two values costs one host-device sync per step: a guard has to know before
    the optimizer steps.

    Args:
        action: "skip" or "stop".
        max_consecutive: stop after this many bad steps in a row (>= 1).
        check_grad_norm: also treat a non-finite grad norm as bad.
        save_checkpoint: write the checkpoint when stopping (the directory is then in
            `self.checkpoint_path`).

    Raises:
        ValueError: for an unknown action or max_consecutive < 1.
    """

    def __init__(
        self,
        action: str = "skip",
        max_consecutive: int = 5,
        check_grad_norm: bool = True,
        save_checkpoint: bool = True,
    ) -> None:
        if action not in _ACTIONS:
            raise ValueError(f"action must be 'skip' or 'stop', got {action!r}")
        if not isinstance(max_consecutive, int) or max_consecutive < 1:
            raise ValueError(f"max_consecutive must be an integer >= 1, got {max_consecutive!r}")
        self.action = action
        self.max_consecutive = max_consecutive
        self.check_grad_norm = check_grad_norm
        self.save_checkpoint = save_checkpoint
        self.bad_steps = 0
        self.consecutive = 0
        self.stop_reason: str | None = None
        self.checkpoint_path: Any = None

    def on_before_optimizer_step(
        self, trainer: Trainer, module: NanoModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Skip the update of a bad step; stop when configured or too many in a row."""
        out = trainer.step_output
        if out is None or out.skipped:
            # Already discarded by the precision plugin (an fp16 overflow: the loss scale
            # halves and the next step retries), which is dynamic loss scaling working.
            return
        values = [out.loss.detach().float().reshape(())]
        if self.check_grad_norm and out.grad_norm is not None:
            values.append(out.grad_norm.detach().float().reshape(()))
        loss, norm = (torch.stack(values).tolist() + [0.0])[:2]  # one device sync for both
        if math.isfinite(loss) and math.isfinite(norm):
            self.consecutive = 0
            return
        step = trainer.global_step + 1
        trainer.request_skip_step()
        self.bad_steps += 1
        self.consecutive += 1
        trainer.log_metrics(
            {"nan_guard/skipped_steps": self.bad_steps, "nan_guard/consecutive": self.consecutive},
            step=step,
        )
        what = f"loss={loss}, grad_norm={norm if self.check_grad_norm else 'unchecked'}"
        if self.action == "stop":
            self._stop(trainer, step, f"non-finite values at step {step} ({what})")
        elif self.consecutive >= self.max_consecutive:
            self._stop(
                trainer,
                step,
                f"{self.consecutive} bad steps in a row, the last at step {step} ({what})",
            )
        elif trainer.is_global_zero:
            log.warning("NaNGuard: skipped the update of step %d: %s", step, what)

    def _stop(self, trainer: Trainer, step: int, reason: str) -> None:
        where = ""
        if self.save_checkpoint:
            # Weights and optimizer are still those of the last good step (the update was
            # skipped); the data position is before the bad batch, so a resume replays it.
            self.checkpoint_path = trainer.save_checkpoint(
                trainer.checkpoint_dir / f"nan-step-{step}"
            )
            where = f"; the last good state is saved in {self.checkpoint_path}"
        self.stop_reason = f"NaNGuard stopped training: {reason}{where}"
        if trainer.is_global_zero:
            log.error(self.stop_reason)
        # A NaN stop is a failure for whoever launched the run: `nanotrain fit` exits non-zero.
        trainer.request_stop(exit_code=EXIT_NONFINITE)

    def state_dict(self) -> dict[str, Any]:
        """Bad-step counters."""
        return {"bad_steps": self.bad_steps, "consecutive": self.consecutive}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the counters of `state_dict`."""
        self.bad_steps = int(state_dict["bad_steps"])
        self.consecutive = int(state_dict["consecutive"])
