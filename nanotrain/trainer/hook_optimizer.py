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

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

    from nanotrain.strategies.base import Strategy

__all__ = ["HookOptimizer"]


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
        loss = closure() if closure is not None else None
        self.stepped = True
        if self._before_update is not None and not self._before_update():
            return loss
        self._strategy.optimizer_step(skip_if=self.skip_if)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients through the strategy (bucketed gradients stay views of their
        buffers; `set_to_none` is the strategy's choice)."""
        self._strategy.zero_grad()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._strategy.optimizer, name)

    def __repr__(self) -> str:
        return f"HookOptimizer({self._strategy.optimizer!r})"
