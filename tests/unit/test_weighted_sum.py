"""`weighted_index_add`: the floats of autograd's ``index_add(y * w)``, forward and backward, with
one [M, H] tensor kept for backward instead of two."""

from __future__ import annotations

import pytest
import torch

from nanotrain.parallel.weighted_sum import index_add_rows, weighted_index_add


def _saved_bytes(fn):
    seen: dict[int, int] = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_floats_as_autograds_index_add_and_one_copy_kept(dtype):
    torch.manual_seed(0)
    m, rows, hidden = 40, 12, 16
    y = torch.randn(m, hidden, dtype=dtype, requires_grad=True)
    w = torch.rand(m, dtype=dtype, requires_grad=True)
    index = torch.randint(0, rows, (m,))
    grad = torch.randn(rows, hidden, dtype=dtype)

    def by_autograd():
        return torch.zeros(rows, hidden, dtype=dtype).index_add(0, index, y * w[:, None])

    expected, autograd_bytes = _saved_bytes(by_autograd)
    got, kept_bytes = _saved_bytes(lambda: weighted_index_add(y, w, index, rows))
    assert torch.equal(got, expected)
    for a, b in zip(
        torch.autograd.grad(got, (y, w), grad),
        torch.autograd.grad(expected, (y, w), grad),
        strict=True,
    ):
        assert torch.equal(a, b)
    # autograd keeps y, w, the index and the weighted copies; this keeps the first three
    weighted_copies = m * hidden * y.element_size()
    assert kept_bytes == autograd_bytes - weighted_copies


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
