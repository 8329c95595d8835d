"""Activation formulas of the attention blocks (`nanotrain.planning.activation_layers` adds
them into a decoder layer): dense (Llama-style, GQA) and MLA attention, with recompute "light"
and the CPU math kernel's saves. Notation and dtypes: `nanotrain.planning.activation_parts`.
"""

from __future__ import annotations

from typing import Any

from nanotrain.planning.activation_parts import F32, Dims, Dtypes, Ledger, gemm_inputs, norm

__all__ = ["dense_attention", "mla_attention", "rotates_whole_heads", "saves_rope_tables"]


def dense_attention(led: Ledger, c: Any, d: Dims, dt: Dtypes, light: bool) -> None:
    """Add to `led` what one microbatch saves through a dense attention block (entered input,
    q, k, v after RoPE, the kernel's output and log-sum-exp; their weights' copies under
    autocast); `light`: under recompute "light"."""
    n, tp, g = d.n, d.tp, dt.gemm
    hq, hkv = c.num_heads // tp * c.head_dim, c.num_kv_heads // tp * c.head_dim
    h = c.hidden_size
    if light:  # q/k/v's input is the rebuilt norm output (or its shard or casts)
        pass
    elif d.saves_shards:  # q/k/v read one gathered x, saved as this rank's shard
        led.add("attention", d.t * h * dt.norm_out)
    else:
        gemm_inputs(led, "attention", dt, 3, n * h, dt.norm_out)  # q/k/v read one entered x
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


def mla_attention(led: Ledger, c: Any, d: Dims, dt: Dtypes, light: bool) -> None:
    """Add to `led` what one microbatch saves through an MLA block (down-projection input,
    latent norms, latents, RoPE, q, k, v and the attention kernel's saves; weight copies under
    autocast); `light`: under recompute "light" (`_mla_attention_light`)."""
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
        gemm_inputs(led, "attention", dt, 1, t * h, dt.norm_out)
        if dt.cast_copies and dt.norm_out > g:
            led.add("attention", t * h * dt.norm_out)
    else:
        gemm_inputs(led, "attention", dt, 2, t * h, dt.norm_out)
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
    norm(led, t, wkv, g, stored_width=wkv + r)
    if wq is None:
        return h * (wkv + r)
    norm(led, t, wq, g, stored_width=wq)
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
