"""Where Lightning's `StochasticWeightAveraging` runs under nanotrain.Trainer, and why not
elsewhere.

The callback copies the module in `setup`, swaps the optimizer's LR scheduler for a
`SWALR` at the epoch SWA starts (by replacing `trainer.lr_scheduler_configs[0]`, which the
nanotrain Trainer then steps at every epoch's end, as Lightning's loop does), averages the
weights at each later epoch's start and copies the average into the module at the end of
fit. It reads `trainer.optimizers`, `trainer.max_epochs` and `trainer.current_epoch`, and
resets `trainer.fit_loop._skip_backward` after each epoch (`FitLoopView`).

Modules with BatchNorm layers are refused: Lightning recomputes their statistics in an extra
epoch that its fit loop adds and runs without backward, which nanotrain's loop has no
counterpart for.
"""

from __future__ import annotations

from typing import Any


class FitLoopView:
    """What Lightning's `StochasticWeightAveraging` touches of `trainer.fit_loop` in a run
    without BatchNorm: `max_epochs` (read) and `_skip_backward`, which it only sets to False
    after every epoch. Any other use of Lightning's fit loop is not there (AttributeError).

    Args:
        trainer: the nanotrain Trainer.
    """

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer

    @property
    def max_epochs(self) -> int:
        """The epoch limit, -1 when there is none (as Lightning)."""
        return self._trainer.max_epochs

    @property
    def _skip_backward(self) -> bool:
        return False

    @_skip_backward.setter
    def _skip_backward(self, value: bool) -> None:
        if value:
            raise ValueError(
                "fit_loop._skip_backward=True (a training epoch without backward) is not "
                "supported by nanotrain.Trainer"
            )


def _swa_callbacks(trainer: Any) -> list[Any]:
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    return [cb for cb in trainer.callbacks if isinstance(cb, StochasticWeightAveraging)]


def swa_refusal(trainer: Any) -> str | None:
    """Why `trainer` cannot run `StochasticWeightAveraging` with Lightning's result, or None."""
    import torch

    from nanotrain.strategies.replicated import ReplicatedStrategy

    strategy, module = trainer.strategy, trainer.module
    if not isinstance(strategy, ReplicatedStrategy):
        return (
            f"under {type(strategy).__name__} a rank holds a shard of the weights or of the "
            "optimizer, so the copy it averages is not the model; use SingleDeviceStrategy or "
            "DDPStrategy"
        )
    if strategy.precision.master_weights:
        return (
            f"precision {strategy.precision.name!r} keeps fp32 master weights, which the "
            "averaged weights copied into the module at the end would not reach; use "
            '"32-true" or "bf16-mixed"'
        )
    if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in module.modules()):
        return (
            f"{type(module).__name__} has BatchNorm layers, whose statistics Lightning "
            "recomputes in an extra epoch without backward that nanotrain's loop does not "
            "run; after fit call torch.optim.swa_utils.update_bn(train_loader, module) "
            "yourself, with an AveragedModel kept in your module instead of the callback"
        )
    if trainer._manual:
        return "manual optimization (the module steps its own schedulers)"
    if trainer._resume_path is not None:
        return (
            "resuming: the checkpoint's scheduler may be the SWALR the callback swapped in, "
            "which the new run's scheduler cannot load; start a new run from the weights"
        )
    return None


def check_swa(trainer: Any) -> None:
    """Raise ValueError at fit start when a `StochasticWeightAveraging` among the Trainer's
    callbacks cannot give Lightning's result (see `swa_refusal`)."""
    callbacks = _swa_callbacks(trainer)
    reason = swa_refusal(trainer) if callbacks else None
    if reason is not None:
        raise ValueError(f"{type(callbacks[0]).__name__} cannot run here: {reason}")
