"""The CPU fast paths of MLA against the reference ops they replace.

`causal_attention` (hand-written attention for unequal q/k and v widths on CPU) against
`F.scaled_dot_product_attention`; `rope_tail` (RoPE of a head's last dims by one complex
multiply) against `apply_rope` on those dims.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanotrain.models.attention import causal_attention
from nanotrain.models.layers import apply_rope, rope_cos_sin, rope_tail, rope_tail_table


def _sdpa(q, k, v, scale):
    b, t, n, dv = v.shape
    y = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale
    )
    return y.transpose(1, 2).reshape(b, t, n * dv)


@pytest.mark.parametrize("dv", [8, 16])  # 8: the hand-written path; 16: SDPA itself
def test_causal_attention_matches_sdpa_values_and_grads(dv):
    torch.manual_seed(0)
    b, t, n, dqk = 2, 7, 3, 16
    q, k = torch.randn(b, t, n, dqk), torch.randn(b, t, n, dqk)
    v = torch.randn(b, t, n, dv)
    grad = torch.randn(b, t, n * dv)
    scale = 0.37  # not a power of two: the scaling order may round differently
    results = []
    for fn in (causal_attention, _sdpa):
        leaves = [z.clone().requires_grad_() for z in (q, k, v)]
        y = fn(*leaves, scale)
        y.backward(grad)
        results.append([y.detach(), *(z.grad for z in leaves)])
    for ours, ref in zip(*results, strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    # causal: the first position attends to itself only
    torch.testing.assert_close(results[0][0][:, 0], v[:, 0].reshape(b, n * dv))


def test_causal_attention_in_bf16_computes_in_fp32_like_sdpa():
    torch.manual_seed(1)
    q, k = torch.randn(2, 5, 2, 16).bfloat16(), torch.randn(2, 5, 2, 16).bfloat16()
    v = torch.randn(2, 5, 2, 8).bfloat16()
    ours = causal_attention(q, k, v, 0.25)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours, _sdpa(q, k, v, 0.25), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_tail_rotates_the_tail_like_apply_rope_and_keeps_the_head(dtype):
    torch.manual_seed(2)
    t, nope, rope = 6, 4, 8
    cos, sin = rope_cos_sin(t, rope, 10000.0, None)
    x = torch.randn(2, t, 3, nope + rope).to(dtype).requires_grad_()
    grad = torch.randn(2, t, 3, nope + rope).to(dtype)
    ours = rope_tail(x, rope_tail_table(cos, sin, nope))
    (g_ours,) = torch.autograd.grad(ours, x, grad)
    head, tail = x.split([nope, rope], dim=-1)
    ref = torch.cat((head, apply_rope(tail, cos, sin, interleaved=True)), dim=-1)
    (g_ref,) = torch.autograd.grad(ref, x, grad)
    if dtype == torch.bfloat16:
        assert torch.equal(ours, ref)  # the same elementwise products and sums
    # fp32 runs as one complex multiply, whose kernel may round a multiply-add differently
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 0.0, "atol": 0.0}
    torch.testing.assert_close(ours, ref, **tol)
    torch.testing.assert_close(g_ours, g_ref, **tol)


def test_rope_tail_takes_a_strided_slice_with_an_odd_offset():
    # a rope key sliced out of a wider projection at an odd column: not viewable as complex
    torch.manual_seed(3)
    t, rope = 5, 4
    cos, sin = rope_cos_sin(t, rope, 10000.0, None)
    wide = torch.randn(2, t, 1 + rope)
    x = wide[..., 1:].unsqueeze(2)  # (B, T, 1, rope), storage offset 1
    ours = rope_tail(x, rope_tail_table(cos, sin, 0))
    ref = apply_rope(x, cos, sin, interleaved=True)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(ours[:, 1:], x[:, 1:])  # positions after 0 were rotated
