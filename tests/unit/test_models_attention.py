"""MLA and dense (GQA) attention against naive per-head implementations written here."""

import math

import pytest
import torch

from nanotrain.models.attention import DenseAttention, MLAttention
from nanotrain.models.config import DeepSeekConfig, DenseConfig
from nanotrain.models.layers import rope_cos_sin, rope_inv_freq

YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 8,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _randomize(module, std):
    """Weights of a larger scale than the model init, so attention is far from uniform."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * std if p.ndim >= 2 else 1 + 0.1 * torch.randn_like(p))


def _rms(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate_complex(x, inv_freq):
    """DeepSeek-reference rope: adjacent pairs as complex numbers times e^(i pos f). x [T, d]."""
    t = x.shape[0]
    angles = torch.outer(torch.arange(t, dtype=torch.float32), inv_freq)
    z = torch.view_as_complex(x.reshape(t, -1, 2).contiguous()) * torch.polar(
        torch.ones_like(angles), angles
    )
    return torch.view_as_real(z).reshape(t, -1)


def _rotate_half(x, inv_freq):
    """Llama rope: dim i paired with i + d/2. x [T, d]."""
    t = x.shape[0]
    angles = torch.outer(torch.arange(t, dtype=torch.float32), inv_freq)
    cos, sin = torch.cat((angles.cos(),) * 2, -1), torch.cat((angles.sin(),) * 2, -1)
    a, b = x.chunk(2, -1)
    return x * cos + torch.cat((-b, a), -1) * sin


def _causal_softmax_attention(q, k, v, scale):
    t = q.shape[0]
    scores = (q @ k.T) * scale
    scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
    return scores.softmax(-1) @ v


def _naive_mla(attn, x, c):
    """One sequence x [T, H] through MLA, head by head, with full (decompressed) keys."""
    w = {n: p.detach() for n, p in attn.named_parameters()}
    inv_freq = rope_inv_freq(c.qk_rope_head_dim, c.rope_theta, c.rope_scaling)
    c_q = _rms(x @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"], c.rms_norm_eps)
    q_all = c_q @ w["q_b_proj.weight"].T  # [T, heads * (nope + rope)]
    latent = x @ w["kv_a_proj_with_mqa.weight"].T
    c_kv, k_rope = latent[:, : c.kv_lora_rank], latent[:, c.kv_lora_rank :]
    k_rope = _rotate_complex(k_rope, inv_freq)  # one rope key shared by every head
    kv_all = _rms(c_kv, w["kv_a_layernorm.weight"], c.rms_norm_eps) @ w["kv_b_proj.weight"].T
    m = 0.1 * c.rope_scaling["mscale_all_dim"] * math.log(c.rope_scaling["factor"]) + 1
    scale = m * m / math.sqrt(c.qk_nope_head_dim + c.qk_rope_head_dim)
    heads = []
    qd, kvd = c.qk_nope_head_dim + c.qk_rope_head_dim, c.qk_nope_head_dim + c.v_head_dim
    for h in range(c.num_heads):
        q_h = q_all[:, h * qd : (h + 1) * qd]
        q_h = torch.cat(
            (q_h[:, : c.qk_nope_head_dim], _rotate_complex(q_h[:, c.qk_nope_head_dim :], inv_freq)),
            -1,
        )
        kv_h = kv_all[:, h * kvd : (h + 1) * kvd]
        k_h = torch.cat((kv_h[:, : c.qk_nope_head_dim], k_rope), -1)
        heads.append(_causal_softmax_attention(q_h, k_h, kv_h[:, c.qk_nope_head_dim :], scale))
    return torch.cat(heads, -1) @ w["o_proj.weight"].T


def test_mla_matches_naive_per_head_implementation():
    torch.manual_seed(0)
    c = DeepSeekConfig(
        hidden_size=32, num_heads=3, q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6,
        qk_rope_head_dim=4, v_head_dim=5, rope_scaling=YARN, max_seq_len=32,
    )  # fmt: skip
    attn = MLAttention(c)
    _randomize(attn, 0.3)
    x = torch.randn(2, 7, 32)
    cos, sin = rope_cos_sin(7, c.qk_rope_head_dim, c.rope_theta, c.rope_scaling)
    y = attn(x, cos, sin)
    assert y.shape == (2, 7, 32)
    for b in range(2):
        torch.testing.assert_close(y[b], _naive_mla(attn, x[b], c), rtol=1e-4, atol=1e-5)


def test_mla_without_query_compression_has_plain_q_proj():
    c = DeepSeekConfig(q_lora_rank=None)
    names = {n for n, _ in MLAttention(c).named_parameters()}
    assert "q_proj.weight" in names and not any(n.startswith("q_a") for n in names)


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])  # MHA, GQA, MQA
def test_dense_attention_matches_naive_grouped_heads(num_kv_heads):
    torch.manual_seed(0)
    c = DenseConfig(hidden_size=32, num_heads=4, num_kv_heads=num_kv_heads)
    attn = DenseAttention(c)
    _randomize(attn, 0.3)
    x = torch.randn(6, 32)
    cos, sin = rope_cos_sin(6, c.head_dim, c.rope_theta, None)
    y = attn(x[None], cos, sin)[0]
    w = {n: p.detach() for n, p in attn.named_parameters()}
    inv_freq = rope_inv_freq(c.head_dim, c.rope_theta)
    d, group = c.head_dim, c.num_heads // num_kv_heads
    q, k, v = (x @ w[f"{n}_proj.weight"].T for n in "qkv")
    heads = []
    for h in range(c.num_heads):
        kv = h // group  # query head h reads kv head h // group
        q_h = _rotate_half(q[:, h * d : (h + 1) * d], inv_freq)
        k_h = _rotate_half(k[:, kv * d : (kv + 1) * d], inv_freq)
        heads.append(_causal_softmax_attention(q_h, k_h, v[:, kv * d : (kv + 1) * d], d**-0.5))
    torch.testing.assert_close(y, torch.cat(heads, -1) @ w["o_proj.weight"].T, rtol=1e-4, atol=1e-5)
