"""Parameter and FLOP accounting as pure functions of a model config (no model is built).

Terms (per token, single tensor-parallel rank = the whole model):
- *total* parameters: every parameter tensor once (a tied head is not counted twice);
  the router bias is a buffer, not a parameter.
- *activated* parameters: what one token computes with: every parameter except the input
  embedding table (a token reads one row of it; with tied embeddings the matrix counts once,
  as the head) and except the routed experts it is not sent to, i.e. attention, norms,
  dense MLPs, routers (every token scores every expert), shared experts, `num_experts_per_tok`
  routed experts per MoE layer, and the output head. This is the definition under which the
  papers' rounded figures all agree: DeepSeek-V3 671.0B total / 36.6B activated ("37B"),
  DeepSeek-V2-Lite 15.7B / 2.45B ("2.4B"), DeepSeek-V2 235.7B / 20.9B ("21B"); counting the
  embedding too would give V2-Lite 2.66B, which contradicts its paper.
- MTP modules are counted separately (`include_mtp`): DeepSeek-V3's 671B / 37B exclude them;
  the Hugging Face checkpoint's 685B adds them: 11.6B of MTP parameters in our model plus
  0.93B + 0.93B for the copies of embedding and head that checkpoint stores in layer 61 (we
  share those with the main model and do not count them again) = 684.49B, plus 0.04B of FP8
  block scales (one float per 128 x 128 weight block) = 684.53B, shown as "685B".

Training FLOPs per token (forward + backward = 3 x forward, a matmul of an [in, out] weight
costing 2 * in * out per token forward):

    flops = 6 * N_matmul + 6 * L_attn * heads * (qk_head_dim + v_head_dim) * S_eff

- N_matmul: activated matrix parameters excluding the input embedding (a lookup, not a matmul)
  and the norm weights, plus the output head once per prediction head (main + each MTP depth,
  since the head is shared but applied D + 1 times).
- the second term is QK^T (qk_head_dim) and attention x V (v_head_dim) for each of
  L_attn = num_layers (+ mtp_depth) attention layers; S_eff = seq_len / 2 with causal=True
  (each query sees on average half the keys, which is what causal flash kernels compute)
  and seq_len with causal=False.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanotrain.models.config import DeepSeekConfig, DenseConfig


@dataclass(frozen=True)
class ParamBreakdown:
    """Parameter counts of one part of a model (main stack or MTP modules), by kind.

    Attributes:
        embedding: input embedding table (0 when tied: the shared matrix counts as `head`).
        head: output head (0 in MTP breakdowns: the head is shared with the main model).
        norms: RMSNorm weights. dense: other matrices (attention, dense MLPs, shared experts,
        routers, MTP projections). experts: all routed experts. experts_active: the
        `num_experts_per_tok` routed experts a token uses.
    """

    embedding: int = 0
    head: int = 0
    norms: int = 0
    dense: int = 0
    experts: int = 0
    experts_active: int = 0

    @property
    def total(self) -> int:
        """All parameters of this part."""
        return self.embedding + self.head + self.norms + self.dense + self.experts

    @property
    def activated(self) -> int:
        """Parameters one token computes with in this part (input embedding excluded)."""
        return self.head + self.norms + self.dense + self.experts_active

    def __add__(self, other: ParamBreakdown) -> ParamBreakdown:
        return ParamBreakdown(
            *(getattr(self, f) + getattr(other, f) for f in self.__dataclass_fields__)
        )


def _attention(config: DenseConfig | DeepSeekConfig) -> ParamBreakdown:
    c, h = config, config.hidden_size
    if isinstance(c, DenseConfig):
        d = c.head_dim
        return ParamBreakdown(dense=2 * h * c.num_heads * d + 2 * h * c.num_kv_heads * d)
    n = c.num_heads
    if c.q_lora_rank is None:
        q, q_norm = h * n * c.qk_head_dim, 0
    else:
        q, q_norm = h * c.q_lora_rank + c.q_lora_rank * n * c.qk_head_dim, c.q_lora_rank
    kv = h * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank * n * (
        c.qk_nope_head_dim + c.v_head_dim
    )
    return ParamBreakdown(norms=q_norm + c.kv_lora_rank, dense=q + kv + n * c.v_head_dim * h)


def _mlp(config: DenseConfig | DeepSeekConfig, moe: bool) -> ParamBreakdown:
    c, h = config, config.hidden_size
    if not moe:
        return ParamBreakdown(dense=3 * h * c.intermediate_size)
    per_expert = 3 * h * c.moe_intermediate_size
    return ParamBreakdown(
        dense=c.n_routed_experts * h + c.n_shared_experts * per_expert,  # router + shared
        experts=c.n_routed_experts * per_expert,
        experts_active=c.num_experts_per_tok * per_expert,
    )


def _layer(config: DenseConfig | DeepSeekConfig, moe: bool) -> ParamBreakdown:
    return ParamBreakdown(norms=2 * config.hidden_size) + _attention(config) + _mlp(config, moe)


def _is_moe(config: DenseConfig | DeepSeekConfig, layer_idx: int) -> bool:
    return isinstance(config, DeepSeekConfig) and config.is_moe_layer(layer_idx)


def main_params(config: DenseConfig | DeepSeekConfig) -> ParamBreakdown:
    """Breakdown of the main model: embedding, decoder layers, final norm and head."""
    c = config
    vh = c.vocab_size * c.hidden_size
    embedding = 0 if c.tie_word_embeddings else vh
    out = ParamBreakdown(embedding=embedding, head=vh, norms=c.hidden_size)
    for i in range(c.num_layers):
        out = out + _layer(c, _is_moe(c, i))
    return out


def mtp_params(config: DenseConfig | DeepSeekConfig) -> ParamBreakdown:
    """Breakdown of all MTP modules (empty for dense configs); embedding and head are shared."""
    if not isinstance(config, DeepSeekConfig) or config.mtp_depth == 0:
        return ParamBreakdown()
    h = config.hidden_size
    moe = config.first_k_dense_replace < config.num_layers
    one = ParamBreakdown(norms=3 * h, dense=2 * h * h) + _layer(config, moe)
    out = ParamBreakdown()
    for _ in range(config.mtp_depth):
        out = out + one
    return out


def total_params(config: DenseConfig | DeepSeekConfig, *, include_mtp: bool = False) -> int:
    """Parameters of the main model (tp=1); `include_mtp=True` adds the MTP modules, which
    gives the parameter count of the built model."""
    extra = mtp_params(config).total if include_mtp else 0
    return main_params(config).total + extra


def active_params(config: DenseConfig | DeepSeekConfig, *, include_mtp: bool = False) -> int:
    """Parameters activated per token (see the module docstring); MTP excluded by default."""
    extra = mtp_params(config).activated if include_mtp else 0
    return main_params(config).activated + extra


@dataclass(frozen=True)
class FlopParts:
    """Training FLOPs per token by where they run (the terms of `flops_per_token`).

    Attributes:
        layers: one entry per decoder layer (matmuls + attention scores).
        head: the output head of the main model.
        mtp: all MTP modules, their head applications included (0 without MTP).
        routed: the part of each `layers` entry spent in routed experts (0 for dense layers),
            which tensor parallelism does not split (see `nanotrain.planning.plan`).
        mtp_routed: the part of `mtp` spent in routed experts.
    """

    layers: tuple[float, ...]
    head: float
    mtp: float
    routed: tuple[float, ...] = ()
    mtp_routed: float = 0.0

    @property
    def total(self) -> float:
        """Sum of all parts: `flops_per_token`."""
        return sum(self.layers) + self.head + self.mtp


def flops_per_token_parts(
    config: DenseConfig | DeepSeekConfig,
    seq_len: int,
    *,
    causal: bool = True,
    include_mtp: bool = True,
) -> FlopParts:
    """`flops_per_token` split per decoder layer, head and MTP (what a pipeline stage runs).

    Raises: ValueError if seq_len < 1.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    c = config
    head = 6.0 * c.vocab_size * c.hidden_size
    if isinstance(c, DeepSeekConfig):
        qk, v = c.qk_head_dim, c.v_head_dim
    else:
        qk = v = c.head_dim
    keys_per_query = seq_len / 2 if causal else seq_len
    scores = 6.0 * c.num_heads * (qk + v) * keys_per_query
    layers, routed = [], []
    for i in range(c.num_layers):
        part = _layer(c, _is_moe(c, i))
        layers.append(6.0 * (part.dense + part.experts_active) + scores)
        routed.append(6.0 * part.experts_active)
    mtp = mtp_routed = 0.0
    if include_mtp and isinstance(c, DeepSeekConfig) and c.mtp_depth > 0:
        m = mtp_params(c)
        mtp = 6.0 * (m.dense + m.experts_active) + c.mtp_depth * (head + scores)
        mtp_routed = 6.0 * m.experts_active
    return FlopParts(tuple(layers), head, mtp, tuple(routed), mtp_routed)


def attention_flops_per_token(
    config: DenseConfig | DeepSeekConfig, seq_len: int, *, causal: bool = True
) -> float:
    """Training FLOPs per token of one decoder layer's attention block: its projections (MLA's
    low-rank down- and up-projections included) and the score / value matmuls. A third of it
    is the forward, which selective recomputation runs again.

    Raises: ValueError if seq_len < 1.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    c = config
    if isinstance(c, DeepSeekConfig):
        qk, v = c.qk_head_dim, c.v_head_dim
    else:
        qk = v = c.head_dim
    keys_per_query = seq_len / 2 if causal else seq_len
    return 6.0 * _attention(c).dense + 6.0 * c.num_heads * (qk + v) * keys_per_query


def linear_flops_per_token_parts(
    config: DenseConfig | DeepSeekConfig,
) -> tuple[tuple[float, ...], float, float]:
    """Training FLOPs per token of the plain linear layers, the GEMMs an fp8 precision plugin
    swaps (attention projections, dense MLPs, shared experts, MTP's projection): per decoder
    layer, of all MTP modules, and of one layer's attention projections. Not counted: the
    attention scores, the MoE router, the routed experts (`GroupedExperts`) and the head."""
    c = config
    per_layer = []
    for i in range(c.num_layers):
        moe = _is_moe(c, i)
        router = c.n_routed_experts * c.hidden_size if moe else 0
        per_layer.append(6.0 * (_layer(c, moe).dense - router))
    mtp = 0.0
    if isinstance(c, DeepSeekConfig) and c.mtp_depth > 0:
        moe = c.first_k_dense_replace < c.num_layers
        router = c.n_routed_experts * c.hidden_size if moe else 0
        mtp = 6.0 * (mtp_params(c).dense - c.mtp_depth * router)
    return tuple(per_layer), mtp, 6.0 * _attention(c).dense


def up_projection_flops_per_token(config: DenseConfig | DeepSeekConfig) -> float:
    """Forward FLOPs per token of one layer's MLA up-projections (q_b_proj with q_lora_rank,
    kv_b_proj), which recompute "light" runs twice more in backward; 0 for dense attention."""
    c = config
    if not isinstance(c, DeepSeekConfig):
        return 0.0
    kv = c.kv_lora_rank * c.num_heads * (c.qk_nope_head_dim + c.v_head_dim)
    q = 0 if c.q_lora_rank is None else c.q_lora_rank * c.num_heads * c.qk_head_dim
    return 2.0 * (q + kv)


def flops_per_token(
    config: DenseConfig | DeepSeekConfig,
    seq_len: int,
    *,
    causal: bool = True,
    include_mtp: bool = True,
) -> float:
    """Training (forward + backward) FLOPs per token at sequence length `seq_len`.

    See the module docstring for the derivation. MTP is included by default because its
    modules run (and cost compute) in every training step.

    Raises: ValueError if seq_len < 1.
    """
    return flops_per_token_parts(config, seq_len, causal=causal, include_mtp=include_mtp).total
