"""An integer the ranks agree on after a step (the largest any rank holds), read without making
the host wait for the device.

Used for decisions every rank must take at the same step: whether a preemption signal reached
any rank (`nanotrain.trainer.preemption`), whether rank 0's clock says a timed checkpoint is
due (`ModelCheckpoint(every_n_minutes=...)`). The value is all-reduced on the device. Reading it
right away would make the host wait for the device to finish the step on a GPU, every step, so
there each step's value is read after the next step (by when it has long arrived) and the
decision lands one step later. On a CPU, where a read waits for nothing, it is read at once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nanotrain.runtime.host_copy import host_to_device


class StepFlag:
    """Agree on an int per step (MAX over the default group's ranks).

    Args:
        defer_reads: read each step's value after the next step; None: on CUDA only.
    """

    def __init__(self, defer_reads: bool | None = None) -> None:
        self.defer_reads = defer_reads
        self._pending: tuple[torch.Tensor, Any] | None = None  # last step's value, unread

    def agree(self, local: int, world_size: int, device: torch.device, final: bool = False) -> int:
        """The largest `local` over all ranks (collective; call on every rank after the same
        step). With deferred reads, the previous call's agreement (0 at the first call);
        `final` (after the last step) also reads this call's, so nothing is lost at the end."""
        if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return local
        flag = host_to_device([local], device, torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        defer = device.type == "cuda" if self.defer_reads is None else self.defer_reads
        if not defer:
            return int(flag.item())
        previous, self._pending = self._pending, _start_read(flag)
        agreed = _finish_read(previous)
        if final:
            agreed, self._pending = max(agreed, _finish_read(self._pending)), None
        return agreed


def _start_read(flag: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Start copying `flag` to the host: (host tensor, CUDA event that marks the copy done,
    None off CUDA)."""
    if flag.device.type != "cuda":
        return flag, None
    host = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True)
    host.copy_(flag, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(flag.device))
    return host, ready


def _finish_read(pending: tuple[torch.Tensor, Any] | None) -> int:
    """The value of a read `_start_read` began (0 for none)."""
    if pending is None:
        return 0
    host, ready = pending
    if ready is not None:
        ready.synchronize()  # queued a step ago: done by now, unless the host ran ahead
    return int(host.item())
