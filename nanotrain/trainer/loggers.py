"""Metric loggers: Lightning's own `Logger` objects, written by rank 0 only.

The Trainer accepts any `lightning.pytorch.loggers.Logger` (TensorBoardLogger, CSVLogger,
WandbLogger, MLFlowLogger, ... or your own) through `Trainer(logger=...)`, and builds the ones
named in `TrainerConfig.loggers` inside the run directory:

- "tensorboard": Lightning's `TensorBoardLogger` writing to `<run_dir>/tensorboard/`;
- "csv": Lightning's `CSVLogger` writing `<run_dir>/csv/metrics.csv` (+ `hparams.yaml`);
- "jsonl": `JSONLinesLogger` below, appending to `<run_dir>/metrics.jsonl`.
"""

from __future__ import annotations

import json
import math
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger

from nanotrain.trainer.config import LOGGER_NAMES

__all__ = ["LOGGER_NAMES", "JSONLinesLogger", "LoggerGroup", "make_loggers", "user_loggers"]


class JSONLinesLogger(Logger):
    """A Lightning `Logger` appending one JSON object per `log_metrics` call to `path`:
    {"step": N, "time": t, name: value, ...}. Several calls may share a step (the training
    scalars, a validation run, a callback's values): merge lines by "step" to get one record
    per step. Hyperparameters go to `hparams.json` in the same folder; text to lines {"step",
    "time", "text": {tag: text}}. Non-finite floats are written as strings ("nan", "inf") so every
    line stays valid JSON.
    """

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    @property
    def name(self) -> str:
        return "jsonl"

    @property
    def version(self) -> str:
        return ""

    @property
    def log_dir(self) -> str:
        return str(self.path.parent)

    @staticmethod
    def _jsonable(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        return value

    def _write(self, record: dict[str, Any]) -> None:
        if self._file.closed:  # reopened by a second fit/validate with the same logger
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Append a line with the scalars of `step`."""
        record = {"step": step, "time": round(time.time(), 3)}
        record.update({k: self._jsonable(float(v)) for k, v in metrics.items()})
        self._write(record)

    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kw: Any) -> None:
        """Write `params` to `hparams.json` next to the metrics file (values that are not
        JSON become strings); the metrics file keeps one kind of line."""
        params = dict(vars(params) if isinstance(params, Namespace) else params)
        (self.path.parent / "hparams.json").write_text(json.dumps(params, indent=2, default=str))

    def log_text(self, tag: str, text: str, step: int) -> None:
        """Append a line {"step", "time", "text": {tag: text}}."""
        self._write({"step": step, "time": round(time.time(), 3), "text": {tag: text}})

    def finalize(self, status: str = "success") -> None:
        """Close the file."""
        if not self._file.closed:
            self._file.close()


class LoggerGroup(list):
    """The loggers of this run (a list, as Lightning's `trainer.loggers`); empty on ranks other
    than 0. Its methods fan out to every logger."""

    @property
    def loggers(self) -> list[Logger]:
        """The loggers themselves (this list)."""
        return list(self)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Send scalars to every logger."""
        for logger in self:
            logger.log_metrics(metrics, step)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Record hyperparameters in every logger."""
        for logger in self:
            logger.log_hyperparams(params)

    def log_text(self, tag: str, text: str, step: int) -> None:
        """Send a text entry to every logger that can hold one (TensorBoard, JSON lines)."""
        for logger in self:
            if isinstance(logger, JSONLinesLogger):
                logger.log_text(tag, text, step)
            elif hasattr(getattr(logger, "experiment", None), "add_text"):
                logger.experiment.add_text(tag, text, global_step=step)

    def flush(self) -> None:
        """Push buffered values to disk."""
        for logger in self:
            logger.save()

    def finalize(self) -> None:
        """Flush and close every logger."""
        for logger in self:
            logger.save()
            logger.finalize("success")


def make_loggers(run_dir: Path, names: list[str], extra: list[Logger] | None = None) -> LoggerGroup:
    """The loggers named in `names` (see the module docstring) inside `run_dir`, then the
    user's Lightning `Logger` objects `extra`; call on rank 0 only."""
    loggers: list[Logger] = []
    if "tensorboard" in names:
        loggers.append(
            TensorBoardLogger(run_dir, name="tensorboard", version="", default_hp_metric=False)
        )
    if "csv" in names:
        loggers.append(CSVLogger(run_dir, name="csv", version=""))
    if "jsonl" in names:
        loggers.append(JSONLinesLogger(run_dir / "metrics.jsonl"))
    return LoggerGroup(loggers + list(extra or []))


def user_loggers(logger: Any) -> tuple[bool, list[Logger]]:
    """Read the Trainer's `logger` argument as Lightning does: (use the named loggers?, the
    user's Logger objects). True: the named ones; False/None: none at all; a Logger or a list
    of them: those (plus the named ones only if the list also holds True).

    Raises:
        TypeError: anything else, with what is accepted.
    """
    if logger is True:
        return True, []
    if logger is False or logger is None:
        return False, []
    items = list(logger) if isinstance(logger, (list, tuple)) else [logger]
    for item in items:
        if not isinstance(item, Logger) and item is not True:
            raise TypeError(
                "logger must be True, False, a lightning.pytorch.loggers.Logger (TensorBoardLogger, "
                f"CSVLogger, WandbLogger, MLFlowLogger, ...) or a list of them; got "
                f"{type(item).__name__}"
            )
    return any(item is True for item in items), [item for item in items if item is not True]
