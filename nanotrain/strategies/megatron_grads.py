"""Gradient norms and inspection for MegatronStrategy: the global grad norm over every shard
(tp slices, ZeRO-2 dp slices, pipeline stages; replicated parameters and a shared embedding
copy counted once), clipping, per-parameter norms and gathered tensors for callbacks."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from nanotrain.parallel.grads import (
    clip_grads_,
    gather_tp_shards,
    param_owners,
    reduced_square_norms,
)


class MegatronGradNorms:
    """Mixin of `MegatronStrategy` (uses its mesh, gradient buckets, ZeRO optimizer and
    pipeline engine)."""

    def _owned_grads(self) -> tuple[list[tuple[int, Tensor]], list[Any]]:
        """``(param_index, grad)`` as the optimizer reads them (whole grads, or under ZeRO-2
        this rank's pieces) and the groups over which their squares add up."""
        assert self._grads is not None
        if self.zero_stage == 2:
            assert self._zero is not None
            return self._zero.owned_grads(), [self.mesh.tp_group, self.mesh.dp_group]
        params = self._grads.layout.params
        owned = [(i, p.grad) for i, p in enumerate(params) if p.grad is not None]
        return owned, [self.mesh.tp_group]

    def _square_norms(self, owned: list[tuple[int, Tensor]], groups: list[Any]) -> Tensor:
        assert self._grads is not None
        params = self._grads.layout.params
        return reduced_square_norms(
            owned,
            len(params),
            [self._sharded.get(id(p), False) for p in params],
            count_replicated=self.mesh.tp_rank == 0,  # replicated grads count once
            groups=groups,
            device=self.root_device,
        )

    def _stage_square_norms(self, owned: list[tuple[int, Tensor]], groups: list[Any]) -> Tensor:
        """`_square_norms` with a pipeline stage's copy of a shared embedding left out (the
        first stage counts it)."""
        sq = self._square_norms(owned, groups)
        if self._pipeline is not None:
            assert self.module is not None and self._grads is not None
            sq = sq * self._pipeline.square_norm_mask(self.module, self._grads.layout.params)
        return sq

    def clip_grad_norm_(self, max_norm: float | None) -> Tensor:
        """Global L2 grad norm over every shard (replicated params once, every pipeline
        stage); clip if asked."""
        owned, groups = self._owned_grads()
        total = self._stage_square_norms(owned, groups).sum()
        if self._pipeline is not None:
            total = self._pipeline.sum_over_stages(total)
        norm = total.sqrt().float()
        if max_norm is not None:
            clip_grads_([g for _, g in owned], norm, max_norm)
        return norm

    # -- inspection ------------------------------------------------------------------------------
    def named_grad_norms(self) -> dict[str, Tensor]:
        """Norm of each parameter's whole gradient (gathered over tp and, under ZeRO-2, dp),
        every pipeline stage's parameters on every rank."""
        assert self.module is not None and self._grads is not None
        names = {id(p): n for n, p in self.module.named_parameters()}
        norms = self._square_norms(*self._owned_grads()).sqrt().float()
        named = {names[id(p)]: norms[i] for i, p in enumerate(self._grads.layout.params)}
        if self._pipeline is None:
            return named
        merged = self._pipeline.gather_over_stages({k: float(v) for k, v in named.items()})
        return {k: torch.tensor(v, device=self.root_device) for k, v in merged.items()}

    def full_tensor(self, name: str, tensor: Tensor) -> Tensor:
        """Gather parameter ``name``'s tp slices (a collective over its tp group)."""
        assert self.module is not None
        owners = param_owners(self.module)
        if name not in owners:
            raise ValueError(f"{name!r} is not a parameter of the module; see named_parameters()")
        owner, local = owners[name]
        return gather_tp_shards(owner, local, tensor)

    def grad_buffer_bytes(self) -> int:
        """Bytes of gradient this rank keeps between steps: the whole flat buffer, or under
        ZeRO-2 only its shard (the whole buffer exists only from backward to the reduction)."""
        assert self._grads is not None, "setup_module() must run first"
        layout = self._grads.layout
        numel = layout.shard_numel if self.zero_stage == 2 else layout.numel
        return numel * layout.params[0].element_size()

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (full / dp under ZeRO)."""
        from nanotrain.parallel.zero import state_bytes

        return state_bytes(self.optimizer)
