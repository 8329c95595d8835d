"""Quantize-dequantize numerics of the emulated fp8/fp4 formats, and the loss scaler.

Bounds come from the formats (mantissa bits, smallest normal: `rounding_bound`), never from
the observed output.
"""

from __future__ import annotations

import pytest
import torch

from nanotrain.precision import DynamicLossScaler, qdq_fp4, qdq_fp8, rounding_bound
from nanotrain.precision.quant import FP4_E2M1_MAX, GRANULARITIES


def test_rounding_bounds_follow_the_formats():
    # e4m3: 3 mantissa bits -> half ulp 2**-4; smallest normal 2**-6 -> 2**-10 below it
    assert rounding_bound("e4m3") == (2.0**-4, 2.0**-10)
    assert rounding_bound("e5m2") == (2.0**-3, 2.0**-14 * 2.0**-3)
    assert rounding_bound("e2m1") == (0.25, 0.25)
    with pytest.raises(ValueError, match="unknown low-precision format 'e3m3'"):
        rounding_bound("e3m3")


def _scales(x: torch.Tensor, granularity: str, fmax: float) -> torch.Tensor:
    """Per-element scale (format max / group amax) the way each granularity groups elements."""
    a = x.abs()
    if granularity == "tensor":
        amax = a.amax().expand_as(x)
    elif granularity == "tile":
        amax = torch.stack(
            [a[:, j : j + 128].amax(-1) for j in range(0, x.shape[1], 128)], -1
        ).repeat_interleave(128, -1)[:, : x.shape[1]]
    else:
        amax = torch.zeros_like(x)
        for i in range(0, x.shape[0], 128):
            for j in range(0, x.shape[1], 128):
                amax[i : i + 128, j : j + 128] = a[i : i + 128, j : j + 128].amax()
    return fmax / amax


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_fp8_e4m3_values_and_matmul_error_within_the_format_bound(granularity):
    g = torch.Generator().manual_seed(0)
    # rows of very different magnitude: per-tensor scaling loses the small ones to subnormals
    a = torch.randn(200, 300, generator=g) * torch.logspace(-3, 1, 200).unsqueeze(1)
    b = torch.randn(300, 160, generator=g)
    fmax = torch.finfo(torch.float8_e4m3fn).max
    rel, absolute = rounding_bound("e4m3")
    qa, qb = qdq_fp8(a, "e4m3", granularity), qdq_fp8(b.t(), "e4m3", granularity).t()
    sa, sb = _scales(a, granularity, fmax), _scales(b.t(), granularity, fmax).t()
    # every element is an e4m3 number times its group's scale (up to fp32 rounding of the
    # unscale/rescale), not a point between e4m3 numbers
    scaled = qa * sa
    torch.testing.assert_close(scaled.to(torch.float8_e4m3fn).float(), scaled, rtol=1e-6, atol=0)
    da_bound = rel * a.abs() + absolute / sa
    db_bound = rel * b.abs() + absolute / sb
    assert ((qa - a).abs() <= da_bound * (1 + 1e-6)).all()
    assert ((qb - b).abs() <= db_bound * (1 + 1e-6)).all()
    # |A'B' - AB| <= dA|B| + |A|dB + dA dB elementwise, plus fp32 accumulation slack
    err = (qa @ qb - a @ b).abs()
    bound = da_bound @ b.abs() + a.abs() @ db_bound + da_bound @ db_bound
    slack = 1e-5 * (a.abs() @ b.abs())
    assert (err <= bound + slack).all()
    assert err.max() > 0  # it did quantize


def test_finer_scaling_is_more_accurate_on_rows_of_different_magnitude():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(256, 256, generator=g) * torch.logspace(-4, 1, 256).unsqueeze(1)
    errs = {
        k: ((qdq_fp8(a, "e4m3", k) - a).abs() / a.abs().amax(1, keepdim=True)).mean()
        for k in GRANULARITIES
    }
    assert errs["tile"] < errs["tensor"]


@pytest.mark.parametrize(("block", "scale_format"), [(32, "e8m0"), (16, "e4m3")])
def test_fp4_e2m1_values_on_the_grid_and_within_the_bound(block, scale_format):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 96, generator=g) * 3
    q = qdq_fp4(x, block, scale_format)
    blocks = x.reshape(64, -1, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    ideal = amax / FP4_E2M1_MAX
    qb = q.reshape(64, -1, block)
    # recover each block's scale: the largest |q| is 6 * scale at most (scale >= ideal)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    scale = None
    if scale_format == "e8m0":
        scale = torch.exp2(torch.ceil(torch.log2(ideal)))
        assert torch.equal(torch.log2(scale), torch.log2(scale).round())  # powers of two
    else:
        # an e4m3 scale rounded up from the ideal one: at most two e4m3 steps (2**-3 relative
        # each) above it; the grid check below then needs the exact scale, so only the bound
        rel, absolute = rounding_bound("e2m1")
        upper = ideal * (1 + 2.0**-3) ** 2
        assert ((qb - blocks).abs() <= (rel * blocks.abs() + absolute * upper) * (1 + 1e-6)).all()
        assert (qb.abs().amax(-1) <= FP4_E2M1_MAX * upper.squeeze(-1) * (1 + 1e-6)).all()
        return
    v = qb / scale
    assert torch.isin(v.abs(), grid).all()
    rel, absolute = rounding_bound("e2m1")
    assert ((qb - blocks).abs() <= (rel * blocks.abs() + absolute * scale) * (1 + 1e-6)).all()


def test_bad_quantizer_arguments():
    with pytest.raises(ValueError, match="granularity must be one of"):
        qdq_fp8(torch.ones(2), "e4m3", "row")
    with pytest.raises(ValueError, match="fp8 format must be one of"):
        qdq_fp8(torch.ones(2), "e3m4")
    with pytest.raises(ValueError, match="scale_format must be 'e8m0'"):
        qdq_fp4(torch.ones(2), 32, "ue8")


def test_loss_scaler_backoff_growth_and_state():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=2)
    g = torch.tensor([8.0, 16.0])
    assert not s.unscale_([g])
    assert torch.equal(g, torch.tensor([1.0, 2.0]))
    s.update()
    s.unscale_([torch.ones(1)])
    s.update()
    assert s.scale == 16.0  # grew after 2 finite steps
    assert s.unscale_([torch.tensor([float("inf")])])
    s.update()
    assert s.scale == 8.0 and s.skipped_steps == 1
    state = s.state_dict()
    t = DynamicLossScaler()
    t.load_state_dict(state)
    assert t.state_dict() == state == {"scale": 8.0, "growth_tracker": 0, "skipped_steps": 1}
    with pytest.raises(ValueError, match="backoff_factor must be in"):
        DynamicLossScaler(backoff_factor=1.5)


def test_emulated_gemm_quantizes_linear_and_expert_matmul_forms_alike():
    from nanotrain.precision.emulated import _LinearMode

    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 256, generator=g, requires_grad=True)
    w = torch.randn(130, 256, generator=g, requires_grad=True)

    def q(t):
        return qdq_fp8(t, "e4m3", "tile")

    with _LinearMode(q, q, q, "cpu"):
        y_linear = torch.nn.functional.linear(x, w)
        y_matmul = x @ w[0:130].T  # GroupedExperts' form: a weight view, transposed
    expected = q(x.detach()) @ q(w.detach()).T
    assert torch.equal(y_linear, expected) and torch.equal(y_matmul, expected)
    (y_matmul * 2).sum().backward()
    grad_out = q(torch.full((5, 130), 2.0))
    torch.testing.assert_close(w.grad, grad_out.T @ q(x.detach()))
    torch.testing.assert_close(x.grad, grad_out @ q(w.detach()))


def test_loss_scaler_flag_of_a_rank_without_gradients_lives_where_its_backend_reduces(
    monkeypatch,
):
    """A rank holding no gradient shard still joins the found-inf all-reduce: under NCCL its
    flag must be a CUDA tensor (a CPU one makes NCCL raise), under gloo a CPU one."""
    from nanotrain.precision import scaler

    nccl, gloo = object(), object()
    monkeypatch.setattr(scaler.dist, "get_backend", lambda g: "nccl" if g is nccl else "gloo")
    monkeypatch.setattr(scaler.torch.cuda, "current_device", lambda: 3)
    assert scaler._device_without_grads([None, gloo, nccl]) == torch.device("cuda", 3)
    assert scaler._device_without_grads([gloo]) == torch.device("cpu")
    assert scaler._device_without_grads([]) == torch.device("cpu")
    assert not DynamicLossScaler().unscale_([], [None])  # no grads, nothing to reduce
