"""ProgressBar: step, loss, learning rate, tokens/s and ETA on the console of rank 0."""

from __future__ import annotations

import datetime
import math
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from nanotrain.callbacks.base import Callback

if TYPE_CHECKING:
    from nanotrain.module import NanoModule
    from nanotrain.strategies.base import StepOutput
    from nanotrain.trainer import Trainer

_MODES = ("auto", "rich", "plain", "off")


def total_steps(trainer: Trainer) -> int | None:
    """The step training will end at, as far as it can be known now (None: unknown).

    The smallest of max_steps, max_epochs × steps per epoch and, once tokens were counted,
    max_tokens ÷ tokens per step so far (rounded up). In manual optimization, where a batch
    may take several optimizer steps (a GAN's two), an epoch's steps are its batches times
    the optimizer steps per batch so far.
    """
    s, st = trainer.settings, trainer.state
    candidates = []
    if s.max_steps is not None:
        candidates.append(s.max_steps)
    if s.max_epochs is not None and st.steps_per_epoch:
        per_batch = 1.0
        if getattr(trainer, "_manual", False) and st.batches_stepped:
            per_batch = st.global_step / st.batches_stepped
        candidates.append(math.ceil(s.max_epochs * st.steps_per_epoch * per_batch))
    if s.max_tokens is not None and st.consumed_tokens and st.global_step:
        candidates.append(math.ceil(s.max_tokens * st.global_step / st.consumed_tokens))
    return min(candidates) if candidates else None


def shown_metrics(trainer: Trainer) -> dict[str, float]:
    """What the bar shows after a log step, by display name.

    When the module logs its LM loss (`train/lm_loss`), that comes first as `lm_loss` (the
    number comparable with `val/loss`), then `bpb` (`train/bpb`, bits per byte) when known,
    then the Trainer's total objective as `total_loss`; otherwise the total is shown as
    `loss`. The progress-bar metrics of the module and validation follow.
    """
    bar = {k: float(v) for k, v in trainer.progress_bar_metrics.items()}
    logged = trainer.callback_metrics
    total = float(logged["train/loss"]) if "train/loss" in logged else None
    if "train/lm_loss" not in logged:
        return bar if total is None else {**bar, "loss": total}
    shown = {"lm_loss": float(logged["train/lm_loss"])}
    if "train/bpb" in logged:
        shown["bpb"] = float(logged["train/bpb"])
    if total is not None:
        shown["total_loss"] = total
    shown.update(bar)
    return shown


def _format_duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))


class ProgressBar(Callback):
    """Shows training progress on rank 0; silent on every other rank.

    In a terminal (mode "auto" with a TTY, or "rich") a rich progress bar updates every step
    with the step count, loss, learning rate, tokens/s and the time left. When the output is
    not a terminal (a log file, a batch job) it prints one plain line every
    `log_every_n_steps` instead, e.g.

        step 20/100 (20%) | lm_loss 2.3456 | bpb 3.1234 | total_loss 2.4012 | lr 3.00e-03 | ...

    plus one line per validation run and one when training ends. In a terminal the bar's
    text takes each validation's values as it ends, so the last frame shows the final one.
    For a module that logs its
    LM loss (`LanguageModelModule`) the bar shows that (`lm_loss`, comparable with
    `val/loss`) and its bits per byte, and names the objective with its auxiliary terms
    `total_loss`; other modules show their objective as `loss` (see `shown_metrics`). The
    values shown are those the Trainer logged at the last log step (reading them every step
    would sync the device).
    tokens/s, s/step and the ETA come from the bar's own clock over the steps since its
    previous update (for the first, since the end of the first step after training
    (re)started), so a slow start such as torch.compile's first step skews neither the first
    ETA nor the rate for the rest of the run. A line printed at that first step itself (a
    resume just before a log step, or `log_every_n_steps=1`) shows no rate.

    Args:
        mode: "auto", "rich", "plain" or "off".
        stream: where to write (default: sys.stdout).
        clock: seconds as a float; tests inject a fake one.

    Raises:
        ValueError: for an unknown mode.
    """

    def __init__(
        self,
        mode: str = "auto",
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        self.mode = mode
        self.stream = stream
        self.clock = clock
        self._active = "off"
        self._progress: Any = None
        self._task: Any = None
        self._start_time = 0.0
        self._start_step = self._start_tokens = 0
        # (time, step, tokens) at the bar's previous update: the rate's window starts there
        self._mark: tuple[float, int, int] = (0.0, 0, 0)
        self._shown: dict[str, float] = {}
        self._rate_parts: list[str] = []  # tokens/s and s/step of the last update
        self._rich_text = ""
        # the step the last validation during fit ran after (None: none yet)
        self.last_validation_step: int | None = None

    def _resolve_mode(self, trainer: Trainer) -> str:
        if not trainer.is_global_zero or self.mode == "off":
            return "off"
        if self.mode != "auto":
            return self.mode
        stream = self.stream or sys.stdout
        return "rich" if getattr(stream, "isatty", lambda: False)() else "plain"

    def _write(self, line: str) -> None:
        stream = self.stream or sys.stdout
        stream.write(line + "\n")
        stream.flush()

    def on_fit_start(self, trainer: Trainer, module: NanoModule) -> None:
        """Forget the previous fit's last validation."""
        self.last_validation_step = None

    def on_train_start(self, trainer: Trainer, module: NanoModule) -> None:
        """Pick the display for this rank and start the clock."""
        self._active = self._resolve_mode(trainer)
        self._start_time = self.clock()
        self._start_step = trainer.global_step
        self._start_tokens = trainer.state.consumed_tokens
        self._mark = (self._start_time, self._start_step, self._start_tokens)
        if self._active == "rich":
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            console = Console(file=self.stream, force_terminal=True) if self.stream else None
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[metrics]}"),
                console=console,
            )
            self._progress.start()
            self._task = self._progress.add_task(
                "train", total=total_steps(trainer), completed=trainer.global_step, metrics=""
            )

    def on_train_step_end(
        self,
        trainer: Trainer,
        module: NanoModule,
        outputs: StepOutput,
        microbatches: list[Any],
        step_idx: int,
    ) -> None:
        """Refresh the bar (rich) or print a line on log steps (plain)."""
        if self._active == "off":
            return
        if trainer.global_step == self._start_step + 1:
            # the rate starts after the first step of this (re)start: that step carries CUDA's
            # start-up and torch.compile's compilation, and would skew the first rate and ETA
            # (it reads the device, which the first step does anyway: it checks the token ids)
            self._mark = (self.clock(), trainer.global_step, trainer.state.consumed_tokens)
        if getattr(trainer, "_manual", False):  # manual optimization logs by batches
            is_log_step = trainer.is_log_step
        else:
            is_log_step = trainer.global_step % trainer.settings.log_every_n_steps == 0
        if is_log_step:
            self._shown = shown_metrics(trainer)
        if self._active == "rich":
            if is_log_step or not self._rich_text:  # the text reads the device: log steps only
                self._rich_text = self._metrics_text(trainer, with_eta=False)
            self._progress.update(
                self._task,
                completed=trainer.global_step,
                total=total_steps(trainer),
                metrics=self._rich_text,
            )
        elif is_log_step:
            self._write(self._metrics_text(trainer, with_eta=True))

    def on_validation_end(self, trainer: Trainer, module: NanoModule) -> None:
        """Print the validation metrics shown in the progress bar (plain mode), or put them
        in the bar's text (rich: the validation after the last step would otherwise never
        reach the screen)."""
        if trainer.is_fitting:
            self.last_validation_step = trainer.global_step
        if self._active == "rich":
            self._shown.update({k: float(v) for k, v in trainer.progress_bar_metrics.items()})
            self._rich_text = self._compose(trainer, self._rate_parts)
            self._progress.update(self._task, metrics=self._rich_text)
            return
        if self._active != "plain":
            return
        shown = {k: float(v) for k, v in trainer.progress_bar_metrics.items()}
        values = " | ".join(f"{k} {v:.4f}" for k, v in shown.items())
        self._write(
            f"validation at step {trainer.global_step}" + (f" | {values}" if values else "")
        )

    def _metrics_text(self, trainer: Trainer, with_eta: bool) -> str:
        step = trainer.global_step
        total = total_steps(trainer)
        rate: list[str] = []
        now, consumed = self.clock(), trainer.state.consumed_tokens
        mark_time, mark_step, mark_tokens = self._mark
        elapsed, steps_done = now - mark_time, step - mark_step
        if elapsed > 0 and steps_done > 0:
            tokens = consumed - mark_tokens
            if tokens:
                rate.append(f"{tokens / elapsed:,.0f} tok/s")
            rate.append(f"{elapsed / steps_done:.3f} s/step")
            if with_eta and total:
                rate.append(f"ETA {_format_duration((total - step) * elapsed / steps_done)}")
            self._mark = (now, step, consumed)
            self._rate_parts = [p for p in rate if not p.startswith("ETA")]
        return self._compose(trainer, rate)

    def _compose(self, trainer: Trainer, rate: list[str]) -> str:
        """The line: step, the shown metrics, the learning rate, then `rate`'s parts."""
        step, total = trainer.global_step, total_steps(trainer)
        parts = [f"step {step}/{total} ({100 * step / total:.0f}%)" if total else f"step {step}"]
        parts += [f"{k} {v:.4f}" for k, v in self._shown.items()]
        optimizer = trainer.strategy.optimizer
        parts.append(f"lr {float(optimizer.param_groups[0]['lr']):.2e}")
        return " | ".join(parts + rate)

    def on_train_end(self, trainer: Trainer, module: NanoModule) -> None:
        """Close the bar, or print a closing line."""
        if self._active == "plain":
            elapsed = self.clock() - self._start_time
            steps = trainer.global_step - self._start_step
            self._write(f"done: {steps} steps in {_format_duration(elapsed)}")
        self._close()

    def teardown(self, trainer: Trainer, module: NanoModule, stage: str) -> None:
        """Make sure a rich bar stops even after an exception."""
        self._close()

    def _close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        self._active = "off"
