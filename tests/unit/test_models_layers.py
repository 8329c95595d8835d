"""RMSNorm, RoPE and YaRN against formulas written out in the test."""

import math

import pytest
import torch

from nanotrain.models.layers import (
    RMSNorm,
    apply_rope,
    rope_attention_factor,
    rope_cos_sin,
    rope_inv_freq,
    softmax_scale,
    yarn_mscale,
)

V3_YARN = {
    "type": "yarn",
    "factor": 40,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def test_rmsnorm_matches_formula():
    norm = RMSNorm(4, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0, 0.5, -1.0]))
    x = torch.tensor([[3.0, -4.0, 0.0, 0.0]])  # mean of squares = 25 / 4
    rms = math.sqrt(25 / 4 + 1e-6)
    expected = torch.tensor([[3 / rms, -8 / rms, 0.0, 0.0]])
    torch.testing.assert_close(norm(x), expected)


def test_rope_rotates_a_known_vector_by_position_times_frequency():
    # dim 4: frequencies theta^0 = 1 and theta^(-1/2) = 0.01 for theta = 10^4
    cos, sin = rope_cos_sin(3, 4, 10000.0, None)
    x = torch.zeros(1, 3, 1, 4)
    x[..., 0] = 1.0  # first pair = (1, 0) in both layouts
    for interleaved in (True, False):
        y = apply_rope(x, cos, sin, interleaved=interleaved)
        partner = 1 if interleaved else 2  # where the pair's second element lives
        for pos in range(3):
            assert y[0, pos, 0, 0].item() == pytest.approx(math.cos(pos * 1.0), abs=1e-6)
            assert y[0, pos, 0, partner].item() == pytest.approx(math.sin(pos * 1.0), abs=1e-6)


def test_rope_interleaved_is_rotate_half_on_permuted_dims():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 8)
    cos, sin = rope_cos_sin(5, 8, 10000.0, None)
    perm = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # adjacent pairs -> (first halves, second halves)
    interleaved = apply_rope(x, cos, sin, interleaved=True)
    half = apply_rope(x[..., perm], cos, sin, interleaved=False)
    torch.testing.assert_close(interleaved[..., perm], half)


def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    cos, sin = rope_cos_sin(12, 8, 10000.0, None)

    def score(pq, pk):
        rq = apply_rope(q, cos[pq : pq + 1], sin[pq : pq + 1], interleaved=True)
        rk = apply_rope(k, cos[pk : pk + 1], sin[pk : pk + 1], interleaved=True)
        return (rq * rk).sum().item()

    assert score(7, 3) == pytest.approx(score(9, 5), abs=1e-5)


def test_yarn_mscale_formula():
    assert yarn_mscale(40, 1.0) == pytest.approx(0.1 * math.log(40) + 1)
    assert yarn_mscale(40, 0.707) == pytest.approx(0.1 * 0.707 * math.log(40) + 1)
    assert yarn_mscale(1.0, 1.0) == 1.0


def test_yarn_softmax_scale_and_cos_sin_factor_for_deepseek_v3():
    m = 0.1 * math.log(40) + 1
    assert softmax_scale(192, V3_YARN) == pytest.approx(192**-0.5 * m * m)
    assert softmax_scale(192, None) == pytest.approx(192**-0.5)
    # V3 (and V2-Lite) set mscale == mscale_all_dim, so cos/sin are not rescaled
    assert rope_attention_factor(V3_YARN) == pytest.approx(1.0)
    assert rope_attention_factor({**V3_YARN, "mscale_all_dim": 0.0}) == pytest.approx(m)


def test_yarn_frequencies_for_deepseek_v3_rope_dims():
    # dim 64, base 1e4, original context 4096. Dimension pair i rotates
    # 4096 * theta^(-2i/64) / (2 pi) times over the original context: >= 32 times for
    # i <= 10 (kept), <= 1 time for i >= 23 (divided by 40), ramp in between.
    # (i = 64 ln(4096 / (2 pi r)) / (2 ln 1e4): r = 32 -> 10.47, r = 1 -> 22.51.)
    inv = rope_inv_freq(64, 10000.0, V3_YARN)
    plain = torch.tensor([10000.0 ** (-2 * i / 64) for i in range(32)])
    torch.testing.assert_close(inv[:11], plain[:11])
    torch.testing.assert_close(inv[23:], plain[23:] / 40)
    ramp = (16 - 10) / (23 - 10)  # fraction interpolated at pair 16
    expected = plain[16] * (1 - ramp) + plain[16] / 40 * ramp
    assert inv[16].item() == pytest.approx(expected.item(), rel=1e-5)
