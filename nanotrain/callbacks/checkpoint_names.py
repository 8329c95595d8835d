"""How `ModelCheckpoint` names its checkpoint directories: Lightning's `filename` templates
(with its version counter), or nanotrain's `step-XXXXXXXX`, and a tag for special saves."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nanotrain.callbacks.checkpoint_options import check_name, format_name
from nanotrain.checkpoint.commit import LAST_POINTER

if TYPE_CHECKING:
    from nanotrain.trainer import Trainer


class CheckpointNames:
    """The naming half of `ModelCheckpoint` (a mixin: it reads the callback's `dirpath`,
    `filename`, `auto_insert_metric_name` and `enable_version_counter`), with Lightning's
    class attributes for the pieces of a name."""

    CHECKPOINT_JOIN_CHAR = "-"
    CHECKPOINT_EQUALS_CHAR = "="
    CHECKPOINT_NAME_LAST = LAST_POINTER
    FILE_EXTENSION = ""  # checkpoints are directories
    STARTING_VERSION = 1

    def _monitor_candidates(self, trainer: Trainer) -> dict[str, torch.Tensor]:
        """`trainer.callback_metrics` with "epoch" and "step" as Lightning adds them."""
        metrics = dict(trainer.callback_metrics)
        for key, value in (("epoch", trainer.current_epoch), ("step", trainer.global_step)):
            logged = metrics.get(key)
            metrics[key] = logged.int() if isinstance(logged, torch.Tensor) else torch.tensor(value)
        return metrics

    def format_checkpoint_name(self, metrics: dict[str, Any], ver: int | None = None) -> str:
        """The directory name `filename` gives for `metrics` (Lightning's formatting: missing
        keys become 0; `ver` appends "-v<ver>"). Without a `filename`: "step-XXXXXXXX"."""
        if self.filename is None:
            name = f"step-{int(metrics['step']):08d}"
        else:
            name = format_name(
                self.filename,
                dict(metrics),
                self.auto_insert_metric_name,
                self.CHECKPOINT_EQUALS_CHAR,
            )
        if ver is not None:
            name = self.CHECKPOINT_JOIN_CHAR.join((name, f"v{ver}"))
        return name

    def _path(
        self, trainer: Trainer, metrics: dict[str, Any], tag: str | None, reusable: str | None
    ) -> Path:
        assert self.dirpath is not None
        name = self.format_checkpoint_name(metrics)
        if tag:
            name = self.CHECKPOINT_JOIN_CHAR.join((name, tag))
        check_name(name, self.filename)
        path = self.dirpath / name
        if self.filename is None or not self.enable_version_counter:
            # nanotrain's step names: one step's state has one name (a resumed run saving a
            # step again writes the same state)
            return path
        chosen = None
        if trainer.is_global_zero:  # rank 0 looks at the folder; every rank takes its answer
            version = self.STARTING_VERSION
            chosen = path
            while chosen.exists() and str(chosen) != reusable:
                chosen = self.dirpath / self.CHECKPOINT_JOIN_CHAR.join((name, f"v{version}"))
                version += 1
            chosen = str(chosen)
        if trainer.world_size > 1:
            chosen = trainer.strategy.broadcast_object(chosen)
        return Path(chosen)
