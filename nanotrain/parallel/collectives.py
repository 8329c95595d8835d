"""Autograd-aware collectives for tensor and sequence parallelism (Megatron's *f* and *g*).

Every function here is pure: ``f(x, group)`` returns a new tensor and reads no global state.
Each names what it does in the forward pass and what its backward pass does with the
gradient, because the pair is the whole point: an identity in forward must become an
all-reduce in backward (and vice versa) for the tensor-parallel math to be exact
(Shoeybi et al. 2019, "Megatron-LM", section 3, operators *f* and *g*; Korthikanti et al.
2022, "Reducing Activation Recomputation", section 4.2, operators *g* and *g-bar*).

Which paper operator each public function is (forward | backward)::

    copy_to_tensor_parallel_region              f      identity        | all-reduce
    reduce_from_tensor_parallel_region          g      all-reduce      | identity
    gather_from_sequence_parallel_region        g      all-gather      | reduce-scatter   (SP)
    reduce_scatter_to_sequence_parallel_region  g-bar  reduce-scatter  | all-gather       (SP)
    enter_tensor_parallel_region                f, or the SP paper's g under sequence parallelism

The two papers reuse the letter: sequence parallelism replaces Megatron-LM's *f* (entering a
tensor-parallel region) by its own *g* and Megatron-LM's *g* (leaving it) by *g-bar*. The
scatter/gather along the last dim and the sequence scatter have no operator in either paper;
they carry the names of Megatron-Core's ``tensor_parallel/mappings.py``.

Every function is a no-op (returns ``x`` itself) when ``group`` is ``None`` or has one rank,
so one-process code pays nothing.

Tensor-parallel splits act on the **last** dim (the hidden/feature dim). Sequence-parallel
functions take ``seq_dim``, which defaults to ``1`` because nanotrain activations are laid
out ``[batch, seq, hidden]`` (Megatron itself uses ``[seq, batch, hidden]``, i.e. dim 0).

Only the tensor forms of the collectives are used (``all_reduce``, the single-tensor
all-gather and reduce-scatter), which gloo, NCCL and others support.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

# torch 2.13 renamed the single-tensor forms (the old names warn); older torch has only those.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = [
    "group_size",
    "group_rank",
    "copy_to_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region",
    "gather_from_tensor_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "enter_tensor_parallel_region",
    "all_gather_along_dim",
    "reduce_scatter_along_dim",
    "split_along_dim",
]


def group_size(group: ProcessGroup | None) -> int:
    """Number of ranks in ``group``; ``1`` for ``None`` (no process group = one process).

    Asks the group itself (``group.size()``), so a stand-in with ``size()``/``rank()``
    (`nanotrain.planning.rank_model.LayoutGroup`) builds a rank's layers without a process
    group, as the planner does on the meta device."""
    return 1 if group is None else group.size()


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank inside ``group``; ``0`` for ``None`` (see `group_size`)."""
    return 0 if group is None else group.rank()


# ---------------------------------------------------------------------------------------------
# Raw (non-autograd) building blocks. Each works on any dim by moving it to the front, because
# the tensor-form collectives only split/concatenate along dim 0.
# ---------------------------------------------------------------------------------------------


def split_along_dim(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """Return this rank's contiguous chunk of ``x`` along ``dim`` (``x.shape[dim] / size`` wide).

    Raises:
        ValueError: if ``x.shape[dim]`` is not divisible by the group size.
    """
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[dim] % size != 0:
        raise ValueError(
            f"cannot split dim {dim} of a tensor of shape {tuple(x.shape)} across {size} ranks: "
            f"{x.shape[dim]} is not divisible by {size}; pad that dim to a multiple of {size}"
        )
    return x.chunk(size, dim=dim)[group_rank(group)].contiguous()


def all_gather_along_dim(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order (no autograd).

    Shapes: ``x`` is ``[..., n, ...]`` on every rank (same shape everywhere); the result is
    ``[..., size * n, ...]``.
    """
    size = group_size(group)
    if size == 1:
        return x
    # The tensor form gathers along dim 0, so gather a flat buffer and re-stack.
    flat = torch.empty(size * x.numel(), dtype=x.dtype, device=x.device)
    _all_gather_single(flat, x.contiguous().view(-1), group=group)
    pieces = flat.view(size, *x.shape).unbind(0)
    return torch.cat(pieces, dim=dim)


def reduce_scatter_along_dim(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """Sum ``x`` over the group and keep this rank's chunk along ``dim`` (no autograd).

    Shapes: ``x`` is ``[..., size * n, ...]``; the result is ``[..., n, ...]``.

    Raises:
        ValueError: if ``x.shape[dim]`` is not divisible by the group size.
    """
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[dim] % size != 0:
        raise ValueError(
            f"cannot reduce-scatter dim {dim} of a tensor of shape {tuple(x.shape)} across "
            f"{size} ranks: {x.shape[dim]} is not divisible by {size}"
        )
    # Stack the chunks rank-major so that chunk r is the r-th contiguous block of the buffer.
    stacked = torch.stack(x.chunk(size, dim=dim), dim=0).contiguous()
    chunk_shape = stacked.shape[1:]
    out = torch.empty(chunk_shape.numel(), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, stacked.view(-1), group=group)
    return out.view(chunk_shape)


def _all_reduce(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Sum ``x`` over the group into a new tensor (the input is never modified)."""
    if group_size(group) == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


# ---------------------------------------------------------------------------------------------
# Autograd functions. The group is a non-tensor argument, so backward returns None for it.
# ---------------------------------------------------------------------------------------------


class _CopyToRegion(torch.autograd.Function):
    """Megatron-LM's *f*: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """Megatron-LM's *g*: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SplitAlongDim(torch.autograd.Function):
    """Keep this rank's chunk of ``dim`` forward; all-gather the gradient along ``dim``."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return split_along_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along_dim(grad, ctx.dim, ctx.group), None, None


class _GatherAlongDim(torch.autograd.Function):
    """All-gather along ``dim`` forward; keep this rank's chunk of the gradient backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather_along_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return split_along_dim(grad, ctx.dim, ctx.group), None, None


class _GatherAlongDimReduceScatterGrad(torch.autograd.Function):
    """Sequence parallelism's *g*: all-gather along ``dim`` forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather_along_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_along_dim(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterAlongDim(torch.autograd.Function):
    """Sequence parallelism's *g-bar*: reduce-scatter along ``dim`` forward, all-gather
    backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return reduce_scatter_along_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along_dim(grad, ctx.dim, ctx.group), None, None


# ---------------------------------------------------------------------------------------------
# Public operators.
# ---------------------------------------------------------------------------------------------


def copy_to_tensor_parallel_region(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """forward: identity; backward: all-reduce (sum) the gradient over ``group``.

    The *f* operator of Megatron-LM (Shoeybi et al. 2019, section 3, figure 3). It enters a
    tensor-parallel region: the layers after it (column-parallel, each rank holding some output
    columns) give every rank only a partial gradient of their shared input, which backward sums.
    """
    if group_size(group) == 1:
        return x
    return _CopyToRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """forward: all-reduce (sum) over ``group``; backward: identity.

    The *g* operator of Megatron-LM (Shoeybi et al. 2019, section 3, figure 3), *f*'s
    conjugate. It leaves a tensor-parallel region: after a row-parallel layer every rank holds
    a partial sum of the output, and the sum's gradient is the same for every rank.
    """
    if group_size(group) == 1:
        return x
    return _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """forward: keep this rank's chunk of the last dim; backward: all-gather the last dim.

    Megatron-Core's ``scatter_to_tensor_model_parallel_region`` (no operator of the paper): feeds
    a ``RowParallelLinear`` built with ``input_is_parallel=False`` a replicated input.
    Shapes: ``[..., d] -> [..., d / tp]``.
    """
    if group_size(group) == 1:
        return x
    return _SplitAlongDim.apply(x, -1, group)


def gather_from_tensor_parallel_region(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """forward: all-gather the last dim; backward: keep this rank's chunk of the last dim.

    Megatron-Core's ``gather_from_tensor_model_parallel_region`` (no operator of the paper): a
    ``ColumnParallelLinear`` with ``gather_output=True`` uses it to return the whole output.
    Shapes: ``[..., d / tp] -> [..., d]``.
    """
    if group_size(group) == 1:
        return x
    return _GatherAlongDim.apply(x, -1, group)


def scatter_to_sequence_parallel_region(
    x: Tensor, group: ProcessGroup | None, seq_dim: int = 1
) -> Tensor:
    """forward: keep this rank's chunk of ``seq_dim``; backward: all-gather along ``seq_dim``.

    Megatron-Core's ``scatter_to_sequence_parallel_region`` (no operator of the paper): turns a
    replicated ``[batch, seq, ...]`` activation into this rank's ``[batch, seq / tp, ...]``.
    """
    if group_size(group) == 1:
        return x
    return _SplitAlongDim.apply(x, seq_dim, group)


def gather_from_sequence_parallel_region(
    x: Tensor, group: ProcessGroup | None, seq_dim: int = 1
) -> Tensor:
    """forward: all-gather along ``seq_dim``; backward: reduce-scatter along ``seq_dim``.

    The *g* operator of sequence parallelism (Korthikanti et al. 2022, section 4.2.2), which
    takes the place of Megatron-LM's *f* before a column-parallel layer: the activation goes
    from ``[batch, seq / tp, ...]`` to ``[batch, seq, ...]``, and each rank's partial input
    gradient is summed and split back along the sequence in one reduce-scatter.
    """
    if group_size(group) == 1:
        return x
    return _GatherAlongDimReduceScatterGrad.apply(x, seq_dim, group)


def reduce_scatter_to_sequence_parallel_region(
    x: Tensor, group: ProcessGroup | None, seq_dim: int = 1
) -> Tensor:
    """forward: reduce-scatter (sum) along ``seq_dim``; backward: all-gather along ``seq_dim``.

    The *g-bar* operator of sequence parallelism (Korthikanti et al. 2022, section 4.2.2),
    *g*'s conjugate, which takes the place of Megatron-LM's *g* after a row-parallel layer: the
    ranks' partial sums ``[batch, seq, ...]`` become this rank's summed
    ``[batch, seq / tp, ...]``.
    """
    if group_size(group) == 1:
        return x
    return _ReduceScatterAlongDim.apply(x, seq_dim, group)


def enter_tensor_parallel_region(
    x: Tensor, group: ProcessGroup | None, *, sequence_parallel: bool = False, seq_dim: int = 1
) -> Tensor:
    """forward: identity (all-gather along ``seq_dim`` if ``sequence_parallel``); backward:
    all-reduce (reduce-scatter along ``seq_dim``).

    Megatron-LM's *f*, or sequence parallelism's *g* when ``sequence_parallel`` (see
    `copy_to_tensor_parallel_region`, `gather_from_sequence_parallel_region`).

    What a ``ColumnParallelLinear`` does to its input, done once so that several column-parallel
    layers reading the same activation (q/k/v, gate/up) share one collective instead of one each
    (build them with ``shared_input=True``). Shapes: ``[batch, seq, ...]`` in and out, or
    ``[batch, seq / tp, ...] -> [batch, seq, ...]`` under sequence parallelism.
    """
    if sequence_parallel:
        return gather_from_sequence_parallel_region(x, group, seq_dim)
    return copy_to_tensor_parallel_region(x, group)
