"""Assemble a run's report from its run directory and write `report.json`, `report.md` and
the pictures.

Sources, all in the run directory: `run_info.json` (written by the `RunReport` callback),
`config.yaml`, the logged metrics (`metrics.jsonl` or `tensorboard/`) and `checkpoints/`.
Anything missing is reported as unknown rather than failing, so a crashed or foreign run
still gets a report of what is known.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import yaml

from nanotrain.report.history import MetricHistory, read_history
from nanotrain.report.plots import Series, line_chart
from nanotrain.report.run_info import read_run_info

__all__ = ["build_report", "write_report", "REPORT_JSON", "REPORT_MD", "PICTURES_DIR"]

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
PICTURES_DIR = "report"


def _read_config(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError:
        return None


def _validation(history: MetricHistory) -> dict[str, Any] | None:
    """Best and last `val/loss` with their logged steps (Lightning's 0-based step: the
    validation after optimizer step N is at N - 1), and `val/bpb` at those steps."""
    best, last = history.best("val/loss"), history.last("val/loss")
    if last is None:
        return None

    def entry(point: tuple[int, float]) -> dict[str, Any]:
        step, loss = point
        return {"step": step, "loss": loss, "bpb": history.at("val/bpb", step)}

    return {
        "best": entry(best) if best else None,
        "last": entry(last),
        "evaluations": len(history.points("val/loss")),
    }


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def _throughput(history: MetricHistory) -> dict[str, Any] | None:
    """Per throughput metric: the mean over logged windows (the first window, which holds
    start-up costs, left out when there are more) and the last window's value."""
    out: dict[str, Any] = {}
    for name in history.names():
        if not name.startswith("throughput/"):
            continue
        values = [v for _, v in history.points(name)]
        steady = values[1:] if len(values) > 1 else values
        out[name.removeprefix("throughput/")] = {"mean": _mean(steady), "last": values[-1]}
    return out or None


def _checkpoint_step(path: Path) -> int | None:
    try:
        return int(json.loads((path / "meta.json").read_text(encoding="utf-8"))["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _checkpoints(
    run_dir: Path, info: dict[str, Any], validation: dict[str, Any] | None
) -> dict[str, Any]:
    """Kept checkpoints; the last (the `last` pointer); the best: the one the checkpoint
    callback ranked best, else the one saved at the step of the best validation loss. Steps
    here are the checkpoints' `global_step` (the number in their names)."""
    from nanotrain.checkpoint.commit import complete_checkpoints, read_last_pointer

    folder = run_dir / "checkpoints"
    kept = {str(p): _checkpoint_step(p) for p in complete_checkpoints(folder)}
    try:
        last = read_last_pointer(folder) if folder.is_dir() else None
    except ValueError:
        last = None
    out: dict[str, Any] = {
        "kept": [{"path": p, "step": s} for p, s in kept.items()],
        "last": str(last) if last is not None and str(last) in kept else None,
        "best": None,
    }
    if out["last"] is None and info.get("last_checkpoint") in kept:
        out["last"] = info["last_checkpoint"]
    recorded = info.get("best_checkpoint")
    if recorded and recorded.get("path") in kept:
        out["best"] = {**recorded, "step": kept[recorded["path"]]}
    elif validation and validation["best"]:
        # validation is logged at the steps completed before the step it follows (Lightning's
        # convention), a checkpoint is named after global_step, which counts that step
        step = validation["best"]["step"] + 1
        match = [p for p, s in kept.items() if s == step]
        if match:
            out["best"] = {"path": match[0], "monitor": "val/loss", "step": step}
    return out


def _training(history: MetricHistory, info: dict[str, Any]) -> dict[str, Any]:
    """Steps, tokens, samples, epochs, skipped steps: the counters at the end of the run
    (`run_info.json`; epochs as a real number, e.g. 1.25 a quarter into the second), else the
    last logged ones (the step of the last `train/loss` + 1, as it is logged 0-based; the
    last `epoch` column: whole epochs)."""
    state = info.get("state") or {}
    last_loss = history.last("train/loss")
    tokens = history.last("trainer/consumed_tokens")
    samples = history.last("trainer/consumed_samples")
    epochs = history.last("epoch")
    epochs = epochs[1] if epochs else None
    if "epoch" in state:
        epochs = float(state["epoch"])
        if state.get("steps_per_epoch"):
            epochs += state.get("steps_in_epoch", 0) / state["steps_per_epoch"]
    settings = info.get("trainer") or {}
    return {
        "steps": state.get("global_step", last_loss[0] + 1 if last_loss else None),
        "tokens": state.get("consumed_tokens", int(tokens[1]) if tokens else None),
        "samples": state.get("consumed_samples", int(samples[1]) if samples else None),
        "epochs": epochs,
        "skipped_steps": state.get("skipped_steps"),
        "last_train_loss": last_loss[1] if last_loss else None,
        "global_batch_size": settings.get("global_batch_size"),
        "micro_batch_size": settings.get("micro_batch_size"),
        "max_steps": settings.get("max_steps"),
    }


def build_report(run_dir: str | Path) -> dict[str, Any]:
    """The report of the run in `run_dir` as a JSON-ready dict (see docs/guide.md).

    Raises:
        FileNotFoundError: when `run_dir` is not a directory.
    """
    return _build(Path(run_dir))[0]


def _build(run_dir: Path) -> tuple[dict[str, Any], MetricHistory]:
    if not run_dir.is_dir():
        raise FileNotFoundError(
            f"{run_dir} is not a run directory; pass one such as runs/<name>/version_0"
        )
    info = read_run_info(run_dir)
    history = read_history(run_dir)
    validation = _validation(history)
    started, ended = info.get("started"), info.get("ended")
    if ended is None and started is not None:
        ended = max((p.stat().st_mtime for p in run_dir.rglob("*") if p.is_file()), default=None)
    report = {
        "run_dir": str(run_dir),
        "status": info.get("status", "unknown (no end recorded: still running or killed)"),
        "started": started,
        "ended": ended,
        "wall_time_s": (ended - started) if started is not None and ended is not None else None,
        "metrics_source": history.source,
        "strategy": info.get("strategy"),
        "model": info.get("model"),
        "data": info.get("data"),
        "training": _training(history, info),
        "validation": validation,
        "throughput": _throughput(history),
        "checkpoints": _checkpoints(run_dir, info, validation),
        "config": _read_config(run_dir),
        "pictures": {},
        "generated": time.time(),
    }
    return report, history


def _draw_pictures(run_dir: Path, history: MetricHistory) -> dict[str, str]:
    """loss.png (training LM loss, total objective and validation loss) and lr.png (learning rate per parameter group)
    under `<run_dir>/report/`; a picture is left out when its metrics were not logged."""
    pictures: dict[str, str] = {}
    # The LM loss is what validation measures; the total objective (MTP, balance terms) is
    # drawn too when it differs, under its own name.
    names = ("train/lm_loss", "train/loss", "val/loss")
    if not history.points("train/lm_loss"):
        names = ("train/loss", "val/loss")
    loss_series = [
        Series(
            "train/loss (total)" if name == "train/loss" and len(names) == 3 else name,
            history.points(name),
            markers=name.startswith("val/"),
        )
        for name in names
        if history.points(name)
    ]
    if loss_series:
        path = run_dir / PICTURES_DIR / "loss.png"
        line_chart(loss_series, path, "loss", ylabel="loss")
        pictures["loss"] = f"{PICTURES_DIR}/loss.png"
    lr_series = [Series(n, history.points(n)) for n in history.names() if n.startswith("lr/")]
    if lr_series:
        path = run_dir / PICTURES_DIR / "lr.png"
        line_chart(lr_series, path, "learning rate", ylabel="lr")
        pictures["lr"] = f"{PICTURES_DIR}/lr.png"
    return pictures


def write_report(run_dir: str | Path) -> dict[str, Any]:
    """Build the report of `run_dir` and write `report.json`, `report.md` and the pictures
    (`report/loss.png`, `report/lr.png`) into it; return the report.

    Raises:
        FileNotFoundError: when `run_dir` is not a directory.
    """
    from nanotrain.report.markdown import render_markdown

    run_dir = Path(run_dir)
    report, history = _build(run_dir)
    report["pictures"] = _draw_pictures(run_dir, history)
    (run_dir / REPORT_JSON).write_text(
        json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8"
    )
    (run_dir / REPORT_MD).write_text(render_markdown(report), encoding="utf-8")
    return report
