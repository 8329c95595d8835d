"""Preemption: on SIGTERM / SIGUSR1, finish the current step, save, and exit with a code
that says "resume me" (`EXIT_PREEMPTED`).

Schedulers (SLURM, Kubernetes, cloud spot instances) announce a preemption with a signal some
time before they kill the job. The handler only records the signal (no work inside a signal
handler); after every optimizer step the ranks agree whether any of them received one (a
one-integer all-reduce, so that they all stop at the same step even when the signal reached
them at different moments), then every rank saves a checkpoint of that step and `fit` returns
with `trainer.exit_code == EXIT_PREEMPTED`.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nanotrain.exit_codes import EXIT_PREEMPTED

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

    def __init__(self, names: list[str]) -> None:
        self.signals = signal_numbers(names)
        self.received: int | None = None
        self._previous: dict[signal.Signals, Any] = {}

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

    def agreed(self, trainer: Trainer) -> int | None:
        """The signal any rank received (collective when there are several ranks; call on
        every rank after the same step), or None."""
        local = int(self.received or 0)
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            flag = torch.tensor(local, device=trainer.strategy.root_device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            local = int(flag)
        return local or None


def stop_if_preempted(trainer: Trainer, watch: PreemptionWatch | None) -> None:
    """After a step: if a preemption signal arrived on any rank, save a checkpoint of this
    step (through the ModelCheckpoint callback when there is one, so that its retention and
    `last` pointer apply) and stop with `EXIT_PREEMPTED`."""
    if watch is None or not watch.signals or trainer.should_stop:
        return
    signum = watch.agreed(trainer)
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
