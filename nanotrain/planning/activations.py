"""Activation memory: the bytes a rank's forward saves for backward, per microbatch and at the
pipeline schedule's worst moment.

The counts follow what OUR forward code saves (read from `models/attention.py`, `layers.py`,
`moe.py`, `deepseek.py`, `transformer.py`, `parallel/cross_entropy.py` and checked against
`torch.autograd.graph.saved_tensors_hooks` on CPU runs, see tests/unit/test_plan_activations.py),
not a textbook number. The per-layer structure is that of Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models", section 4: tensors inside the tp matmuls
split by tp, the others split by tp along the sequence under sequence parallelism; selective
recomputation drops the attention core); the schedule term is Megatron-LM's (Narayanan et al.
2021): a rank holds the activations of the microbatches its schedule has forwarded but not yet
backpropagated, taken here from the code's own schedule (`PlanLayout.schedule_actions`).

Notation, one microbatch of b sequences of s tokens: N = b*s tokens; T = N / tp tokens of the
residual stream on this rank under sequence parallelism (N without); heads and widths inside
attention and the MLPs are split by tp; a MoE layer's experts receive T*K token copies in all
(balanced routing, K = num_experts_per_tok, the same with or without expert parallelism).

Dtypes (`_Dtypes`): "32-true" saves fp32 everywhere; "bf16-true" saves bf16 activations but
RMSNorm keeps an fp32 copy of its input (it computes in fp32); the autocast-style modes
("bf16-mixed", "16-mixed", the fp8/fp4 emulations and, approximated alike, "transformer-engine")
keep an fp32 residual stream and fp32 norm outputs, and every low-precision GEMM saves its OWN
low-precision copy of its input and of its weight (autocast casts per call; the cached weight
cast lives as long as the microbatch's graph), which we count under "weight_copies".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nanotrain.parallel.tensor import pad_vocab_size
from nanotrain.planning.layout import PlanLayout, Workload

__all__ = ["ActivationEstimate", "activation_estimate", "layer_activation_bytes"]

_I64, _F32 = 8, 4


@dataclass(frozen=True)
class ActivationEstimate:
    """Saved-for-backward activation bytes of one pipeline rank.

    Attributes:
        per_microbatch_chunk: bytes one microbatch saves through each local chunk of the rank
            (its layers, plus the embedding on virtual stage 0 and the head, loss and MTP on
            the last virtual stage).
        in_flight: most (microbatch, chunk) forwards alive at once (`PlanLayout.in_flight`).
        saved_peak: most bytes of saved activations alive at once over the schedule
            (forwards add a chunk's bytes, backwards free them, in the schedule's own order).
        transient: bytes that recomputation rebuilds during one layer's backward on top of
            `saved_peak` (0 without recomputation).
        peak: saved_peak + transient, the activation term of the rank's memory peak.
        detail: bytes per part for ONE microbatch through all local chunks ("norms",
            "attention", "mlp", "moe", "recompute_inputs", "weight_copies", "rope",
            "embedding", "logits", "mtp").
    """

    per_microbatch_chunk: list[int]
    in_flight: int
    peak: int
    detail: dict[str, int]
    saved_peak: int = 0
    transient: int = 0
    chunks: list[list[int]] = field(default_factory=list)

    @property
    def per_microbatch(self) -> int:
        """Bytes one microbatch saves through all local chunks."""
        return sum(self.per_microbatch_chunk)


@dataclass(frozen=True)
class _Dtypes:
    """Bytes per element of what a precision mode saves.

    stream: the residual stream and embedding output; gemm: GEMM outputs and what is computed
    from them inside a block; param: parameters; cast_copies: each low-precision GEMM saves its
    own low-precision copy of its input (when that input is wider) and of its weight.
    """

    stream: int
    gemm: int
    param: int
    cast_copies: bool

    @property
    def norm_out(self) -> int:
        """RMSNorm output: weight (param dtype) times the normalized input cast back."""
        return max(self.param, self.stream)

    def with_stream(self, stream: int) -> _Dtypes:
        return _Dtypes(stream, self.gemm, self.param, self.cast_copies)


def _dtypes(precision: str) -> _Dtypes:
    if precision == "32-true":
        return _Dtypes(4, 4, 4, False)
    if precision == "bf16-true":
        return _Dtypes(2, 2, 2, False)
    return _Dtypes(4, 2, 4, True)  # autocast (bf16/fp16) and the emulations built on it


@dataclass(frozen=True)
class _Dims:
    """One microbatch on one rank: b sequences of s tokens, tp ranks, sequence parallel or not,
    and which SDPA kernel runs ("fused": flash / memory-efficient; "math": CPU fallback)."""

    b: int
    s: int
    tp: int
    sp: bool
    kernel_for_unequal_dims: str  # "fused" (cuda) or "math" (CPU, qk head dim != v head dim)

    @property
    def n(self) -> int:
        """Tokens of the whole microbatch (what the tp region sees)."""
        return self.b * self.s

    @property
    def t(self) -> int:
        """Tokens of the residual stream on this rank."""
        return self.n // self.tp if self.sp and self.tp > 1 else self.n


class _Ledger(dict):
    """part -> bytes, with `add`."""

    def add(self, part: str, nbytes: int) -> None:
        self[part] = self.get(part, 0) + int(nbytes)


def _norm(led: _Ledger, tokens: int, width: int, in_bytes: int, stored_width: int) -> None:
    """RMSNorm: pow saves the fp32 input (the input's own storage when fp32, which may be wider:
    `stored_width`, else an fp32 copy), rsqrt saves [tokens, 1] fp32 and the weight product
    saves the normalized input cast back to the input dtype."""
    x32 = tokens * (stored_width if in_bytes == _F32 else width) * _F32
    led.add("norms", x32 + tokens * _F32 + tokens * width * in_bytes)


def _gemm_inputs(led: _Ledger, part: str, dt: _Dtypes, copies: int, elems: int, shared: int):
    """Inputs saved by `copies` linears reading one activation of `elems` elements stored in
    `shared` bytes each: one storage, or one low-precision copy per linear under autocast."""
    if dt.cast_copies and shared > dt.gemm:
        led.add(part, copies * elems * dt.gemm)
    else:
        led.add(part, elems * shared)


def _swiglu(led: _Ledger, part: str, dt: _Dtypes, rows: int, hidden: int, inter: int) -> None:
    """SwiGLU internals: silu saves gate's output, the product saves silu(g) and up's output,
    down saves the product: 4 [rows, inter] tensors (the input is counted by the caller)."""
    led.add(part, 4 * rows * inter * dt.gemm)
    if dt.cast_copies:
        led.add("weight_copies", 3 * hidden * inter * dt.gemm)


def _dense_attention(led: _Ledger, c: Any, d: _Dims, dt: _Dtypes) -> None:
    n, tp, g = d.n, d.tp, dt.gemm
    hq, hkv = c.num_heads // tp * c.head_dim, c.num_kv_heads // tp * c.head_dim
    h = c.hidden_size
    _gemm_inputs(led, "attention", dt, 3, n * h, dt.norm_out)  # q/k/v read one entered x
    _rope_copies(led, d, c.head_dim, g, calls=2)
    # flash SDPA saves q and k after rope, v (kv heads, not expanded for GQA), out (o_proj reads
    # it as a view) and the fp32 log-sum-exp
    led.add("attention", n * (2 * hq + 2 * hkv) * g + d.b * c.num_heads // tp * d.s * _F32)
    if dt.cast_copies:
        led.add("weight_copies", ((hq + 2 * hkv) * h + hq * h) * g)


def _rope_copies(led: _Ledger, d: _Dims, rope_dim: int, g: int, calls: int) -> None:
    """apply_rope saves cos and sin cast to the activation dtype: a new copy per call unless
    that dtype is fp32 (then the chunk's own tables, counted once per chunk)."""
    if g != _F32:
        led.add("rope", calls * 2 * d.s * (rope_dim // 2) * g)


def _mla_attention(led: _Ledger, c: Any, d: _Dims, dt: _Dtypes) -> None:
    n, t, tp, g = d.n, d.t, d.tp, dt.gemm
    h, heads = c.hidden_size, c.num_heads // tp
    wq, wkv, r = c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim
    nope, dv, dqk = c.qk_nope_head_dim, c.v_head_dim, c.qk_head_dim
    # replicated down-projections read this rank's T tokens of the norm output; without
    # q_lora_rank, q_proj reads the hidden state entered (all-gathered under sp) itself
    _gemm_inputs(led, "attention", dt, 2, t * h, dt.norm_out)
    if wq is None and dt.cast_copies:
        led.add("attention", (n - t) * h * g)  # its copy is of all N tokens, not T
    elif wq is None and d.sp:
        led.add("attention", n * h * dt.norm_out)
    _norm(led, t, wkv, g, stored_width=wkv + r)  # kv_a_layernorm on a view of [c_KV | k^R]
    weights = h * (wkv + r)
    if wq is not None:
        _norm(led, t, wq, g, stored_width=wq)
        weights += h * wq
    # the latents [RMSNorm(c_Q) | RMSNorm(c_KV) | k^R], all-gathered under sp, feed q_b / kv_b
    latent_bytes = max(dt.param, g)
    width = (wq or 0) + wkv + r
    if dt.cast_copies:
        led.add("attention", n * ((wq or 0) + wkv) * g)
    else:
        led.add("attention", n * width * latent_bytes)
    if wq is None:
        weights += h * heads * dqk
    else:
        weights += wq * heads * dqk
    weights += wkv * heads * (nope + dv) + heads * dv * h
    _rope_copies(led, d, r, g, calls=2)
    kernel = "fused" if dqk == dv else d.kernel_for_unequal_dims
    if kernel == "fused":
        # q and k are fresh cats; v is a view of kv_b's output [N, heads*(nope+dv)]; o_proj
        # reads the output as a view; plus the fp32 log-sum-exp
        led.add("attention", n * heads * (2 * dqk + nope + 2 * dv) * g)
        led.add("attention", d.b * heads * d.s * _F32)
    else:
        # CPU math kernel (head dims differ): fp32 scaled q, k, the [s, s] probabilities and
        # a contiguous v; o_proj saves a contiguous copy of the output
        led.add("attention", n * heads * (2 * dqk + dv) * _F32 + d.b * heads * d.s * d.s * _F32)
        led.add("attention", n * heads * dv * g)
    if dt.cast_copies:
        led.add("weight_copies", weights * g)


def _dense_mlp(led: _Ledger, c: Any, d: _Dims, dt: _Dtypes, inter: int, part: str) -> None:
    _gemm_inputs(led, part, dt, 2, d.n * c.hidden_size, dt.norm_out)  # gate/up, entered x
    _swiglu(led, part, dt, d.n, c.hidden_size, inter // d.tp)


def _moe(led: _Ledger, c: Any, d: _Dims, dt: _Dtypes, ep: int, training: bool) -> None:
    t, h, g = d.t, c.hidden_size, dt.gemm
    e, k = c.n_routed_experts, c.num_experts_per_tok
    copies = t * k
    # router (kept in fp32): its input h.float() (the norm output itself when fp32), the
    # sigmoid / softmax scores, the top-k indices, and the normalized weights with their sum
    led.add("moe", t * h * _F32 + t * e * _F32 + t * k * _I64)
    if dt.param != _F32:
        led.add("weight_copies", e * h * _F32)  # weight.float() of a bf16 router
    if c.norm_topk_prob:
        led.add("moe", t * k * _F32 + t * _F32)
    if training and c.aux_loss_alpha > 0:
        led.add("moe", t * _F32 + 2 * d.b * e * _F32)  # balance loss: score sums, [B, E] stats
    # dispatch: token_index; the sorted copies (fp32 under autocast, which casts them again);
    # under ep the received copies replace them and the regroup permutations are saved
    led.add("moe", copies * _I64 * (1 if ep == 1 else 3))
    # the experts' gate and up matmuls read the sorted copies (each casts its own under autocast)
    _gemm_inputs(led, "moe", dt, 2, copies * h, dt.norm_out)
    _swiglu(led, "moe", dt, copies, h, c.moe_intermediate_size)
    if dt.cast_copies:  # _swiglu counted one expert's weights; the rank holds E / ep
        led.add("weight_copies", (e // ep - 1) * 3 * h * c.moe_intermediate_size * g)
    # combine: slot, the gate weights per copy, the expert outputs and the weighted outputs
    led.add("moe", copies * _I64 + copies * g + 2 * copies * h * g)
    if c.n_shared_experts > 0:
        shared = c.n_shared_experts * c.moe_intermediate_size
        # the router's fp32 input is the same storage only without sp, casts or bf16 norms
        if d.sp or dt.cast_copies or dt.norm_out != _F32:
            _gemm_inputs(led, "moe", dt, 2, d.n * h, dt.norm_out)
        _swiglu(led, "moe", dt, d.n, h, shared // d.tp)


def _layer(
    c: Any, moe: bool, d: _Dims, dt: _Dtypes, ep: int, recompute: str | None
) -> tuple[_Ledger, int]:
    """(bytes per part of one decoder layer, bytes recomputed transiently in its backward)."""
    full = _Ledger()
    t, h = d.t, c.hidden_size
    _norm(full, t, h, dt.stream, h)
    attn = _Ledger()
    if hasattr(c, "kv_lora_rank"):
        _mla_attention(attn, c, d, dt)
    else:
        _dense_attention(attn, c, d, dt)
    _norm(full, t, h, dt.stream, h)
    if moe:
        _moe(full, c, d, dt, ep, training=True)
    else:
        _dense_mlp(full, c, d, dt, c.intermediate_size, "mlp")
    if recompute == "full":  # checkpoint keeps the layer input; backward rebuilds the rest
        rebuilt = sum(full.values()) + sum(attn.values())
        kept = _Ledger(recompute_inputs=t * h * dt.stream)
        return kept, rebuilt
    if recompute == "selective":  # checkpoint keeps the attention input (the norm output)
        full.add("recompute_inputs", t * h * dt.norm_out)
        return full, sum(attn.values())
    for part, nbytes in attn.items():
        full.add(part, nbytes)
    return full, 0


def _head(led: _Ledger, c: Any, d: _Dims, dt: _Dtypes, part: str) -> None:
    """Final norm, LM head and the loss of one output (the main head or one MTP depth)."""
    n, h = d.n, c.hidden_size
    _norm(led, d.t, h, dt.stream, h)
    led.add(part, n * h * dt.norm_out)  # lm_head (kept high) reads the (gathered) norm output
    if d.tp == 1:  # F.cross_entropy: fp32 log-probs, targets, total weight
        led.add(part, n * c.vocab_size * _F32 + n * _I64 + _F32)
    else:  # vocab-parallel: fp32 softmax shard, local targets, two bool masks
        led.add(part, n * pad_vocab_size(c.vocab_size, d.tp) // d.tp * _F32 + n * (_I64 + 2))
    led.add(part, _I64)  # the token count's clamp


def _embedding(led: _Ledger, d: _Dims, part: str) -> None:
    led.add(part, d.n * _I64 + (d.n if d.tp > 1 else 0))  # ids (masked) and the bool mask


def _mtp(led: _Ledger, c: Any, d: _Dims, dt: _Dtypes, ep: int, recompute: str | None) -> int:
    """One MTP depth: embedding of the shifted ids, enorm / hnorm, eh_proj, a decoder layer,
    its norm, head and loss. Returns the bytes recomputed transiently in its block's backward."""
    t, h = d.t, c.hidden_size
    sub = _Ledger()
    _embedding(sub, d, "mtp")
    _norm(sub, t, h, dt.param, h)  # enorm of the embedding (param dtype)
    # hnorm reads h, already saved by the head's final norm when fp32
    sub.add("norms", t * _F32 + t * h * dt.stream + (t * h * _F32 if dt.stream != _F32 else 0))
    _gemm_inputs(sub, "mtp", dt, 1, t * 2 * h, dt.norm_out)  # eh_proj reads [enorm | hnorm]
    if dt.cast_copies:
        sub.add("weight_copies", 2 * h * h * dt.gemm)
    block_dt = dt.with_stream(dt.gemm if dt.cast_copies else dt.stream)  # eh_proj's output
    moe = c.first_k_dense_replace < c.num_layers
    block, rebuilt = _layer(c, moe, d, block_dt, ep, recompute)
    for part, nbytes in block.items():
        sub.add(part, nbytes)
    if recompute is not None or dt.gemm == _F32:
        sub.add("rope", 2 * d.s * (c.qk_rope_head_dim // 2) * _F32)  # tables made again
    _head(sub, c, d, block_dt, "mtp")
    for part, nbytes in sub.items():
        led.add(part, nbytes)
    return rebuilt


def layer_activation_bytes(
    config: Any,
    layer_idx: int,
    layout: PlanLayout,
    workload: Workload,
    device: str = "cuda",
) -> dict[str, int]:
    """Bytes per part that one microbatch saves through decoder layer `layer_idx`."""
    d = _dims(layout, workload, device)
    moe = bool(getattr(config, "is_moe_layer", lambda i: False)(layer_idx))
    led, _ = _layer(config, moe, d, _dtypes(workload.precision), layout.ep, layout.recompute)
    return dict(led)


def _dims(layout: PlanLayout, workload: Workload, device: str) -> _Dims:
    sp = layout.sequence_parallel and layout.tp > 1
    if sp and workload.seq_len % layout.tp:
        raise ValueError(
            f"sequence parallelism splits seq_len={workload.seq_len} over tp={layout.tp}; "
            "use a seq_len that is a multiple of tp or turn sequence_parallel off"
        )
    kernel = "math" if device == "cpu" else "fused"
    return _Dims(workload.micro_batch_size, workload.seq_len, layout.tp, sp, kernel)


_CACHE: dict[tuple, tuple[_Ledger, int]] = {}


def _chunk(
    config: Any,
    layers: tuple[int, ...],
    first: bool,
    last: bool,
    d: _Dims,
    precision: str,
    ep: int,
    recompute: str | None,
) -> tuple[_Ledger, int]:
    """(bytes per part of one microbatch through one chunk, its largest transient)."""
    key = (repr(config), layers, first, last, d, precision, ep, recompute)
    if key in _CACHE:
        return _CACHE[key]
    dt = _dtypes(precision)
    led, transient = _Ledger(), 0
    rope_dim = getattr(config, "qk_rope_head_dim", None) or getattr(config, "head_dim", 0)
    if first:
        _embedding(led, d, "embedding")
    per_kind: dict[bool, tuple[_Ledger, int]] = {}
    for i in layers:
        moe = bool(getattr(config, "is_moe_layer", lambda _: False)(i))
        if moe not in per_kind:
            per_kind[moe] = _layer(config, moe, d, dt, ep, recompute)
        part_bytes, rebuilt = per_kind[moe]
        for part, nbytes in part_bytes.items():
            led.add(part, nbytes)
        transient = max(transient, rebuilt)
    if layers and (recompute is not None or dt.gemm == _F32):
        led.add("rope", 2 * d.s * (rope_dim // 2) * _F32)  # the chunk's cos / sin tables
    if last:
        _head(led, config, d, dt, "logits")
        for _ in range(getattr(config, "mtp_depth", 0)):
            transient = max(transient, _mtp(led, config, d, dt, ep, recompute))
    if len(_CACHE) > 4096:
        _CACHE.clear()
    _CACHE[key] = (led, transient)
    return led, transient


def activation_estimate(
    config: Any,
    layout: PlanLayout,
    workload: Workload,
    pp_rank: int = 0,
    *,
    device: str = "cuda",
) -> ActivationEstimate:
    """Activation bytes of pipeline rank `pp_rank` of `layout` training `workload`.

    Args:
        config: a DenseConfig or DeepSeekConfig.
        layout, workload: the plan (see `PlanLayout`, `Workload`).
        pp_rank: the pipeline rank (every tp / dp / ep rank of a stage saves the same).
        device: "cuda" (flash / memory-efficient attention saves q, k, v, out and the
            log-sum-exp) or "cpu" (torch's math kernel for MLA, whose q/k and v head dims
            differ, saves the fp32 [s, s] probabilities).

    Raises:
        ValueError: for a pp_rank outside the layout, or a sequence that sequence
            parallelism cannot split.
    """
    if not 0 <= pp_rank < layout.pp:
        raise ValueError(f"pp_rank={pp_rank} is outside [0, {layout.pp}) for {layout.describe()}")
    d = _dims(layout, workload, device)
    if layout.pp > 1:
        chunks = layout.stage_chunks(config, pp_rank)
    else:
        chunks = [list(range(config.num_layers))]
    num_virtual = layout.pp * len(chunks)
    per_chunk, detail, transient = [], _Ledger(), 0
    for c, layers in enumerate(chunks):
        virtual = c * layout.pp + pp_rank
        led, rebuilt = _chunk(
            config,
            tuple(layers),
            virtual == 0,
            virtual == num_virtual - 1,
            d,
            workload.precision,
            layout.ep,
            layout.recompute,
        )
        per_chunk.append(sum(led.values()))
        for part, nbytes in led.items():
            detail.add(part, nbytes)
        transient = max(transient, rebuilt)
    num_microbatches = workload.num_microbatches(layout)
    saved_peak = _schedule_peak(layout, num_microbatches, pp_rank, per_chunk)
    return ActivationEstimate(
        per_microbatch_chunk=per_chunk,
        in_flight=layout.in_flight(num_microbatches, pp_rank),
        peak=saved_peak + transient,
        detail=dict(detail),
        saved_peak=saved_peak,
        transient=transient,
        chunks=[list(c) for c in chunks],
    )


def _schedule_peak(
    layout: PlanLayout, num_microbatches: int, pp_rank: int, per_chunk: list[int]
) -> int:
    """Most saved bytes alive at once: walk the schedule's forwards (add that chunk's bytes)
    and backwards (free them). Without a pipeline, gradient accumulation frees each
    microbatch before the next: one microbatch through the whole model."""
    if layout.pp == 1:
        return sum(per_chunk)
    live = peak = 0
    for action in layout.schedule_actions(num_microbatches, pp_rank):
        live += per_chunk[action.chunk] * (1 if action.kind == "F" else -1)
        peak = max(peak, live)
    return peak
