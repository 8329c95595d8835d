"""Lightning hooks nanotrain does not call: refused at the start of fit, never skipped.

A LightningModule (or a nanotrain Callback) that overrides a hook the nanotrain Trainer does
not run would train differently from `lightning.Trainer` with no error. `check_hooks` finds
every such override before any work and raises one `ValueError` naming the hook and what to
do instead. The hooks nanotrain does run are listed in docs/lightning.md.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl

from nanotrain.callbacks.base import Callback

if TYPE_CHECKING:
    from nanotrain.strategies.base import Strategy

__all__ = ["check_hooks", "UNSUPPORTED_MODULE_HOOKS", "UNSUPPORTED_CALLBACK_HOOKS"]

_MODE = (
    "nanotrain switches the model between train and eval mode itself (eval, no grad, for "
    "validation, test and predict); drop the override"
)
_TRANSFER = (
    "the strategy moves each batch to its device (tensors, and lists / tuples / dicts of "
    "them); move or transform other data in training_step / validation_step instead"
)

#: LightningModule hooks the nanotrain Trainer does not call -> what to do instead
UNSUPPORTED_MODULE_HOOKS: dict[str, str] = {
    "backward": (
        "nanotrain runs backward itself (the loss weighed by tokens, loss scaling, pipeline "
        "schedules); put code that runs around it in on_before_backward / on_after_backward"
    ),
    "transfer_batch_to_device": _TRANSFER,
    "on_before_batch_transfer": _TRANSFER,
    "on_after_batch_transfer": _TRANSFER,
    "on_validation_model_eval": _MODE,
    "on_validation_model_train": _MODE,
    "on_validation_model_zero_grad": _MODE,
    "on_test_model_eval": _MODE,
    "on_test_model_train": _MODE,
    "on_predict_model_eval": _MODE,
    "configure_sharded_model": "Lightning 2.1 renamed it configure_model, which nanotrain calls",
    "configure_callbacks": (
        "pass the callbacks to Trainer(callbacks=[...]) (nanotrain.callbacks, or your own "
        "nanotrain.Callback)"
    ),
}

#: Lightning Callback hooks a nanotrain Callback may define by habit that nanotrain never runs
UNSUPPORTED_CALLBACK_HOOKS: dict[str, str] = {
    "on_sanity_check_start": "nanotrain runs no sanity-check validation; drop the hook",
    "on_sanity_check_end": "nanotrain runs no sanity-check validation; drop the hook",
}


#: the hooks that run around each microbatch's backward
BACKWARD_HOOKS = ("on_before_backward", "on_after_backward")

#: Lightning's per-batch training hooks: when any is overridden, the Trainer runs them around
#: each microbatch (`nanotrain.trainer.train_step`); else the strategy's loop runs bare
WINDOW_HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_zero_grad",
    "optimizer_zero_grad",
    *BACKWARD_HOOKS,
)


def hook_base(cls: type) -> type:
    """The class whose no-op hooks `cls` may override: LightningModule for a module,
    Lightning's Callback for a callback written against Lightning, else nanotrain's."""
    if issubclass(cls, pl.LightningModule):
        return pl.LightningModule
    return pl.Callback if issubclass(cls, pl.Callback) else Callback


def overrides(obj: Any, name: str) -> bool:
    """Whether `obj` (or its class) defines hook `name` itself (not the base class's no-op)."""
    return name in getattr(obj, "__dict__", {}) or class_overrides(type(obj), name)


@functools.lru_cache(maxsize=4096)
def class_overrides(cls: type, name: str) -> bool:
    """Whether class `cls` defines hook `name` beyond its `hook_base`'s no-op; cached, as the
    Trainer asks for every callback at every hook."""
    own = getattr(cls, name, None)
    return own is not None and own is not getattr(hook_base(cls), name, None)


def uses_any_hook(module: Any, callbacks: list[Any], names: tuple[str, ...]) -> bool:
    """Whether `module` or one of `callbacks` overrides any of the hooks `names`."""
    return any(overrides(obj, name) for obj in (module, *callbacks) for name in names)


def backward_hooks_refusal(strategy: Any) -> str:
    """Why `strategy` cannot run `on_before_backward` / `on_after_backward`, and what to do."""
    return (
        f"on_before_backward / on_after_backward cannot run under {type(strategy).__name__} "
        "with this layout: under pipeline parallelism (pp > 1) backward runs per model chunk "
        "inside the schedule, and under ZeRO-2 the reduced gradients live in this rank's "
        "shards, not in .grad; move the code to on_before_optimizer_step (the step's gradients, "
        "reduced, before clipping), or train with pp=1 and zero_stage <= 1"
    )


#: LightningDataModule hooks the nanotrain Trainer does not call (as the module's of the same name)
UNSUPPORTED_DATAMODULE_HOOKS = ("transfer_batch_to_device", "on_before_batch_transfer",
                                "on_after_batch_transfer")  # fmt: skip


def check_datamodule_hooks(datamodule: Any) -> None:
    """Raise ValueError at the start of a stage for a batch-transfer hook `datamodule` overrides
    (Lightning calls them; nanotrain's strategy moves each batch itself)."""
    if datamodule is None:
        return
    for name in UNSUPPORTED_DATAMODULE_HOOKS:
        own = getattr(type(datamodule), name, None)
        if own is not None and own is not getattr(pl.LightningDataModule, name, None):
            raise ValueError(
                f"{type(datamodule).__name__}.{name} is a Lightning hook the nanotrain Trainer "
                f"does not call: {_TRANSFER}"
            )


def check_hooks(module: Any, callbacks: list[Callback], strategy: Strategy) -> None:
    """Raise ValueError at fit start for a hook `module` or a callback overrides that the
    nanotrain Trainer would not call, or that `strategy`'s layout cannot run."""
    for name, instead in UNSUPPORTED_MODULE_HOOKS.items():
        if overrides(module, name):
            raise ValueError(
                f"{type(module).__name__}.{name} is a Lightning hook the nanotrain Trainer does "
                f"not call: {instead}"
            )
    for callback in callbacks:
        for name, instead in UNSUPPORTED_CALLBACK_HOOKS.items():
            if overrides(callback, name):
                raise ValueError(
                    f"{type(callback).__name__}.{name} is a Lightning callback hook the nanotrain "
                    f"Trainer does not call: {instead}"
                )
    if not strategy.supports_backward_hooks:
        users = [
            type(obj).__name__
            for obj in (module, *callbacks)
            if any(overrides(obj, h) for h in BACKWARD_HOOKS)
        ]
        if users:
            raise ValueError(f"{', '.join(users)}: " + backward_hooks_refusal(strategy))
