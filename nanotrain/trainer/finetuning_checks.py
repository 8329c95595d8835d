"""Where Lightning's `BaseFinetuning` callbacks (`BackboneFinetuning` and your subclasses) run
under nanotrain.Trainer, and why not elsewhere.

They freeze parameters in `setup`, before `configure_optimizers`, and at an epoch's start
unfreeze them and add them to `trainer.optimizers[0]` as a new param group. That is
Lightning's result on one process whose optimizer updates the module's own parameters, and
under DDPStrategy, which averages the gradients of parameters unfrozen after it wrapped the
module itself (`DDPStrategy._finish_grad_sync`).
"""

from __future__ import annotations

from typing import Any


def _finetuning_callbacks(trainer: Any) -> list[Any]:
    from lightning.pytorch.callbacks import BaseFinetuning

    return [cb for cb in trainer.callbacks if isinstance(cb, BaseFinetuning)]


def finetuning_refusal(trainer: Any) -> str | None:
    """Why `trainer` cannot run a `BaseFinetuning` callback with Lightning's result, or None."""
    from nanotrain.strategies.ddp import DDPStrategy
    from nanotrain.strategies.single_device import SingleDeviceStrategy

    strategy = trainer.strategy
    if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
        return (
            f"under {type(strategy).__name__} the parameters frozen when the module is wrapped "
            "are left out of the gradient reduction and the sharded optimizer state (the "
            "trainable set is taken once), so an unfrozen backbone would not train as under "
            "Lightning; run it under DDPStrategy or on one process (SingleDeviceStrategy), or "
            "fine-tune without freezing: give the "
            "backbone's param group a learning rate of 0 in configure_optimizers and raise it "
            "in your module's on_train_epoch_start at the epoch you would unfreeze it"
        )
    if strategy.precision.master_weights:
        return (
            f"precision {strategy.precision.name!r} keeps fp32 master weights, which the "
            "optimizer updates instead of the module's parameters the callback adds; use "
            '"32-true" or "bf16-mixed"'
        )
    if trainer._resume_path is not None:
        return (
            "resuming: the checkpoint's optimizer holds the param groups the callback added, "
            "which the new optimizer does not have when it loads; start the fine-tuning run "
            "from the weights (load_from_checkpoint) instead"
        )
    return None


def check_finetuning(trainer: Any) -> None:
    """Raise ValueError at fit start when a `BaseFinetuning` callback among the Trainer's
    callbacks cannot give Lightning's result (see `finetuning_refusal`)."""
    callbacks = _finetuning_callbacks(trainer)
    reason = finetuning_refusal(trainer) if callbacks else None
    if reason is not None:
        raise ValueError(f"{type(callbacks[0]).__name__} cannot run here: {reason}")
