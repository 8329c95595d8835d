"""The callbacks every Trainer gets unless switched off, as Lightning adds its own."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from nanotrain.callbacks.base import Callback
from nanotrain.callbacks.checkpoint import ModelCheckpoint
from nanotrain.callbacks.grad_norm import GradNormMonitor
from nanotrain.callbacks.lr_monitor import LearningRateMonitor
from nanotrain.callbacks.moe_load import MoELoadMonitor
from nanotrain.callbacks.nan_guard import NaNGuard
from nanotrain.callbacks.progress import ProgressBar
from nanotrain.callbacks.report import RunReport
from nanotrain.callbacks.throughput import ThroughputMonitor


def default_callbacks(
    enable_checkpointing: bool = True,
    enable_progress_bar: bool = True,
    enable_monitors: bool = True,
) -> list[Callback]:
    """The default callbacks of `nanotrain.Trainer` and `nanotrain fit`.

    - `ModelCheckpoint(every_n_steps=100, save_top_k=3)`: a checkpoint every 100 steps and at
      the end, the last 3 kept (with `enable_checkpointing`);
    - `ProgressBar()` (with `enable_progress_bar`);
    - `NaNGuard()`: a step with a non-finite loss or grad norm is skipped (always);
    - `LearningRateMonitor()`, `ThroughputMonitor()`, `GradNormMonitor()`, `MoELoadMonitor()`
      (with `enable_monitors`; the last logs nothing for a dense model) and `RunReport()`
      (report.md, report.json and pictures in the run directory at the end of fit).
    """
    callbacks: list[Callback] = []
    if enable_checkpointing:
        default_saver = ModelCheckpoint(every_n_steps=100, save_top_k=3)
        default_saver.final_save_competes = True  # `ckpt_path="best"`: the trained state
        callbacks.append(default_saver)
    if enable_progress_bar:
        callbacks.append(ProgressBar())
    callbacks.append(NaNGuard())
    if enable_monitors:
        callbacks += [
            LearningRateMonitor(),
            ThroughputMonitor(),
            GradNormMonitor(),
            MoELoadMonitor(),
            RunReport(),
        ]
    return callbacks


def is_user_lightning_callback(cb: Any) -> bool:
    """Whether `cb` is a user's subclass of `lightning.pytorch.Callback` that inherits
    nothing from Lightning's built-in callbacks (those read Lightning's Trainer internals);
    its hooks get Lightning's arguments from the nanotrain Trainer."""
    if not isinstance(cb, pl.Callback):
        return False
    inherited = type(cb).__mro__[1:]
    return not any(
        c.__module__.split(".")[0] in ("lightning", "pytorch_lightning") and c is not pl.Callback
        for c in (type(cb), *inherited)
    )


def with_defaults(
    user: list[Any],
    enable_checkpointing: bool = True,
    enable_progress_bar: bool = True,
    enable_monitors: bool = True,
) -> list[Callback]:
    """The user's callbacks plus every default whose class the user did not pass (a user's
    `ModelCheckpoint` replaces the default one, as in Lightning; the switches turn off
    defaults only, a callback passed explicitly always runs). Defaults run first, so a
    NaN guard has skipped a bad step before user callbacks see it; a checkpoint callback runs
    last, after the callbacks whose state it saves have updated.

    Raises:
        TypeError: an entry is not a nanotrain Callback.
    """
    for cb in user:
        if not isinstance(cb, Callback) and not is_user_lightning_callback(cb):
            raise TypeError(
                f"callbacks must be nanotrain Callbacks (nanotrain.callbacks) or your own "
                f"subclasses of lightning's Callback, got {type(cb).__name__}; Lightning's "
                "built-in callbacks read its Trainer's internals and are not supported: use "
                "their nanotrain counterparts (see docs/lightning.md)"
            )
    given = {type(cb) for cb in user}
    defaults = [
        cb
        for cb in default_callbacks(enable_checkpointing, enable_progress_bar, enable_monitors)
        if type(cb) not in given
    ]
    ordered = [cb for cb in defaults if not isinstance(cb, ModelCheckpoint)] + user
    return ordered + [cb for cb in defaults if isinstance(cb, ModelCheckpoint)]
