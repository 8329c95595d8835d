"""EarlyStopping: end training when a validation metric stops improving."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from nanotrain.callbacks.base import Callback

if TYPE_CHECKING:
    from nanotrain.module import NanoModule
    from nanotrain.trainer import Trainer

log = logging.getLogger(__name__)


class EarlyStopping(Callback):
    """Stops training once `monitor` has not improved for `patience` validation runs.

    Checked at the end of every validation run during `fit`, on the value in
    `trainer.callback_metrics` (reduced over all batches and ranks, so every rank decides
    alike). An improvement is a value below `best - min_delta` (mode "min") or above
    `best + min_delta` (mode "max"). The best value and the count of runs without
    improvement are saved in checkpoints, so a resumed run keeps counting.

    Args:
        monitor: the logged metric to watch, e.g. "val/loss".
        mode: "min" (lower is better) or "max".
        patience: validation runs without improvement to tolerate before stopping (>= 1).
        min_delta: the smallest change that counts as an improvement (>= 0).
        check_finite: stop at once when the metric is NaN or infinite.
        strict: raise when the metric is missing after a validation run (otherwise ignore
            that run).

    Raises:
        ValueError: for a bad mode, patience or min_delta; at a validation run, with
            `strict`, when `monitor` was not logged (the message lists what was).
    """

    def __init__(
        self,
        monitor: str = "val/loss",
        mode: str = "min",
        patience: int = 3,
        min_delta: float = 0.0,
        check_finite: bool = True,
        strict: bool = True,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        if not isinstance(patience, int) or patience < 1:
            raise ValueError(f"patience must be an integer >= 1, got {patience!r}")
        if min_delta < 0:
            raise ValueError(f"min_delta must be >= 0 (the sign follows mode), got {min_delta}")
        self.monitor = monitor
        self.mode = mode
        self.patience = patience
        self.min_delta = min_delta
        self.check_finite = check_finite
        self.strict = strict
        self.best: float | None = None
        self.wait_count = 0
        self.stopped_step: int | None = None
        self.stop_reason: str | None = None

    @property
    def state_key(self) -> str:
        """One entry per monitored metric and mode, so two EarlyStoppings can coexist."""
        return f"EarlyStopping[{self.monitor},{self.mode}]"

    def _improved(self, value: float) -> bool:
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_validation_end(self, trainer: Trainer, module: NanoModule) -> None:
        """Compare the new value with the best one; request a stop when patience runs out."""
        if not trainer.training:
            return  # `validate` alone has nothing to stop
        if self.monitor not in trainer.callback_metrics:
            if self.strict:
                known = sorted(trainer.callback_metrics)
                raise ValueError(
                    f"EarlyStopping monitors {self.monitor!r}, which was not logged; logged "
                    f"metrics are {known}. Log it in validation_step or pass strict=False"
                )
            return
        value = float(trainer.callback_metrics[self.monitor])
        reason = self.update(value)
        if reason is not None:
            self.stopped_step = trainer.global_step
            self.stop_reason = f"EarlyStopping at step {trainer.global_step}: {reason}"
            if trainer.is_global_zero:
                log.info(self.stop_reason)
            trainer.request_stop()

    def update(self, value: float) -> str | None:
        """Account one validation result; return why training should stop, or None."""
        if self.check_finite and not math.isfinite(value):
            return f"{self.monitor} = {value} is not finite"
        if self._improved(value):
            self.best, self.wait_count = value, 0
            return None
        self.wait_count += 1
        if self.wait_count >= self.patience:
            return (
                f"{self.monitor} did not improve on {self.best:.6g} (by more than "
                f"{self.min_delta:g}) in {self.wait_count} validation runs"
            )
        return None

    def state_dict(self) -> dict[str, Any]:
        """Best value, runs without improvement and, if stopped, the step."""
        return {
            "monitor": self.monitor,
            "mode": self.mode,
            "best": self.best,
            "wait_count": self.wait_count,
            "stopped_step": self.stopped_step,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` returned.

        Raises:
            ValueError: when the state belongs to a different monitor or mode.
        """
        if (state_dict["monitor"], state_dict["mode"]) != (self.monitor, self.mode):
            raise ValueError(
                f"this EarlyStopping watches {self.monitor!r} ({self.mode}) but the checkpoint's "
                f"watched {state_dict['monitor']!r} ({state_dict['mode']}); use the same "
                "monitor and mode to resume, or drop the callback state"
            )
        best = state_dict["best"]
        self.best = None if best is None else float(best)
        self.wait_count = int(state_dict["wait_count"])
        stopped = state_dict["stopped_step"]
        self.stopped_step = None if stopped is None else int(stopped)
