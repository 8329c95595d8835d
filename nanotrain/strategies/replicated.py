"""The microbatch loop shared by strategies that keep a full model copy on every process."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from nanotrain.parallel.data_parallel import GradBuckets
from nanotrain.precision.master import MainGrads, MasterWeights, grad_of
from nanotrain.runtime.profiling import named_range
from nanotrain.strategies.base import MicrobatchHooks, StepOutput, Strategy
from nanotrain.strategies.optimizers import OptimizerSetup
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
        # fp32 accumulation for bf16 parameters: `MainGrads`, or DDP's bucketed `GradBuckets`
        self._main_grads: MainGrads | GradBuckets | None = None
        # every parameter of the module, listed once: walking the module tree each step is a
        # measurable part of a small model's step (the grads are looked up each step, so
        # freezing or unfreezing during training is still seen)
        self._all_params: list[nn.Parameter] = []

    def _wrap(self, module: NanoModule) -> nn.Module:
        """Return the module whose forward runs one training microbatch."""
        return TrainingStepWrapper(module)

    def setup_module(self, module: NanoModule) -> None:
        super().setup_module(module)
        self._all_params = list(module.parameters())
        if self.precision.master_weights:
            self._main_grads = self._make_main_grads(module)
        self._step_runner = self._wrap(module)

    def setup_optimizers(self, module: NanoModule) -> OptimizerSetup:
        """`configure_optimizers`; with low-precision parameters the optimizer is moved onto
        fp32 master weights (`nanotrain.precision.MasterWeights`)."""
        setup = super().setup_optimizers(module)
        if self.precision.master_weights:
            self._master_holder = MasterWeights(setup.optimizer)
        return setup

    def _make_main_grads(self, module: NanoModule) -> MainGrads | GradBuckets:
        """The fp32 gradients of the low-precision parameters (one flat buffer)."""
        return MainGrads(list(self.parameters()))

    def _reduce_main_grads(self) -> None:
        """Average the fp32 main grads over replicas (nothing for one process)."""

    def _finish_grad_sync(self) -> None:
        """Complete the gradient averaging after the last microbatch's backward (the fp32 main
        grads, if any; subclasses add what their wrapper leaves out)."""
        if self._main_grads is not None:
            self._reduce_main_grads()

    def _found_inf_groups(self) -> list[Any]:
        """Groups over which an fp16 overflow is reduced (every rank that holds gradients)."""
        return []

    def _sync_context(self, is_last_microbatch: bool) -> contextlib.AbstractContextManager:
        """Context for one microbatch's backward; DDP disables gradient sync on all but the last."""
        return contextlib.nullcontext()

    def forward_backward(
        self,
        module: NanoModule,
        microbatches: Sequence[Any],
        batch_idx: int,
        hooks: MicrobatchHooks | None = None,
    ) -> StepOutput:
        """Accumulate gradients of the objective over the global batch (each loss term, or the
        whole loss, averaged over its global count: `weighting`); reduce its value."""
        assert self._step_runner is not None, "setup_module() must run before forward_backward()"
        weighed = weigh_microbatches(self, module, microbatches)
        accumulator = LossAccumulator(weighed)
        num_micro = len(microbatches)
        precision = self.precision
        for i, microbatch in enumerate(microbatches):
            if hooks is not None:
                hooks.start(i, microbatch)
            with self._sync_context(i == num_micro - 1):
                with named_range("nanotrain/forward"), precision.forward_context():
                    output = self._step_runner(microbatch, batch_idx + i)
                # scaled by the microbatch's share of each global count (times the replicas,
                # which DDP's average divides out again)
                objective = accumulator.objective(i, output)
                if hooks is not None:
                    hooks.before(i, objective)
                with named_range("nanotrain/backward"):
                    precision.scale_loss(objective).backward()
            if hooks is not None and i < num_micro - 1:
                hooks.after()
                hooks.end(i, output, objective)
        self._finish_grad_sync()
        if hooks is not None:  # the last microbatch's: its gradients are reduced by now
            hooks.after()
            hooks.end(num_micro - 1, output, objective)
        if precision.uses_loss_scaling:
            grads = [grad_of(p) for p in self._all_params]
            precision.unscale_grads_([g for g in grads if g is not None], self._found_inf_groups())
        loss, terms = accumulator.finish(self)
        return StepOutput(
            loss=loss,
            num_tokens=weighed.tokens,
            num_samples=weighed.samples,
            metrics={**terms, **precision.step_metrics()},
            skipped=precision.skip_step,
        )

    def average_grads_(self) -> None:
        """Average every parameter's `.grad` over the data-parallel replicas, in place (manual
        optimization's `manual_backward`; nothing for one process). Gradients already equal
        on every replica stay as they are, so calling it after each backward gives what DDP's
        reducer gives."""

    def grads_for_clipping(self) -> list[Tensor]:
        """This replica's (already synchronized) gradients as the optimizer reads them."""
        return [g for g in map(grad_of, self._all_params) if g is not None]

    def clip_grad_norm_(self, max_norm: float | None) -> Tensor:
        """Global L2 grad norm over this (already synchronized) replica's gradients; clip if asked."""
        grads = self.grads_for_clipping()
        if not grads:
            return torch.zeros((), device=self.root_device)
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if max_norm is not None:
            # what torch.nn.utils.clip_grad_norm_ does, on the grads the optimizer reads
            self.clip_grads_(norm, max_norm)
        return norm

    def zero_grad(self) -> None:
        """Drop the gradients (and zero the fp32 main grads, if any)."""
        super().zero_grad()
        if self._main_grads is not None:
            self._main_grads.zero_()

    def teardown(self) -> None:
        self._step_runner = None
        self._all_params = []
        if self._main_grads is not None:
            self._main_grads.remove()
            self._main_grads = None
