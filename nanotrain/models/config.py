"""Typed model configurations: `DenseConfig` (Llama-style) and `DeepSeekConfig` (DeepSeek-V3).

Every check runs in `__post_init__`, so a bad value fails at construction with the fix in the
message, before any model or process group exists.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

_YARN_KEYS = {
    "type",
    "rope_type",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
}


def _require_positive(cfg: Any, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(
                f"{name} must be a positive integer, got {value!r}; set it to a value >= 1"
            )


def _require_non_negative(cfg: Any, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def _validate_rope_scaling(rope_scaling: dict[str, Any] | None) -> None:
    if rope_scaling is None:
        return
    if not isinstance(rope_scaling, dict):
        raise TypeError(f"rope_scaling must be a dict or None, got {type(rope_scaling).__name__}")
    kind = rope_scaling.get("type", rope_scaling.get("rope_type"))
    if kind != "yarn":
        raise ValueError(
            f"rope_scaling type {kind!r} is not supported; use {{'type': 'yarn', ...}} or None"
        )
    unknown = set(rope_scaling) - _YARN_KEYS
    if unknown:
        raise ValueError(
            f"unknown rope_scaling keys {sorted(unknown)}; allowed: {sorted(_YARN_KEYS)}"
        )
    for key in ("factor", "original_max_position_embeddings"):
        if key not in rope_scaling:
            raise ValueError(f"rope_scaling of type 'yarn' needs the key {key!r}")
    if rope_scaling["factor"] < 1:
        raise ValueError(f"rope_scaling factor must be >= 1, got {rope_scaling['factor']}")


@dataclass
class _BaseConfig:
    """Fields shared by both model families (see the subclasses for their meaning)."""

    vocab_size: int = 257
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 128
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    init_std: float = 0.02

    def _validate_common(self) -> None:
        _require_positive(
            self, "vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size"
        )
        _require_positive(self, "max_seq_len")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.init_std <= 0 or not math.isfinite(self.init_std):
            raise ValueError(f"init_std must be a positive finite number, got {self.init_std}")
        _validate_rope_scaling(self.rope_scaling)

    @classmethod
    def field_names(cls) -> list[str]:
        """Names of every field, e.g. to list the valid overrides in an error message."""
        return [f.name for f in fields(cls)]


@dataclass
class DenseConfig(_BaseConfig):
    """A Llama-style dense decoder: RMSNorm, rotate-half RoPE, MHA/GQA/MQA, SwiGLU MLP.

    Attributes:
        num_kv_heads: key/value heads; `num_heads` = MHA, 1 = MQA, in between = GQA. None means
            `num_heads`. Must divide `num_heads`.
        head_dim: per-head width; None means `hidden_size // num_heads` (then `num_heads` must
            divide `hidden_size`).
        Others: see `DeepSeekConfig`, which shares them.

    Raises:
        ValueError: on any inconsistent or out-of-range value, with the fix in the message.
    """

    num_kv_heads: int | None = None
    head_dim: int | None = None

    def __post_init__(self) -> None:
        self._validate_common()
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        _require_positive(self, "num_kv_heads")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}; "
                "pick a divisor (1 = MQA, num_heads = MHA)"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_heads != 0:
                raise ValueError(
                    f"num_heads={self.num_heads} must divide hidden_size={self.hidden_size} "
                    "(or set head_dim explicitly)"
                )
            self.head_dim = self.hidden_size // self.num_heads
        _require_positive(self, "head_dim")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")


@dataclass
class DeepSeekConfig(_BaseConfig):
    """DeepSeek-V2/V3: MLA attention, DeepSeekMoE, aux-loss-free balancing, MTP.

    Attributes:
        vocab_size, hidden_size, num_layers, num_heads: the usual sizes.
        intermediate_size: SwiGLU width of the first `first_k_dense_replace` dense layers.
        max_seq_len: longest sequence the rope tables are meant for.
        rope_theta: RoPE base. rope_scaling: None or a YaRN dict with DeepSeek's keys
            (type='yarn', factor, original_max_position_embeddings, beta_fast, beta_slow,
            mscale, mscale_all_dim).
        rope_interleave: True = the rope dims of MLA rotate adjacent pairs (DeepSeek's
            reference code and HF `rope_interleave=True`); False = rotate-half.
        q_lora_rank: query compression rank d_c'; None = plain `q_proj` (V2-Lite).
        kv_lora_rank: key/value compression rank d_c.
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim: per-head widths d_h, d_h^R, value dim.
        n_routed_experts, n_shared_experts, moe_intermediate_size: DeepSeekMoE sizes.
        num_experts_per_tok: K_r routed experts per token.
        n_group, topk_group: group-limited routing (select K_r experts from the best
            `topk_group` of `n_group` equal expert groups).
        routed_scaling_factor: multiplies the routed gate weights.
        scoring_func: 'sigmoid' (V3) or 'softmax' (V2) affinity.
        norm_topk_prob: normalize the selected K_r weights to sum to one.
        first_k_dense_replace: the first k layers use a dense SwiGLU instead of MoE.
        mtp_depth: number D of multi-token-prediction modules (0 = off).
        mtp_loss_weight: lambda, the weight of the MTP loss in `total_loss`.
        aux_loss_alpha: alpha of the sequence-wise balance loss (0 = off).
        bias_update_speed: gamma of the aux-loss-free bias update (0 = off).
        capacity_factor: None = dropless (every routed copy is computed). A number f > 0 caps
            each expert at ceil(f * N * K / E) copies of a rank's N tokens per MoE forward;
            copies over the cap are dropped, lowest routing weight first (DeepSeekMoE).

    Raises:
        ValueError: on any inconsistent or out-of-range value, with the fix in the message.
    """

    rope_interleave: bool = True
    q_lora_rank: int | None = 32
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    moe_intermediate_size: int = 32
    num_experts_per_tok: int = 2
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    scoring_func: str = "sigmoid"
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 1
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3
    aux_loss_alpha: float = 0.0
    bias_update_speed: float = 0.001
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        self._validate_common()
        _require_positive(
            self,
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "n_routed_experts",
            "moe_intermediate_size",
            "num_experts_per_tok",
            "n_group",
            "topk_group",
        )
        _require_non_negative(self, "n_shared_experts", "first_k_dense_replace", "mtp_depth")
        if self.q_lora_rank is not None:
            _require_positive(self, "q_lora_rank")
        if self.qk_rope_head_dim % 2 != 0:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE")
        if self.scoring_func not in ("sigmoid", "softmax"):
            raise ValueError(
                f"unknown scoring_func {self.scoring_func!r}; use 'sigmoid' (V3) or 'softmax' (V2)"
            )
        self._validate_routing()
        if self.first_k_dense_replace > self.num_layers:
            raise ValueError(
                f"first_k_dense_replace={self.first_k_dense_replace} exceeds num_layers="
                f"{self.num_layers}; use at most num_layers (all dense)"
            )
        for name in ("mtp_loss_weight", "aux_loss_alpha", "bias_update_speed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.routed_scaling_factor <= 0:
            raise ValueError(f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor}")
        self._validate_capacity()

    def _validate_capacity(self) -> None:
        f = self.capacity_factor
        if f is None:
            return
        if isinstance(f, bool) or not isinstance(f, (int, float)):
            raise TypeError(f"capacity_factor must be a number or None, got {type(f).__name__}")
        if not (f > 0 and math.isfinite(f)):
            raise ValueError(
                f"capacity_factor must be > 0 and finite, got {f}; use e.g. 1.25 (each expert "
                "takes up to 1.25x its balanced share of token copies) or None for dropless"
            )

    def _validate_routing(self) -> None:
        e, k = self.n_routed_experts, self.num_experts_per_tok
        if k > e:
            raise ValueError(
                f"num_experts_per_tok={k} is larger than n_routed_experts={e}; lower top-k "
                "or add experts"
            )
        if e % self.n_group != 0:
            raise ValueError(
                f"n_group={self.n_group} must divide n_routed_experts={e} (groups are equal "
                "slices of the experts)"
            )
        if self.topk_group > self.n_group:
            raise ValueError(
                f"topk_group={self.topk_group} is larger than n_group={self.n_group}; "
                "use topk_group <= n_group"
            )
        reachable = self.topk_group * (e // self.n_group)
        if k > reachable:
            raise ValueError(
                f"num_experts_per_tok={k} cannot be reached from topk_group={self.topk_group} "
                f"groups of {e // self.n_group} experts ({reachable} candidates); raise "
                "topk_group or lower num_experts_per_tok"
            )

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head: nope part + rope part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        """True when layer `layer_idx` of the main stack uses DeepSeekMoE (not a dense MLP)."""
        return layer_idx >= self.first_k_dense_replace


ModelConfig = DenseConfig | DeepSeekConfig


_FAMILIES = {"DeepSeekConfig": DeepSeekConfig, "DenseConfig": DenseConfig}


def config_to_dict(config: DeepSeekConfig | DenseConfig) -> dict[str, Any]:
    """A model config as plain JSON values: {"family": class name, "config": fields}."""
    return {"family": type(config).__name__, "config": asdict(config)}


def config_from_dict(data: dict[str, Any]) -> DeepSeekConfig | DenseConfig:
    """Inverse of `config_to_dict`; raises ValueError for an unknown family or fields."""
    family = _FAMILIES.get(data.get("family", ""))
    if family is None:
        raise ValueError(
            f"unknown model family {data.get('family')!r}; expected one of {sorted(_FAMILIES)}"
        )
    try:
        return family(**data["config"])
    except TypeError as exc:
        raise ValueError(f"model config does not match {family.__name__}: {exc}") from exc


def unknown_fields_error(cls: type, names: Any, source: str) -> ValueError | None:
    """The error for `names` that are not fields of config class `cls` (None when all are),
    naming `source` (e.g. "preset 'tiny'") and listing the valid fields."""
    valid = {f.name for f in fields(cls)}
    unknown = sorted(set(names) - valid)
    if not unknown:
        return None
    return ValueError(
        f"{unknown} are not fields of {cls.__name__} ({source}); valid fields: {sorted(valid)}"
    )
