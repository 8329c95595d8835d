"""Causal self-attention: `DenseAttention` (MHA/GQA/MQA) and `MLAttention` (DeepSeek MLA).

Both run on `torch.nn.functional.scaled_dot_product_attention` with `is_causal=True` (MLA on
CPU: the same math by hand, see `causal_attention`) and take the rotary tables `(cos, sin)`
computed once per forward by the model. With packed documents masked
(`nanotrain.models.documents`) they take an explicit block-causal mask instead, and the
tables per token (positions restart in each document).

Shape comments name the dims: B batch; T the whole sequence (every position, as attention
sees it once inside the tensor-parallel region); T_local this rank's part of it (T / tp under
sequence parallelism, else T); H hidden; n and n_kv this rank's query and key/value heads
(num_heads / tp, num_kv_heads / tp). Head widths are named after the attributes holding them
(head_dim; MLA's nope_dim, rope_dim, v_dim, qk_head_dim = nope_dim + rope_dim, and the latent
ranks q_lora_rank, kv_lora_rank), or d_qk and d_v in `causal_attention`.

Context parallelism (`cp_group`, `nanotrain.parallel.context`): a rank holds T_q = T / cp
tokens of each sequence (two chunks) and computes their queries; the keys and values of the
whole sequence (T_k = T) come from an all-gather along the sequence: K and V after RoPE for
`DenseAttention`, the compressed latent c_KV and the rope key k^R for `MLAttention`
(kv_lora_rank + rope_dim per token, expanded to per-head keys and values on every rank). The
model then passes the causal mask by global position, [1, 1, T_q, T_k].
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanotrain.models.config import DeepSeekConfig, DenseConfig
from nanotrain.models.layers import (
    RMSNorm,
    apply_rope,
    divide_evenly,
    rope_tail,
    rope_tail_table,
    softmax_scale,
    tp_size_of,
)
from nanotrain.models.recompute import recomputed
from nanotrain.parallel.collectives import enter_tensor_parallel_region, group_size
from nanotrain.parallel.context import gather_sequence
from nanotrain.parallel.saved_rebuild import RebuiltSaves
from nanotrain.parallel.sp_regather import saved_as_shard
from nanotrain.parallel.tensor import ColumnParallelLinear, RowParallelLinear


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(scale * q k^T + causal mask) v per head, heads merged into the last dim.

    With `mask` (a block-causal [B, 1, T, T] bool, True = may attend, from
    `nanotrain.models.documents`, or context parallelism's [1, 1, T_q, T_k] by global
    position) it replaces the causal mask; every query must see at least one key.

    On CPU with a value width other than the query/key width (MLA), SDPA has no fused kernel
    and runs its math fallback; this computes the same products by hand (one baddbmm that
    scales and masks, softmax, bmm) and skips that fallback's guard against fully masked rows
    (an `all` and a `where` over the [B, heads, T, T] scores per call), which a causal mask
    never produces: every row keeps its diagonal. Elsewhere it calls SDPA, whose fused kernels
    do not store the [T, T] probabilities.

    Args: q [B, T, heads, d_qk]; k [B, T_k, heads, d_qk]; v [B, T_k, heads, d_v] (any
        strides; T_k = T unless a mask says otherwise).
    Returns: [B, T, heads * d_v].
    """
    b, t, n, _ = q.shape
    tk, dv = k.shape[1], v.shape[-1]
    if q.device.type != "cpu" or q.shape[-1] == dv:
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
        )  # (B, n, T, d_v)
        return y.transpose(1, 2).reshape(b, t, n * dv)  # (B, T, n * d_v)
    # bf16/fp16 run in fp32, as SDPA's CPU math fallback does (also under autocast, which
    # would otherwise run baddbmm and bmm in bf16)
    work = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32
    with torch.autocast("cpu", enabled=False):
        qh = q.transpose(1, 2).reshape(b * n, t, -1).to(work)  # (B*n, T, d_qk)
        kh = k.permute(0, 2, 3, 1).reshape(b * n, -1, tk).to(work)  # (B*n, d_qk, T_k)
        vh = v.transpose(1, 2).reshape(b * n, tk, dv).to(work)  # (B*n, T_k, d_v)
        if mask is None:
            bias = torch.full((t, t), float("-inf"), dtype=work, device=q.device).triu_(1)
        else:  # ([B|1], 1, T, T_k) bool -> one additive (T, T_k) bias per head of each sample
            bias = torch.zeros(mask.shape, dtype=work, device=q.device)
            bias = bias.masked_fill_(~mask, float("-inf")).expand(b, n, t, tk)
            bias = bias.reshape(b * n, t, tk)
        probs = torch.baddbmm(bias, qh, kh, alpha=scale).softmax(dim=-1)  # (B*n, T, T_k)
        y = torch.bmm(probs, vh).view(b, n, t, dv)  # (B, n, T, d_v)
    return y.transpose(1, 2).reshape(b, t, n * dv).to(q.dtype)  # (B, T, n * d_v)


class DenseAttention(nn.Module):
    """Llama-style attention with rotate-half RoPE; MHA, GQA or MQA by `num_kv_heads`.

    Heads are split across the tensor-parallel group (q/k/v column-parallel, o row-parallel).
    q, k and v share one input collective, so a layer communicates once forward (after o) and
    once backward (before q/k/v). With `sequence_parallel`, x and the output are
    [B, T / tp, hidden] (this rank's part of the sequence): x is all-gathered along the
    sequence before the projections and o's partial sums are reduce-scattered.

    Under context parallelism (`cp_group`) K and V (after RoPE) are all-gathered along the
    sequence over the cp ranks, in one collective.

    Shapes: x [B, T, hidden] -> [B, T, hidden] (T / tp under sequence parallelism).
    Raises: ValueError when the tp size does not divide num_heads or num_kv_heads.
    """

    def __init__(
        self,
        config: DenseConfig,
        *,
        tp_group: Any = None,
        device: Any = None,
        sequence_parallel: bool = False,
        cp_group: Any = None,
    ):
        super().__init__()
        self.cp_group = cp_group
        tp = tp_size_of(tp_group)
        self.head_dim = config.head_dim
        self.local_heads = divide_evenly(config.num_heads, tp, "num_heads")
        self.local_kv_heads = divide_evenly(config.num_kv_heads, tp, "num_kv_heads")
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        kw = {"tp_group": tp_group, "device": device, "sequence_parallel": sequence_parallel}
        h, d = config.hidden_size, config.head_dim
        self.q_proj = ColumnParallelLinear(h, config.num_heads * d, shared_input=True, **kw)
        self.k_proj = ColumnParallelLinear(h, config.num_kv_heads * d, shared_input=True, **kw)
        self.v_proj = ColumnParallelLinear(h, config.num_kv_heads * d, shared_input=True, **kw)
        self.o_proj = RowParallelLinear(config.num_heads * d, h, **kw)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, T_local, H]; cos, sin [T, head_dim / 2] or per token [B, T, head_dim / 2];
        mask: None (causal) or block-causal [B, 1, T, T] bool (`nanotrain.models.documents`)."""
        # (B, T_local, H) -> (B, T, H): all-gathered along the sequence under sequence parallelism
        shard = x
        x = enter_tensor_parallel_region(x, self.tp_group, sequence_parallel=self.sequence_parallel)
        b, t, _ = x.shape  # the whole sequence from here to o_proj
        # under sequence parallelism q, k, v save their input as this rank's shard
        with saved_as_shard(x, shard, self.tp_group, self.sequence_parallel):
            q = self.q_proj(x).view(b, t, self.local_heads, self.head_dim)  # (B, T, n, head_dim)
            k = self.k_proj(x).view(b, t, self.local_kv_heads, self.head_dim)  # (B, T, n_kv, hd)
            v = self.v_proj(x).view(b, t, self.local_kv_heads, self.head_dim)  # (B, T, n_kv, hd)
        q = apply_rope(q, cos, sin, interleaved=False)
        k = apply_rope(k, cos, sin, interleaved=False)
        if group_size(self.cp_group) > 1:
            # the whole sequence's keys and values, one all-gather: (B, T_k, n_kv, 2 * hd)
            kv = gather_sequence(torch.cat((k, v), dim=-1), self.cp_group)
            k, v = kv.split(self.head_dim, dim=-1)  # each (B, T_k, n_kv, head_dim)
        # (B, n | n_kv, T | T_k, head_dim) for SDPA; enable_gqa shares each kv head across its q group
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        gqa = self.local_kv_heads != self.local_heads
        # (B, n, T, head_dim): softmax(q k^T / sqrt(head_dim) + causal mask) v per head; the
        # block-causal mask of packed documents is given explicitly (SDPA's math or
        # memory-efficient kernels: flash attention takes no mask)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa
        )
        # heads merged back into the last dim: (B, T, n * head_dim)
        y = y.transpose(1, 2).reshape(b, t, self.local_heads * self.head_dim)
        return self.o_proj(y)  # (B, T_local, H): summed over tp (reduce-scattered under SP)


class MLAttention(nn.Module):
    """Multi-head Latent Attention (DeepSeek-V2 section 2.1, DeepSeek-V3 section 2.1.1).

    Per token (paper notation): c_Q = W_DQ h (optional, rank `q_lora_rank`), q = W_UQ RMSNorm(c_Q)
    split per head into [q^C (qk_nope) | q^R (qk_rope)]; [c_KV | k^R] = W_DKV h with c_KV of
    rank `kv_lora_rank` and one rope key k^R shared by all heads; [k^C | v] = W_UKV RMSNorm(c_KV)
    per head. RoPE is applied to q^R and k^R only; the score scale is 1/sqrt(qk_head_dim)
    times the YaRN mscale^2. Training computes the full keys (no latent-cache absorption).

    Tensor parallelism: the down-projections (`q_a_proj`, `kv_a_proj_with_mqa`) and their norms
    are replicated and run on the tokens this rank holds; the up-projections are column-parallel
    (heads split) and `o_proj` is row-parallel. The latents [RMSNorm(c_Q) | RMSNorm(c_KV) | k^R]
    enter the tensor-parallel region in ONE collective: an all-gather along the sequence under
    sequence parallelism (they are q_lora_rank + kv_lora_rank + rope_dim wide, narrower than
    the hidden state: 2112 vs 7168 for V3, so cheaper to gather than x, and the replicated
    down-projections run on T / tp tokens instead of all T), a grad all-reduce without it. The
    down-projection and norm weights then get grads from this rank's tokens only, which the
    strategy sums over tp (they are tp-replicated). Without `q_lora_rank`, `q_proj` reads the
    hidden state and gathers it itself.

    Context parallelism (`cp_group`): the normalized latent RMSNorm(c_KV) and the rope key k^R
    (after RoPE) are all-gathered along the sequence in one collective (kv_lora_rank +
    rope_dim per token: 576 for V3, against 2 x 128 heads x 128 = 32768 for full K and V), and
    `kv_b_proj` expands them to this rank's heads for all T_k keys.

    Shapes: x [B, T, hidden] -> [B, T, hidden] (T / tp under sequence parallelism).
    Raises: ValueError when the tp size does not divide num_heads.
    """

    def __init__(
        self,
        config: DeepSeekConfig,
        *,
        tp_group: Any = None,
        device: Any = None,
        sequence_parallel: bool = False,
        cp_group: Any = None,
    ):
        super().__init__()
        self.cp_group = cp_group
        c = config
        tp = tp_size_of(tp_group)
        self.local_heads = divide_evenly(c.num_heads, tp, "num_heads")
        self.nope_dim, self.rope_dim, self.v_dim = (
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
        )
        self.q_lora_rank, self.kv_lora_rank = c.q_lora_rank, c.kv_lora_rank
        self.interleaved = c.rope_interleave
        self.scale = softmax_scale(c.qk_head_dim, c.rope_scaling)
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        split = {"tp_group": tp_group, "device": device, "sequence_parallel": sequence_parallel}
        latent_in = {**split, "shared_input": True}  # reads the latents entered once in forward
        replicated = {"tp_group": None, "device": device}
        q_out = c.num_heads * c.qk_head_dim
        if c.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(c.hidden_size, q_out, **split)
        else:
            self.q_a_proj = ColumnParallelLinear(c.hidden_size, c.q_lora_rank, **replicated)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, device=device)
            self.q_b_proj = ColumnParallelLinear(c.q_lora_rank, q_out, **latent_in)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(
            c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, **replicated
        )
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps, device=device)
        self.kv_b_proj = ColumnParallelLinear(
            c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), **latent_in
        )
        self.o_proj = RowParallelLinear(c.num_heads * c.v_head_dim, c.hidden_size, **split)
        self.rebuild_heads = False  # recompute "light" (`set_recompute`)

    def _latents(self, x: torch.Tensor) -> tuple[Any, ...]:
        """(RMSNorm(c_Q) or None, RMSNorm(c_KV), k^R), each [B, T, width] for the whole sequence,
        and the context in which the up-projections read them (under sequence parallelism
        their saved input is kept as this rank's shard, `sp_regather`).

        One collective for the three: the rope key is shared by every head but each tp rank
        uses it (like the latents) for its own heads only, so its grad is summed over tp there.
        """
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], -1)
        parts = [self.kv_a_layernorm(c_kv), k_rope]  # (B, T_local, kv_lora_rank), (.., rope_dim)
        if self.q_lora_rank is not None:
            parts.insert(0, self.q_a_layernorm(self.q_a_proj(x)))  # (B, T_local, q_lora_rank)
        if tp_size_of(self.tp_group) == 1:
            # entering the region is the identity: skip the cat and its split (two copies)
            pieces = tuple(parts) if self.q_lora_rank is not None else (None, *parts)
            return (*pieces, contextlib.nullcontext())
        shard = torch.cat(parts, dim=-1)  # (B, T_local, [q_lora_rank +] kv_lora_rank + rope)
        latents = enter_tensor_parallel_region(
            shard, self.tp_group, sequence_parallel=self.sequence_parallel
        )  # (B, T, [q_lora_rank +] kv_lora_rank + rope_dim)
        region = saved_as_shard(latents, shard, self.tp_group, self.sequence_parallel)
        widths = [p.shape[-1] for p in parts]
        pieces = latents.split(widths, dim=-1)  # each (B, T, its width)
        if self.q_lora_rank is None:
            return None, *pieces, region
        return pieces[0], pieces[1], pieces[2], region

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, T_local, H]; cos, sin [T, rope_dim / 2] or per token [B, T, rope_dim / 2];
        mask: None (causal) or block-causal [B, 1, T, T] bool (`nanotrain.models.documents`)."""
        # (B, T, q_lora_rank) or None, (B, T, kv_lora_rank), (B, T, rope_dim)
        q_latent, c_kv, k_rope, region = self._latents(x)
        if q_latent is None:  # no q latent: q from x, gathered (and kept as its shard) by q_proj
            q_latent = self.q_proj(x)  # (B, T, n * qk_head_dim)
        if not self.rebuild_heads:
            with region:  # the up-projections read the latents (saved as the shard under sp)
                q, k, v = self._heads(q_latent, c_kv, k_rope, cos, sin)
            # (B, T, n * v_dim) into o_proj, which sums over tp: (B, T_local, H) out
            return self.o_proj(causal_attention(q, k, v, self.scale, mask))
        # recompute "light": the up-projections keep only the latents (a checkpoint), and the
        # q, k, v the attention core saves are made again from them in backward; both read the
        # latents through the sp region, so they too are kept as the shard
        with region:
            q, k, v = recomputed(self._heads, q_latent, c_kv, k_rope, cos, sin)
            with RebuiltSaves() as saves:
                saves.track_all((q, k, v), self._heads, q_latent, c_kv, k_rope, cos, sin)
                y = causal_attention(q, k, v, self.scale, mask)  # (B, T, n * v_dim)
        return self.o_proj(y)

    def _heads(
        self,
        q_latent: torch.Tensor,
        c_kv: torch.Tensor,
        k_rope: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The up-projections and RoPE: this rank's heads of q [B, T, n, qk_head_dim], k
        [B, T_k, n, qk_head_dim] and v [B, T_k, n, v_dim] from the latents (without
        `q_lora_rank`, q_latent is q_proj's output already); T_k = T, or the whole sequence
        under context parallelism (c_KV and k^R gathered over the cp ranks)."""
        n = self.local_heads
        b, t, _ = c_kv.shape  # the whole sequence (this rank's chunks under cp) to o_proj
        # q: this rank's heads, each [q^C | q^R]: (B, T, n * qk_head_dim)
        q = q_latent if self.q_lora_rank is None else self.q_b_proj(q_latent)
        q = q.view(b, t, n, self.nope_dim + self.rope_dim)  # (B, T, n, qk_head_dim)
        if self.interleaved and self.nope_dim % 2 == 0:
            # rotate q^R inside the whole head [q^C | q^R]: no split and cat back
            table = rope_tail_table(cos, sin, self.nope_dim)  # ([B,] T, 1, qk_head_dim / 2, 2)
            q = rope_tail(q, table)  # (B, T, n, qk_head_dim)
            # k^R, the one rope key every head shares: (B, T, 1, rope_dim)
            k_rope = rope_tail(k_rope.unsqueeze(2), table[..., self.nope_dim // 2 :, :])
        else:
            # q^C (B, T, n, nope_dim) and q^R (B, T, n, rope_dim)
            q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
            q_rope = apply_rope(q_rope, cos, sin, interleaved=self.interleaved)
            q = torch.cat((q_nope, q_rope), dim=-1)  # (B, T, n, qk_head_dim)
            # k^R, the one rope key every head shares: (B, T, 1, rope_dim)
            k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin, interleaved=self.interleaved)
        if group_size(self.cp_group) > 1:
            # the whole sequence's latent and rope key, one all-gather:
            # (B, T_k, kv_lora_rank + rope_dim), then (B, T_k, kv_lora_rank), (B, T_k, 1, rope)
            latent = gather_sequence(torch.cat((c_kv, k_rope.squeeze(2)), -1), self.cp_group)
            c_kv, k_rope = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
            k_rope = k_rope.unsqueeze(2)
        tk = c_kv.shape[1]
        kv = self.kv_b_proj(c_kv)  # (B, T_k, n * (nope_dim + v_dim))
        # [k^C | v] per head: (B, T_k, n, nope_dim + v_dim)
        kv = kv.view(b, tk, n, self.nope_dim + self.v_dim)
        # k^C (B, T_k, n, nope_dim) and v (B, T_k, n, v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        # [k^C | k^R] with k^R broadcast to every head: (B, T_k, n, qk_head_dim)
        k = torch.cat((k_nope, k_rope.expand(b, tk, n, self.rope_dim)), dim=-1)
        return q, k, v
