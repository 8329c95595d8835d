"""Named model configurations, from CPU-test sized to the real DeepSeek-V3 671B.

    from nanotrain.models import presets
    config = presets.get("tiny", vocab_size=300)   # any config field can be overridden
    presets.names()                                # every preset name

| name               | family   | what it is for                                            |
|--------------------|----------|-----------------------------------------------------------|
| `tiny`             | DeepSeek | CPU tests: MLA, 8 routed experts in 4 groups, MTP on      |
| `tiny-dense`       | dense    | CPU tests: Llama-style with GQA                           |
| `deepseek-100m`    | DeepSeek | benchmarks: ~100M-class MoE model                         |
| `dense-100m`       | dense    | benchmarks: ~100M-class Llama-style model                 |
| `dense-8b`         | dense    | Llama-3.1-8B's shapes (8.03B)                             |
| `deepseek-v2-lite` | DeepSeek | DeepSeek-V2-Lite (15.7B total, 2.4B activated)            |
| `dense-70b`        | dense    | Llama-3.1-70B's shapes (70.6B)                            |
| `deepseek-v3-671b` | DeepSeek | DeepSeek-V3 (671B total, 37B activated, MTP depth 1)      |

Long-context stages (`long_context_names()`): `dense-8b-32k`, `dense-8b-128k`,
`dense-70b-32k`, `dense-70b-128k`, `deepseek-v3-671b-32k`, `deepseek-v3-671b-128k`: the same
shapes with `max_seq_len` 32,768 / 131,072 and YaRN rope scaling (`_long_context`).

`markdown_table()` renders the parameter counts of every preset (used by docs/models.md).
"""

from __future__ import annotations

from typing import Any

from nanotrain.models.config import DeepSeekConfig, DenseConfig, unknown_fields_error

# DeepSeek-V3 extends its context with YaRN (paper section 4.3); V2-Lite ships the same keys
# with mscale 0.707.
_V3_YARN = {
    "type": "yarn",
    "factor": 40,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _llama31(hidden: int, layers: int, heads: int, ffn: int) -> dict[str, Any]:
    """Llama-3.1's config.json shapes. Its context extension past 8,192 tokens uses the
    "llama3" rope scaling, which the models do not implement, so the presets keep the 8,192
    tokens of Llama-3's pre-training."""
    return dict(
        vocab_size=128256,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=8,
        intermediate_size=ffn,
        max_seq_len=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )


_PRESETS: dict[str, tuple[type[DenseConfig] | type[DeepSeekConfig], dict[str, Any]]] = {
    "tiny": (
        DeepSeekConfig,
        dict(
            vocab_size=257,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            intermediate_size=128,
            max_seq_len=256,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            n_shared_experts=1,
            moe_intermediate_size=32,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            mtp_depth=1,
            mtp_loss_weight=0.3,
            aux_loss_alpha=0.0001,
            bias_update_speed=0.001,
        ),
    ),
    "tiny-dense": (
        DenseConfig,
        dict(
            vocab_size=257,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=160,
            max_seq_len=256,
        ),
    ),
    "deepseek-100m": (
        DeepSeekConfig,
        dict(
            vocab_size=32000,
            hidden_size=512,
            num_layers=8,
            num_heads=8,
            intermediate_size=1536,
            max_seq_len=2048,
            q_lora_rank=192,
            kv_lora_rank=128,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
            n_routed_experts=16,
            n_shared_experts=1,
            moe_intermediate_size=384,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            mtp_depth=1,
            mtp_loss_weight=0.3,
            aux_loss_alpha=0.0001,
            bias_update_speed=0.001,
        ),
    ),
    "dense-100m": (
        DenseConfig,
        dict(
            vocab_size=32000,
            hidden_size=768,
            num_layers=12,
            num_heads=12,
            num_kv_heads=4,
            intermediate_size=2048,
            max_seq_len=2048,
            rope_theta=500000.0,
        ),
    ),
    "dense-8b": (DenseConfig, _llama31(hidden=4096, layers=32, heads=32, ffn=14336)),
    # DeepSeek-V2-Lite config.json: no query compression, softmax routing with aux loss, no
    # bias balancing and no MTP.
    "deepseek-v2-lite": (
        DeepSeekConfig,
        dict(
            vocab_size=102400,
            hidden_size=2048,
            num_layers=27,
            num_heads=16,
            intermediate_size=10944,
            max_seq_len=163840,
            rope_scaling={**_V3_YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            n_routed_experts=64,
            n_shared_experts=2,
            moe_intermediate_size=1408,
            num_experts_per_tok=6,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
            scoring_func="softmax",
            norm_topk_prob=False,
            first_k_dense_replace=1,
            mtp_depth=0,
            aux_loss_alpha=0.001,
            bias_update_speed=0.0,
        ),
    ),
    "dense-70b": (DenseConfig, _llama31(hidden=8192, layers=80, heads=64, ffn=28672)),
    # DeepSeek-V3 config.json plus the paper's training hyper-parameters (section 4.2):
    # alpha = 1e-4, gamma = 0.001, lambda = 0.3 (for the first 10T tokens).
    "deepseek-v3-671b": (
        DeepSeekConfig,
        dict(
            vocab_size=129280,
            hidden_size=7168,
            num_layers=61,
            num_heads=128,
            intermediate_size=18432,
            max_seq_len=163840,
            rope_scaling=dict(_V3_YARN),
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            n_routed_experts=256,
            n_shared_experts=1,
            moe_intermediate_size=2048,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
            scoring_func="sigmoid",
            norm_topk_prob=True,
            first_k_dense_replace=3,
            mtp_depth=1,
            mtp_loss_weight=0.3,
            aux_loss_alpha=0.0001,
            bias_update_speed=0.001,
        ),
    ),
}


def _long_context(base: str, seq_len: int) -> tuple[type, dict[str, Any]]:
    """Preset `base` for a context-extension stage to `seq_len` tokens with YaRN.

    DeepSeek-V3 (paper section 4.3) extends 4K -> 32K -> 128K with the same YaRN settings in
    both stages (factor 40 over 4,096 original positions, beta_fast 32, beta_slow 1,
    mscale = mscale_all_dim = 1.0), so both of its stages keep `_V3_YARN`. The Llama-3.1-shaped
    dense presets pre-train at 8,192 tokens; Llama 3.1 itself extended with its own "llama3"
    scaling (factor 8), which nanotrain does not implement: here they use YaRN with factor
    seq_len / 8,192 and no mscale keys (the temperature 0.1 ln(factor) + 1 then scales
    cos / sin, as transformers' YaRN does).
    """
    cls, values = _PRESETS[base]
    values = {**values, "max_seq_len": seq_len}
    if cls is DenseConfig:
        original = _PRESETS[base][1]["max_seq_len"]
        values["rope_scaling"] = {
            "type": "yarn",
            "factor": seq_len // original,
            "original_max_position_embeddings": original,
            "beta_fast": 32,
            "beta_slow": 1,
        }
    else:
        values["rope_scaling"] = dict(_V3_YARN)
    return cls, values


_LONG_CONTEXT = {
    f"{base}-{label}": (base, seq_len)
    for base in ("dense-8b", "dense-70b", "deepseek-v3-671b")
    for label, seq_len in (("32k", 32768), ("128k", 131072))
}
for _name, (_base, _seq) in _LONG_CONTEXT.items():
    _PRESETS[_name] = _long_context(_base, _seq)


def names() -> list[str]:
    """Every preset name, smallest first (the long-context stages after their bases)."""
    return list(_PRESETS)


def long_context_names() -> list[str]:
    """The context-extension presets: `<base>-32k` and `<base>-128k` (YaRN, see
    `_long_context`)."""
    return list(_LONG_CONTEXT)


def get(name: str, **overrides: Any) -> DenseConfig | DeepSeekConfig:
    """A fresh config for preset `name`, with any field replaced by `overrides`.

    Example: `get("tiny", vocab_size=300, mtp_depth=0)`.

    Raises:
        ValueError: for an unknown preset name or an override that is not a field of the
            preset's config class (the message lists the valid choices), or when the
            overridden config is inconsistent (from the config's own validation).
    """
    if name not in _PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {names()}")
    cls, values = _PRESETS[name]
    error = unknown_fields_error(cls, overrides, f"preset {name!r}")
    if error is not None:
        raise error
    # copy nested dicts so a caller mutating rope_scaling cannot change the preset
    merged = {k: (dict(v) if isinstance(v, dict) else v) for k, v in values.items()}
    merged.update(overrides)
    return cls(**merged)


def _human(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(int(n))


def markdown_table(seq_len: int = 4096) -> str:
    """A Markdown table of every preset's parameter counts and training FLOPs per token.

    Columns: total (main model, MTP excluded), activated per token (MTP excluded), MTP
    modules' own parameters, and `flops_per_token(config, seq_len)` (MTP included).
    """
    # imported here: accounting imports nothing from presets, but keep presets importable alone
    from nanotrain.models import accounting

    rows = [
        "| preset | family | layers | hidden | total params | activated / token | MTP params "
        f"| train FLOPs / token (seq {seq_len}) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in names():
        if name in _LONG_CONTEXT:
            continue  # the same shapes as their base (`long_context_table`)
        c = get(name)
        family = "DeepSeek" if isinstance(c, DeepSeekConfig) else "dense"
        rows.append(
            f"| `{name}` | {family} | {c.num_layers} | {c.hidden_size} "
            f"| {_human(accounting.total_params(c))} | {_human(accounting.active_params(c))} "
            f"| {_human(accounting.mtp_params(c).total)} "
            f"| {accounting.flops_per_token(c, seq_len) / 1e9:.3g} G |"
        )
    return "\n".join(rows)


def long_context_table() -> str:
    """A Markdown table of the long-context presets: base, context, YaRN settings and
    training FLOPs per token at their own context (MTP included)."""
    from nanotrain.models import accounting

    rows = [
        "| preset | base | max_seq_len | YaRN factor | original positions "
        "| train FLOPs / token (at max_seq_len) |",
        "|---|---|---|---|---|---|",
    ]
    for name, (base, seq_len) in _LONG_CONTEXT.items():
        c = get(name)
        yarn = c.rope_scaling
        rows.append(
            f"| `{name}` | `{base}` | {seq_len} | {yarn['factor']} "
            f"| {yarn['original_max_position_embeddings']} "
            f"| {accounting.flops_per_token(c, seq_len) / 1e9:.3g} G |"
        )
    return "\n".join(rows)
