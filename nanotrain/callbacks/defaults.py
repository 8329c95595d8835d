"""The callbacks every Trainer gets unless switched off, as Lightning adds its own."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from nanotrain.callbacks.base import Callback
from nanotrain.callbacks.checkpoint import ModelCheckpoint
from nanotrain.callbacks.grad_norm import GradNormMonitor
from nanotrain.callbacks.lightning_builtins import builtin_refusal, lightning_builtin
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
    - `LearningRateMonitor(logging_interval="step")` (every rate on log steps), `ThroughputMonitor()`, `GradNormMonitor()`, `MoELoadMonitor()`
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
            LearningRateMonitor(logging_interval="step"),
            ThroughputMonitor(),
            GradNormMonitor(),
            MoELoadMonitor(),
            RunReport(),
        ]
    return callbacks


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
        TypeError: an entry is neither a nanotrain Callback nor a lightning.pytorch.Callback
            subclass of your own, or is one of Lightning's built-in callbacks (naming its
            nanotrain counterpart: `lightning_builtins.COUNTERPARTS`).
    """
    for cb in user:
        builtin = lightning_builtin(cb)
        if builtin is not None:  # its nanotrain counterpart, by name
            raise builtin_refusal(builtin)
        if not isinstance(cb, Callback | pl.Callback):
            raise TypeError(
                f"callbacks must be nanotrain Callbacks (nanotrain.callbacks) or your own "
                f"subclasses of lightning's Callback, got {type(cb).__name__}"
            )
    given = {type(cb) for cb in user}
    defaults = [
        cb
        for cb in default_callbacks(enable_checkpointing, enable_progress_bar, enable_monitors)
        if type(cb) not in given
    ]
    ordered = [cb for cb in defaults if not isinstance(cb, ModelCheckpoint)] + user
    return ordered + [cb for cb in defaults if isinstance(cb, ModelCheckpoint)]
