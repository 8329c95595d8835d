"""ZeRO-3 inside MegatronStrategy: the model wrapped by FSDP2 (`nanotrain.parallel.fully_sharded`)
and everything the strategy reads from it: the microbatch loop's gradient sync, the
sequence-parallel sum over tp, the global grad norm over DTensor shards, clipping, whole
tensors for callbacks and checkpoints, and optimizer state as plain rank-local tensors.

Grad norm counting rule (as `nanotrain.parallel.grads`, with FSDP2's shards added): every
rank squares its local shard of every gradient; tp-replicated parameters count on tp rank 0
only; the squares are summed over tp, over the FSDP group (dp, or expert-dp for routed
experts) and for experts over ep (expert-dp x ep = dp), then over pp.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, distribute_tensor

from nanotrain.models.cast_cache import drop_step_casts
from nanotrain.parallel.collectives import all_gather_along_dim
from nanotrain.parallel.expert import is_expert_param
from nanotrain.parallel.fully_sharded import (
    StepRunner,
    gathered_params,
    local_tensor,
    reduce_after_schedule,
    shard_fully,
)
from nanotrain.parallel.grads import (
    all_reduce_coalesced,
    gather_tp_shards,
    is_tp_sharded,
    param_owners,
    reduced_square_norms,
    sequence_parallel_params,
)
from nanotrain.parallel.mesh import ParallelMesh

if TYPE_CHECKING:
    from nanotrain.precision.base import Precision


def fsdp_mixed_precision(precision: Precision) -> MixedPrecisionPolicy:
    """FSDP2's policy for a precision plugin: low-precision parameters ("bf16-true") become
    fp32 shards gathered in bf16 (the fp32 masters of the other stages are the shards
    themselves), gradients reduced in the plugin's ``reduce_dtype`` (fp32 unless asked);
    autocast precisions ("bf16-mixed", "16-mixed", fp8/fp4 emulation) keep fp32 parameters
    and let autocast cast inside the forward, exactly as on one process."""
    if precision.master_weights:
        return MixedPrecisionPolicy(
            param_dtype=precision.param_dtype,
            reduce_dtype=precision.reduce_dtype,
            cast_forward_inputs=False,
        )
    if precision.name != "32-true" and precision.reduce_dtype != torch.float32:
        return MixedPrecisionPolicy(reduce_dtype=precision.reduce_dtype, cast_forward_inputs=False)
    return MixedPrecisionPolicy(cast_forward_inputs=False)


class FullyShardedModel:
    """The ZeRO-3 state of one `MegatronStrategy` fit.

    Args:
        module: the built `NanoModule` (precision applied); wrapped in place.
        mesh: the strategy's `ParallelMesh`.
        precision: the precision plugin (`fsdp_mixed_precision`).
        device: the compute device.
        reshard_after_forward, cpu_offload: see `shard_fully`.
        sequence_parallel: whether tp-replicated grads are summed over tp.
        keep_gathered_in_backward: the pipeline schedule splits backwards (zb_*,
            DualPipeV): keep the gathered parameters from each unit's backward until
            `finish` (see `set_sync`).
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: ParallelMesh,
        precision: Precision,
        device: torch.device,
        *,
        reshard_after_forward: bool,
        cpu_offload: bool,
        sequence_parallel: bool,
        keep_gathered_in_backward: bool = False,
    ) -> None:
        self.module, self.mesh = module, mesh
        self.keep_gathered_in_backward = keep_gathered_in_backward
        self.distributed = mesh.world_size > 1  # one process: nothing to shard or wrap
        if precision.master_weights and self.distributed:  # fp32 shards, gathered in bf16
            with torch.no_grad():
                for p in module.parameters():
                    if p.is_floating_point():
                        p.data = p.data.float()
        tp_sharded = is_tp_sharded(module)
        names = [n for n, p in module.named_parameters() if p.requires_grad]
        params = dict(module.named_parameters())
        self._tp_sharded = {n: tp_sharded.get(id(params[n]), False) for n in names}
        self._expert = {n: is_expert_param(params[n]) for n in names}
        sp_ids = set()
        if sequence_parallel and mesh.tp_size > 1:
            sp_ids = {id(p) for p in sequence_parallel_params(module)}
        sp_names = {n for n in names if id(params[n]) in sp_ids}
        self.runner: StepRunner | None = None
        if self.distributed:
            self.runner = shard_fully(
                module,
                dp_group=mesh.dp_group,
                expert_dp_group=mesh.expert_dp_group,
                dp_size=mesh.dp_size,
                device=device,
                mp_policy=fsdp_mixed_precision(precision),
                reshard_after_forward=reshard_after_forward,
                cpu_offload=cpu_offload,
            )
        self.device = device
        # the wrapped parameters (new objects), each once, in model order
        seen: set[int] = set()
        self.named: list[tuple[str, nn.Parameter]] = []
        for name, p in module.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self.named.append((name, p))
        self.sp_params = [p for n, p in self.named if n in sp_names]

    # -- the step ------------------------------------------------------------------------------
    def run(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` inside FSDP2's root hooks (parameters gathered as each unit runs);
        the step's weight casts are dropped after it (`drop_step_casts`), so under autocast
        each microbatch keeps its own low-precision copies until its backward."""
        if self.runner is None:
            return fn(*args)
        try:
            return self.runner(fn, *args)
        finally:
            drop_step_casts()  # each microbatch casts the gathered weights itself

    def set_sync(self, sync: bool) -> None:
        """Whether the next backward reduce-scatters (the last microbatch) or accumulates
        unsharded gradients locally (the others). Under a schedule that splits backwards
        (``keep_gathered_in_backward``), sync off also keeps every unit's gathered
        parameters from its backward until `finish`: the weight halves run after FSDP2's
        post-backward hook (which fires when the input half ends) and accumulate into them."""
        if self.runner is not None:
            self.runner.set_requires_gradient_sync(sync)
            if self.keep_gathered_in_backward and not sync:
                self.runner.set_reshard_after_backward(False, recurse=True)

    def finish(self) -> None:
        """After a pipeline schedule: reduce-scatter what every backward accumulated
        (`reduce_after_schedule`, freeing the gathered parameters), then turn sync off again
        for the next step's schedule."""
        if self.runner is not None:
            if self.keep_gathered_in_backward:
                self.runner.set_reshard_after_backward(True, recurse=True)
            reduce_after_schedule(self.runner)

    def gathered_params(self, params: Sequence[Tensor]) -> list[Tensor]:
        """FSDP2's gathered copy of each of ``params`` (`fully_sharded.gathered_params`)."""
        if self.runner is None:
            return list(params)
        return gathered_params(self.runner, params)

    def local_grads(self) -> list[tuple[int, Tensor]]:
        """``(index in named, local gradient shard)`` of every parameter with a gradient."""
        return [
            (i, local_tensor(p.grad)) for i, (_, p) in enumerate(self.named) if p.grad is not None
        ]

    def reduce_sequence_parallel_grads(self) -> None:
        """Sum over tp the (already dp-reduced) shards of the grads of tp-replicated
        parameters, which saw only this rank's part of the sequence. The tp peers hold the
        same dp slice of each, so the sums line up element by element."""
        pieces = [local_tensor(p.grad) for p in self.sp_params if p.grad is not None]
        all_reduce_coalesced(pieces, self.mesh.tp_group)

    def square_norms(self) -> Tensor:
        """Squared norm of each parameter's whole gradient (float64 [len(named)]), identical
        on every rank of a pipeline stage (module docstring's counting rule)."""
        mesh = self.mesh
        owned = self.local_grads()
        total = torch.zeros(len(self.named), dtype=torch.float64, device=self.device)
        sharded = [self._tp_sharded[n] for n, _ in self.named]
        for expert in (False, True):
            mine = [(i, g) for i, g in owned if self._expert[self.named[i][0]] == expert]
            groups = [mesh.tp_group]
            groups += [mesh.expert_dp_group, mesh.ep_group] if expert else [mesh.dp_group]
            total += reduced_square_norms(
                [(i, g.to(self.device)) for i, g in mine],
                len(self.named),
                sharded,
                count_replicated=mesh.tp_rank == 0,
                groups=groups,
                device=self.device,
            )
        return total

    # -- whole tensors --------------------------------------------------------------------------
    def full_tensor(self, name: str, tensor: Tensor) -> Tensor:
        """Parameter ``name``'s whole value (or gradient): gathered over its FSDP group, then
        over tp and, for routed experts, over ep."""
        owners = param_owners(self.module)
        if name not in owners:
            raise ValueError(f"{name!r} is not a parameter of the module; see named_parameters()")
        owner, local = owners[name]
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        full = gather_tp_shards(owner, local, tensor.to(self.device))
        ep_dims = getattr(owner, "ep_partition_dims", {})
        if local in ep_dims and getattr(owner, "ep_size", 1) > 1:
            full = all_gather_along_dim(full.contiguous(), ep_dims[local], self.mesh.ep_group)
        return full

    def model_state_dict(self) -> dict[str, Tensor]:
        """The rank-local (tp / ep slice) weights as ZeRO-0/1/2 ranks hold them: every FSDP
        shard gathered over its group (collective: every rank of the group must call it)."""
        state = self.module.state_dict()
        return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}

    @torch.no_grad()
    def load_model_state_dict(self, state: dict[str, Tensor]) -> None:
        """Load rank-local (tp / ep slice) weights, each rank keeping its FSDP shard.

        Raises:
            ValueError: missing or unexpected keys, or a shape that does not fit.
        """
        current = self.module.state_dict()
        missing = sorted(set(current) - set(state))
        unexpected = sorted(set(state) - set(current))
        if missing or unexpected:
            raise ValueError(
                f"model state does not fit: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        for name, target in current.items():
            value = state[name]
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(
                    f"{name}: saved shape {tuple(value.shape)}, model {tuple(target.shape)}"
                )
            if isinstance(target, DTensor):
                piece = distribute_tensor(
                    value.to(target.device, target.dtype),
                    target.device_mesh,
                    target.placements,
                    src_data_rank=None,
                )
                target.to_local().copy_(piece.to_local())
            else:
                target.copy_(value)

    # -- optimizer state -------------------------------------------------------------------------
    @staticmethod
    def to_local_state(state: dict[str, Any]) -> dict[str, Any]:
        """``optimizer.state_dict()`` with DTensor state as this rank's local tensors."""
        out = dict(state)
        out["state"] = {
            k: {n: local_tensor(v) if isinstance(v, Tensor) else v for n, v in entry.items()}
            for k, entry in state["state"].items()
        }
        return out

    @staticmethod
    def to_dtensor_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        """Inverse of `to_local_state`: each per-element local tensor placed like its
        parameter (the optimizer's parameters in ``param_groups`` order)."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        out = dict(state)
        converted = {}
        for k, entry in state["state"].items():
            p = params[int(k)]
            new = {}
            for n, v in entry.items():
                if isinstance(p, DTensor) and isinstance(v, Tensor) and v.dim() > 0:
                    local = p.to_local()
                    v = DTensor.from_local(
                        v.to(local.device, local.dtype).reshape(local.shape),
                        p.device_mesh,
                        p.placements,
                        shape=p.shape,
                        stride=p.stride(),
                    )
                new[n] = v
            converted[k] = new
        out["state"] = converted
        return out

    # -- accounting ------------------------------------------------------------------------------
    def local_bytes(self) -> dict[str, int]:
        """Bytes this rank holds between steps: "params" (its shards), "grads" (their
        gradient shards)."""
        params = sum(local_tensor(p).numel() * p.element_size() for _, p in self.named)
        grads = sum(
            local_tensor(p.grad).numel() * p.grad.element_size()
            for _, p in self.named
            if p.grad is not None
        )
        return {"params": params, "grads": grads}


def check_zero3_options(
    zero_stage: int,
    cpu_offload: bool,
    reshard_after_forward: bool,
    overlap_forward_backward: bool = False,
) -> None:
    """Refuse, at construction, the ZeRO-3 options and combinations that cannot work.

    Raises:
        ValueError: ``cpu_offload`` or ``reshard_after_forward=False`` without ZeRO-3, or
            ZeRO-3 with ``overlap_forward_backward`` (reason in the message).
    """
    if zero_stage != 3:
        if cpu_offload:
            raise ValueError(
                f"cpu_offload=True needs zero_stage=3 (got {zero_stage}): offload moves the "
                "parameter, gradient and optimizer-state shards that only ZeRO-3 has"
            )
        if not reshard_after_forward:
            raise ValueError(
                f"reshard_after_forward=False needs zero_stage=3 (got {zero_stage}): under "
                "ZeRO-0/1/2 every rank keeps whole parameters anyway"
            )
        return
    if overlap_forward_backward:
        raise ValueError(
            "zero_stage=3 with overlap_forward_backward=True is not supported: the paired "
            "backward runs on a second thread while the forward gathers parameters, and "
            "FSDP2's per-unit state is driven by one thread; use overlap_forward_backward="
            "False, or zero_stage=1/2"
        )
