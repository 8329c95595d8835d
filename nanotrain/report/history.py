"""The scalars a run logged, read back from its run directory.

The Trainer's loggers write `metrics.jsonl` (one JSON object per logging call) and TensorBoard
event files; the report reads the first when it exists, else the second, so a run that logged
to either can be reported on.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["MetricHistory", "read_history"]


class MetricHistory:
    """Logged scalars by name: `series[name]` is a list of (step, value), sorted by step.

    When a step was logged twice (a run resumed from an earlier checkpoint logs the rewound
    steps again), the later value wins: it belongs to the run that continued.
    """

    def __init__(self, series: dict[str, dict[int, float]] | None = None, source: str = "") -> None:
        self._series = {k: dict(v) for k, v in (series or {}).items()}
        self.source = source

    def add(self, name: str, step: int, value: float) -> None:
        """Record `value` of `name` at `step` (replacing an earlier value of that step)."""
        self._series.setdefault(name, {})[int(step)] = float(value)

    def names(self) -> list[str]:
        """Every logged scalar name, sorted."""
        return sorted(self._series)

    def points(self, name: str) -> list[tuple[int, float]]:
        """(step, value) of `name`, sorted by step; [] when it was never logged."""
        return sorted(self._series.get(name, {}).items())

    def at(self, name: str, step: int) -> float | None:
        """The value of `name` logged at `step`, or None."""
        return self._series.get(name, {}).get(step)

    def last(self, name: str) -> tuple[int, float] | None:
        """(step, value) of the latest step `name` was logged at, or None."""
        points = self.points(name)
        return points[-1] if points else None

    def best(self, name: str, mode: str = "min") -> tuple[int, float] | None:
        """(step, value) of the lowest (mode "min") or highest finite value; the earliest step
        wins a tie. None when `name` has no finite value."""
        finite = [(s, v) for s, v in self.points(name) if math.isfinite(v)]
        if not finite:
            return None
        sign = 1.0 if mode == "min" else -1.0
        return min(finite, key=lambda sv: (sign * sv[1], sv[0]))


def _read_jsonl(path: Path) -> MetricHistory:
    history = MetricHistory(source=path.name)
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash: keep everything before it
        if not isinstance(record, dict) or "step" not in record:
            continue
        for name, value in record.items():
            if name in ("step", "time") or isinstance(value, (dict, list, bool)):
                continue
            try:
                history.add(name, record["step"], float(value))
            except (TypeError, ValueError):
                continue
    return history


def _read_tensorboard(log_dir: Path) -> MetricHistory:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    history = MetricHistory(source="tensorboard")
    for tag in acc.Tags().get("scalars", []):
        for event in acc.Scalars(tag):
            history.add(tag, event.step, event.value)
    return history


def read_history(run_dir: str | Path) -> MetricHistory:
    """The scalars logged in `run_dir`: from `metrics.jsonl`, else from `tensorboard/`; an
    empty history when the run logged neither."""
    run_dir = Path(run_dir)
    if (run_dir / "metrics.jsonl").is_file():
        return _read_jsonl(run_dir / "metrics.jsonl")
    if (run_dir / "tensorboard").is_dir():
        return _read_tensorboard(run_dir / "tensorboard")
    return MetricHistory(source="none")
