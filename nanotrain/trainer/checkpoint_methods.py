"""The Trainer's checkpoint methods: what a checkpoint holds (`payload.py`) and where it is
stored (`save_load.py`), behind the names Lightning users call."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class CheckpointMethods:
    """Mixin of `nanotrain.Trainer`: save, restore and resume (call them on every rank)."""

    def checkpoint_payload(self) -> dict[str, Any]:
        """Everything this rank needs for an exact resume, as tensors and plain values."""
        from nanotrain.checkpoint.payload import make_payload

        return make_payload(self)

    def load_checkpoint_payload(self, payload: dict[str, Any], weights_only: bool = False) -> None:
        """Restore a payload made by `checkpoint_payload` (only the model when weights_only)."""
        from nanotrain.checkpoint.payload import restore_payload

        restore_payload(self, payload, weights_only)

    def save_checkpoint(self, path: str | Path) -> Path:
        """Write a checkpoint of the current state to `path` (call on every rank): a
        nanotrain checkpoint directory, or for a path ending in ".ckpt" a Lightning
        checkpoint file that `lightning.Trainer(...).fit(ckpt_path=path)` resumes and a plain
        `LightningModule.load_from_checkpoint(path)` reads
        (`nanotrain.checkpoint.lightning_ckpt`)."""
        from nanotrain.checkpoint import save_checkpoint
        from nanotrain.checkpoint.lightning_ckpt import LIGHTNING_SUFFIX, save_lightning

        if Path(path).suffix == LIGHTNING_SUFFIX:
            return save_lightning(self, Path(path))
        return save_checkpoint(self, Path(path))

    def _resume(self, path: Path, weights_only: bool = False) -> None:
        from nanotrain.checkpoint import load_checkpoint
        from nanotrain.checkpoint.files import check_resumable
        from nanotrain.checkpoint.lightning_ckpt import (
            is_lightning_file,
            read_lightning,
            restore_lightning,
        )

        if is_lightning_file(Path(path)):  # written by lightning.Trainer (or as its format)
            restore_lightning(self, read_lightning(Path(path)), weights_only)
            return

        if not weights_only:
            check_resumable(path)
        self.load_checkpoint_payload(load_checkpoint(self, path), weights_only=weights_only)
