"""Gradients of MegatronStrategy: checks that the built model fits the layout, the bucket sets
gradients are reduced in (dense weights over dp, expert weights over expert-dp), the
sequence-parallel sum over tp, the global grad norm over every shard (tp slices, ZeRO-2 dp
slices, experts split over ep, pipeline stages; replicated parameters and a shared embedding
copy counted once), clipping, per-parameter norms and gathered tensors for callbacks."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn

from nanotrain.parallel.collectives import all_gather_along_dim
from nanotrain.parallel.data_parallel import FlatLayout, GradBuckets, GradBucketSets
from nanotrain.parallel.expert import is_expert_param
from nanotrain.parallel.grads import (
    all_reduce_coalesced,
    clip_grads_,
    gather_tp_shards,
    param_owners,
    reduced_square_norms,
)
from nanotrain.parallel.mesh import ParallelMesh
from nanotrain.parallel.tensor import _TensorParallelModule
from nanotrain.precision.master import grad_of

# A set of (param_index, grad or grad piece) and the groups over which their squares add up.
GradSet = tuple[list[tuple[int, Tensor]], list[Any]]


def expert_param_ids(module: nn.Module) -> set[int]:
    """``id`` of every routed-expert parameter of ``module`` (tagged by
    `nanotrain.parallel.expert.mark_expert_params`; `GroupedExperts` keeps the tag through
    meta-device materialization and dtype casts)."""
    return {id(p) for p in module.parameters() if is_expert_param(p)}


def check_built_model(
    module: nn.Module, params: list[nn.Parameter], mesh: ParallelMesh, sequence_parallel: bool
) -> None:
    """Refuse a built model whose parameters do not match the layout the strategy reduces.

    Warns (on the first rank of each pipeline stage holding routed experts) when tp > 1
    without ``sequence_parallel``: every tp rank would repeat the experts' computation.

    Raises:
        ValueError: no trainable parameter; ``sequence_parallel`` with tp > 1 but no
            sequence-parallel layer (its replicated grads would be summed over tp twice over);
            ep > 1 without pipelining but no expert-parallel parameter (every rank would hold
            every expert and the expert grads would be summed ep times).
    """
    if not params:
        raise ValueError("MegatronStrategy found no trainable parameters after configure_model")
    if sequence_parallel and mesh.tp_size > 1:
        layers = [m for m in module.modules() if isinstance(m, _TensorParallelModule)]
        if not any(getattr(m, "sequence_parallel", False) for m in layers if m.tp_size > 1):
            raise ValueError(
                "sequence_parallel=True but the model has no sequence-parallel tensor-parallel "
                "layer; build its layers with sequence_parallel=True (from the strategy's "
                "`sequence_parallel`) or use sequence_parallel=False"
            )
    # once per pipeline stage that holds routed experts (its first rank): rank 0's stage
    # may hold only dense layers
    first_of_stage = mesh.coords.tp_rank == 0 and mesh.coords.dp_rank == 0
    if mesh.tp_size > 1 and not sequence_parallel and first_of_stage and expert_param_ids(module):
        warnings.warn(
            f"tp={mesh.tp_size} without sequence_parallel: every tp rank routes the same "
            "tokens and runs the same routed-expert computation (tp-fold repeated expert "
            "FLOPs); pass sequence_parallel=True so that each tp rank routes 1/tp of the "
            "tokens (Megatron-Core requires it for MoE with tensor parallelism)",
            stacklevel=2,
        )
    # A pipeline stage may hold no MoE layer at all, so only a whole model is checked.
    if mesh.ep_size > 1 and mesh.pp_size == 1 and not expert_param_ids(module):
        raise ValueError(
            f"ep={mesh.ep_size} but the model built no expert-parallel parameters: its "
            "configure_model must build the MoE layers on the strategy's mesh "
            "(build_model(config, mesh=...)) so that each rank holds 1/ep of the experts"
        )


def bucket_numel_for(element_size: int, bucket_size_mb: float) -> int:
    """Elements per gradient bucket: ``bucket_size_mb`` MiB of parameters of that element size
    (the planner lays out ZeRO's padded buffers with the same rule)."""
    return max(1, int(bucket_size_mb * 2**20) // element_size)


def build_grad_buckets(
    params: list[nn.Parameter],
    expert_ids: set[int],
    mesh: ParallelMesh,
    bucket_size_mb: float,
    zero_stage: int,
    grad_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> tuple[GradBucketSets, list[bool]]:
    """Split ``params`` (in backward order) into dense and expert weights (``id`` in
    ``expert_ids``, see `expert_param_ids`) and give each its
    flat, bucketed gradient buffer: dense reduced over the data-parallel group, experts over
    the expert-data-parallel group. Both divide by the full dp size (see
    `nanotrain.parallel.data_parallel`). ``grad_dtype`` / ``reduce_dtype``: see `GradBuckets`
    (fp32 main grads for bf16 parameters; bf16 on the wire). Returns the sets and, per set,
    whether it holds experts.
    """
    bucket_numel = bucket_numel_for(params[0].element_size(), bucket_size_mb)
    dense = [p for p in params if id(p) not in expert_ids]
    experts = [p for p in params if id(p) in expert_ids]
    sets, is_expert = [], []
    for members, group, size, expert in (
        (dense, mesh.dp_group, mesh.dp_size, False),
        (experts, mesh.expert_dp_group, mesh.expert_dp_size, True),
    ):
        if not members:  # e.g. a pipeline stage without MoE layers
            continue
        layout = FlatLayout(members, size, bucket_numel)
        sets.append(
            GradBuckets(
                layout,
                group,
                reduce_scatter=zero_stage == 2,
                divisor=mesh.dp_size,
                grad_dtype=grad_dtype,
                reduce_dtype=reduce_dtype,
            )
        )
        is_expert.append(expert)
    return GradBucketSets(sets), is_expert


class MegatronGradNorms:
    """Mixin of `MegatronStrategy` (uses its mesh, gradient bucket sets, ZeRO optimizer,
    sequence-parallel parameters and pipeline engine)."""

    def _grad_sets(self) -> list[GradSet]:
        """Per bucket set: ``(param_index, grad)`` as the optimizer reads them (whole grads,
        or under ZeRO-2 this rank's pieces) and the groups over which their squares add up:
        tp (shards), the set's own dp group under ZeRO-2, and ep for experts (each ep rank
        holds different experts)."""
        sets = self._grads
        assert sets is not None
        out = []
        for k, buckets in enumerate(sets.sets):
            groups = [self.mesh.tp_group]
            if self.zero_stage == 2:
                assert self._zero is not None
                owned = self._zero.owned_grads(k)
                groups.append(buckets.group)
            else:
                base = sets.offset(k)
                params = buckets.layout.params
                owned = [
                    (base + i, grad_of(p)) for i, p in enumerate(params) if grad_of(p) is not None
                ]
            if self._expert_sets[k]:
                groups.append(self.mesh.ep_group)
            out.append((owned, groups))
        return out

    def _square_norms(self, grad_sets: list[GradSet]) -> Tensor:
        """Squared norm of each parameter's whole gradient ([num_params] float64), the same
        on every rank of a pipeline stage."""
        assert self._grads is not None
        params = self._grads.params
        sharded = [self._sharded.get(id(p), False) for p in params]
        total = torch.zeros(len(params), dtype=torch.float64, device=self.root_device)
        for owned, groups in grad_sets:
            total += reduced_square_norms(
                owned,
                len(params),
                sharded,
                count_replicated=self.mesh.tp_rank == 0,  # replicated grads count once
                groups=groups,
                device=self.root_device,
            )
        return total

    def _stage_square_norms(self, grad_sets: list[GradSet]) -> Tensor:
        """`_square_norms` with a pipeline stage's copy of a shared embedding left out (the
        first stage counts it)."""
        sq = self._square_norms(grad_sets)
        if self._pipeline is not None:
            assert self.module is not None and self._grads is not None
            sq = sq * self._pipeline.square_norm_mask(self.module, self._grads.params)
        return sq

    def grads_for_clipping(self) -> list[Tensor]:
        """This rank's gradients as the optimizer reads them (whole, or its ZeRO-2 shards)."""
        return [g for owned, _ in self._grad_sets() for _, g in owned]

    def clip_grad_norm_(self, max_norm: float | None) -> Tensor:
        """Global L2 grad norm over every shard (replicated params once, every expert and
        pipeline stage); clip if asked."""
        grad_sets = self._grad_sets()
        total = self._stage_square_norms(grad_sets).sum()
        if self._pipeline is not None:
            total = self._pipeline.sum_over_stages(total)
        norm = total.sqrt().float()
        if max_norm is not None:
            clip_grads_([g for owned, _ in grad_sets for _, g in owned], norm, max_norm)
        return norm

    def _unscale_grads(self) -> None:
        """Unscale this rank's reduced gradients (whole buffers, or its ZeRO-2 shards) and
        reduce the found-inf flag over tp, pp and dp (dp contains ep and expert-dp), i.e. over
        every rank: all ranks skip the same step."""
        assert self._grads is not None
        local = [s.shard_grad if self.zero_stage == 2 else s.buffer for s in self._grads.sets]
        mesh = self.mesh
        groups = [mesh.tp_group, mesh.pp_group, mesh.dp_group]
        self.precision.unscale_grads_([g for g in local if g is not None], groups)

    def _reduce_sequence_parallel_grads(self) -> None:
        """Sum over tp the grads of replicated params that saw only this rank's tokens."""
        if not self._sp_params:
            return
        if self.zero_stage == 2:
            assert self._zero is not None
            wanted = {id(p) for p in self._sp_params}
            params = self._grads.params
            pieces = [g for i, g in self._zero.owned_grads() if id(params[i]) in wanted]
        else:
            pieces = [grad_of(p) for p in self._sp_params if grad_of(p) is not None]
        all_reduce_coalesced(pieces, self.mesh.tp_group)

    # -- inspection ------------------------------------------------------------------------------
    def named_grad_norms(self) -> dict[str, Tensor]:
        """Norm of each parameter's whole gradient (gathered over tp, over ep for experts and,
        under ZeRO-2, over dp), every pipeline stage's parameters on every rank."""
        assert self.module is not None and self._grads is not None
        names = {id(p): n for n, p in self.module.named_parameters()}
        norms = self._square_norms(self._grad_sets()).sqrt().float()
        named = {names[id(p)]: norms[i] for i, p in enumerate(self._grads.params)}
        if self._pipeline is None:
            return named
        merged = self._pipeline.gather_over_stages({k: float(v) for k, v in named.items()})
        return {k: torch.tensor(v, device=self.root_device) for k, v in merged.items()}

    def full_tensor(self, name: str, tensor: Tensor) -> Tensor:
        """Gather parameter ``name``'s tp slices, and for routed experts every ep rank's
        experts (collectives over its tp / ep group)."""
        assert self.module is not None
        owners = param_owners(self.module)
        if name not in owners:
            raise ValueError(f"{name!r} is not a parameter of the module; see named_parameters()")
        owner, local = owners[name]
        full = gather_tp_shards(owner, local, tensor)
        ep_dims = getattr(owner, "ep_partition_dims", {})
        if local in ep_dims and getattr(owner, "ep_size", 1) > 1:
            # rank r of the ep group holds the r-th contiguous slice of the experts
            full = all_gather_along_dim(full.contiguous(), ep_dims[local], self.mesh.ep_group)
        return full

    def grad_buffer_bytes(self) -> int:
        """Bytes of gradient this rank keeps between steps: the whole flat buffers, or under
        ZeRO-2 only their shards (a whole buffer exists only from backward to the reduction)."""
        assert self._grads is not None, "setup_module() must run first"
        total = 0
        for buckets in self._grads.sets:
            layout = buckets.layout
            numel = layout.shard_numel if self.zero_stage == 2 else layout.numel
            total += numel * buckets._dtype.itemsize
        return total

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (full / dp under ZeRO)."""
        from nanotrain.parallel.zero import state_bytes

        return state_bytes(self.optimizer)
