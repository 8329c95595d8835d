"""`index_add_rows`: the floats of autograd's ``index_add``, forward and backward, keeping only
the index."""

from __future__ import annotations

import torch

from nanotrain.parallel.row_sum import index_add_rows


def _saved_bytes(fn):
    seen: dict[int, int] = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def test_index_add_rows_gives_index_adds_floats_and_keeps_only_the_index():
    torch.manual_seed(0)
    rows = torch.randn(30, 8, requires_grad=True)
    index = torch.randint(0, 10, (30,))
    grad = torch.randn(10, 8)
    expected, autograd_bytes = _saved_bytes(lambda: torch.zeros(10, 8).index_add(0, index, rows))
    got, kept_bytes = _saved_bytes(lambda: index_add_rows(rows, index, 10))
    assert torch.equal(got, expected)
    (g_got,) = torch.autograd.grad(got, rows, grad)
    (g_expected,) = torch.autograd.grad(expected, rows, grad)
    assert torch.equal(g_got, g_expected)
    assert kept_bytes == index.numel() * 8  # the int64 index alone
    assert autograd_bytes == kept_bytes + rows.numel() * 4  # autograd keeps the rows too
