"""The optimizer Lightning's optimization hooks receive under the nanotrain Trainer.

`optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)`, `optimizer_zero_grad`,
`on_before_zero_grad`, `on_before_optimizer_step` and `configure_gradient_clipping` get a
`HookOptimizer` where Lightning passes its `LightningOptimizer`: `step(closure)` and
`zero_grad()` go through the strategy (fp32 master weights, ZeRO shards, gradient buckets,
a device-side skip flag), and every other attribute (`param_groups`, `state`, `defaults`) is
the real optimizer's, so an LR warm-up written in `optimizer_step` changes the learning rate
the update uses.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch import Tensor

    from nanotrain.strategies.base import Strategy

__all__ = ["HookOptimizer", "needs_closure"]


class _SkipUpdate(Exception):
    """Raised inside a closure-calling optimizer's step when its update is to be skipped."""


def needs_closure(optimizer: Any) -> bool:
    """Whether `optimizer.step` needs a closure that recomputes the loss (LBFGS: its line
    search evaluates the loss and gradients several times per step)."""
    if isinstance(optimizer, torch.optim.LBFGS):
        return True
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def check_closure_optimizer(strategy: Strategy) -> None:
    """Refuse, at fit start, an optimizer that `needs_closure` where its line search would not
    read what it reads under one process.

    Raises:
        ValueError: under a strategy other than SingleDeviceStrategy / DDPStrategy (sharded
            parameters: its dot products would cover this rank's shard only), with fp32 master
            weights, or with fp16 loss scaling (as Lightning, which refuses AMP with LBFGS).
    """
    from nanotrain.strategies.replicated import ReplicatedStrategy

    optimizer = strategy.optimizer
    if not needs_closure(optimizer):
        return
    name = type(optimizer).__name__
    if not isinstance(strategy, ReplicatedStrategy):
        raise ValueError(
            f"{name}.step needs a closure that recomputes the loss; nanotrain runs it under "
            f"SingleDeviceStrategy and DDPStrategy only ({type(strategy).__name__} shards the "
            "parameters, so its line search would read this rank's shard only): train with "
            "strategy='single' or 'ddp', or use a first-order optimizer (SGD, AdamW)"
        )
    if strategy._master_holder is not None or strategy.precision.uses_loss_scaling:
        raise ValueError(
            f"{name}.step needs a closure that recomputes the loss, which nanotrain runs in "
            f"full precision only (precision={strategy.precision.name!r} keeps fp32 master "
            "weights or scales the loss; Lightning refuses LBFGS with AMP too): use "
            "precision='32-true' or a first-order optimizer"
        )


class HookOptimizer:
    """One optimizer step's view of the strategy's optimizer (see the module docstring).

    Args:
        strategy: the strategy whose optimizer this is.
    """

    def __init__(self, strategy: Strategy, before_update: Callable[[], bool] | None = None) -> None:
        self._strategy = strategy
        #: Lightning's work between the closure and the update (`on_before_optimizer_step`,
        #: clipping); returns False when the update is to be skipped
        self._before_update = before_update
        #: a 0-dim device flag: where True, the update is dropped on the device (NaNGuard)
        self.skip_if: Tensor | None = None
        #: whether `step` ran in this optimizer step
        self.stepped = False
        #: whether the closure `closure_for` made was called (Lightning refuses a step without)
        self.closure_ran = False
        #: for an optimizer that `needs_closure`: runs the step's forward and backward again
        #: (Lightning's closure: training_step, zero_grad, backward) and returns the loss
        self.rerun: Callable[[], Any] | None = None

    def closure_for(self, loss: Any) -> Callable[[], Any]:
        """Lightning's optimizer closure for this step: the forward and backward of every
        microbatch ran before `optimizer_step`, so calling it returns the step's `loss`."""

        def closure() -> Any:
            self.closure_ran = True
            return loss

        return closure

    @property
    def optimizer(self) -> Any:
        """The real `torch.optim.Optimizer` (as `LightningOptimizer.optimizer`)."""
        return self._strategy.optimizer

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Apply this step's update, as Lightning's `optimizer.step(closure)`: the closure,
        then `on_before_optimizer_step` and gradient clipping (`before_update`; a callback may
        skip the update there), then the strategy's update."""
        if self.rerun is not None:
            return self._step_with_closure(closure)
        loss = closure() if closure is not None else None
        self.stepped = True
        if self._before_update is not None and not self._before_update():
            return loss
        self._strategy.optimizer_step(skip_if=self.skip_if)
        return loss

    def _step_with_closure(self, closure: Callable[[], Any] | None) -> Any:
        """As Lightning for an optimizer that calls its closure (LBFGS): every call of the
        closure the optimizer makes is followed by `before_update` (on_before_optimizer_step,
        clipping); the first returns the loss computed before `optimizer_step`, each later one
        runs the forward and backward again (`rerun`). A skip asked for after any call
        (`request_skip_step`, the NaN guard) ends the optimizer's step there and puts the
        parameters and the optimizer's state back as they were before it."""
        self.stepped = True
        calls = 0
        first_loss: Any = None

        def optimizer_closure() -> Any:
            nonlocal calls, first_loss
            loss = (closure() if closure is not None else None) if calls == 0 else self.rerun()
            if calls == 0:
                first_loss = loss
            calls += 1
            if self._before_update is not None and not self._before_update():
                raise _SkipUpdate
            return loss

        optimizer = self._strategy.optimizer
        params = [p for g in optimizer.param_groups for p in g["params"]]
        saved = [p.detach().clone() for p in params], copy.deepcopy(optimizer.state_dict())
        try:
            return self._strategy.optimizer_step(skip_if=self.skip_if, closure=optimizer_closure)
        except _SkipUpdate:
            with torch.no_grad():
                for p, before in zip(params, saved[0], strict=True):
                    p.copy_(before)
            optimizer.load_state_dict(saved[1])
            return first_loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients through the strategy (bucketed gradients stay views of their
        buffers; `set_to_none` is the strategy's choice)."""
        self._strategy.zero_grad()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._strategy.optimizer, name)

    def __repr__(self) -> str:
        return f"HookOptimizer({self._strategy.optimizer!r})"
