"""Preemption: on SIGTERM / SIGUSR1, finish the current step, save, and exit with a code
that says "resume me" (`EXIT_PREEMPTED`).

Schedulers (SLURM, Kubernetes, cloud spot instances) announce a preemption with a signal some
time before they kill the job. The handler only records the signal (no work inside a signal
handler); after every optimizer step the ranks agree whether any of them received one (a
one-integer all-reduce, so that they all stop at the same step even when the signal reached
them at different moments), then every rank saves a checkpoint of that step and `fit` returns
with `trainer.exit_code == EXIT_PREEMPTED`.

On a GPU the host would have to wait for the device to read the all-reduced flag, after every
step. So there each step's flag is read one step later: it is ready by then (it was queued
before the next step's work), the host runs ahead as usual, and the ranks stop after the step
that follows the signal (one step later than on CPU, where a read costs nothing).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nanotrain.exit_codes import EXIT_PREEMPTED
from nanotrain.host_copy import host_to_device

if TYPE_CHECKING:
    from nanotrain.trainer import Trainer

log = logging.getLogger(__name__)


def signal_numbers(names: list[str]) -> list[signal.Signals]:
    """The signals named `names` (e.g. ["SIGTERM", "SIGUSR1"]).

    Raises:
        ValueError: a name this platform does not have, or one that cannot be caught.
    """
    out = []
    for name in names:
        sig = getattr(signal.Signals, str(name).upper(), None) if str(name).isidentifier() else None
        if sig is None or sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(
                f"preemption_signals: {name!r} is not a signal that can be caught; use names "
                "such as 'SIGTERM', 'SIGUSR1', 'SIGUSR2' (or [] to disable)"
            )
        out.append(sig)
    return out


class PreemptionWatch:
    """Records whether one of `signals` arrived; `install`/`uninstall` around `fit`.

    Handlers can only be installed from the main thread; elsewhere (a Trainer run in a
    worker thread) the watch stays inactive and says so in a warning-level log line.
    """

    def __init__(self, names: list[str], defer_reads: bool | None = None) -> None:
        """`defer_reads`: read each step's agreed flag after the next step (None: on CUDA,
        where reading it at once would make the host wait for the device)."""
        self.signals = signal_numbers(names)
        self.received: int | None = None
        self.defer_reads = defer_reads
        self._previous: dict[signal.Signals, Any] = {}
        self._pending: tuple[torch.Tensor, Any] | None = None  # last step's flag, unread

    def install(self) -> PreemptionWatch:
        """Install the handlers (remembering the previous ones); returns self."""
        if not self.signals:
            return self
        if threading.current_thread() is not threading.main_thread():
            log.warning("preemption signals are not handled: fit runs outside the main thread")
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        """Put the previous handlers back."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signum

    def agreed(self, trainer: Trainer, final: bool = False) -> int | None:
        """The signal any rank received (collective when there are several ranks; call on
        every rank after the same step), or None. With deferred reads, the answer is the
        previous call's agreement (None at the first call); `final` (after the last step)
        reads this call's too, so a signal in the last step is not lost."""
        local = int(self.received or 0)
        if trainer.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return local or None
        device = trainer.strategy.root_device
        flag = host_to_device([local], device, torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        defer = device.type == "cuda" if self.defer_reads is None else self.defer_reads
        if not defer:
            return int(flag.item()) or None
        previous, self._pending = self._pending, _start_read(flag)
        agreed = _finish_read(previous)
        if final:
            agreed, self._pending = max(agreed, _finish_read(self._pending)), None
        return agreed or None


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


def stop_if_preempted(trainer: Trainer, watch: PreemptionWatch | None, final: bool = False) -> None:
    """After a step: if a preemption signal arrived on any rank, save a checkpoint of this
    step (through the ModelCheckpoint callback when there is one, so that its retention and
    `last` pointer apply) and stop with `EXIT_PREEMPTED`."""
    if watch is None or not watch.signals or trainer.should_stop:
        return
    signum = watch.agreed(trainer, final)
    if signum is None:
        return
    from nanotrain.callbacks.checkpoint import ModelCheckpoint

    step = trainer.global_step
    saver = next((cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)), None)
    if saver is not None:
        path = saver.save_now(trainer) if saver._last_saved_step != step else saver.dirpath
    else:
        path = trainer.save_checkpoint(trainer.checkpoint_dir / f"step-{step:08d}")
    if trainer.is_global_zero:
        log.warning(
            "received %s: saved step %d in %s and stopping (exit code %d); run the same "
            "command with --ckpt_path last to resume",
            signal.Signals(signum).name,
            step,
            path,
            EXIT_PREEMPTED,
        )
    trainer.request_stop(exit_code=EXIT_PREEMPTED)
