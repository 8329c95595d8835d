"""Metric loggers: TensorBoard event files and a JSON-lines metrics file, written by rank 0."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


class TensorBoardLogger:
    """Writes scalars and text to TensorBoard event files under `log_dir`.

    `experiment` is the underlying `torch.utils.tensorboard.SummaryWriter` (as in Lightning),
    for images, histograms and anything else.
    """

    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.experiment = SummaryWriter(log_dir=str(self.log_dir))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Write each scalar at `step`."""
        for name, value in metrics.items():
            self.experiment.add_scalar(name, value, global_step=step)

    def log_text(self, tag: str, text: str, step: int) -> None:
        """Write a text entry (rendered in TensorBoard's text tab)."""
        self.experiment.add_text(tag, text, global_step=step)

    def flush(self) -> None:
        """Push buffered events to disk."""
        self.experiment.flush()

    def finalize(self) -> None:
        """Flush and close the event file."""
        self.experiment.close()


class JSONLinesLogger:
    """Appends one JSON object per logging call to `path`: {"step": N, "time": t, name: value}.

    Non-finite floats are written as strings ("nan", "inf") so every line stays valid JSON.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    @staticmethod
    def _jsonable(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        return value

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Append a line with the scalars of `step`."""
        record = {"step": step, "time": round(time.time(), 3)}
        record.update({k: self._jsonable(v) for k, v in metrics.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def log_text(self, tag: str, text: str, step: int) -> None:
        """Append a line {"step", "time", "text": {tag: text}}."""
        record = {"step": step, "time": round(time.time(), 3), "text": {tag: text}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def flush(self) -> None:
        """Flush the file."""
        self._file.flush()

    def finalize(self) -> None:
        """Close the file."""
        if not self._file.closed:
            self._file.close()


class LoggerGroup:
    """Fans out to several loggers; empty (a no-op) on ranks other than 0."""

    def __init__(self, loggers: list[Any]) -> None:
        self.loggers = loggers

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Send scalars to every logger."""
        for logger in self.loggers:
            logger.log_metrics(metrics, step)

    def log_text(self, tag: str, text: str, step: int) -> None:
        """Send a text entry to every logger."""
        for logger in self.loggers:
            logger.log_text(tag, text, step)

    def flush(self) -> None:
        """Flush every logger."""
        for logger in self.loggers:
            logger.flush()

    def finalize(self) -> None:
        """Close every logger."""
        for logger in self.loggers:
            logger.finalize()


def make_loggers(run_dir: Path, names: list[str]) -> LoggerGroup:
    """The loggers named in `names` ("tensorboard" → `run_dir/tensorboard/`, "jsonl" →
    `run_dir/metrics.jsonl`), grouped; call on rank 0 only."""
    loggers: list[Any] = []
    if "tensorboard" in names:
        loggers.append(TensorBoardLogger(run_dir / "tensorboard"))
    if "jsonl" in names:
        loggers.append(JSONLinesLogger(run_dir / "metrics.jsonl"))
    return LoggerGroup(loggers)
