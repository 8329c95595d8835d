"""EarlyStopping: end training when a validation metric stops improving, with Lightning's
arguments and decisions."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason

from nanotrain.callbacks.base import Callback

if TYPE_CHECKING:
    from nanotrain.module import NanoModule
    from nanotrain.trainer import Trainer

log = logging.getLogger(__name__)

__all__ = ["EarlyStopping", "EarlyStoppingReason"]


class EarlyStopping(Callback):
    """Stops training once `monitor` stops improving (or reaches a threshold), as Lightning's.

    Checked on the value in `trainer.callback_metrics` (reduced over all batches and ranks, so
    every rank decides alike), at the end of each training epoch or of each validation run
    (`check_on_train_epoch_end`). In this order, as Lightning: a non-finite value stops
    (`check_finite`); reaching `stopping_threshold` stops; being worse than
    `divergence_threshold` stops; a value better than the best by more than `min_delta` is the
    new best; otherwise the check counts towards `patience`. A stop goes through
    `trainer.request_stop()`. The best value and the count are saved in checkpoints, so a
    resumed run keeps counting.

    Args:
        monitor: the logged metric to watch, e.g. "val/loss".
        min_delta: the smallest change that counts as an improvement (>= 0).
        patience: checks without improvement to tolerate before stopping (0 and 1 both stop
            at the first check without improvement, as in Lightning).
        verbose: log every improvement and the reason of a stop (see `log_rank_zero_only`).
        mode: "min" (lower is better) or "max".
        strict: raise when the metric is missing at a check (otherwise skip that check).
        check_finite: stop at once when the metric is NaN or infinite.
        stopping_threshold: stop once the metric is better than this.
        divergence_threshold: stop once the metric is worse than this.
        check_on_train_epoch_end: check at the end of each training epoch (True) or of each
            validation run during fit (False); None decides as Lightning: at epoch ends when
            validation runs once per epoch (no `val_check_interval`, `check_val_every_n_epoch`
            1), else after validation.
        log_rank_zero_only: with several processes, log only on rank 0 (else every rank logs,
            its rank in front).

    Attributes:
        best_score: the best value so far (a tensor, ±inf before the first check).
        wait_count: checks since the last improvement.
        stopped_epoch / stopped_step: the epoch / global step of the stop (0 / None before).
        stopping_reason / stopping_reason_message: Lightning's `EarlyStoppingReason` and text.

    Raises:
        ValueError / TypeError: at construction, for a bad mode, patience, min_delta or
            threshold; at a check, with `strict`, when `monitor` was not logged (the message
            lists what was).
    """

    mode_dict = {"min": torch.lt, "max": torch.gt}
    order_dict = {"min": "<", "max": ">"}

    def __init__(
        self,
        monitor: str = "val/loss",
        min_delta: float = 0.0,
        patience: int = 3,
        verbose: bool = False,
        mode: str = "min",
        strict: bool = True,
        check_finite: bool = True,
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
        check_on_train_epoch_end: bool | None = None,
        log_rank_zero_only: bool = False,
    ) -> None:
        if not isinstance(monitor, str):
            raise TypeError(f"monitor must be a metric name (str), got {monitor!r}")
        if mode not in self.mode_dict:
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        if not isinstance(patience, int) or isinstance(patience, bool) or patience < 0:
            raise ValueError(f"patience must be an integer >= 0, got {patience!r}")
        if not _is_number(min_delta):
            raise TypeError(
                f"min_delta must be a number, got {type(min_delta).__name__} {min_delta!r} (the "
                "order of EarlyStopping's arguments is Lightning's: monitor, min_delta, patience, "
                "verbose, mode, ...; pass them by name)"
            )
        if min_delta < 0:
            raise ValueError(f"min_delta must be >= 0 (the sign follows mode), got {min_delta}")
        for name, value in (
            ("stopping_threshold", stopping_threshold),
            ("divergence_threshold", divergence_threshold),
        ):
            if value is not None and not _is_number(value):
                raise TypeError(f"{name} must be a number or None, got {value!r}")
        if check_on_train_epoch_end not in (None, True, False):
            raise ValueError(
                f"check_on_train_epoch_end must be None, True or False, got "
                f"{check_on_train_epoch_end!r}"
            )
        self.monitor = monitor
        self.min_delta = min_delta
        self.patience = patience
        self.verbose = verbose
        self.mode = mode
        self.strict = strict
        self.check_finite = check_finite
        self.stopping_threshold = stopping_threshold
        self.divergence_threshold = divergence_threshold
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self._check_on_train_epoch_end = check_on_train_epoch_end  # resolved in `setup`
        self.log_rank_zero_only = log_rank_zero_only
        # as Lightning: the delta is applied with the sign that makes an improvement harder
        self._signed_delta = min_delta if mode == "max" else -min_delta
        self.best_score = torch.tensor(math.inf if mode == "min" else -math.inf)
        self.best: float | None = None
        self.wait_count = 0
        self.stopped_epoch = 0
        self.stopped_step: int | None = None
        self.stopping_reason = EarlyStoppingReason.NOT_STOPPED
        self.stopping_reason_message: str | None = None
        self.stop_reason: str | None = None
        self._last_check_step: int | None = None

    @property
    def state_key(self) -> str:
        """One entry per monitored metric and mode, so two EarlyStoppings can coexist."""
        return f"EarlyStopping[{self.monitor},{self.mode}]"

    @property
    def monitor_op(self) -> Any:
        """`torch.lt` in mode "min", `torch.gt` in mode "max" (as Lightning)."""
        return self.mode_dict[self.mode]

    def setup(self, trainer: Trainer, module: NanoModule, stage: str) -> None:
        """Decide, as Lightning, whether checks run at epoch ends or after validation."""
        if self.check_on_train_epoch_end is None:
            s = trainer.settings
            once_per_epoch = s.val_check_interval is None and s.check_val_every_n_epoch == 1
            self._check_on_train_epoch_end = once_per_epoch

    def on_train_epoch_end(self, trainer: Trainer, module: NanoModule) -> None:
        """Check at the end of each training epoch (when the check runs there)."""
        if self._check_on_train_epoch_end and trainer.is_fitting:
            self._run_check(trainer)

    def on_validation_end(self, trainer: Trainer, module: NanoModule) -> None:
        """Check after each validation run of `fit` (when the check runs there)."""
        # not after a validation lightning.Trainer would not run (fit's final one)
        extra = trainer.validation_is_extra
        if not self._check_on_train_epoch_end and trainer.is_fitting and not extra:
            self._run_check(trainer)

    def _run_check(self, trainer: Trainer) -> None:
        if getattr(trainer, "fast_dev_run", False):
            return  # as Lightning: a dev run does not stop early
        if self.monitor not in trainer.callback_metrics:
            known = sorted(trainer.callback_metrics)
            message = (
                f"EarlyStopping monitors {self.monitor!r}, which was not logged; logged "
                f"metrics are {known}. Log it in validation_step or pass strict=False"
            )
            if self.strict:
                raise ValueError(message)
            if self.verbose:
                self._log(trainer, message, logging.WARNING)
            return
        if trainer.global_step == self._last_check_step:
            # A run resumed from a checkpoint saved at an epoch's end repeats that epoch's
            # end (validation, on_train_epoch_end): its value was counted already.
            return
        current = torch.as_tensor(trainer.callback_metrics[self.monitor]).detach().squeeze()
        self._last_check_step = trainer.global_step
        should_stop, reason = self._evaluate(current)
        if should_stop:
            self.stopped_epoch = trainer.current_epoch
            self.stopped_step = trainer.global_step
            self.stopping_reason_message = reason
            self.stop_reason = f"EarlyStopping at step {trainer.global_step}: {reason}"
            trainer.request_stop()
        if reason and self.verbose:
            self._log(trainer, reason, logging.INFO)
        elif should_stop and trainer.is_global_zero:
            log.info(self.stop_reason)

    def update(self, value: float | torch.Tensor) -> str | None:
        """Account one check of `value`; return why training should stop, or None."""
        should_stop, reason = self._evaluate(torch.as_tensor(value).detach().squeeze(), value)
        return reason if should_stop else None

    def _evaluate(self, current: torch.Tensor, given: Any = None) -> tuple[bool, str | None]:
        """Lightning's `_evaluate_stopping_criteria`, in the same order and arithmetic."""
        op, order = self.monitor_op, self.order_dict[self.mode]
        if self.check_finite and not torch.isfinite(current):
            self.stopping_reason = EarlyStoppingReason.NON_FINITE_METRIC
            return True, (
                f"Monitored metric {self.monitor} = {current} is not finite. Previous best "
                f"value was {self.best_score:.3f}. Signaling Trainer to stop."
            )
        if self.stopping_threshold is not None and op(current, self.stopping_threshold):
            self.stopping_reason = EarlyStoppingReason.STOPPING_THRESHOLD
            return True, (
                f"Stopping threshold reached: {self.monitor} = {current} {order} "
                f"{self.stopping_threshold}. Signaling Trainer to stop."
            )
        if self.divergence_threshold is not None and op(-current, -self.divergence_threshold):
            self.stopping_reason = EarlyStoppingReason.DIVERGENCE_THRESHOLD
            return True, (
                f"Divergence threshold reached: {self.monitor} = {current} {order} "
                f"{self.divergence_threshold}. Signaling Trainer to stop."
            )
        if op(current - self._signed_delta, self.best_score.to(current.device)):
            if torch.isfinite(self.best_score):
                message = (
                    f"Metric {self.monitor} improved by {abs(self.best_score - current):.3f} >= "
                    f"min_delta = {abs(self.min_delta)}. New best score: {current:.3f}"
                )
            else:
                message = f"Metric {self.monitor} improved. New best score: {current:.3f}"
            self.best_score, self.wait_count = current, 0
            plain = isinstance(given, int | float) and not isinstance(given, bool)
            self.best = float(given) if plain else float(current)
            return False, message
        self.wait_count += 1
        if self.wait_count >= self.patience:
            self.stopping_reason = EarlyStoppingReason.PATIENCE_EXHAUSTED
            return True, (
                f"Monitored metric {self.monitor} did not improve in the last "
                f"{self.wait_count} records. Best score: {self.best_score:.3f}. Signaling "
                "Trainer to stop."
            )
        return False, None

    def _log(self, trainer: Trainer, message: str, level: int) -> None:
        rank = trainer.global_rank if trainer.world_size > 1 else None
        if rank is None or not self.log_rank_zero_only or rank == 0:
            log.log(level, message if rank is None else f"[rank: {rank}] {message}")

    def state_dict(self) -> dict[str, Any]:
        """Best value, checks without improvement and, if stopped, when and why."""
        return {
            "monitor": self.monitor,
            "mode": self.mode,
            "best": self.best,
            "wait_count": self.wait_count,
            "stopped_step": self.stopped_step,
            "stopped_epoch": self.stopped_epoch,
            "stopping_reason": self.stopping_reason.value,
            "stopping_reason_message": self.stopping_reason_message,
            "last_check_step": self._last_check_step,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (this callback's `patience` stays as given).

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
        if best is None:
            self.best_score = torch.tensor(math.inf if self.mode == "min" else -math.inf)
        else:
            self.best_score = torch.tensor(float(best))
        self.wait_count = int(state_dict["wait_count"])
        stopped = state_dict["stopped_step"]
        self.stopped_step = None if stopped is None else int(stopped)
        self.stopped_epoch = int(state_dict.get("stopped_epoch", 0))
        reason = state_dict.get("stopping_reason", EarlyStoppingReason.NOT_STOPPED.value)
        self.stopping_reason = EarlyStoppingReason(reason)
        self.stopping_reason_message = state_dict.get("stopping_reason_message")
        self._last_check_step = state_dict.get("last_check_step")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
