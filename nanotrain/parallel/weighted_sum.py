"""Sums of routed expert outputs per token that keep for backward only what it reads.

`weighted_index_add` computes ``out[index[i]] += w[i] * y[i]`` as autograd would from
``zeros.index_add(0, index, y * w[:, None])``, with the same ops forward and backward (so the
same floats), but saves only y, w and index: autograd's graph also keeps the weighted copies
``y * w`` (`index_add` saves its source), a second [M, H] tensor per MoE layer.
`index_add_rows` is the unweighted sum, which keeps only the index (autograd's would keep the
summed rows too).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["index_add_rows", "weighted_index_add"]


class _WeightedIndexAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, w, index, num_rows):  # noqa: ANN001, ANN205
        ctx.save_for_backward(y, w, index)
        return y.new_zeros(num_rows, y.shape[-1]).index_add(0, index, y * w[:, None])

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        y, w, index = ctx.saved_tensors
        grad_rows = grad_out.index_select(0, index)  # (M, H): what index_add hands its source
        grad_y = grad_rows * w[:, None] if ctx.needs_input_grad[0] else None
        grad_w = (grad_rows * y).sum(-1) if ctx.needs_input_grad[1] else None
        return grad_y, grad_w, None, None


def weighted_index_add(y: Tensor, w: Tensor, index: Tensor, num_rows: int) -> Tensor:
    """``zeros(num_rows, H).index_add(0, index, y * w[:, None])`` keeping y, w and index only.

    Args: y [M, H]; w [M] in y's dtype; index [M] int64 rows of the output; num_rows.
    Returns: [num_rows, H] in y's dtype.
    """
    return _WeightedIndexAdd.apply(y, w, index, num_rows)


class _IndexAddRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, index, num_rows):  # noqa: ANN001, ANN205
        ctx.save_for_backward(index)
        return rows.new_zeros(num_rows, rows.shape[-1]).index_add(0, index, rows)

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        (index,) = ctx.saved_tensors
        return grad_out.index_select(0, index), None, None


def index_add_rows(rows: Tensor, index: Tensor, num_rows: int) -> Tensor:
    """``zeros(num_rows, H).index_add(0, index, rows)`` keeping only the index for backward.

    Args: rows [M, H]; index [M] int64 rows of the output; num_rows.
    Returns: [num_rows, H] in rows' dtype.
    """
    return _IndexAddRows.apply(rows, index, num_rows)
