"""One optimizer step of `MegatronStrategy` (a mixin): the microbatch loop (or the pipeline
schedule) with the gradient reductions, the step's reduced loss terms, what the optimizer
updates (the module's parameters or ZeRO's shards), and zeroing the gradient buffers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor

from nanotrain.parallel.context import context_batch
from nanotrain.runtime.profiling import named_range
from nanotrain.strategies.base import MicrobatchHooks, StepOutput
from nanotrain.strategies.weighting import LossAccumulator, weigh_microbatches

if TYPE_CHECKING:
    from nanotrain.module import NanoModule
    from nanotrain.parallel.data_parallel import GradBucketSets
    from nanotrain.parallel.zero import ZeroOptimizer
    from nanotrain.strategies.megatron_pipeline import PipelineEngine


class MegatronStep:
    """Mixin of `MegatronStrategy`: ``self._grads`` are its gradient buckets (ZeRO-0/1/2),
    ``self._pipeline`` its schedule under pp > 1, ``self._zero`` its sharded optimizer."""

    _grads: GradBucketSets | None
    _pipeline: PipelineEngine | None
    _zero: ZeroOptimizer | None

    def forward_backward(
        self,
        module: NanoModule,
        microbatches: Sequence[Any],
        batch_idx: int,
        hooks: MicrobatchHooks | None = None,
    ) -> StepOutput:
        """Accumulate the gradient of the mean loss over the global batch's tokens; reduce it
        over dp (and tp under SP). `hooks` need `supports_microbatch_hooks`."""
        if self.cp > 1:  # this rank's two chunks of every sequence
            microbatches = [context_batch(mb, self.mesh.cp_group) for mb in microbatches]
        if self._fsdp is not None:
            return self._forward_backward_sharded(module, microbatches, batch_idx, hooks)
        grads = self._grads
        assert grads is not None, "setup_module() must run before forward_backward()"
        weighed = weigh_microbatches(self, module, microbatches)
        accumulator = LossAccumulator(weighed)
        grads.attach()
        last: tuple[Any, Tensor] | None = None  # the last microbatch's output and objective
        if self._pipeline is not None:
            sums = self._pipeline.train_step(
                module, microbatches, accumulator, batch_idx, grads, self.precision
            )
        else:
            sums, last = self._accumulate(
                module, microbatches, accumulator, batch_idx, grads, hooks
            )
        self._reduce_sequence_parallel_grads()
        if hooks is not None and last is not None:  # its gradients are reduced by now
            hooks.after()
            hooks.end(len(microbatches) - 1, *last)
        if self.zero_stage == 2:
            grads.release()
        if self.precision.uses_loss_scaling:
            self._unscale_grads()
        return self._step_output(accumulator, sums, weighed)

    def _step_output(self, accumulator: LossAccumulator, sums: Tensor, weighed: Any) -> StepOutput:
        """The step's global loss terms (reduced from the accumulator's local `sums`) with its
        token and sample counts and the precision's metrics."""
        loss, terms = accumulator.finish(self, sums)
        return StepOutput(
            loss=loss,
            num_tokens=weighed.tokens,
            num_samples=weighed.samples,
            metrics={**terms, **self.precision.step_metrics()},
            skipped=self.precision.skip_step,
        )

    def _accumulate(
        self,
        module: NanoModule,
        microbatches: Sequence[Any],
        accumulator: LossAccumulator,
        batch_idx: int,
        grads: GradBucketSets,
        hooks: MicrobatchHooks | None = None,
    ) -> tuple[Tensor, tuple[Any, Tensor]]:
        """Forward and backward of each microbatch in turn; dp reduction on the last one.
        Returns the accumulator's local sums of the (weighed) loss terms, and the last
        microbatch's `training_step` output and objective (for its end hook)."""
        num_micro = len(microbatches)
        for i, microbatch in enumerate(microbatches):
            grads.set_sync(i == num_micro - 1)
            if hooks is not None:
                hooks.start(i, microbatch)
            with named_range("nanotrain/forward"), self.precision.forward_context():
                output = module.training_step(microbatch, batch_idx + i)
            objective = accumulator.objective(i, output)
            if hooks is not None:
                hooks.before(i, objective)
            with named_range("nanotrain/backward"):
                self.precision.scale_loss(objective).backward()
            if hooks is not None and i < num_micro - 1:
                hooks.after()
                hooks.end(i, output, objective)
        with named_range("nanotrain/grad_reduction"):
            grads.finish()
        return accumulator.sums, (output, objective)

    @property
    def supports_microbatch_hooks(self) -> bool:
        """Not under pp > 1 (forward and backward run per model chunk inside the schedule)."""
        return self.pp == 1

    @property
    def supports_backward_hooks(self) -> bool:
        """Not under pp > 1 nor ZeRO-2/3 (the reduced gradients live in this rank's shards,
        not whole in `.grad`)."""
        return self.pp == 1 and self.zero_stage < 2

    def _updater(self) -> Any:
        """Under ZeRO the sharded optimizer (it updates this rank's shard, on fp32 masters when
        the precision keeps them, then all-gathers the parameters); else as every strategy."""
        return self._zero if self._zero is not None else super()._updater()

    def zero_grad(self) -> None:
        """Zero the gradient buffers (the grads stay views of them); under ZeRO-3 drop the
        gradient shards."""
        if self._fsdp is not None:
            self.optimizer.zero_grad(set_to_none=True)
            return
        assert self._grads is not None
        self._grads.zero_()
