"""Asynchronous saves: the training loop waits only while the state is copied to host memory.

`PendingSave(trainer, path)` copies everything a checkpoint holds (model, optimizer state by
name, trainer state, RNG) to host memory, creates the temporary directory (a collective), and
starts a background thread that writes and hashes the files. `finish()` — which the next save,
the end of training or a preemption calls — waits for the thread and then does the collective
part of the commit on the calling (main) thread: the ranks agree that every write succeeded,
rank 0 writes `meta.json`, renames the directory and moves `last`. All collectives therefore
stay on the main thread, in the same order on every rank.

Cost: a host copy of the whole per-rank state lives until the files are written.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nanotrain.checkpoint import commit as _commit
from nanotrain.checkpoint import optim_state, save_load
from nanotrain.checkpoint.collective import attempt
from nanotrain.checkpoint.layout import sharded_layout

if TYPE_CHECKING:
    from nanotrain.trainer import Trainer

__all__ = ["PendingSave"]


class PendingSave:
    """A checkpoint being written in the background; `finish()` commits it.

    Call the constructor and `finish` on every rank at the same points (both are collective).
    """

    def __init__(self, trainer: Trainer, path: str | Path) -> None:
        self.trainer, self.final = trainer, Path(path)
        payload = trainer.checkpoint_payload()
        strategy = trainer.strategy
        if sharded_layout(strategy) is not None and payload.get("optimizer") is not None:
            payload[save_load.EXPORTED_OPTIMIZER] = optim_state.export_state(strategy)
        self.snapshot = save_load.Snapshot.of(trainer, payload)
        self._payload = _to_host(payload)  # the only part the training loop waits for
        self.tmp = save_load.temporary_dir_on_all_ranks(trainer, self.final)
        _commit.IN_PROGRESS.add(self.tmp)
        self._result: tuple[Any, Exception | None] = (None, None)
        self._thread = threading.Thread(target=self._write, name="nanotrain-save", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        self._result = attempt(
            lambda: save_load._write_files(self.trainer, self._payload, self.tmp)
        )
        self._payload = {}  # free the host copy as soon as it is on disk

    def wait_written(self) -> None:
        """Block until this rank's files are written (no collective)."""
        self._thread.join()

    def finish(self) -> Path:
        """Wait for the files, then commit (collective). Returns the checkpoint directory.

        Raises:
            RuntimeError: as `save_checkpoint` when writing or committing failed on any rank.
        """
        self.wait_written()
        written, error = self._result
        try:
            return save_load.conclude(
                self.trainer, self.final, self.tmp, self.snapshot, written, error
            )
        finally:
            _commit.IN_PROGRESS.discard(self.tmp)


def _to_host(obj: Any) -> Any:
    """A copy of `obj` whose tensors are new CPU tensors (training may change the originals).

    GPU tensors are copied into pinned memory without blocking, all of them queued before one
    wait per device, instead of a blocking copy from pageable memory per tensor."""
    devices: set[torch.device] = set()
    copied = _copy_tree(obj, devices)
    for device in devices:
        torch.cuda.current_stream(device).synchronize()  # every queued copy has landed
    return copied


def _copy_tree(obj: Any, devices: set[torch.device]) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if not t.is_cuda:
            return t.to("cpu", copy=True)
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        host.copy_(t, non_blocking=True)
        devices.add(t.device)
        return host
    if isinstance(obj, dict):
        return {k: _copy_tree(v, devices) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        copied = [_copy_tree(v, devices) for v in obj]
        return type(obj)(copied) if isinstance(obj, list) else tuple(copied)
    return obj
