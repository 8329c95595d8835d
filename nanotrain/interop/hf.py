"""Conversion to and from Hugging Face `transformers` checkpoints (config.json + safetensors).

Families: `DeepSeekConfig` <-> `DeepseekV3ForCausalLM` (model_type "deepseek_v3") and
`DenseConfig` <-> `LlamaForCausalLM` (model_type "llama"). Our module tree mirrors HF's, so a
key mostly gains or loses the `model.` prefix; the exceptions are:

    ours                                    HF checkpoint
    layers.{i}.mlp.experts.gate_proj [E,I,H] model.layers.{i}.mlp.experts.{e}.gate_proj.weight [I,H]
    (up_proj, down_proj alike)               (transformers >= 5 fuses them in memory on load and
                                              writes them back per expert; fused tensors
                                              `experts.gate_up_proj` / `experts.down_proj` are
                                              accepted on import too)
    mtp.{k}.{enorm,hnorm,eh_proj}           model.layers.{L+k}.{enorm,hnorm,eh_proj}
    mtp.{k}.norm                            model.layers.{L+k}.shared_head.norm
    mtp.{k}.block.*                         model.layers.{L+k}.*        (L = num_layers)

MTP follows DeepSeek's released checkpoint; `DeepseekV3ForCausalLM` does not load those keys.
RoPE needs no permutation: HF `rope_interleave=True` rotates adjacent pairs like our MLA, and
although it writes the rotated pairs de-interleaved, q and k get the same permutation, so every
attention score (hence every logit) is unchanged.

Nothing here imports `transformers`; it is only needed to run the exported model.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch
from torch import Tensor

from nanotrain.models.build import build_model
from nanotrain.models.config import DeepSeekConfig, DenseConfig
from nanotrain.models.lazy import stack

ModelConfig = DenseConfig | DeepSeekConfig

_COMMON = {  # ours -> HF, for both families
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "max_seq_len": "max_position_embeddings",
    "rms_norm_eps": "rms_norm_eps",
    "tie_word_embeddings": "tie_word_embeddings",
    "init_std": "initializer_range",
}
# DeepSeek fields whose HF name is our name
_DEEPSEEK_SAME = (
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "n_routed_experts", "n_shared_experts", "moe_intermediate_size", "num_experts_per_tok",
    "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace",
    "rope_interleave",
)  # fmt: skip
# training-only fields with no HF meaning, kept under config.json["nanotrain"] for a lossless trip
_TRAINING_ONLY = ("mtp_loss_weight", "aux_loss_alpha", "bias_update_speed")
_YARN_KEYS = (
    "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
    "mscale_all_dim",
)  # fmt: skip
_MTP_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight")


# ----------------------------------------------------------------------------------- config


def _rope_to_hf(config: ModelConfig) -> dict[str, Any]:
    """rope_theta + rope_parameters (transformers >= 5) + rope_scaling (older readers)."""
    out: dict[str, Any] = {"rope_theta": config.rope_theta}
    if config.rope_scaling is None:
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": config.rope_theta}
        return out
    yarn = {k: config.rope_scaling[k] for k in _YARN_KEYS if config.rope_scaling.get(k) is not None}
    out["rope_parameters"] = {"rope_type": "yarn", "rope_theta": config.rope_theta, **yarn}
    out["rope_scaling"] = {"type": "yarn", "rope_type": "yarn", **yarn}
    return out


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """Our config as a transformers config.json dict (`DeepseekV3ForCausalLM` or `LlamaForCausalLM`).

    Raises:
        ValueError: for DeepSeek settings transformers' DeepseekV3 cannot express: softmax
            scoring (it routes with sigmoid only) or groups of a single expert (it ranks groups
            by their two best experts).
        TypeError: for anything but a DenseConfig or DeepSeekConfig.
    """
    if not isinstance(config, DenseConfig | DeepSeekConfig):
        raise TypeError(
            f"config_to_hf needs a DenseConfig or DeepSeekConfig, got {type(config).__name__}"
        )
    hf: dict[str, Any] = {theirs: getattr(config, ours) for ours, theirs in _COMMON.items()}
    hf.update(_rope_to_hf(config), hidden_act="silu", attention_bias=False)
    if isinstance(config, DenseConfig):
        hf.update(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            num_key_value_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            mlp_bias=False,
        )
        return hf
    if config.scoring_func != "sigmoid":
        raise ValueError(
            f"transformers' DeepseekV3 routes with sigmoid scores only; scoring_func="
            f"{config.scoring_func!r} cannot be exported. Use scoring_func='sigmoid'."
        )
    if config.n_routed_experts // config.n_group < 2:
        raise ValueError(
            f"transformers' DeepseekV3 scores an expert group by its two best experts, so each of "
            f"the n_group={config.n_group} groups needs >= 2 of the {config.n_routed_experts} "
            "experts; lower n_group"
        )
    if config.rms_norm_eps != 1e-6:
        warnings.warn(
            "transformers' DeepseekV3 uses eps=1e-6 in q_a_layernorm/kv_a_layernorm whatever "
            f"rms_norm_eps says ({config.rms_norm_eps}); its logits will differ slightly",
            stacklevel=2,
        )
    hf.update({name: getattr(config, name) for name in _DEEPSEEK_SAME})
    hf.update(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        num_key_value_heads=config.num_heads,  # MLA: every head has its own key/value
        num_nextn_predict_layers=config.mtp_depth,
        scoring_func="sigmoid",
        topk_method="noaux_tc",  # DeepSeek's name for bias-steered (aux-loss-free) selection
        nanotrain={name: getattr(config, name) for name in _TRAINING_ONLY},
    )
    return hf


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise ValueError(f"RoPE type {kind!r} is not supported by nanotrain; only default and yarn")
    if params.get("attention_factor") is not None or params.get("truncate", True) is not True:
        raise ValueError(
            "yarn with an explicit attention_factor or truncate=False is not supported"
        )
    yarn = {k: params[k] for k in _YARN_KEYS if params.get(k) is not None}
    return theta, {"type": "yarn", **yarn}


def _family(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures") or []
    if hf.get("model_type") == "deepseek_v3" or "DeepseekV3ForCausalLM" in archs:
        return "deepseek"
    if hf.get("model_type") == "llama" or "LlamaForCausalLM" in archs:
        return "dense"
    raise ValueError(
        f"unsupported checkpoint: model_type={hf.get('model_type')!r}, architectures={archs}; "
        "nanotrain converts DeepseekV3ForCausalLM (deepseek_v3) and LlamaForCausalLM (llama)"
    )


def config_from_hf(hf_config: dict[str, Any]) -> ModelConfig:
    """A transformers config.json dict as our DeepSeekConfig or DenseConfig.

    The family comes from "model_type" (or "architectures"). Reads RoPE settings from either
    `rope_parameters` (transformers >= 5) or `rope_theta` + `rope_scaling` (older files).

    Raises:
        ValueError: for another architecture, a quantized checkpoint, biases, an activation
            other than SiLU, or RoPE scaling other than YaRN.
    """
    hf = hf_config
    family = _family(hf)
    if hf.get("quantization_config"):
        raise ValueError(
            "quantized checkpoints (e.g. DeepSeek-V3's fp8 release) are not supported; "
            "dequantize to bf16/fp32 first"
        )
    if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("only SiLU MLPs without biases are supported (hidden_act='silu', no bias)")
    theta, scaling = _rope_from_hf(hf)
    kw: dict[str, Any] = {ours: hf[theirs] for ours, theirs in _COMMON.items() if theirs in hf}
    kw.update(rope_theta=theta, rope_scaling=scaling)
    if family == "dense":
        return DenseConfig(
            **kw, num_kv_heads=hf.get("num_key_value_heads"), head_dim=hf.get("head_dim")
        )
    kw.update({name: hf[name] for name in _DEEPSEEK_SAME if hf.get(name) is not None})
    if "q_lora_rank" in hf:  # None is meaningful here: a plain q_proj (V2-Lite)
        kw["q_lora_rank"] = hf["q_lora_rank"]
    kw["scoring_func"] = hf.get("scoring_func", "sigmoid")
    kw["mtp_depth"] = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0
    extras = hf.get("nanotrain") or {}
    kw.update({name: extras[name] for name in _TRAINING_ONLY if name in extras})
    return DeepSeekConfig(**kw)


# ------------------------------------------------------------------------------ state dicts


def _expected_state(config: ModelConfig) -> dict[str, torch.Size]:
    """Key -> shape of a single-process model's state_dict (built on meta: no memory)."""
    return {k: v.shape for k, v in build_model(config, device="meta").state_dict().items()}


def _hf_layer_keys(layer_key: str, tensor: Tensor, hf_prefix: str) -> dict[str, Tensor]:
    """One key of a decoder layer (relative to the layer) -> HF keys; unstacks routed experts."""
    match = re.fullmatch(r"mlp\.experts\.(gate_proj|up_proj|down_proj)", layer_key)
    if match is None:
        return {hf_prefix + layer_key: tensor}
    name = match.group(1)
    return {f"{hf_prefix}mlp.experts.{e}.{name}.weight": w for e, w in enumerate(tensor.unbind(0))}


def state_dict_to_hf(config: ModelConfig, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Our full (single-process or gathered) state_dict -> HF checkpoint tensors.

    Vocabulary padding rows (tensor-parallel padding) are cut to `vocab_size`; with tied
    embeddings `lm_head.weight` is left out, as transformers does. Tensors are not copied.

    Raises:
        ValueError: when keys are missing or unknown (e.g. a wrapper prefix such as "model."
            was not stripped) or a shape does not match `config`.
    """
    expected = _expected_state(config)
    _check_keys(set(state_dict), set(expected), "state_dict")
    num_layers, out = config.num_layers, {}
    for key, tensor in state_dict.items():
        if key in ("embed_tokens.weight", "lm_head.weight"):
            tensor = tensor[: config.vocab_size]
        _check_shape(key, tensor, expected)
        if key == "lm_head.weight":
            if not config.tie_word_embeddings:
                out[key] = tensor
        elif match := re.fullmatch(r"layers\.(\d+)\.(.+)", key):
            out.update(_hf_layer_keys(match.group(2), tensor, f"model.layers.{match.group(1)}."))
        elif match := re.fullmatch(r"mtp\.(\d+)\.(.+)", key):
            prefix, rest = f"model.layers.{num_layers + int(match.group(1))}.", match.group(2)
            if rest == "norm.weight":
                out[prefix + "shared_head.norm.weight"] = tensor
            elif rest in _MTP_OWN:
                out[prefix + rest] = tensor
            else:
                out.update(_hf_layer_keys(rest.removeprefix("block."), tensor, prefix))
        else:
            out["model." + key] = tensor
    if isinstance(config, DeepSeekConfig) and config.n_shared_experts == 0:
        _add_empty_shared_experts(out, config.hidden_size)
    return out


def _add_empty_shared_experts(hf: dict[str, Tensor], hidden: int) -> None:
    # transformers always builds shared experts, 0 wide when there are none; writing them
    # (empty) keeps its load report free of "missing" keys
    for key in [k for k in hf if k.endswith(".mlp.gate.weight")]:
        prefix, dtype = key.removesuffix("gate.weight") + "shared_experts.", hf[key].dtype
        for name, shape in (
            ("gate_proj", (0, hidden)),
            ("up_proj", (0, hidden)),
            ("down_proj", (hidden, 0)),
        ):
            hf[f"{prefix}{name}.weight"] = torch.empty(shape, dtype=dtype)


def _check_keys(got: set[str], expected: set[str], what: str) -> None:
    missing, unknown = sorted(expected - got), sorted(got - expected)
    if missing or unknown:
        raise ValueError(
            f"{what} does not match the config: missing {missing[:8]}"
            f"{'...' if len(missing) > 8 else ''}, unexpected {unknown[:8]}"
            f"{'...' if len(unknown) > 8 else ''}. Strip wrapper prefixes (e.g. 'model.') and "
            "check that the config describes this checkpoint."
        )


def _check_shape(key: str, tensor: Tensor, expected: dict[str, torch.Size]) -> None:
    if tensor.shape != expected[key]:
        raise ValueError(
            f"{key}: shape {tuple(tensor.shape)} != {tuple(expected[key])} for this config"
        )


def _our_layer_key(
    rest: str, prefix: str, experts: dict[str, dict[int, Tensor]], t: Tensor
) -> dict:
    """One HF decoder-layer key -> ours; per-expert tensors are parked in `experts` to stack."""
    if match := re.fullmatch(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", rest):
        experts.setdefault(f"{prefix}mlp.experts.{match.group(2)}", {})[int(match.group(1))] = t
        return {}
    if rest == "mlp.experts.gate_up_proj":  # transformers' fused layout [E, 2I, H], gate first
        gate, up = t.chunk(2, dim=1)
        return {f"{prefix}mlp.experts.gate_proj": gate, f"{prefix}mlp.experts.up_proj": up}
    if rest == "mlp.experts.down_proj":
        return {f"{prefix}mlp.experts.down_proj": t}
    return {prefix + rest: t}


# MTP layers' copies of the shared embedding / head: DeepSeek's release stores them, but our
# MTP modules use the main model's
_MTP_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def state_dict_from_hf(config: ModelConfig, hf_state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """HF checkpoint tensors -> a state_dict our single-process model loads with strict=True.

    MTP layers beyond `config.mtp_depth` are skipped. With tied embeddings a missing
    `lm_head.weight` is filled from the embedding. The values may be `LazyTensor`s
    (`hf_io.open_hf_checkpoint`): nothing is read then; per-expert tensors are stacked and a
    fused `gate_up_proj` is split lazily, so a rank later reads only its experts and rows.

    Raises:
        ValueError: for fp8 scale tensors, or when keys are missing, unknown, or mis-shaped.
    """
    num_layers, out = config.num_layers, {}
    experts: dict[str, dict[int, Tensor]] = {}
    for key, t in hf_state_dict.items():
        if key.endswith("weight_scale_inv"):
            raise ValueError(f"{key}: fp8 checkpoints are not supported; dequantize to bf16 first")
        if key == "lm_head.weight" or not (
            match := re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key)
        ):
            out[key.removeprefix("model.")] = t
            continue
        index, rest = int(match.group(1)), match.group(2)
        if rest.endswith("rotary_emb.inv_freq"):  # rotary tables some old checkpoints saved
            continue
        if index < num_layers:
            out.update(_our_layer_key(rest, f"layers.{index}.", experts, t))
            continue
        k = index - num_layers
        if k >= getattr(config, "mtp_depth", 0) or rest in _MTP_SHARED_COPIES:
            continue
        if rest == "shared_head.norm.weight":
            out[f"mtp.{k}.norm.weight"] = t
        elif rest in _MTP_OWN:
            out[f"mtp.{k}.{rest}"] = t
        else:
            out.update(_our_layer_key(rest, f"mtp.{k}.block.", experts, t))
    for key, per_expert in experts.items():
        if sorted(per_expert) != list(range(len(per_expert))):
            raise ValueError(f"{key}: experts {sorted(per_expert)} are not 0..E-1")
        out[key] = stack([per_expert[e] for e in range(len(per_expert))])  # lazy if they are
    if config.tie_word_embeddings and "lm_head.weight" not in out and "embed_tokens.weight" in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    if isinstance(config, DeepSeekConfig) and config.n_shared_experts == 0:
        # transformers always builds shared experts; with none they are 0-wide
        out = {k: v for k, v in out.items() if ".mlp.shared_experts." not in k}
    expected = _expected_state(config)
    _check_keys(set(out), set(expected), "HF checkpoint")
    for key, tensor in out.items():
        _check_shape(key, tensor, expected)
    return out
