"""Timer: Lightning's `Timer` callback (and what `Trainer(max_time=...)` adds): stop training
once a time budget is spent, the time kept in checkpoints so a resumed run counts on."""

from __future__ import annotations

import re
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from nanotrain.callbacks.base import Callback

if TYPE_CHECKING:
    from nanotrain.module import NanoModule
    from nanotrain.trainer import Trainer

STAGES = ("train", "validate", "test")


def parse_duration(duration: Any, name: str = "duration") -> float | None:
    """Seconds of a Lightning duration: "DD:HH:MM:SS", a dict of `timedelta` arguments, a
    `timedelta`, or None (no limit).

    Raises:
        ValueError: any other form, naming the accepted ones.
    """
    if duration is None:
        return None
    if isinstance(duration, str):
        match = re.fullmatch(r"(\d+):(\d\d):(\d\d):(\d\d)", duration.strip())
        if not match:
            raise ValueError(
                f"{name}={duration!r} is not a duration: pass a string 'DD:HH:MM:SS' (e.g. "
                "'00:12:00:00'), a dict such as {'hours': 12}, or a datetime.timedelta"
            )
        days, hours, minutes, seconds = (int(g) for g in match.groups())
        duration = timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
    elif isinstance(duration, dict):
        try:
            duration = timedelta(**duration)
        except TypeError as exc:
            raise ValueError(
                f"{name}={duration!r}: a dict holds datetime.timedelta's arguments (days, "
                f"hours, minutes, seconds, ...): {exc}"
            ) from None
    if not isinstance(duration, timedelta):
        raise ValueError(
            f"{name} must be 'DD:HH:MM:SS', a dict of timedelta arguments or a timedelta, got "
            f"{type(duration).__name__}"
        )
    return duration.total_seconds()


class Timer(Callback):
    """Tracks the time spent training, validating and testing and stops training once
    `duration` has passed, as Lightning's `Timer`.

    Args:
        duration: the time budget of training ("DD:HH:MM:SS", a dict of `timedelta`
            arguments, a `timedelta`); None only measures.
        interval: "step" checks after every optimizer step (Lightning: every training batch;
            the same without gradient accumulation), "epoch" at every epoch's end.
        verbose: print a line on rank 0 when the limit is reached.

    The check also runs when fit starts (a resumed run whose budget is spent trains no
    step). Every rank stops together: global rank 0's clock decides.

    Raises:
        ValueError: a malformed duration or an unknown interval.
    """

    def __init__(self, duration: Any = None, interval: str = "step", verbose: bool = True):
        if interval not in ("step", "epoch"):
            raise ValueError(f"Timer interval must be 'step' or 'epoch', got {interval!r}")
        self._duration = parse_duration(duration)
        self._interval = interval
        self._verbose = verbose
        self._start: dict[str, float | None] = dict.fromkeys(STAGES)
        self._end: dict[str, float | None] = dict.fromkeys(STAGES)
        self._offset = 0.0

    def start_time(self, stage: str = "train") -> float | None:
        """`time.monotonic()` when `stage` ("train", "validate", "test") last started."""
        return self._start[stage]

    def end_time(self, stage: str = "train") -> float | None:
        """`time.monotonic()` when `stage` last ended (None while it runs)."""
        return self._end[stage]

    def time_elapsed(self, stage: str = "train") -> float:
        """Seconds spent in `stage`; for training, also those of the run it resumed."""
        start, end = self._start[stage], self._end[stage]
        offset = self._offset if stage == "train" else 0.0
        if start is None:
            return offset
        return (time.monotonic() if end is None else end) - start + offset

    def time_remaining(self, stage: str = "train") -> float | None:
        """Seconds left of `duration` (None without one)."""
        if self._duration is None:
            return None
        return self._duration - self.time_elapsed(stage)

    def _mark(self, which: dict[str, float | None], stage: str) -> None:
        which[stage] = time.monotonic()
        if which is self._start:
            self._end[stage] = None

    def on_train_start(self, trainer: Trainer, module: NanoModule) -> None:  # noqa: D102
        self._mark(self._start, "train")

    def on_train_end(self, trainer: Trainer, module: NanoModule) -> None:  # noqa: D102
        self._mark(self._end, "train")

    def on_validation_start(self, trainer: Trainer, module: NanoModule) -> None:  # noqa: D102
        self._mark(self._start, "validate")

    def on_validation_end(self, trainer: Trainer, module: NanoModule) -> None:  # noqa: D102
        self._mark(self._end, "validate")

    def on_test_start(self, trainer: Trainer, module: NanoModule) -> None:  # noqa: D102
        self._mark(self._start, "test")

    def on_test_end(self, trainer: Trainer, module: NanoModule) -> None:  # noqa: D102
        self._mark(self._end, "test")

    def on_fit_start(self, trainer: Trainer, module: NanoModule) -> None:  # noqa: D102
        if self._duration is not None:  # a resumed budget may be spent already
            self._check(trainer)

    def on_train_step_end(self, trainer: Trainer, module: NanoModule, *args: Any) -> None:  # noqa: D102
        if self._interval == "step" and self._duration is not None:
            self._check(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: NanoModule) -> None:  # noqa: D102
        if self._interval == "epoch" and self._duration is not None:
            self._check(trainer)

    def _check(self, trainer: Trainer) -> None:
        # global rank 0's clock decides: every rank stops after the same step
        spent = trainer.strategy.broadcast_object(self.time_elapsed() >= self._duration, src=0)
        if spent:
            trainer.should_stop = True
            if self._verbose and trainer.is_global_zero:
                elapsed = timedelta(seconds=int(self.time_elapsed()))
                print(f"Time limit reached. Elapsed time is {elapsed}. Signaling Trainer to stop.")

    def state_dict(self) -> dict[str, Any]:
        """{"time_elapsed": {stage: seconds}} (Lightning's keys are the same stages' names)."""
        return {"time_elapsed": {stage: self.time_elapsed(stage) for stage in STAGES}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Count on from the training time of the saved run."""
        self._offset = float(state.get("time_elapsed", {}).get("train", 0.0))
