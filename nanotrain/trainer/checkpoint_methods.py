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
        """Write a checkpoint of the current state to `path` (call on every rank)."""
        from nanotrain.checkpoint import save_checkpoint

        return save_checkpoint(self, Path(path))

    def _resume(self, path: Path, weights_only: bool = False) -> None:
        from nanotrain.checkpoint import load_checkpoint
        from nanotrain.checkpoint.files import check_resumable

        if not weights_only:
            check_resumable(path)
        self.load_checkpoint_payload(load_checkpoint(self, path), weights_only=weights_only)
