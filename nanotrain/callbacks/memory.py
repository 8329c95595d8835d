"""MemoryMonitor: device memory peaks per step (CUDA) or the process's resident memory (CPU)."""

from __future__ import annotations

import resource
import sys
from typing import TYPE_CHECKING, Any

import torch

from nanotrain.callbacks.base import Callback

if TYPE_CHECKING:
    from nanotrain.module import NanoModule
    from nanotrain.strategies.base import StepOutput
    from nanotrain.trainer import Trainer

GIB = 2**30


def process_memory_bytes() -> tuple[int | None, int]:
    """(resident set size now, highest resident set size so far) of this process, in bytes.

    Both come from one read of /proc/self/status (VmRSS, VmHWM) where it exists, so the
    peak is never below the current value; elsewhere the current size is None and the peak
    comes from `getrusage`.
    """
    fields: dict[str, int] = {}
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    fields[key] = int(value.split()[0]) * 1024  # reported in kB
    except (OSError, ValueError):
        pass
    if "VmRSS" in fields and "VmHWM" in fields:
        return fields["VmRSS"], max(fields["VmHWM"], fields["VmRSS"])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # getrusage reports kilobytes on Linux, bytes on macOS.
    return None, peak if sys.platform == "darwin" else peak * 1024


class MemoryMonitor(Callback):
    """Logs memory use, as the maximum over all ranks (the rank closest to running out).

    On CUDA (per step; the peak counters are reset at the start of every step, so a logged
    peak belongs to the logged step alone):
        memory/peak_allocated_gib, memory/peak_reserved_gib: highest bytes held by tensors
        and by the caching allocator during the step; memory/allocated_gib at the step's end.
    On CPU:
        memory/rss_gib: the process's resident memory at the step's end;
        memory/peak_rss_gib: the highest it has been since the process started.

    Args:
        log_every_n_steps: cadence; None uses the Trainer's.

    Raises:
        ValueError: for a non-positive cadence.
    """

    def __init__(self, log_every_n_steps: int | None = None) -> None:
        if log_every_n_steps is not None and log_every_n_steps <= 0:
            raise ValueError(f"log_every_n_steps must be positive or None, got {log_every_n_steps}")
        self.log_every_n_steps = log_every_n_steps

    def _is_log_step(self, trainer: Trainer, step: int) -> bool:
        return step % (self.log_every_n_steps or trainer.settings.log_every_n_steps) == 0

    def on_train_step_start(
        self, trainer: Trainer, module: NanoModule, microbatches: list[Any], step_idx: int
    ) -> None:
        """Reset the CUDA peak counters so the peak covers this step only."""
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def on_train_step_end(
        self,
        trainer: Trainer,
        module: NanoModule,
        outputs: StepOutput,
        microbatches: list[Any],
        step_idx: int,
    ) -> None:
        """On log steps, reduce this rank's figures to the maximum over ranks and log them."""
        if not self._is_log_step(trainer, trainer.global_step):
            return
        local = self.read(trainer.strategy.root_device)
        if not local:
            return
        names = list(local)
        values = torch.tensor([local[n] for n in names], dtype=torch.float64)
        # Every rank takes part in the reduction, even when only rank 0 writes the result.
        values = trainer.strategy.reduce(values.to(trainer.strategy.root_device), op="max")
        trainer.log_metrics(dict(zip(names, values.cpu().tolist(), strict=True)))

    @staticmethod
    def read(device: torch.device) -> dict[str, float]:
        """This process's memory figures for `device`, in GiB (see the class docstring)."""
        if device.type == "cuda":
            return {
                "memory/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
                "memory/peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
                "memory/allocated_gib": torch.cuda.memory_allocated(device) / GIB,
            }
        rss, peak = process_memory_bytes()
        metrics = {"memory/peak_rss_gib": peak / GIB}
        if rss is not None:
            metrics["memory/rss_gib"] = rss / GIB
        return metrics
