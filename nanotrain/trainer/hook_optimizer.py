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

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = strategy
        #: a 0-dim device flag: where True, the update is dropped on the device (NaNGuard)
        self.skip_if: Tensor | None = None
        #: whether `step` ran in this optimizer step
        self.stepped = False

    @property
    def optimizer(self) -> Any:
        """The real `torch.optim.Optimizer` (as `LightningOptimizer.optimizer`)."""
        return self._strategy.optimizer

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Apply this step's update. `closure` (Lightning's optimizer closure) returns the
        step's loss: the forward and backward of every microbatch ran before this hook, so
        calling it computes nothing again."""
        loss = closure() if closure is not None else None
        self._strategy.optimizer_step(skip_if=self.skip_if)
        self.stepped = True
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients through the strategy (bucketed gradients stay views of their
        buffers; `set_to_none` is the strategy's choice)."""
        self._strategy.zero_grad()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._strategy.optimizer, name)

    def __repr__(self) -> str:
        return f"HookOptimizer({self._strategy.optimizer!r})"
