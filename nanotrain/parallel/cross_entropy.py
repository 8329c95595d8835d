"""Cross-entropy over vocabulary-sharded logits (Megatron's vocab-parallel cross-entropy).

The logits of a tensor-parallel LM head are split along the vocabulary: rank ``r`` of ``tp``
holds global ids ``[r*V/tp, (r+1)*V/tp)``. Gathering them would cost a ``[tokens, V]`` buffer
per rank; instead the softmax normalizer and the target logit are reduced as per-token scalars.

This is Megatron-LM's fusion of the parallel output GEMM with the loss (Shoeybi et al. 2019,
section 3: "communicating scalar losses instead of logits"): per token, the largest logit is
all-reduced with MAX over the tensor-parallel group, then the sum of ``exp(logit - max)`` and
the target's logit (zeroed on every rank but the one owning the target id) are all-reduced with SUM
in one collective. The backward needs no communication: each rank's logit gradient,
``softmax - one_hot(target)`` over its own columns, uses only the reduced scalars.
Shapes below: ``[...]`` the token dims (e.g. ``[B, T]``), ``V/tp`` this rank's columns.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from nanotrain.parallel.collectives import group_rank, group_size

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over vocab-sharded logits; only ``[...]``-shaped tensors cross ranks.

    forward: all-reduce (MAX) of the per-token max logit, then one all-reduce (SUM) of the
    stacked per-token target logit and sum of exponentials over ``group``; loss =
    log(sum_exp) - target_logit, 0 at ``ignore_index``. backward: local, no collective:
    ``(softmax - one_hot(target)) * grad_loss`` on this rank's vocab shard.
    """

    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, vocab_size):
        rows_per_rank = logits.shape[-1]
        vocab_start = group_rank(group) * rows_per_rank
        logits_dtype = logits.dtype
        logits = logits.float()
        if vocab_size is not None:
            # Padding columns (global id >= vocab_size) must not take part in the softmax.
            col = torch.arange(rows_per_rank, device=logits.device) + vocab_start
            logits = logits.masked_fill(col >= vocab_size, float("-inf"))
        # Subtracting the global max keeps exp() finite; it cancels out of the loss.
        logits_max = logits.amax(dim=-1, keepdim=True)  # [..., 1]
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max  # [..., V/tp]

        local_target = target - vocab_start
        outside = (local_target < 0) | (local_target >= rows_per_rank)
        local_target = local_target.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)  # [...]
        target_logit = target_logit.masked_fill(outside, 0.0)  # only the owner contributes
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)  # [...], this rank's columns only until the all-reduce
        # One all-reduce for both per-token sums: [2, ...].
        sums = torch.stack([target_logit, sum_exp])
        dist.all_reduce(sums, group=group)
        target_logit, sum_exp = sums.unbind(0)

        ignored = target == ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))  # [..., V/tp], this rank's columns
        ctx.save_for_backward(softmax, local_target, outside, ignored)
        ctx.logits_dtype = logits_dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside, ignored = ctx.saved_tensors
        # d loss / d logits = softmax - one_hot(target), zero for ignored tokens. Built in place
        # in the saved softmax to avoid a second [..., V/tp] buffer (as Megatron does), so this
        # backward can run only once (no retain_graph=True re-runs).
        grad = softmax
        hit = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        scale = grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1)
        return (grad * scale).to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor,
    target: Tensor,
    tp_group: ProcessGroup | None = None,
    ignore_index: int = -100,
    *,
    vocab_size: int | None = None,
) -> Tensor:
    """Per-token cross-entropy of vocab-sharded logits, never gathering the full vocabulary.

    Args:
        logits: ``[..., V / tp]``, this rank's contiguous vocab shard (rank ``r`` holds global
            ids ``[r*V/tp, (r+1)*V/tp)``, as produced by a ``ColumnParallelLinear`` head or a
            tied ``VocabParallelEmbedding``).
        target: ``[...]`` global token ids (int64); ``ignore_index`` marks tokens to skip.
        tp_group: the tensor-parallel group (``None``: the logits are the full vocabulary).
        ignore_index: target value whose loss (and gradient) is zero.
        vocab_size: the unpadded vocabulary; columns with global id ``>= vocab_size`` (padding)
            are excluded from the softmax. ``None``: every column is a real token.

    Returns:
        ``[...]`` float32 loss per token, ``0`` where ``target == ignore_index``. With
        ``tp_group=None`` it equals ``F.cross_entropy(logits, target, reduction="none")``.
        Target ids outside the vocabulary are not checked (that would need a host sync).

    Raises:
        ValueError: if ``target.shape`` is not ``logits.shape[:-1]``.
    """
    if target.shape != logits.shape[:-1]:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal logits shape without the vocab dim "
            f"{tuple(logits.shape[:-1])}"
        )
    if group_size(tp_group) == 1:
        if vocab_size is not None:
            logits = logits[..., :vocab_size]
        flat = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]),
            target.reshape(-1),
            ignore_index=ignore_index,
            reduction="none",
        )
        return flat.view(target.shape)
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group, ignore_index, vocab_size)
