"""Presets, parameter/FLOP accounting against the built models, and config validation."""

import time

import pytest

from nanotrain.models import DeepSeekConfig, DenseConfig, build_model, presets
from nanotrain.models import accounting as acc


def _count(model, activated=False, skip_mtp=False):
    """Parameters of a built (meta) model, counted by name; experts scaled by K / E."""
    c, total = model.config, 0
    for name, p in model.named_parameters():
        if skip_mtp and name.startswith("mtp."):
            continue
        n = p.numel()
        if activated and name == "embed_tokens.weight" and not c.tie_word_embeddings:
            continue  # a lookup: one row per token
        if activated and ".mlp.experts." in name:
            n = n * c.num_experts_per_tok // c.n_routed_experts
        total += n
    return total


def test_deepseek_v3_671b_counts_match_the_paper_and_build_is_instant():
    config = presets.get("deepseek-v3-671b")
    start = time.perf_counter()
    model = build_model(config, device="meta")
    assert time.perf_counter() - start < 5.0
    total, active = acc.total_params(config), acc.active_params(config)
    assert total == _count(model, skip_mtp=True)
    assert active == _count(model, activated=True, skip_mtp=True)
    assert round(total / 1e9) == 671  # paper: 671B total, MTP excluded
    assert round(active / 1e9) == 37  # paper: 37B activated
    # The HF checkpoint's "685B" adds the MTP module and its own copies of embedding and head
    # (684.49B of weights; its FP8 block scales, one per 128 x 128 block, add ~0.04B more).
    hf = acc.total_params(config, include_mtp=True) + 2 * config.vocab_size * config.hidden_size
    assert hf / 1e9 == pytest.approx(684.5, abs=0.1)
    assert acc.total_params(config, include_mtp=True) == _count(model)


def test_deepseek_v2_lite_counts_match_its_paper():
    config = presets.get("deepseek-v2-lite")
    model = build_model(config, device="meta")
    assert acc.total_params(config) == _count(model)
    assert round(acc.total_params(config) / 1e8) == 157  # 15.7B
    assert int(acc.active_params(config) / 1e8) == 24  # 2.4B


@pytest.mark.parametrize("name, published", [("dense-8b", 8.03e9), ("dense-70b", 70.55e9)])
def test_llama31_presets_count_the_published_parameters(name, published):
    # Meta's Llama-3.1 model cards: 8.03B and 70.55B parameters (untied embedding and head).
    config = presets.get(name)
    assert isinstance(config, DenseConfig) and not config.tie_word_embeddings
    assert (config.vocab_size, config.num_kv_heads, config.rope_theta) == (128256, 8, 500000.0)
    assert config.rms_norm_eps == 1e-5
    counted = _count(build_model(config, device="meta"))
    assert counted == pytest.approx(published, rel=0.005)
    assert acc.total_params(config) == counted


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("tiny", {}),
        ("tiny", {"q_lora_rank": None, "mtp_depth": 2, "tie_word_embeddings": True}),
        ("tiny-dense", {}),
        ("tiny-dense", {"tie_word_embeddings": True, "num_kv_heads": 1}),
        ("deepseek-100m", {}),
        ("dense-100m", {}),
    ],
)
def test_accounting_equals_counting_the_built_model(name, overrides):
    config = presets.get(name, **overrides)
    model = build_model(config, device="meta")
    assert acc.total_params(config, include_mtp=True) == _count(model)
    assert acc.total_params(config) == _count(model, skip_mtp=True)
    assert acc.active_params(config) == _count(model, activated=True, skip_mtp=True)


def test_flops_per_token_dense_by_hand():
    c = presets.get("tiny-dense")  # V=257 H=64 L=2 heads=4 kv=2 d=16 I=160
    attn = 64 * 64 * 2 + 64 * 32 * 2  # q, o + k, v
    mlp = 3 * 64 * 160
    matmul = 2 * (attn + mlp) + 257 * 64  # + the head (the embedding is a lookup)
    seq = 128
    causal = 6 * matmul + 6 * 2 * 4 * (16 + 16) * seq / 2
    assert acc.flops_per_token(c, seq) == pytest.approx(causal)
    assert acc.flops_per_token(c, seq, causal=False) == pytest.approx(causal + 6 * 2 * 4 * 32 * 64)


def test_flops_per_token_deepseek_counts_active_matmuls_and_mtp_from_the_model():
    c = presets.get("tiny")
    model = build_model(c, device="meta")
    head = c.vocab_size * c.hidden_size
    matmul = 0  # matrices a token multiplies with, experts scaled by K / E
    for name, p in model.named_parameters():
        if p.ndim < 2 or name == "embed_tokens.weight":
            continue
        n = p.numel()
        matmul += n * c.num_experts_per_tok // c.n_routed_experts if ".experts." in name else n
    matmul += c.mtp_depth * head  # the shared head runs once more per MTP depth
    layers, seq = c.num_layers + c.mtp_depth, 64
    attention = 6 * layers * c.num_heads * (c.qk_head_dim + c.v_head_dim) * seq / 2
    assert acc.flops_per_token(c, seq) == pytest.approx(6 * matmul + attention)
    without = acc.flops_per_token(c, seq, include_mtp=False)
    assert without < acc.flops_per_token(c, seq)
    with pytest.raises(ValueError, match="seq_len"):
        acc.flops_per_token(c, 0)


def test_presets_names_get_and_overrides():
    assert {"tiny", "tiny-dense", "deepseek-v2-lite", "deepseek-v3-671b"} <= set(presets.names())
    tiny = presets.get("tiny", vocab_size=300)
    assert isinstance(tiny, DeepSeekConfig) and tiny.vocab_size == 300
    assert tiny.mtp_depth >= 1 and tiny.n_routed_experts >= 8 and tiny.q_lora_rank is not None
    assert isinstance(presets.get("tiny-dense"), DenseConfig)
    presets.get("deepseek-v3-671b").rope_scaling["factor"] = 1  # must not leak into the preset
    assert presets.get("deepseek-v3-671b").rope_scaling["factor"] == 40
    with pytest.raises(ValueError, match="unknown model preset"):
        presets.get("gpt-5")
    with pytest.raises(ValueError, match="not fields of DenseConfig"):
        presets.get("tiny-dense", n_routed_experts=4)
    assert "deepseek-v3-671b" in presets.markdown_table()


@pytest.mark.parametrize(
    "cls, kwargs, message",
    [
        (DenseConfig, {"hidden_size": 65}, "must divide hidden_size"),
        (DenseConfig, {"num_kv_heads": 3}, "must divide num_heads"),
        (DenseConfig, {"num_layers": -1}, "num_layers must be a positive integer"),
        (DenseConfig, {"head_dim": 7}, "must be even"),
        (DenseConfig, {"rope_scaling": {"type": "linear", "factor": 2}}, "not supported"),
        (DenseConfig, {"rope_scaling": {"type": "yarn"}}, "needs the key"),
        (DeepSeekConfig, {"num_experts_per_tok": 9}, "larger than n_routed_experts"),
        (DeepSeekConfig, {"n_group": 3}, "must divide n_routed_experts"),
        (DeepSeekConfig, {"n_group": 2, "topk_group": 3}, "topk_group=3 is larger"),
        (
            DeepSeekConfig,
            {"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3},
            "cannot be reached",
        ),
        (DeepSeekConfig, {"scoring_func": "relu"}, "unknown scoring_func"),
        (DeepSeekConfig, {"kv_lora_rank": 0}, "kv_lora_rank must be a positive"),
        (DeepSeekConfig, {"n_shared_experts": -1}, "n_shared_experts must be an integer >= 0"),
        (DeepSeekConfig, {"qk_rope_head_dim": 5}, "must be even"),
        (DeepSeekConfig, {"first_k_dense_replace": 3}, "exceeds num_layers"),
        (DeepSeekConfig, {"aux_loss_alpha": -0.1}, "aux_loss_alpha must be >= 0"),
        (DeepSeekConfig, {"routed_scaling_factor": 0.0}, "routed_scaling_factor must be > 0"),
        (DeepSeekConfig, {"q_lora_rank": 0}, "q_lora_rank must be a positive"),
    ],
)
def test_invalid_config_raises_with_fix(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


def test_rope_scaling_must_be_a_dict():
    with pytest.raises(TypeError, match="rope_scaling must be a dict"):
        DenseConfig(rope_scaling="yarn")


@pytest.mark.parametrize("name", presets.long_context_names())
def test_long_context_presets_build_with_yarn_and_the_base_shapes(name):
    base, label = name.rsplit("-", 1)
    seq_len = {"32k": 32768, "128k": 131072}[label]
    config = presets.get(name)
    assert config.max_seq_len == seq_len
    yarn = config.rope_scaling
    assert yarn["type"] == "yarn" and (yarn["beta_fast"], yarn["beta_slow"]) == (32, 1)
    if base.startswith("deepseek"):
        # DeepSeek-V3 section 4.3: the same YaRN in both stages (s = 40, over 4K positions)
        assert yarn["factor"] == 40 and yarn["original_max_position_embeddings"] == 4096
        assert yarn["mscale"] == yarn["mscale_all_dim"] == 1.0
    else:  # Llama-3.1-shaped: pre-trained at 8,192 tokens, stretched to seq_len
        assert yarn["original_max_position_embeddings"] == 8192
        assert yarn["factor"] == seq_len // 8192
    assert acc.total_params(config, include_mtp=True) == acc.total_params(
        presets.get(base), include_mtp=True
    )
    if base == "dense-8b":  # one family built on meta (the big ones cost seconds each)
        assert _count(build_model(config, device="meta")) == acc.total_params(config)
    assert name not in presets.markdown_table()  # the base's row holds its shapes
