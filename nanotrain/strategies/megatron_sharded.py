"""The ZeRO-3 side of `MegatronStrategy` (a mixin): where the strategy's gradient, state and
inspection methods read the FSDP2-wrapped model (`megatron_zero3.FullyShardedModel`) instead
of the flat gradient buckets. Every method falls back to the ZeRO-0/1/2 implementation when
ZeRO-3 is off."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from nanotrain.parallel.fully_sharded import local_tensor
from nanotrain.parallel.grads import clip_grads_
from nanotrain.runtime.profiling import named_range
from nanotrain.strategies.base import MicrobatchHooks, StepOutput
from nanotrain.strategies.weighting import LossAccumulator, weigh_microbatches

if TYPE_CHECKING:
    from nanotrain.module import NanoModule
    from nanotrain.strategies.megatron_zero3 import FullyShardedModel


class ShardedMethods:
    """Mixin of `MegatronStrategy`; ``self._fsdp`` is the `FullyShardedModel` under ZeRO-3."""

    _fsdp: FullyShardedModel | None
    reduce_scatter_every_microbatch: bool

    def _forward_backward_sharded(
        self,
        module: NanoModule,
        microbatches: Sequence[Any],
        batch_idx: int,
        hooks: MicrobatchHooks | None,
    ) -> StepOutput:
        """Every microbatch's forward and backward through FSDP2; only the last one
        reduce-scatters (the others accumulate unsharded gradients locally), or with
        ``reduce_scatter_every_microbatch`` each one adds its reduce-scattered gradient to
        the shards: either way the same sum as the buckets' of ZeRO-0/1/2, divided by dp."""
        fsdp = self._fsdp
        assert fsdp is not None
        weighed = weigh_microbatches(self, module, microbatches)
        accumulator = LossAccumulator(weighed)
        if self._pipeline is not None:
            fsdp.set_sync(False)  # `fsdp.finish` reduce-scatters after the schedule
            sums = self._pipeline.train_step(
                module, microbatches, accumulator, batch_idx, fsdp, self.precision, run=fsdp.run
            )
            return self._finish_sharded_step(fsdp, accumulator, weighed, sums)
        num_micro = len(microbatches)
        for i, microbatch in enumerate(microbatches):
            fsdp.set_sync(self.reduce_scatter_every_microbatch or i == num_micro - 1)
            if hooks is not None:
                hooks.start(i, microbatch)

            def step(mb: Any, idx: int, m: int = i) -> tuple[Any, Tensor]:
                # the objective is made inside the root's forward so that FSDP2 finds a
                # tensor to hook its end-of-backward work on, whatever training_step returns
                out = module.training_step(mb, idx)
                return out, accumulator.objective(m, out)

            with named_range("nanotrain/forward"), self.precision.forward_context():
                output, objective = fsdp.run(step, microbatch, batch_idx + i)
            if hooks is not None:
                hooks.before(i, objective)
            with named_range("nanotrain/backward"):
                self.precision.scale_loss(objective).backward()
            if hooks is not None:
                hooks.after()
                hooks.end(i, output, objective)
        return self._finish_sharded_step(fsdp, accumulator, weighed, accumulator.sums)

    def _finish_sharded_step(
        self, fsdp: FullyShardedModel, accumulator: LossAccumulator, weighed: Any, sums: Tensor
    ) -> StepOutput:
        """The sequence-parallel sum, unscaling, and the step's global loss terms."""
        fsdp.reduce_sequence_parallel_grads()
        if self.precision.uses_loss_scaling:
            mesh = self.mesh
            grads = [g for _, g in fsdp.local_grads()]
            self.precision.unscale_grads_(grads, [mesh.tp_group, mesh.pp_group, mesh.dp_group])
        return self._step_output(accumulator, sums, weighed)

    # -- gradients -------------------------------------------------------------------------------
    def grads_for_clipping(self) -> list[Tensor]:
        """Under ZeRO-3 this rank's local gradient shards."""
        if self._fsdp is None:
            return super().grads_for_clipping()
        return [g for _, g in self._fsdp.local_grads()]

    def clip_grad_norm_(self, max_norm: float | None) -> Tensor:
        """Global L2 grad norm (under ZeRO-3 from the local shards, see
        `megatron_zero3`); clip if asked."""
        if self._fsdp is None:
            return super().clip_grad_norm_(max_norm)
        total = self._stage_square_norms_sharded().sum()
        if self._pipeline is not None:
            total = self._pipeline.sum_over_stages(total)
        norm = total.sqrt().float()
        if max_norm is not None:
            clip_grads_(self.grads_for_clipping(), norm, max_norm)
        return norm

    def named_grad_norms(self) -> dict[str, Tensor]:
        """Norm of each parameter's whole gradient, identical on every rank."""
        if self._fsdp is None:
            return super().named_grad_norms()
        norms = self._fsdp.square_norms().sqrt().float()
        named = {name: norms[i] for i, (name, _) in enumerate(self._fsdp.named)}
        if self._pipeline is None:
            return named
        merged = self._pipeline.gather_over_stages({k: float(v) for k, v in named.items()})
        return {k: torch.tensor(v, device=self.root_device) for k, v in merged.items()}

    def _stage_square_norms_sharded(self) -> Tensor:
        """Per-parameter squared grad norms of this stage, a shared embedding copy left out
        on the stages that do not count it."""
        assert self._fsdp is not None
        sq = self._fsdp.square_norms()
        if self._pipeline is not None:
            assert self.module is not None
            params = [p for _, p in self._fsdp.named]
            sq = sq * self._pipeline.square_norm_mask(self.module, params)
        return sq

    def full_tensor(self, name: str, tensor: Tensor) -> Tensor:
        """The whole value of parameter ``name`` (or its gradient) from this rank's piece."""
        if self._fsdp is None:
            return super().full_tensor(name, tensor)
        return self._fsdp.full_tensor(name, tensor)

    def grad_buffer_bytes(self) -> int:
        """Under ZeRO-3 the bytes of this rank's gradient shards."""
        if self._fsdp is None:
            return super().grad_buffer_bytes()
        return self._fsdp.local_bytes()["grads"]

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (its shards under ZeRO-2/3)."""
        return sum(
            local_tensor(v).numel() * v.element_size()
            for state in self.optimizer.state.values()
            for v in state.values()
            if isinstance(v, Tensor)
        )

    # -- state -----------------------------------------------------------------------------------
    def model_state_dict(self) -> dict[str, Tensor]:
        """This rank's weights as tensor/expert-parallel slices (under ZeRO-3 gathered over
        dp: a collective)."""
        if self._fsdp is None:
            return super().model_state_dict()
        return self._fsdp.model_state_dict()

    def load_model_state_dict(self, state: dict[str, Tensor]) -> None:
        """Load weights produced by `model_state_dict` (strict)."""
        if self._fsdp is None:
            return super().load_model_state_dict(state)
        return self._fsdp.load_model_state_dict(state)

    def optimizer_state_dict(self) -> dict[str, Any]:
        """As every strategy's; under ZeRO-3 the state tensors are this rank's local shards
        (plain tensors)."""
        state = super().optimizer_state_dict()
        if self._fsdp is None:
            return state
        return self._fsdp.to_local_state(state)

    def load_optimizer_state_dict(self, state: dict[str, Any]) -> None:
        """Load what `optimizer_state_dict` produced."""
        if self._fsdp is not None:
            state = self._fsdp.to_dtensor_state(self.optimizer, state)
        super().load_optimizer_state_dict(state)

    def _run_forward(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` (under ZeRO-3 inside FSDP2's hooks, parameters gathered)."""
        return fn(*args) if self._fsdp is None else self._fsdp.run(fn, *args)


__all__ = ["ShardedMethods"]
