"""Per-layer activation formulas: the bytes one microbatch saves for backward through each
part of the model (a decoder layer with dense or MLA attention and a dense or MoE MLP, the
embedding, the head and loss, an MTP depth). `nanotrain.planning.activations` adds them up per
pipeline chunk and walks the schedule.

The counts follow what OUR forward code saves (read from `models/attention.py`, `layers.py`,
`moe.py`, `deepseek.py`, `transformer.py`, `parallel/cross_entropy.py` and checked against
`torch.autograd.graph.saved_tensors_hooks` on CPU runs, see tests/unit/test_plan_activations.py),
not a textbook number. The per-layer structure is that of Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models", section 4: tensors inside the tp matmuls
split by tp, the others split by tp along the sequence under sequence parallelism; selective
recomputation drops the attention core). Recompute "light" (`nanotrain.models.recompute`)
drops what its saved-tensor hooks rebuild: the norms' outputs and their casts, MLA's q, k, v
and the SwiGLU activations.

Notation, one microbatch of b sequences of s tokens: N = b*s tokens; T = N / tp tokens of the
residual stream on this rank under sequence parallelism (N without); heads and widths inside
attention and the MLPs are split by tp; a MoE layer's experts receive T*K token copies in all
(balanced routing, K = num_experts_per_tok, the same with or without expert parallelism).

Dtypes (`Dtypes`): "32-true" saves fp32 everywhere; "bf16-true" saves bf16 activations but
RMSNorm keeps an fp32 copy of its input (it computes in fp32); the autocast-style modes
("bf16-mixed", "16-mixed", the fp8/fp4 emulations and, approximated alike, "transformer-engine")
keep an fp32 residual stream and fp32 norm outputs, and every low-precision GEMM saves its OWN
low-precision copy of its input and of its weight, which we count under "weight_copies". Under
plain autocast ("bf16-mixed", "16-mixed") the weight casts are made once per training step and
shared by its microbatches (`nanotrain.models.cast_cache`; `Dtypes.copies_per_step`); the
emulations quantize their weights per call.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from nanotrain.models.fp8_saves import fp8_saved_bytes
from nanotrain.models.moe import expert_capacity
from nanotrain.parallel.tensor import pad_vocab_size

__all__ = [
    "F32",
    "I64",
    "Dims",
    "Dtypes",
    "Ledger",
    "decoder_layer",
    "dtypes_for",
    "embedding",
    "head_and_loss",
    "mtp_block",
    "rotates_whole_heads",
    "saves_rope_tables",
]

I64, F32 = 8, 4  # bytes per int64 / fp32 element


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element of what a precision mode saves.

    stream: the residual stream and embedding output; gemm: GEMM outputs and what is computed
    from them inside a block; param: parameters; cast_copies: each low-precision GEMM saves its
    own low-precision copy of its input (when that input is wider) and of its weight;
    copies_per_step: the weight copies are made once per step, not per microbatch;
    fp8_experts: the routed experts keep their rows and SwiGLU inputs (gate and up outputs)
    as e4m3 with one fp32 scale per 1 x 128 tile (`nanotrain.models.fp8_saves`).
    """

    stream: int
    gemm: int
    param: int
    cast_copies: bool
    copies_per_step: bool = False
    fp8_experts: bool = False

    @property
    def norm_out(self) -> int:
        """RMSNorm output: weight (param dtype) times the normalized input cast back."""
        return max(self.param, self.stream)

    def with_stream(self, stream: int) -> Dtypes:
        """The same dtypes with a residual stream of `stream` bytes per element."""
        return replace(self, stream=stream)


def dtypes_for(precision: str, fp8_experts: bool = False) -> Dtypes:
    """The `Dtypes` a Trainer precision name saves (see the module docstring), with the
    routed experts' saves in fp8 when `fp8_experts`."""
    if precision == "32-true":
        return Dtypes(4, 4, 4, False, fp8_experts=fp8_experts)
    if precision == "bf16-true":
        return Dtypes(2, 2, 2, False, fp8_experts=fp8_experts)
    # autocast (bf16/fp16), whose weight casts last the step, and the emulations built on it
    return Dtypes(4, 2, 4, True, precision in ("bf16-mixed", "16-mixed"), fp8_experts)


@dataclass(frozen=True)
class Dims:
    """One microbatch on one rank: b sequences of s tokens, tp ranks, sequence parallel or not,
    and which SDPA kernel runs ("fused": flash / memory-efficient; "math": CPU fallback)."""

    b: int
    s: int
    tp: int
    sp: bool
    kernel_for_unequal_dims: str  # "fused" (cuda) or "math" (CPU, qk head dim != v head dim)
    # under sequence parallelism the gathered block inputs are saved as this rank's shards
    # (`nanotrain.parallel.sp_regather`); not inside a recomputed block
    shards: bool = True

    @property
    def saves_shards(self) -> bool:
        """Whether a gathered block input is saved as this rank's shard."""
        return self.sp and self.shards

    def recomputed(self) -> Dims:
        """The same microbatch inside a recomputed block (gathered inputs saved whole)."""
        return replace(self, shards=False)

    @property
    def n(self) -> int:
        """Tokens of the whole microbatch (what the tp region sees)."""
        return self.b * self.s

    @property
    def t(self) -> int:
        """Tokens of the residual stream on this rank."""
        return self.n // self.tp if self.sp and self.tp > 1 else self.n


class Ledger(dict):
    """part -> bytes, with `add`."""

    def add(self, part: str, nbytes: int) -> None:
        """Add `nbytes` to `part`."""
        self[part] = self.get(part, 0) + int(nbytes)


def _norm(led: Ledger, tokens: int, width: int, in_bytes: int, stored_width: int) -> None:
    """RMSNorm: pow saves the fp32 input (the input's own storage when fp32, which may be wider:
    `stored_width`, else an fp32 copy), rsqrt saves [tokens, 1] fp32 and the weight product
    saves the normalized input cast back to the input dtype."""
    x32 = tokens * (stored_width if in_bytes == F32 else width) * F32
    led.add("norms", x32 + tokens * F32 + tokens * width * in_bytes)


def _gemm_inputs(led: Ledger, part: str, dt: Dtypes, copies: int, elems: int, shared: int):
    """Inputs saved by `copies` linears reading one activation of `elems` elements stored in
    `shared` bytes each: one storage, or one low-precision copy per linear under autocast."""
    if dt.cast_copies and shared > dt.gemm:
        led.add(part, copies * elems * dt.gemm)
    else:
        led.add(part, elems * shared)


def _swiglu(
    led: Ledger,
    part: str,
    dt: Dtypes,
    rows: int,
    hidden: int,
    inter: int,
    light: bool,
    scaled: bool = False,
) -> None:
    """SwiGLU internals: silu saves gate's output, the product saves silu(g) and up's output,
    down saves the product: 4 [rows, inter] tensors, 2 when recompute "light" rebuilds
    silu(g) and the product (the input is counted by the caller). `scaled` (routed experts:
    the product times each row's gate weight): the scale [rows, 1], and the scaled product
    that down saves unless light rebuilds it; with `dt.fp8_experts` their gate and up
    outputs in fp8."""
    tensors = 2 if light else (5 if scaled else 4)
    if scaled and dt.fp8_experts:  # gate and up in fp8, the rest as computed
        led.add(part, 2 * fp8_saved_bytes(rows, inter))
        tensors -= 2
    led.add(part, tensors * rows * inter * dt.gemm + (rows * dt.gemm if scaled else 0))
    if dt.cast_copies:
        led.add("weight_copies", 3 * hidden * inter * dt.gemm)


def _dense_attention(led: Ledger, c: Any, d: Dims, dt: Dtypes, light: bool) -> None:
    n, tp, g = d.n, d.tp, dt.gemm
    hq, hkv = c.num_heads // tp * c.head_dim, c.num_kv_heads // tp * c.head_dim
    h = c.hidden_size
    if light:  # q/k/v's input is the rebuilt norm output (or its shard or casts)
        pass
    elif d.saves_shards:  # q/k/v read one gathered x, saved as this rank's shard
        led.add("attention", d.t * h * dt.norm_out)
    else:
        _gemm_inputs(led, "attention", dt, 3, n * h, dt.norm_out)  # q/k/v read one entered x
    _rope_copies(led, d, c.head_dim, g, calls=2)
    # flash SDPA saves q and k after rope, v (kv heads, not expanded for GQA), out (o_proj reads
    # it as a view) and the fp32 log-sum-exp
    led.add("attention", n * (2 * hq + 2 * hkv) * g + d.b * c.num_heads // tp * d.s * F32)
    if dt.cast_copies:
        led.add("weight_copies", ((hq + 2 * hkv) * h + hq * h) * g)


def _rope_copies(led: Ledger, d: Dims, rope_dim: int, g: int, calls: int) -> None:
    """apply_rope saves cos and sin cast to the activation dtype: a new copy per call unless
    that dtype is fp32 (then the chunk's own tables, counted once per chunk)."""
    if g != F32:
        led.add("rope", calls * 2 * d.s * (rope_dim // 2) * g)


def rotates_whole_heads(c: Any) -> bool:
    """Whether MLA applies RoPE by `rope_tail` over the whole query head (interleaved RoPE and
    an even no-RoPE width), building its rotation table in every layer, rather than by
    `apply_rope` on the chunk's cos / sin tables (models/attention.py)."""
    return bool(c.rope_interleave) and c.qk_nope_head_dim % 2 == 0


def saves_rope_tables(c: Any, dt: Dtypes, recompute: str | None) -> bool:
    """Whether one microbatch keeps its chunk's cos / sin tables: every checkpoint takes them
    as inputs, and fp32 `apply_rope` saves views of them; MLA's whole-head rotation saves a
    table of its own per layer instead (`_mla_rope`). Recompute "light" checkpoints MLA's
    up-projections with RoPE, not dense attention's."""
    mla = hasattr(c, "kv_lora_rank")
    if recompute in ("full", "selective") or (recompute == "light" and mla):
        return True
    return dt.gemm == F32 and not (mla and rotates_whole_heads(c))


def _mla_rope(led: Ledger, c: Any, d: Dims, g: int) -> None:
    """What MLA's RoPE saves in one layer (sequence s: attention runs on whole sequences)."""
    r = c.qk_rope_head_dim
    if not rotates_whole_heads(c):
        _rope_copies(led, d, r, g, calls=2)
    elif g == F32:
        # the complex multiply saves the layer's table [s, 1, qk_head_dim / 2, 2] (the key's
        # factors are a slice of it)
        led.add("rope", d.s * c.qk_head_dim * F32)
    else:
        # without complex numbers: cos and sin factors [s, 1, width] per call, query then key
        led.add("rope", 2 * d.s * (c.qk_head_dim + r) * g)


def _mla_attention(led: Ledger, c: Any, d: Dims, dt: Dtypes, light: bool) -> None:
    n, t, tp, g = d.n, d.t, d.tp, dt.gemm
    h, heads = c.hidden_size, c.num_heads // tp
    wq, wkv, r = c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim
    nope, dv, dqk = c.qk_nope_head_dim, c.v_head_dim, c.qk_head_dim
    if light:
        _mla_attention_light(led, c, d, dt)
        return
    # replicated down-projections read this rank's T tokens of the norm output; without
    # q_lora_rank, q_proj reads the hidden state entered (all-gathered under sp) itself
    if wq is None and d.saves_shards:
        # q_proj keeps its gathered x as the shard: the storage kv_a_proj reads, unless that
        # one reads a cast copy
        _gemm_inputs(led, "attention", dt, 1, t * h, dt.norm_out)
        if dt.cast_copies and dt.norm_out > g:
            led.add("attention", t * h * dt.norm_out)
    else:
        _gemm_inputs(led, "attention", dt, 2, t * h, dt.norm_out)
        if wq is None and dt.cast_copies:
            led.add("attention", (n - t) * h * g)  # its copy is of all N tokens, not T
        elif wq is None and d.sp:
            led.add("attention", n * h * dt.norm_out)
    weights = _latent_norms(led, c, d, dt)  # + the down-projections' weights
    # q_b / kv_b read the latents: under tp one entered buffer [RMSNorm(c_Q) | RMSNorm(c_KV) |
    # k^R] (all-gathered under sp) that both save; at tp = 1 the two norm outputs themselves
    # (k^R is then a view of kv_a's output, saved by its norm)
    latent_bytes = max(dt.param, g)
    width = (wq or 0) + wkv + (r if tp > 1 else 0)
    if d.saves_shards:  # the latents saved as this rank's shard [T, width]
        led.add("attention", t * width * latent_bytes)
    elif dt.cast_copies:
        led.add("attention", n * ((wq or 0) + wkv) * g)
    else:
        led.add("attention", n * width * latent_bytes)
    if wq is None:
        weights += h * heads * dqk
    else:
        weights += wq * heads * dqk
    weights += wkv * heads * (nope + dv) + heads * dv * h
    _mla_rope(led, c, d, g)
    kernel = "fused" if dqk == dv else d.kernel_for_unequal_dims
    if kernel == "fused":
        # q and k are fresh cats; v is a view of kv_b's output [N, heads*(nope+dv)]; o_proj
        # reads the output as a view; plus the fp32 log-sum-exp
        led.add("attention", n * heads * (2 * dqk + nope + 2 * dv) * g)
        led.add("attention", d.b * heads * d.s * F32)
    else:
        # CPU math kernel (head dims differ): fp32 q, k, v for its GEMMs and the [s, s]
        # probabilities; o_proj saves a contiguous copy of the output
        led.add("attention", _math_kernel_qkv(c, d, dt, light=False))
        led.add("attention", d.b * heads * d.s * d.s * F32 + n * heads * dv * g)
    if dt.cast_copies:
        led.add("weight_copies", weights * g)


def _math_kernel_qkv(c: Any, d: Dims, dt: Dtypes, light: bool) -> int:
    """What the CPU math attention path (`causal_attention`) saves of q, k and v: fp32 copies
    laid out per head [b*heads, s, d], except where its reshapes are views. That happens with
    fp32 activations (no cast) and one sequence per microbatch (b = 1 merges into the heads
    dim): v is then a view of kv_b's output [s, heads*(nope + dv)], which is saved whole, and
    under recompute "light" q, k and v are all views of the rebuilt tensors (kept as
    recipes)."""
    heads = c.num_heads // d.tp
    dqk, dv = c.qk_head_dim, c.v_head_dim
    if dt.gemm != F32 or d.b > 1:
        return d.n * heads * (2 * dqk + dv) * F32
    if light:
        return 0
    return d.n * heads * (2 * dqk + c.qk_nope_head_dim + dv) * F32


def _latent_norms(led: Ledger, c: Any, d: Dims, dt: Dtypes) -> int:
    """MLA's latent norms (kv_a_layernorm on a view of [c_KV | k^R], q_a_layernorm); returns
    the down-projections' weight elements."""
    t, g, h = d.t, dt.gemm, c.hidden_size
    wq, wkv, r = c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim
    _norm(led, t, wkv, g, stored_width=wkv + r)
    if wq is None:
        return h * (wkv + r)
    _norm(led, t, wq, g, stored_width=wq)
    return h * (wkv + r + wq)


def _mla_attention_light(led: Ledger, c: Any, d: Dims, dt: Dtypes) -> None:
    """MLA under recompute "light": the down-projections' input is the rebuilt norm output;
    the up-projections and RoPE are a checkpoint keeping the latents (and, without
    q_lora_rank, q_proj's output); the attention core's q, k, v are rebuilt."""
    n, t, tp, g = d.n, d.t, d.tp, dt.gemm
    h, heads = c.hidden_size, c.num_heads // tp
    wq, wkv, r = c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim
    dv, dqk = c.v_head_dim, c.qk_head_dim
    # the down-projections and o_proj cast their weights outside the checkpoint
    weights = _latent_norms(led, c, d, dt) + heads * dv * h
    if wq is None:
        weights += h * heads * dqk
        led.add("attention", n * heads * dqk * g)  # q_proj's output enters the checkpoint
    latent_bytes = max(dt.param, g)
    if tp > 1:  # the entered latents buffer, as this rank's shard under sp
        width = (wq or 0) + wkv + r
        led.add("attention", (t if d.saves_shards else n) * width * latent_bytes)
    else:  # the norm outputs, and k^R as a view of kv_a's output (its norm's fp32 input)
        led.add("attention", t * ((wq or 0) + wkv) * latent_bytes)
        if g != F32:
            led.add("attention", t * (wkv + r) * g)
    kernel = "fused" if dqk == dv else d.kernel_for_unequal_dims
    if kernel == "fused":  # the output (o_proj reads it as a view) and the log-sum-exp
        led.add("attention", n * heads * dv * g + d.b * heads * d.s * F32)
    else:  # the math kernel's q, k, v, probabilities and output, as without recomputation
        led.add("attention", _math_kernel_qkv(c, d, dt, light=True))
        led.add("attention", d.b * heads * d.s * d.s * F32 + n * heads * dv * g)
    if dt.cast_copies:
        led.add("weight_copies", weights * g)


def _dense_mlp(
    led: Ledger, c: Any, d: Dims, dt: Dtypes, inter: int, part: str, light: bool
) -> None:
    if light:  # gate/up's input is the rebuilt norm output (or its shard or casts)
        pass
    elif d.saves_shards:  # gate/up read one gathered x, saved as this rank's shard
        led.add(part, d.t * c.hidden_size * dt.norm_out)
    else:
        _gemm_inputs(led, part, dt, 2, d.n * c.hidden_size, dt.norm_out)  # gate/up, entered x
    _swiglu(led, part, dt, d.n, c.hidden_size, inter // d.tp, light)


def _moe(led: Ledger, c: Any, d: Dims, dt: Dtypes, ep: int, training: bool, light: bool) -> None:
    t, h, g = d.t, c.hidden_size, dt.gemm
    e, k = c.n_routed_experts, c.num_experts_per_tok
    copies = t * k
    # router (kept in fp32): its input h.float() (the norm output itself when fp32; rebuilt
    # under recompute "light"), the sigmoid / softmax scores, the top-k indices, and the
    # normalized weights with their sum
    led.add("moe", (0 if light else t * h * F32) + t * e * F32 + t * k * I64)
    if dt.param != F32:
        led.add("weight_copies", e * h * F32)  # weight.float() of a bf16 router
    if c.norm_topk_prob:
        led.add("moe", t * k * F32 + t * F32)
    if training and c.aux_loss_alpha > 0:
        led.add("moe", t * F32 + 2 * d.b * e * F32)  # balance loss: score sums, [B, E] stats
    rows = _expert_rows(c, d)
    if getattr(c, "capacity_factor", None) is None:
        # dispatch: token_index; the sorted copies (fp32 under autocast, which casts them
        # again); under ep the received copies replace them and the regroup permutations
        # are saved
        led.add("moe", copies * I64 * (1 if ep == 1 else 3))
        # the grouped GEMM's int32 end offset per local expert (the path unequal groups take
        # on CUDA, and on a CPU where torch runs it)
        led.add("moe", e // ep * 4)
    else:
        led.add("moe", (rows + 1) * I64)  # dispatch: each slot's source token (or none)
    # the experts' gate and up GEMMs read their rows; under autocast the layer casts them once
    # for both (`GroupedExperts` casts its input as autocast would; the fp8/fp4 emulations'
    # per-expert loop casts per matmul instead, one copy more, approximated alike)
    if dt.fp8_experts:
        led.add("moe", fp8_saved_bytes(rows, h))
    else:
        _gemm_inputs(led, "moe", dt, 1, rows * h, dt.norm_out)
    _swiglu(led, "moe", dt, rows, h, c.moe_intermediate_size, light, scaled=True)
    if dt.cast_copies:  # _swiglu counted one expert's weights; the rank holds E / ep
        led.add("weight_copies", (e // ep - 1) * 3 * h * c.moe_intermediate_size * g)
    # the combine sums outputs the experts weighed: it keeps the copies' token index (with a
    # capacity, each choice's slot: under sequence parallelism for every token of the
    # gathered sequences, d.n, not this rank's d.t)
    led.add("moe", (copies if getattr(c, "capacity_factor", None) is None else d.n * k) * I64)
    if c.n_shared_experts > 0:
        shared = c.n_shared_experts * c.moe_intermediate_size
        # gate/up's input: under sp saved as the shard, the router's fp32 input itself unless
        # the norm output is bf16; else the same storage only without casts or bf16 norms
        if light:  # the rebuilt norm output (or its shard or casts)
            pass
        elif d.saves_shards:
            if dt.norm_out != F32:
                led.add("moe", d.t * h * dt.norm_out)
        elif d.sp or dt.cast_copies or dt.norm_out != F32:
            _gemm_inputs(led, "moe", dt, 2, d.n * h, dt.norm_out)
        _swiglu(led, "moe", dt, d.n, h, shared // d.tp, light)


def _capacity_slots(c: Any, d: Dims) -> int:
    """Expert slots of one microbatch with a capacity factor: E x B x C, C per whole sequence
    of S tokens (`expert_capacity`), filled or not; under sequence parallelism every tp rank
    runs them all (the layer gathers the sequences)."""
    return c.n_routed_experts * d.b * expert_capacity(c, d.s)


def decoder_layer(
    c: Any, moe: bool, d: Dims, dt: Dtypes, ep: int, recompute: str | None
) -> tuple[Ledger, int]:
    """(bytes per part of one decoder layer, bytes recomputed transiently in its backward)."""
    full = Ledger()
    t, h = d.t, c.hidden_size
    light = recompute == "light"
    if recompute == "full":  # a checkpointed layer keeps nothing in fp8 (`Fp8Saves`)
        dt = replace(dt, fp8_experts=False)
    # a recomputed block saves its gathered inputs whole, for the backward right after
    d_attn = d.recomputed() if recompute in ("full", "selective") else d
    d_mlp = d.recomputed() if recompute == "full" else d
    _layer_norm(full, t, h, dt, light)
    attn = Ledger()
    if hasattr(c, "kv_lora_rank"):
        _mla_attention(attn, c, d_attn, dt, light)
    else:
        _dense_attention(attn, c, d_attn, dt, light)
    _layer_norm(full, t, h, dt, light)
    if moe:
        _moe(full, c, d_mlp, dt, ep, training=True, light=light)
    else:
        _dense_mlp(full, c, d_mlp, dt, c.intermediate_size, "mlp", light)
    if recompute == "full":  # checkpoint keeps the layer input; backward rebuilds the rest
        rebuilt = sum(full.values()) + sum(attn.values())
        kept = Ledger(recompute_inputs=t * h * dt.stream)
        return kept, rebuilt
    if recompute == "selective":  # checkpoint keeps the attention input (the norm output)
        full.add("recompute_inputs", t * h * dt.norm_out)
        return full, max(sum(attn.values()), _fp8_unpacked(c, moe, d, dt))
    for part, nbytes in attn.items():
        full.add(part, nbytes)
    return full, _light_transient(c, moe, d, dt) if light else _fp8_unpacked(c, moe, d, dt)


def _layer_norm(led: Ledger, t: int, h: int, dt: Dtypes, light: bool) -> None:
    """A decoder layer's RMSNorm: under recompute "light" a checkpoint keeping its input."""
    if light:
        led.add("norms", t * h * dt.stream)
    else:
        _norm(led, t, h, dt.stream, h)


def _light_transient(c: Any, moe: bool, d: Dims, dt: Dtypes) -> int:
    """The largest set of tensors recompute "light" rebuilds at once in a layer's backward:
    MLA's q, k and [k^C | v] for the attention core, or one SwiGLU's silu(gate) and product
    (and, for the routed experts, the product scaled by the gate weights)."""
    g, tp = dt.gemm, d.tp
    rebuilt = 0
    if hasattr(c, "kv_lora_rank"):
        heads = c.num_heads // tp
        rebuilt = d.n * heads * (2 * c.qk_head_dim + c.qk_nope_head_dim + c.v_head_dim) * g
    if moe:
        rows = _expert_rows(c, d)
        inter, tensors = c.moe_intermediate_size, 3
    else:
        rows, inter, tensors = d.n, c.intermediate_size // tp, 2
    return max(rebuilt, tensors * rows * inter * g + _fp8_unpacked(c, moe, d, dt))


def _expert_rows(c: Any, d: Dims) -> int:
    """Rows the routed experts compute on per microbatch: token copies, or capacity slots."""
    return d.t * c.num_experts_per_tok if c.capacity_factor is None else _capacity_slots(c, d)


def _fp8_unpacked(c: Any, moe: bool, d: Dims, dt: Dtypes) -> int:
    """What the routed experts' backward unpacks from fp8 at once (the batched path reads
    them together): their rows and the gate and up outputs in the GEMMs' dtype."""
    if not (moe and dt.fp8_experts):
        return 0
    return _expert_rows(c, d) * (c.hidden_size + 2 * c.moe_intermediate_size) * dt.gemm


def head_and_loss(
    led: Ledger, c: Any, d: Dims, dt: Dtypes, part: str, recompute: str | None = None
) -> int:
    """Final norm, LM head and the loss of one output (the main head or one MTP depth).
    Returns the bytes recomputed transiently in its backward (recompute "full" keeps only the
    head's input and the labels, `CausalLM.norm_head_loss`)."""
    if recompute != "full":
        _head_and_loss(led, c, d, dt, part)
        return 0
    rebuilt = Ledger()
    _head_and_loss(rebuilt, c, d.recomputed(), dt, part)
    led.add("recompute_inputs", d.t * c.hidden_size * dt.stream + d.n * I64)
    return sum(rebuilt.values())


def _head_and_loss(led: Ledger, c: Any, d: Dims, dt: Dtypes, part: str) -> None:
    n, h = d.n, c.hidden_size
    _norm(led, d.t, h, dt.stream, h)
    # lm_head (kept high) reads the norm output, gathered and kept as its shard under sp
    led.add(part, (d.t if d.saves_shards else n) * h * dt.norm_out)
    if d.tp == 1:  # F.cross_entropy: fp32 log-probs, targets, total weight
        led.add(part, n * c.vocab_size * F32 + n * I64 + F32)
    else:  # vocab-parallel: fp32 softmax shard, local targets, two bool masks
        led.add(part, n * pad_vocab_size(c.vocab_size, d.tp) // d.tp * F32 + n * (I64 + 2))
    led.add(part, I64)  # the token count's clamp


def embedding(led: Ledger, d: Dims, part: str) -> None:
    """The (vocab-parallel) embedding: its ids and, under tp, the out-of-shard mask."""
    led.add(part, d.n * I64 + (d.n if d.tp > 1 else 0))  # ids (masked) and the bool mask


def mtp_block(led: Ledger, c: Any, d: Dims, dt: Dtypes, ep: int, recompute: str | None) -> int:
    """One MTP depth: embedding of the shifted ids, enorm / hnorm, eh_proj, a decoder layer,
    its norm, head and loss. Returns the most bytes recomputed transiently in the backward of
    its block or of its head."""
    t, h = d.t, c.hidden_size
    sub = Ledger()
    embedding(sub, d, "mtp")
    _norm(sub, t, h, dt.param, h)  # enorm of the embedding (param dtype)
    # hnorm reads h, already saved by the head's final norm when fp32
    sub.add("norms", t * F32 + t * h * dt.stream + (t * h * F32 if dt.stream != F32 else 0))
    _gemm_inputs(sub, "mtp", dt, 1, t * 2 * h, dt.norm_out)  # eh_proj reads [enorm | hnorm]
    if dt.cast_copies:
        sub.add("weight_copies", 2 * h * h * dt.gemm)
    block_dt = dt.with_stream(dt.gemm if dt.cast_copies else dt.stream)  # eh_proj's output
    moe = c.first_k_dense_replace < c.num_layers
    block, rebuilt = decoder_layer(c, moe, d, block_dt, ep, recompute)
    for part, nbytes in block.items():
        sub.add(part, nbytes)
    if saves_rope_tables(c, dt, recompute):
        sub.add("rope", 2 * d.s * (c.qk_rope_head_dim // 2) * F32)  # tables made again
    rebuilt = max(rebuilt, head_and_loss(sub, c, d, block_dt, "mtp", recompute))
    for part, nbytes in sub.items():
        led.add(part, nbytes)
    return rebuilt
