"""ModelCheckpoint's arguments: their checks (Lightning's names and nanotrain's, which must
agree where both are given) and the checkpoint names its `filename` template makes."""

from __future__ import annotations

import math
import os
import re
from datetime import timedelta
from typing import Any

import torch

from nanotrain.checkpoint.commit import LAST_POINTER, TMP_MARKER

__all__ = [
    "check_filename",
    "check_name",
    "check_options",
    "format_name",
    "is_int",
    "merge_interval",
    "merge_steps",
]


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_options(
    save_top_k: Any, mode: str, keep_best_k: Any, monitor: str | None, save_last: Any
) -> None:
    """Refuse out-of-range ranking and retention options, naming the value and the fix."""
    if not is_int(save_top_k) or save_top_k < -1:
        raise ValueError(
            f"save_top_k must be an integer >= -1 (-1: keep all, 0: keep no top-k checkpoint), "
            f"got {save_top_k!r}"
        )
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    if monitor is not None and not isinstance(monitor, str):
        raise TypeError(f"monitor must be a metric name (str) or None, got {monitor!r}")
    if keep_best_k is not None and (not is_int(keep_best_k) or keep_best_k < 0):
        raise ValueError(f"keep_best_k must be a non-negative integer, got {keep_best_k!r}")
    if keep_best_k and monitor is None:
        raise ValueError(
            f"keep_best_k={keep_best_k} needs a metric to rank by: set monitor, e.g. "
            "monitor='val/loss'"
        )
    if save_last not in (None, True, False, "link"):
        raise ValueError(f"save_last must be None, True, False or 'link', got {save_last!r}")


def merge_steps(every_n_steps: Any, every_n_train_steps: Any) -> int | None:
    """The step cadence from nanotrain's and Lightning's spelling (None: none)."""
    if every_n_steps is not None and (not is_int(every_n_steps) or every_n_steps <= 0):
        raise ValueError(f"every_n_steps must be a positive integer or None, got {every_n_steps!r}")
    lightning = every_n_train_steps
    if lightning is not None and (not is_int(lightning) or lightning < 0):
        raise ValueError(
            f"every_n_train_steps must be an integer >= 0 (0: no step cadence) or None, got "
            f"{lightning!r}"
        )
    lightning = lightning or None
    if every_n_steps is not None and every_n_train_steps is not None:
        if lightning != every_n_steps:
            raise ValueError(
                f"every_n_steps={every_n_steps} and every_n_train_steps={every_n_train_steps} "
                "are two names for the same cadence and disagree; pass only one of them"
            )
    return every_n_steps if every_n_steps is not None else lightning


def merge_interval(every_n_minutes: Any, train_time_interval: Any) -> float | None:
    """The time cadence in seconds from nanotrain's and Lightning's spelling (None: none)."""
    minutes = every_n_minutes
    if minutes is not None and (
        not isinstance(minutes, int | float) or isinstance(minutes, bool) or not minutes > 0
    ):
        raise ValueError(f"every_n_minutes must be positive or None, got {minutes!r}")
    interval = train_time_interval
    if interval is not None:
        if not isinstance(interval, timedelta):
            raise TypeError(
                f"train_time_interval must be a datetime.timedelta (as Lightning), got "
                f"{type(interval).__name__} {interval!r}; for a number of minutes pass "
                "every_n_minutes"
            )
        if interval.total_seconds() < 0:
            raise ValueError(f"train_time_interval must not be negative, got {interval}")
    if minutes is not None and interval is not None:
        if not math.isclose(minutes * 60, interval.total_seconds()):
            raise ValueError(
                f"every_n_minutes={minutes} and train_time_interval={interval} are two names "
                "for the same cadence and disagree; pass only one of them"
            )
    if minutes is not None:
        return float(minutes) * 60
    return None if interval is None else interval.total_seconds()


def check_filename(filename: Any, auto_insert_metric_name: bool) -> None:
    """Refuse a `filename` template that is not a str or would not name one directory."""
    if filename is None or filename == "":
        return
    if not isinstance(filename, str):
        raise TypeError(
            f"filename must be a str template such as '{{epoch}}-{{step}}' or None, got "
            f"{type(filename).__name__} {filename!r}; nanotrain's every_n_steps, "
            "every_n_minutes, keep_best_k and async_save are keyword-only"
        )
    literal = re.sub(r"\{.*?\}", "", filename)
    if "/" in literal or os.sep in literal or TMP_MARKER in literal:
        raise ValueError(
            f"filename={filename!r} would not be one directory name: a checkpoint is a "
            f"directory in dirpath, so the name cannot hold '/' or {TMP_MARKER!r}; put "
            "folders in dirpath instead"
        )
    if auto_insert_metric_name:
        slashed = [g[1:] for g in re.findall(r"(\{.*?)[:\}]", filename) if "/" in g]
        if slashed:
            raise ValueError(
                f"filename={filename!r} with auto_insert_metric_name=True would put "
                f"{slashed[0]!r} into the checkpoint name, and its '/' would make a subfolder "
                "(Lightning makes one); pass auto_insert_metric_name=False and write the label "
                "yourself, e.g. 'val_loss={val/loss:.2f}'"
            )


def check_name(name: str, filename: str | None) -> None:
    """Refuse a formatted checkpoint `name` that is no usable directory name."""
    bad = not name or name in (".", "..", LAST_POINTER) or TMP_MARKER in name
    if bad or "/" in name or os.sep in name:
        raise ValueError(
            f"ModelCheckpoint(filename={filename!r}) gave the checkpoint name {name!r}, which is "
            f"not a usable directory name (empty, '.', '..', {LAST_POINTER!r}, or holding '/' "
            f"or {TMP_MARKER!r}); change the template"
        )


def format_name(
    filename: str, metrics: dict[str, Any], auto_insert_metric_name: bool, equals: str
) -> str:
    """Lightning's `ModelCheckpoint._format_checkpoint_name`, step for step."""
    groups = re.findall(r"(\{.*?)[:\}]", filename)
    # longest first, so that "epoch" does not replace a part of "epoch_test"
    for group in sorted(groups, key=len, reverse=True):
        name = group[1:]
        if auto_insert_metric_name:
            filename = filename.replace(group, name + equals + "{" + name)
        # "{0[name]}" reads names with dots too
        filename = filename.replace(group, f"{{0[{name}]")
        if name not in metrics:
            metrics[name] = torch.tensor(0)
    return filename.format(metrics)
