"""Gradient bookkeeping across shards: which parameters are split over tensor parallelism,
sequence-parallel gradient sync, the global grad norm (each element counted once) and clipping.

Counting rule of the global norm. A parameter is either *tp-sharded* (each tensor-parallel rank
holds a different slice: its squared norm is summed over the tp group) or *tp-replicated* (every
tp rank holds the same tensor: counted once, on tp rank 0). Under ZeRO-2 each data-parallel rank
holds a different slice of every gradient, so the squares are summed over the dp group as well.
This is Megatron-LM's rule (``param_is_not_tensor_parallel_duplicate`` in its grad-norm
clipping): every element of the model's gradient is squared exactly once somewhere, and
summing the per-parameter squares over the groups that hold different shards (then over pp)
gives every rank the same global norm sqrt(sum of squares), the norm
`torch.nn.utils.clip_grad_norm_` would compute on the unsharded model.
The caller passes the groups per parameter set: routed experts, split over expert parallelism,
add the ep group (and under ZeRO-2 their expert-dp group instead of dp); pipeline stages are
summed afterwards over the pp group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from nanotrain.parallel.collectives import all_gather_along_dim, group_size
from nanotrain.parallel.tensor import VocabParallelEmbedding, _TensorParallelModule
from nanotrain.runtime.host_copy import host_to_device

__all__ = [
    "all_reduce_coalesced",
    "clip_grads_",
    "gather_tp_shards",
    "reduced_square_norms",
    "param_owners",
    "sequence_parallel_params",
    "tp_partition_dim",
]


def param_owners(module: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Map each parameter's full name (as ``module.named_parameters()`` gives it) to the
    module that registers it and its local name there."""
    owners: dict[str, tuple[nn.Module, str]] = {}
    for prefix, sub in module.named_modules():
        for local, _ in sub.named_parameters(recurse=False):
            owners.setdefault(f"{prefix}.{local}" if prefix else local, (sub, local))
    return owners


def tp_partition_dim(owner: nn.Module, local_name: str) -> int | None:
    """The dim along which ``owner.<local_name>`` is split over tensor parallelism, or None
    when every tp rank holds the whole tensor (replicated, or a group of one)."""
    if isinstance(owner, _TensorParallelModule) and owner.tp_size > 1:
        return owner.tp_partition_dims.get(local_name)
    return None


def is_tp_sharded(module: nn.Module) -> dict[int, bool]:
    """``id(param) -> True`` when that parameter is split over tensor parallelism."""
    out: dict[int, bool] = {}
    for owner, local in param_owners(module).values():
        p = getattr(owner, local)
        out[id(p)] = out.get(id(p), False) or tp_partition_dim(owner, local) is not None
    return out


def sequence_parallel_params(module: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters whose grads are partial sums over the tp group under sequence
    parallelism, so they must be all-reduced over it.

    These are the tp-replicated parameters (norm weights, routers, latent projections, and the
    bias of a sequence-parallel ``RowParallelLinear``, see its ``partial_grad_names``): they
    only see this rank's slice of the sequence. A model whose replicated parameter sees the
    whole sequence (after an explicit gather) marks it ``param.sequence_parallel = False``
    to be left out (Megatron marks the opposite way; here the safe default is to reduce).
    """
    sharded = is_tp_sharded(module)
    out, seen = [], set()
    for p in module.parameters():
        if not p.requires_grad or id(p) in seen or sharded.get(id(p), False):
            continue
        seen.add(id(p))
        if getattr(p, "sequence_parallel", True):
            out.append(p)
    return out


def all_reduce_coalesced(
    tensors: Sequence[Tensor], group: ProcessGroup | None, average: bool = False
) -> None:
    """Sum (``average``: average) ``tensors`` in place over ``group``, one collective per
    dtype (flatten, reduce, copy back); every rank passes the same list in the same order.

    No-op for an empty list, ``None`` or a group of one.
    """
    size = group_size(group)
    if not tensors or size == 1:
        return
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=group)
        if average:
            flat /= size
        for t, piece in zip(same, flat.split([t.numel() for t in same]), strict=True):
            t.copy_(piece.view_as(t))


def reduced_square_norms(
    owned: Sequence[tuple[int, Tensor]],
    num_params: int,
    tp_sharded: Sequence[bool],
    *,
    count_replicated: bool,
    groups: Sequence[ProcessGroup | None],
    device: torch.device,
) -> Tensor:
    """Squared L2 norm of each parameter's whole gradient, spread over processes.

    Args:
        owned: ``(param_index, grad or grad piece)`` this process holds; several pieces of one
            parameter add up.
        num_params: length of the result.
        tp_sharded: per parameter, True when each tp rank holds a different slice.
        count_replicated: True on exactly one holder of the tp-replicated grads (tp rank 0).
        groups: the groups over which the squares are summed (tp, and dp under ZeRO-2).
        device: where the result lives.

    Returns: float64 ``[num_params]``, identical on every process of ``groups``. The global
    grad norm is ``result.sum().sqrt()``.
    """
    sq = torch.zeros(num_params, dtype=torch.float64, device=device)
    if owned:
        # one multi-tensor kernel for every piece's norm (accumulated in float64, as the
        # sum of squares was), not an upcast copy and three kernels per piece
        norms = torch._foreach_norm([g.detach() for _, g in owned], 2, dtype=torch.float64)
        where = host_to_device([i for i, _ in owned], device, torch.int64)
        sq.index_add_(0, where, torch.stack(norms).square())
    if not count_replicated:
        sq = sq * host_to_device([float(s) for s in tp_sharded], device, sq.dtype)
    for group in groups:
        if group_size(group) > 1:
            dist.all_reduce(sq, group=group)
    return sq


@torch.no_grad()
def clip_grads_(grads: Sequence[Tensor], total_norm: Tensor, max_norm: float) -> None:
    """Scale ``grads`` in place by ``min(1, max_norm / (total_norm + 1e-6))`` (torch's rule)."""
    if not grads:
        return
    coef = (max_norm / (total_norm.double() + 1e-6)).clamp(max=1.0)
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dtype, same in by_dtype.items():
        torch._foreach_mul_(same, coef.to(dtype))  # one multi-tensor kernel per dtype


@torch.no_grad()
def gather_tp_shards(owner: nn.Module, local_name: str, tensor: Tensor) -> Tensor:
    """The whole tensor of ``owner.<local_name>`` (or its grad) from this rank's tp slice.

    A collective over the owner's tp group when the parameter is sharded; a vocabulary-parallel
    embedding drops its padding rows. Replicated parameters are returned as they are.
    """
    dim = tp_partition_dim(owner, local_name)
    if dim is None:
        return tensor
    full = all_gather_along_dim(tensor.contiguous(), dim, owner.tp_group)
    if isinstance(owner, VocabParallelEmbedding):
        full = full[: owner.num_embeddings]
    return full
