"""A sum of rows into fewer rows that keeps only the index for backward.

`index_add_rows` computes ``zeros(num_rows, H).index_add(0, index, rows)`` with autograd's
floats forward and backward, but saves only the index: autograd's `index_add` also keeps its
source rows, an [M, H] tensor per MoE layer where routed expert outputs are summed per token.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["index_add_rows"]


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
