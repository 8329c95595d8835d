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

The bytes per element each precision saves, the microbatch's dimensions and the ledger are in
`nanotrain.planning.activation_parts`; the attention formulas in
`nanotrain.planning.activation_attention`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from nanotrain.models.fp8_saves import fp8_saved_bytes
from nanotrain.models.moe import expert_capacity
from nanotrain.parallel.tensor import pad_vocab_size
from nanotrain.planning.activation_attention import (
    dense_attention,
    mla_attention,
    rotates_whole_heads,
    saves_rope_tables,
)
from nanotrain.planning.activation_parts import (
    F32,
    I64,
    Dims,
    Dtypes,
    Ledger,
    dtypes_for,
    gemm_inputs,
    norm,
)

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


def _dense_mlp(
    led: Ledger, c: Any, d: Dims, dt: Dtypes, inter: int, part: str, light: bool
) -> None:
    if light:  # gate/up's input is the rebuilt norm output (or its shard or casts)
        pass
    elif d.saves_shards:  # gate/up read one gathered x, saved as this rank's shard
        led.add(part, d.t * c.hidden_size * dt.norm_out)
    else:
        gemm_inputs(led, part, dt, 2, d.n * c.hidden_size, dt.norm_out)  # gate/up, entered x
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
        gemm_inputs(led, "moe", dt, 1, rows * h, dt.norm_out)
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
            gemm_inputs(led, "moe", dt, 2, d.n * h, dt.norm_out)
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
    _layernorm(full, t, h, dt, light)
    attn = Ledger()
    if hasattr(c, "kv_lora_rank"):
        mla_attention(attn, c, d_attn, dt, light)
    else:
        dense_attention(attn, c, d_attn, dt, light)
    _layernorm(full, t, h, dt, light)
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


def _layernorm(led: Ledger, t: int, h: int, dt: Dtypes, light: bool) -> None:
    """A decoder layer's RMSNorm: under recompute "light" a checkpoint keeping its input."""
    if light:
        led.add("norms", t * h * dt.stream)
    else:
        norm(led, t, h, dt.stream, h)


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
    norm(led, d.t, h, dt.stream, h)
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
    norm(sub, t, h, dt.param, h)  # enorm of the embedding (param dtype)
    # hnorm reads h, already saved by the head's final norm when fp32
    sub.add("norms", t * F32 + t * h * dt.stream + (t * h * F32 if dt.stream != F32 else 0))
    gemm_inputs(sub, "mtp", dt, 1, t * 2 * h, dt.norm_out)  # eh_proj reads [enorm | hnorm]
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
