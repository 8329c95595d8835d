"""The microbatch loop shared by strategies that keep a full model copy on every process."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from nanotrain.profiling import named_range
from nanotrain.strategies.base import StepOutput, Strategy
from nanotrain.strategies.weighting import LossAccumulator, weigh_microbatches

if TYPE_CHECKING:
    from nanotrain.module import NanoModule


class TrainingStepWrapper(nn.Module):
    """Makes `training_step` the `forward` of a module, so that wrappers such as DDP see it.

    DDP installs its gradient-reduction hooks around `forward`; routing `training_step`
    through here is what makes those hooks fire for a LightningModule-style step.
    """

    def __init__(self, module: NanoModule) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: Any, batch_idx: int) -> Any:
        return self.module.training_step(batch, batch_idx)


class ReplicatedStrategy(Strategy):
    """Full model on each process; gradient accumulation over microbatches, one update per step.

    Subclasses decide how gradients are synchronized (`_sync_context`) and how
    tensors are reduced across processes (`reduce`).
    """

    def __init__(self) -> None:
        super().__init__()
        self._step_runner: nn.Module | None = None

    def _wrap(self, module: NanoModule) -> nn.Module:
        """Return the module whose forward runs one training microbatch."""
        return TrainingStepWrapper(module)

    def setup_module(self, module: NanoModule) -> None:
        super().setup_module(module)
        self._step_runner = self._wrap(module)

    def _sync_context(self, is_last_microbatch: bool) -> contextlib.AbstractContextManager:
        """Context for one microbatch's backward; DDP disables gradient sync on all but the last."""
        return contextlib.nullcontext()

    def forward_backward(
        self, module: NanoModule, microbatches: Sequence[Any], batch_idx: int
    ) -> StepOutput:
        """Accumulate gradients of the objective over the global batch (each loss term, or the
        whole loss, averaged over its global count: `weighting`); reduce its value."""
        assert self._step_runner is not None, "setup_module() must run before forward_backward()"
        weighed = weigh_microbatches(self, module, microbatches)
        accumulator = LossAccumulator(weighed)
        num_micro = len(microbatches)
        for i, microbatch in enumerate(microbatches):
            with self._sync_context(i == num_micro - 1):
                with named_range("nanotrain/forward"):
                    output = self._step_runner(microbatch, batch_idx)
                # scaled by the microbatch's share of each global count (times the replicas,
                # which DDP's average divides out again)
                with named_range("nanotrain/backward"):
                    accumulator.objective(i, output).backward()
        loss, terms = accumulator.finish(self)
        num_tokens, num_samples = weighed.host_totals()
        return StepOutput(loss=loss, num_tokens=num_tokens, num_samples=num_samples, metrics=terms)

    def clip_grad_norm_(self, max_norm: float | None) -> Tensor:
        """Global L2 grad norm over this (already synchronized) replica's gradients; clip if asked."""
        params = [p for p in self.parameters() if p.grad is not None]
        if not params:
            return torch.zeros((), device=self.root_device)
        if max_norm is None:
            grads = [p.grad for p in params]
            return torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        return torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)

    def validation_step(self, module: NanoModule, batch: Any, batch_idx: int) -> Any:
        with torch.no_grad():
            return module.validation_step(batch, batch_idx)

    def teardown(self) -> None:
        self._step_runner = None
