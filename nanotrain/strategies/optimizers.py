"""Parse what `configure_optimizers` returns, in the forms Lightning accepts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class SchedulerConfig:
    """An LR scheduler and when it steps: every optimizer step or every epoch (Lightning's
    `interval`), every `frequency` of those ("manual": only the module steps it)."""

    scheduler: Any
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None  # a ReduceLROnPlateau's metric, read from callback_metrics
    strict: bool = True  # the metric missing is an error (else a warning and no step)
    reduce_on_plateau: bool = False  # stepped with the metric, after validation


@dataclass
class OptimizerSetup:
    """The one optimizer of a run and its (optional) LR scheduler."""

    optimizer: torch.optim.Optimizer
    scheduler: SchedulerConfig | None = None
    # manual optimization: every optimizer and scheduler as configure_optimizers gave them
    manual_optimizers: list[Any] | None = None
    manual_schedulers: list[Any] | None = None


def _scheduler_config(entry: Any, monitor: str | None = None) -> SchedulerConfig:
    """One Lightning lr_scheduler entry (a scheduler or its config dict; `monitor`: the
    top-level one of configure_optimizers' dict) as a SchedulerConfig.

    Raises:
        ValueError: a malformed entry, or a ReduceLROnPlateau without a monitor.
    """
    strict = True
    if isinstance(entry, dict):
        monitor, strict = entry.get("monitor", monitor), bool(entry.get("strict", True))
        if "scheduler" not in entry:
            raise ValueError(
                "an lr_scheduler dict must have a 'scheduler' key, e.g. "
                "{'scheduler': sched, 'interval': 'step'}"
            )
        interval = entry.get("interval", "epoch")
        if interval not in ("step", "epoch"):
            raise ValueError(f"lr_scheduler interval must be 'step' or 'epoch', got {interval!r}")
        frequency = int(entry.get("frequency", 1))
        if frequency < 1:
            raise ValueError(f"lr_scheduler frequency must be >= 1, got {frequency}")
        entry_scheduler = entry["scheduler"]
    else:
        entry_scheduler, interval, frequency = entry, "epoch", 1
    plateau = isinstance(entry_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if isinstance(entry, dict):
        plateau = bool(entry.get("reduce_on_plateau", plateau))
    if plateau and monitor is None:
        raise ValueError(
            "a ReduceLROnPlateau scheduler needs the metric it watches (as Lightning): return "
            '{"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val_loss"}} '
            "from configure_optimizers"
        )
    return SchedulerConfig(entry_scheduler, interval, frequency, monitor, strict, plateau)


def parse_optimizer_config(config: Any) -> OptimizerSetup:
    """Turn a `configure_optimizers` result into an `OptimizerSetup`.

    Accepted: an optimizer; a one-element list/tuple of one; `([optimizer], [scheduler])`;
    a dict `{"optimizer": opt, "lr_scheduler": sched | {"scheduler": sched, "interval": ...}}`,
    alone or as a one-element list/tuple.
    As in Lightning, a bare scheduler steps once per epoch unless `interval="step"` is given.

    Raises:
        ValueError: for none or several optimizers, or a malformed scheduler entry.
    """
    if isinstance(config, torch.optim.Optimizer):
        return OptimizerSetup(config)
    if isinstance(config, dict):
        if "optimizer" not in config:
            raise ValueError("configure_optimizers returned a dict without an 'optimizer' key")
        sched, monitor = config.get("lr_scheduler"), config.get("monitor")
        return OptimizerSetup(
            config["optimizer"], _scheduler_config(sched, monitor) if sched else None
        )
    if isinstance(config, (list, tuple)):
        if len(config) == 1 and isinstance(config[0], dict):  # Lightning's list of one dict
            return parse_optimizer_config(config[0])
        if len(config) == 2 and isinstance(config[0], (list, tuple)):
            optimizers, schedulers = list(config[0]), list(config[1])
        else:
            optimizers, schedulers = list(config), []
        if len(optimizers) != 1:
            raise ValueError(
                f"nanotrain trains with exactly one optimizer; configure_optimizers gave "
                f"{len(optimizers)}. Put all parameter groups into one optimizer."
            )
        if not isinstance(optimizers[0], torch.optim.Optimizer):
            raise ValueError(
                "configure_optimizers must return an optimizer, ([optimizer], [scheduler]) or "
                f"{{'optimizer': ..., 'lr_scheduler': ...}} (or a list of one); its list held "
                f"a {type(optimizers[0]).__name__}"
            )
        if len(schedulers) > 1:
            raise ValueError("nanotrain supports at most one LR scheduler per run")
        return OptimizerSetup(
            optimizers[0], _scheduler_config(schedulers[0]) if schedulers else None
        )
    raise ValueError(
        "configure_optimizers must return an optimizer, ([optimizer], [scheduler]) or "
        f"{{'optimizer': ..., 'lr_scheduler': ...}}; got {type(config).__name__}"
    )


class OptimizerList:
    """Several optimizers seen as one by the strategy and checkpoints: their parameter groups
    in order, and one state dict holding each optimizer's."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every optimizer's parameter groups, in order."""
        return [g for opt in self.optimizers for g in opt.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every optimizer's `zero_grad`."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """{"optimizers": [each optimizer's state dict]}."""
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what `state_dict` returned, optimizer by optimizer.

        Raises:
            ValueError: the checkpoint holds another number of optimizers.
        """
        saved = state.get("optimizers")
        if saved is None or len(saved) != len(self.optimizers):
            raise ValueError(
                f"the checkpoint holds {0 if saved is None else len(saved)} optimizer states, "
                f"but configure_optimizers returned {len(self.optimizers)} optimizers"
            )
        for opt, opt_state in zip(self.optimizers, saved, strict=True):
            opt.load_state_dict(opt_state)


class SchedulerList:
    """Several LR schedulers seen as one by checkpoints (each one's state dict, in order)."""

    def __init__(self, schedulers: list[Any]) -> None:
        self.schedulers = schedulers

    def state_dict(self) -> dict[str, Any]:
        """{"schedulers": [each scheduler's state dict]}."""
        return {"schedulers": [s.state_dict() for s in self.schedulers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what `state_dict` returned, scheduler by scheduler."""
        for sched, sched_state in zip(self.schedulers, state["schedulers"], strict=True):
            sched.load_state_dict(sched_state)


def parse_manual_config(config: Any) -> OptimizerSetup:
    """A `configure_optimizers` result for manual optimization, in any of Lightning's forms
    (several optimizers and schedulers too, read by Lightning's own parser): one optimizer
    and scheduler as themselves, several as an `OptimizerList` /
    `SchedulerList` (the module steps them; the Trainer never does: interval "manual").

    Raises:
        ValueError: what Lightning's parser refuses (e.g. no optimizer).
    """
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch.core.optimizer import (
        _configure_optimizers,
        _configure_schedulers_manual_opt,
    )

    try:
        optimizers, schedulers, _ = _configure_optimizers(config)
        configs = _configure_schedulers_manual_opt(schedulers)
    except MisconfigurationException as exc:
        raise ValueError(f"configure_optimizers: {exc}") from None
    if not optimizers:
        raise ValueError("configure_optimizers returned no optimizer")
    optimizer = optimizers[0] if len(optimizers) == 1 else OptimizerList(optimizers)
    scheduler = None
    if configs:
        objects = [c.scheduler for c in configs]
        one = objects[0] if len(objects) == 1 else SchedulerList(objects)
        scheduler = SchedulerConfig(one, interval="manual")
    setup = OptimizerSetup(optimizer, scheduler)
    setup.manual_optimizers, setup.manual_schedulers = optimizers, [c.scheduler for c in configs]
    return setup
