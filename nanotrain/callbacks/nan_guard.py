"""NaNGuard: keep a non-finite loss or gradient from reaching the weights."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nanotrain.callbacks.base import Callback
from nanotrain.checkpoint.files import read_meta
from nanotrain.checkpoint.resume import newest_finite
from nanotrain.runtime.exit_codes import EXIT_NONFINITE
from nanotrain.runtime.host_copy import host_to_device

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

    Where the check runs (`on_device`):

    - on the device (the default when the optimizer can skip an update there: torch's fused
      optimizers, which `optimizer_impl="auto"` picks on CUDA): the bad-step test and the
      skip are decided by the optimizer on the device, so a step never waits for the GPU.
      The guard reads its device-side counters on logging steps (and when a checkpoint is
      saved or training ends): that is when bad steps are logged, counted in
      `trainer.state.skipped_steps`, and when a "stop" (or `max_consecutive`) takes effect.
      The weights never took a bad update, so the checkpoint written then is a good state;
      its data position is after the bad batch. The LR schedule moves on at a bad step.
    - on the host (otherwise, or `on_device=False`): the loss and grad norm are read before
      the optimizer steps (one host-device sync per step), and a stop happens at the bad
      step itself, whose checkpoint's data position is before the bad batch (a resume
      replays it).

    Args:
        action: "skip" or "stop".
        max_consecutive: stop after this many bad steps in a row (>= 1).
        check_grad_norm: also treat a non-finite grad norm as bad.
        save_checkpoint: write the checkpoint when stopping (the directory is then in
            `self.checkpoint_path`).
        on_device: None (default) checks on the device when
            `trainer.strategy.can_skip_on_device`, on the host otherwise; True requires the
            device check; False always checks on the host.

    Raises:
        ValueError: for an unknown action or max_consecutive < 1; at the first step, for
            on_device=True with an optimizer that cannot skip on the device.
    """

    def __init__(
        self,
        action: str = "skip",
        max_consecutive: int = 5,
        check_grad_norm: bool = True,
        save_checkpoint: bool = True,
        on_device: bool | None = None,
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
        self.on_device = on_device
        # device mode: [bad steps, consecutive, checks, check index of the last bad one]
        self._device_counts: torch.Tensor | None = None
        self._first_check_step = 0

    def on_before_optimizer_step(
        self, trainer: Trainer, module: NanoModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Skip the update of a bad step; stop when configured or too many in a row."""
        out = trainer.step_output
        if out is None or out.skipped:
            # Already discarded by the precision plugin (an fp16 overflow: the loss scale
            # halves and the next step retries), which is dynamic loss scaling working.
            return
        checked = [out.loss] + ([out.grad_norm] if self.check_grad_norm else [])
        checked = [v for v in checked if v is not None]
        if self._checks_on_device(trainer):
            self._check_on_device(trainer, torch.stack([v.detach().float() for v in checked]))
            return
        # the first read waits for the device; the second finds it idle
        loss = float(checked[0])
        norm = float(checked[1]) if len(checked) > 1 else 0.0
        if math.isfinite(loss) and math.isfinite(norm):
            self.consecutive = 0
            return
        step = trainer.global_step + 1
        trainer.request_skip_step()
        self.bad_steps += 1
        self.consecutive += 1
        what = f"loss={loss}, grad_norm={norm if self.check_grad_norm else 'unchecked'}"
        self._report(trainer, step, f"at step {step} ({what})")

    def _checks_on_device(self, trainer: Trainer) -> bool:
        if self.on_device is False:
            return False
        if self.on_device and not trainer.strategy.can_skip_on_device:
            raise ValueError(
                "NaNGuard(on_device=True) needs an optimizer that can skip an update on the "
                "device (a fused one: LanguageModelModule(optimizer_impl='fused')) and no fp16 "
                "loss scaling; use on_device=None to fall back to the host check"
            )
        return trainer.strategy.can_skip_on_device

    def _check_on_device(self, trainer: Trainer, values: torch.Tensor) -> None:
        """Skip the update where a value is non-finite and count it, all on the device."""
        bad = ~torch.isfinite(values).all()
        if self._device_counts is None:
            self._first_check_step = trainer.global_step + 1
            start = [self.bad_steps, self.consecutive, 0, -1]
            self._device_counts = host_to_device(start, values.device, torch.long)
        c = self._device_counts
        checks = c[2] + 1
        consecutive = (c[1] + 1) * bad  # back to 0 at a good step
        last = torch.where(bad, c[2], c[3])  # index of this check, 0-based
        self._device_counts = torch.stack([c[0] + bad, consecutive, checks, last])
        trainer.request_skip_step(bad)

    def on_train_step_end(self, trainer: Trainer, module: NanoModule, *args: Any) -> None:
        """Device mode: read the counters on logging steps and act on new bad steps."""
        if trainer.is_log_step:
            self._settle(trainer)

    def on_train_end(self, trainer: Trainer, module: NanoModule) -> None:
        """Device mode: account for bad steps since the last logging step."""
        self._settle(trainer)

    def _settle(self, trainer: Trainer | None) -> None:
        if self._device_counts is None:
            return
        total, consecutive, checks, last = self._device_counts.tolist()  # one device read
        new = total - self.bad_steps
        self.bad_steps, self.consecutive = total, consecutive
        self._device_counts = None  # restarts from the host counters at the next check
        base = self._first_check_step
        if new <= 0 or trainer is None:
            return
        trainer.state.skipped_steps += new
        step = base + last
        self._report(
            trainer,
            step,
            f"in {new} step(s) up to step {trainer.global_step}, the last at step {step}; "
            "their updates were skipped on the device",
            now=trainer.global_step,
        )

    def _report(self, trainer: Trainer, step: int, what: str, now: int | None = None) -> None:
        """Log the counters at `step` and skip, warn, or stop (checkpoint named after `now`,
        the current step in device mode, else the bad step)."""
        trainer.log_metrics(
            {"nan_guard/skipped_steps": self.bad_steps, "nan_guard/consecutive": self.consecutive},
            step=step - 1,  # Lightning's 0-based step of the bad step, as its train/loss
        )
        at = step if now is None else now
        if self.action == "stop":
            self._stop(trainer, at, f"non-finite values {what}")
        elif self.consecutive >= self.max_consecutive:
            self._stop(trainer, at, f"{self.consecutive} bad steps in a row, {what}")
        elif trainer.is_global_zero:
            log.warning("NaNGuard: skipped the update: non-finite values %s", what)

    def _stop(self, trainer: Trainer, step: int, reason: str) -> None:
        where = ""
        if self.save_checkpoint:
            # Weights and optimizer are still those of the last good step (the update was
            # skipped); the data position is before the bad batch, so a resume replays it.
            self.checkpoint_path = trainer.save_checkpoint(
                trainer.checkpoint_dir / f"nan-step-{step}"
            )
            where = self._where_to_resume(Path(self.checkpoint_path))
        self.stop_reason = f"NaNGuard stopped training: {reason}{where}"
        if trainer.is_global_zero:
            log.error(self.stop_reason)
        # A NaN stop is a failure for whoever launched the run: `nanotrain fit` exits non-zero.
        trainer.request_stop(exit_code=EXIT_NONFINITE)

    @staticmethod
    def _where_to_resume(saved: Path) -> str:
        """The stop message's pointer to the state to resume: the checkpoint just saved when
        its state is finite, else the newest finite one (the weights may have gone non-finite
        before a step's loss did)."""
        try:
            nonfinite = read_meta(saved).get("nonfinite")
        except (OSError, ValueError):  # not a checkpoint this process can read back
            nonfinite = None
        if not nonfinite:
            return f"; the last good state is saved in {saved}"
        good = newest_finite(saved.parent)
        found = (
            f"the last finite checkpoint is {good} (ckpt_path='last' resumes it)"
            if good is not None
            else "no finite checkpoint exists: start again, or from an earlier run's checkpoint"
        )
        return f"; the state at the stop is not finite ({', '.join(nonfinite)}), saved in {saved}; {found}"

    def state_dict(self) -> dict[str, Any]:
        """Bad-step counters (device mode: read from the device first)."""
        if self._device_counts is not None:
            counts = self._device_counts.tolist()
            return {"bad_steps": counts[0], "consecutive": counts[1]}
        return {"bad_steps": self.bad_steps, "consecutive": self.consecutive}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the counters of `state_dict`."""
        self.bad_steps = int(state_dict["bad_steps"])
        self.consecutive = int(state_dict["consecutive"])
        self._device_counts = None
