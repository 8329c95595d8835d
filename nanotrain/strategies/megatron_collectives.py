"""How `MegatronStrategy` (a mixin) answers the Trainer's questions across ranks: its rank and
data shard, barriers, object broadcasts and gathers, tensor reductions over the mesh's
data-parallel group, and manual optimization's gradient average."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import Tensor

from nanotrain.parallel.grads import all_reduce_coalesced
from nanotrain.strategies.base import DataShard
from nanotrain.strategies.rendezvous import (
    LaunchedRanks,
)

if TYPE_CHECKING:
    from nanotrain.parallel.mesh import ParallelMesh

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class MegatronCollectives(LaunchedRanks):
    """Mixin of `MegatronStrategy`; ``self.mesh`` is its `ParallelMesh` (after
    `setup_environment`)."""

    mesh: ParallelMesh
    module: Any

    def data_shard(self) -> DataShard:
        """``(data_rank, dp // cp)``: tensor- and context-parallel peers read the same
        samples (context-parallel ones then keep different chunks of them)."""
        return DataShard(self.mesh.data_rank, self.mesh.data_size)

    @property
    def gradient_replicas(self) -> int:
        """Weight replicas: the mesh's dp group (data x context parallel ranks)."""
        return self.mesh.dp_size

    @property
    def metric_process_group(self) -> Any:
        return self.mesh.dp_group

    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            dist.barrier()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=src)
        return holder[0]

    def gather_from_stages(self, obj: Any) -> list[Any]:
        """Every pipeline stage's ``obj`` in stage order (an object all-gather over this
        rank's pipeline group); ``[obj]`` without pipelining."""
        if self.mesh.pp_size == 1:
            return [obj]
        parts: list[Any] = [None] * self.mesh.pp_size
        dist.all_gather_object(parts, obj, group=self.mesh.pp_group)
        return parts

    def reduce(self, tensor: Tensor, op: str = "mean") -> Tensor:
        """Reduce over the data-parallel group (tp peers already hold the same values)."""
        if op not in _REDUCE_OPS:
            raise ValueError(f"reduce op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
        out = tensor.detach().clone()
        if self.mesh.dp_size > 1:
            dist.all_reduce(out, op=_REDUCE_OPS[op], group=self.mesh.dp_group)
        if op == "mean":
            out = out / self.mesh.dp_size
        return out

    def average_grads_(self) -> None:
        """Average every parameter's `.grad` over the data-parallel group, in place (manual
        optimization's `manual_backward`, which runs only under data parallelism alone: tp,
        pp, ep and ZeRO are refused at fit start). One flat all-reduce per dtype, as
        `DDPStrategy.average_grads_`; gradients already equal on every replica stay so."""
        assert self.module is not None
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        all_reduce_coalesced(grads, self.mesh.dp_group, average=True)
