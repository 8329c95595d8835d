"""The closing summary of `nanotrain fit`: what a run achieved and where its files are.

Printed on global rank 0 after fit (the report is written by then), e.g.::

    finished: 12 steps, 24,576 tokens in 0:00:18 (1,546 tokens/s; MFU n/a: no peak ...)
    last validation (step 12): val/loss 4.7076 | 6.7936 bits per byte
    run folder:  runs/tiny_deepseek/version_0
    report:      runs/tiny_deepseek/version_0/report.md
    checkpoint:  runs/tiny_deepseek/version_0/checkpoints/step-00000012
    TensorBoard: tensorboard --logdir runs/tiny_deepseek/version_0/tensorboard
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

_LABEL = 13  # width of the "name:" column


def _shown_path(path: str | Path) -> str:
    """`path` relative to the working directory when it lies below it (shorter to copy)."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _callback(trainer: Any, name: str) -> Any:
    """The trainer's first callback of class `name` (or a subclass of it), or None."""
    return next(
        (cb for cb in trainer.callbacks if any(c.__name__ == name for c in type(cb).__mro__)),
        None,
    )


def _row(name: str, value: str) -> str:
    return f"{name + ':':<{_LABEL}}{value}"


def fit_summary(trainer: Any) -> str:
    """The summary lines of a finished (or stopped) fit of `trainer`.

    Reads the last logged validation values (`trainer.callback_metrics`), the run report of
    `RunReport` (tokens, wall time, mean tokens/s, MFU, the last checkpoint) and the run
    folder; a line whose facts are missing is left out.
    """
    report = getattr(_callback(trainer, "RunReport"), "report", None) or {}
    lines = [_outcome(trainer, report)]
    validation = _validation(trainer)
    if validation:
        lines.append(validation)
    run_dir = getattr(trainer, "run_dir", None)
    if run_dir is not None:
        lines.append(_row("run folder", _shown_path(run_dir)))
        if (Path(run_dir) / "report.md").exists():
            lines.append(_row("report", _shown_path(Path(run_dir) / "report.md")))
    last = (report.get("checkpoints") or {}).get("last")
    if last:
        lines.append(_row("checkpoint", _shown_path(last)))
    if run_dir is not None and (Path(run_dir) / "tensorboard").is_dir():
        logdir = _shown_path(Path(run_dir) / "tensorboard")
        lines.append(_row("TensorBoard", f"tensorboard --logdir {logdir}"))
    return "\n".join(lines)


def _outcome(trainer: Any, report: dict[str, Any]) -> str:
    """`finished: N steps, T tokens in H:MM:SS (R tokens/s; MFU ...)`."""
    status = report.get("status") or ("stopped" if trainer.should_stop else "finished")
    # "finished: 600 steps", or a status that names its step ("stopped early at step 8")
    head = status if "step" in status else f"{status}: {trainer.global_step:,} steps"
    tokens = (report.get("training") or {}).get("tokens")
    if tokens:
        head += f", {int(tokens):,} tokens"
    wall = report.get("wall_time_s")
    if wall:
        head += f" in {datetime.timedelta(seconds=round(wall))}"
    rates = []
    throughput = report.get("throughput") or {}
    tokens_per_sec = (throughput.get("tokens_per_sec") or {}).get("mean")
    if tokens_per_sec:
        rates.append(f"{tokens_per_sec:,.0f} tokens/s")
    mfu = (throughput.get("mfu") or {}).get("mean")
    monitor = _callback(trainer, "ThroughputMonitor")
    if mfu:
        rates.append(f"MFU {100 * mfu:.1f}%")
    elif getattr(monitor, "mfu_note", None):
        rates.append(f"MFU n/a: {monitor.mfu_note}")
    return head + (f" ({'; '.join(rates)})" if rates else "")


def _validation(trainer: Any) -> str | None:
    """`final validation (step N): val/loss X | Y bits per byte`, from the last logged values."""
    metrics = trainer.callback_metrics
    if "val/loss" not in metrics:
        return None
    bar = getattr(trainer, "progress_bar_callback", None)
    step = getattr(bar, "last_validation_step", None)
    where = "last validation" if step is None else f"last validation (step {step:,})"
    text = f"{where}: val/loss {float(metrics['val/loss']):.4f}"
    if "val/bpb" in metrics:
        text += f" | {float(metrics['val/bpb']):.4f} bits per byte"
    return text


def print_fit_summary(trainer: Any) -> None:
    """Print `fit_summary` on global rank 0 (stdout, after the progress bar has closed)."""
    if trainer.is_global_zero:
        print(fit_summary(trainer), flush=True)


__all__ = ["fit_summary", "print_fit_summary"]
