"""LearningRateMonitor: the learning rate of every optimizer parameter group."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from nanotrain.callbacks.base import Callback

if TYPE_CHECKING:
    from nanotrain.module import NanoModule
    from nanotrain.trainer import Trainer


# group entries that are not a distinguishing setting (the rate itself moves with the schedule)
_NOT_SETTINGS = {"params", "param_names", "name", "lr", "initial_lr"}


def param_group_names(optimizer: torch.optim.Optimizer) -> list[str]:
    """A name per parameter group: its "name" entry when it has one; otherwise, among several
    groups, the settings that set it apart from the others (e.g. "weight_decay=0.0" for the
    usual no-decay group), else "group<i>" (its position in `configure_optimizers`).
    Names are unique: a clash falls back to "group<i>"."""
    groups = optimizer.param_groups
    differing = sorted(
        key
        for key in {k for g in groups for k in g} - _NOT_SETTINGS
        if len({repr(g.get(key)) for g in groups}) > 1
    )
    names = []
    for i, group in enumerate(groups):
        if "name" in group:
            names.append(str(group["name"]))
        elif len(groups) > 1 and differing:
            names.append(",".join(f"{key}={group.get(key)}" for key in differing))
        else:
            names.append(f"group{i}")
    if len(set(names)) < len(names):
        names = [name if names.count(name) == 1 else f"group{i}" for i, name in enumerate(names)]
    return names


class LearningRateMonitor(Callback):
    """Logs `lr/<group>` for each optimizer parameter group: the rate the step used.

    The rate is read at `on_train_step_start`, before the scheduler moves it, and logged at
    the step's `trainer.logged_step` (Lightning's 0-based step, where that step's `train/loss`
    is logged too), so `lr/group0` at step N is the rate that produced the weights of the
    (N + 1)-th optimizer step. Groups are named by a "name" key in the param group
    (e.g. `{"params": ..., "name": "decay"}`), else by the settings that set them apart
    (`lr/weight_decay=0.0`), else "group<i>" (see `param_group_names`).

    In manual optimization every optimizer is read (with several, each name gets the
    optimizer's class between: `lr/Adam/group0`, `lr/SGD/group0`, a repeated class numbered
    `SGD-1` as Lightning numbers it), on the batches Lightning's monitor logs (every
    log_every_n_steps batches, whatever optimizer steps a batch takes) at the batch's
    `trainer.logged_step`.

    Args:
        log_every_n_steps: cadence; None uses the Trainer's. Lightning's positional
            `logging_interval` ("step", "epoch") is taken here too.
        log_momentum: also log `momentum/<group>` (SGD momentum or Adam's beta1).
        log_weight_decay: also log `weight_decay/<group>`.
        logging_interval: Lightning's: "step" logs every optimizer on the Trainer's log
            steps, "epoch" once at the start of each training epoch; None (the default)
            logs an optimizer whose scheduler steps by epoch at the epoch's start, one whose
            scheduler steps by step on log steps, and one without a scheduler at both.

    Raises:
        ValueError: for a non-positive cadence or another `logging_interval`.
    """

    def __init__(
        self,
        log_every_n_steps: int | str | None = None,
        log_momentum: bool = False,
        log_weight_decay: bool = False,
        *,
        logging_interval: str | None = None,
    ) -> None:
        if isinstance(log_every_n_steps, str):  # Lightning's first argument
            logging_interval, log_every_n_steps = log_every_n_steps, None
        if logging_interval not in (None, "step", "epoch"):
            raise ValueError(
                f"logging_interval must be None, 'step' or 'epoch' (as Lightning's), got "
                f"{logging_interval!r}"
            )
        if log_every_n_steps is not None and log_every_n_steps <= 0:
            raise ValueError(f"log_every_n_steps must be positive or None, got {log_every_n_steps}")
        self.log_every_n_steps = log_every_n_steps
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.log_weight_decay = log_weight_decay

    def on_train_step_start(
        self, trainer: Trainer, module: NanoModule, microbatches: list[Any], step_idx: int
    ) -> None:
        """Log the rates this step will use, on log steps."""
        if self.logging_interval == "epoch":
            return
        # the step's (manual optimization: the batch's) number once it completes: the cadence
        manual = getattr(trainer, "_manual", False)
        step = (trainer.state.batches_stepped if manual else trainer.global_step) + 1
        every = self.log_every_n_steps or trainer.settings.log_every_n_steps
        if step % every == 0:
            metrics = self._read_all(trainer, "step")
            if metrics:  # logged_step: the steps completed before this one, as Lightning's
                self._publish(trainer, metrics)

    def on_train_epoch_start(self, trainer: Trainer, module: NanoModule) -> None:
        """Log the rates the epoch starts with: every optimizer's with
        `logging_interval="epoch"`; with None, as Lightning, those whose scheduler steps by
        epoch and those without a scheduler."""
        if self.logging_interval != "step":
            metrics = self._read_all(trainer, "epoch")
            if metrics:
                self._publish(trainer, metrics)

    @staticmethod
    def _publish(trainer: Trainer, metrics: dict[str, float]) -> None:
        """Send the rates to the loggers and, as Lightning's monitor does, into
        `trainer.callback_metrics` (where a callback or a plateau scheduler may read them)."""
        trainer.log_metrics(metrics, step=trainer.logged_step)
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})

    def _read_all(self, trainer: Trainer, when: str) -> dict[str, float]:
        """`read` of the Trainer's optimizer, or of each of several (manual optimization),
        that is due `when` ("step": on log steps, "epoch": at an epoch's start). With
        `logging_interval` None that is Lightning's rule: an optimizer whose scheduler has
        the other interval is left out (manual optimization's schedulers count as "epoch",
        as Lightning's do); one without a scheduler is due at both."""
        optimizers = trainer.optimizers
        if self.logging_interval is None:
            interval = {id(c.scheduler.optimizer): c.interval for c in trainer.lr_scheduler_configs}
            optimizers = [o for o in optimizers if interval.get(id(o), when) == when]
        if len(trainer.optimizers) == 1:
            return self.read(optimizers[0]) if optimizers else {}
        metrics: dict[str, float] = {}
        seen: dict[str, int] = {}
        for optimizer in trainer.optimizers:
            kind = type(optimizer).__name__
            label = kind if kind not in seen else f"{kind}-{seen[kind]}"
            seen[kind] = seen.get(kind, 0) + 1
            if optimizer not in optimizers:
                continue
            for key, value in self.read(optimizer).items():
                head, _, group = key.partition("/")
                metrics[f"{head}/{label}/{group}"] = value
        return metrics

    def read(self, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        """The current `lr/<group>` (and momentum / weight decay if asked) of `optimizer`."""
        metrics: dict[str, float] = {}
        for name, group in zip(param_group_names(optimizer), optimizer.param_groups, strict=True):
            metrics[f"lr/{name}"] = float(group["lr"])
            if self.log_momentum:
                momentum = group.get("momentum", group.get("betas", (None,))[0])
                if momentum is not None:
                    metrics[f"momentum/{name}"] = float(momentum)
            if self.log_weight_decay and "weight_decay" in group:
                metrics[f"weight_decay/{name}"] = float(group["weight_decay"])
        return metrics
