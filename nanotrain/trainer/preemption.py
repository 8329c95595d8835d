"""Preemption: on SIGTERM / SIGUSR1, finish the current step, save, and exit with a code
that says "resume me" (`EXIT_PREEMPTED`).

Schedulers (SLURM, Kubernetes, cloud spot instances) announce a preemption with a signal some
time before they kill the job. The handler only records the signal (no work inside a signal
handler); after every optimizer step the ranks agree whether any of them received one (a
one-integer all-reduce, so that they all stop at the same step even when the signal reached
them at different moments), then every rank saves a checkpoint of that step and `fit` returns
with `trainer.exit_code == EXIT_PREEMPTED`.

On a GPU the flag is read one step late (`nanotrain.checkpoint.step_flag`), so the ranks stop
after the step that follows the signal (on CPU, where a read costs nothing, at once).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import TYPE_CHECKING, Any

from nanotrain.checkpoint.step_flag import StepFlag
from nanotrain.runtime.exit_codes import EXIT_PREEMPTED

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
        self._flag = StepFlag(defer_reads)
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

    def agreed(self, trainer: Trainer, final: bool = False) -> int | None:
        """The signal any rank received (collective when there are several ranks; call on
        every rank after the same step), or None. With deferred reads, the answer is the
        previous call's agreement (None at the first call); `final` (after the last step)
        reads this call's too, so a signal in the last step is not lost."""
        local = int(self.received or 0)
        device = trainer.strategy.root_device
        return self._flag.agree(local, trainer.world_size, device, final) or None


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
