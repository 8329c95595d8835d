"""Building blocks shared by both model families: RMSNorm, rotary embeddings (+ YaRN), SwiGLU.

Rotary tables are computed on the fly from the config (a handful of floats per position), so
a model built on the meta device has no buffer that must be recomputed after materializing.

Shape comments: B batch, T sequence, heads the attention heads of x, dim the rotated width
(dim / 2 rotation pairs; r in `rope_tail_table`), hidden the model width.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanotrain.models.fp8_saves import keep_in_fp8
from nanotrain.parallel.collectives import enter_tensor_parallel_region
from nanotrain.parallel.saved_rebuild import RebuiltSaves
from nanotrain.parallel.sp_regather import saved_as_shard
from nanotrain.parallel.tensor import ColumnParallelLinear, RowParallelLinear


def tp_size_of(tp_group: Any) -> int:
    """Number of ranks in a tensor-parallel group (1 for None)."""
    return 1 if tp_group is None else tp_group.size()


def divide_evenly(total: int, parts: int, what: str) -> int:
    """`total // parts`, raising ValueError when `parts` does not divide `total`."""
    if total % parts != 0:
        raise ValueError(
            f"{what}={total} is not divisible by the tensor-parallel size {parts}; "
            "choose a tp size that divides it"
        )
    return total // parts


class RMSNorm(nn.Module):
    """Root-mean-square norm: y = x / sqrt(mean(x^2) + eps) * weight, computed in float32.

    Args:
        dim: size of the last dimension. eps: added inside the square root.
    Shapes: x [..., dim] -> [..., dim] in x's dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, device: Any = None, dtype: Any = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 statistics: bf16 mean-of-squares loses ~3 digits on wide hidden sizes
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN attention-temperature factor 0.1 * mscale * ln(factor) + 1 (1 when factor <= 1)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    # the dimension index whose wavelength fits `num_rotations` times into `max_pos`
    return dim * math.log(max_pos / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def rope_inv_freq(
    dim: int, theta: float, rope_scaling: dict[str, Any] | None = None, device: Any = None
) -> torch.Tensor:
    """Rotary inverse frequencies theta^(-2i/dim), i = 0 .. dim/2-1, optionally YaRN-scaled.

    YaRN (Peng et al. 2023, as configured in DeepSeek-V3): dimensions that rotate more than
    `beta_fast` times over the original context keep their frequency (extrapolation), those
    rotating fewer than `beta_slow` times are divided by `factor` (interpolation), with a
    linear ramp in between.

    Returns: float32 tensor [dim // 2].
    """
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim  # (dim/2,)
    inv_freq = 1.0 / (theta**exponents)
    if rope_scaling is None:
        return inv_freq
    factor = float(rope_scaling["factor"])
    original = int(rope_scaling["original_max_position_embeddings"])
    beta_fast = rope_scaling.get("beta_fast") or 32
    beta_slow = rope_scaling.get("beta_slow") or 1
    low = max(math.floor(_yarn_correction_dim(beta_fast, dim, theta, original)), 0)
    high = min(math.ceil(_yarn_correction_dim(beta_slow, dim, theta, original)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = (torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)
    keep = 1.0 - ramp.clamp(0.0, 1.0)  # 1 = extrapolate (high frequency), 0 = interpolate
    return inv_freq / factor * (1.0 - keep) + inv_freq * keep


def rope_attention_factor(rope_scaling: dict[str, Any] | None) -> float:
    """Scale applied to cos/sin under YaRN: mscale(factor, mscale) / mscale(factor, mscale_all_dim).

    DeepSeek-V3 sets mscale == mscale_all_dim, so this is 1 there and the temperature moves
    into the softmax scale instead (see `softmax_scale`).
    """
    if rope_scaling is None:
        return 1.0
    factor = float(rope_scaling["factor"])
    mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def softmax_scale(qk_head_dim: int, rope_scaling: dict[str, Any] | None) -> float:
    """Attention logit scale: 1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = qk_head_dim**-0.5
    if rope_scaling is not None and rope_scaling.get("mscale_all_dim"):
        m = yarn_mscale(float(rope_scaling["factor"]), rope_scaling["mscale_all_dim"])
        scale = scale * m * m
    return scale


def rope_cos_sin(
    seq_len: int,
    dim: int,
    theta: float,
    rope_scaling: dict[str, Any] | None,
    device: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * inv_freq for positions 0..seq_len-1, each float32 [seq_len, dim//2].

    Both are multiplied by `rope_attention_factor(rope_scaling)`.
    """
    inv_freq = rope_inv_freq(dim, theta, rope_scaling, device=device)
    # (seq_len, dim/2): position p times inv_freq[i]
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    factor = rope_attention_factor(rope_scaling)
    return angles.cos() * factor, angles.sin() * factor


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool
) -> torch.Tensor:
    """Rotate x by position: each pair (a, b) -> (a cos - b sin, b cos + a sin).

    Args:
        x: [B, T, heads, dim]. cos, sin: [T, dim // 2] from `rope_cos_sin`, or [B, T, dim // 2]
            (each token's own position, `nanotrain.models.documents.rope_at`).
        interleaved: True pairs adjacent dims (x0, x1), (x2, x3), ... as DeepSeek's reference
            code does, and keeps that layout; False pairs dim i with i + dim/2 (Llama's
            "rotate half").
    Returns: tensor like x.
    """
    cos = cos.unsqueeze(-2).to(x.dtype)  # ([B,] T, 1, dim/2) broadcasts over heads
    sin = sin.unsqueeze(-2).to(x.dtype)
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]  # each (B, T, heads, dim/2): even, odd dims
        # (B, T, heads, dim/2, 2) flattened back to the interleaved (B, T, heads, dim)
        return torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    a, b = x.chunk(2, dim=-1)  # each (B, T, heads, dim/2): first, second half
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)  # (B, T, heads, dim)


def rope_tail_table(cos: torch.Tensor, sin: torch.Tensor, skip: int) -> torch.Tensor:
    """Rotation factors for `rope_tail`: 1 on the first `skip` dims, cos + i sin on the rest.

    Args: cos, sin: [T, r // 2] from `rope_cos_sin` (or [B, T, r // 2], per-token positions);
        skip: width of the unrotated head (even).
    Returns: float32 [[B,] T, 1, skip // 2 + r // 2, 2], one factor (real, imaginary) per adjacent
    pair of dims. Real-valued, so torch.compile can fuse building it (inductor generates no
    code for complex numbers); eager `rope_tail` views it as complex without a copy.
    """
    lead = cos.shape[:-1]  # (T,) or (B, T)
    real = torch.cat((cos.new_ones(*lead, skip // 2), cos), dim=-1)  # ([B,] T, skip/2 + r/2)
    imag = torch.cat((sin.new_zeros(*lead, skip // 2), sin), dim=-1)  # ([B,] T, skip/2 + r/2)
    # ([B,] T, 1, skip/2 + r/2, 2)
    return torch.stack((real.float(), imag.float()), dim=-1).unsqueeze(-3)


def rope_tail(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE of x's last dims and identity on the first ones, in one multiply.

    Each adjacent pair (a, b) read as a + ib times its factor cos + i sin is
    (a cos - b sin) + i(a sin + b cos): `apply_rope(interleaved=True)` in one complex multiply
    (the same products and sums; equal floats, or an ulp apart where the complex kernel fuses
    a multiply-add), and a pair times 1 + 0i is itself. Used for MLA's queries [q^C | q^R]:
    rotating q^R inside the whole head avoids splitting it off and concatenating it back (a
    copy forward and one backward per layer), and the complex multiply replaces rope's seven
    elementwise kernels. Dtypes without a complex counterpart (bf16, fp16), and
    torch.compile (inductor generates no code for complex numbers; it fuses the real form
    into one kernel), take the same math as x * c + pair_swap(x) * s.

    Args: x: [B, T, heads, dim] (dim even); table: [[B,] T, 1, dim // 2, 2] from
        `rope_tail_table` (or a slice of one along its pairs' dim, -2).
    Returns: tensor like x.
    """
    pairs = x.unflatten(-1, (-1, 2))  # (B, T, heads, dim/2, 2)
    if x.dtype in (torch.float32, torch.float64) and not torch.compiler.is_compiling():
        if pairs.storage_offset() % 2 or any(st % 2 for st in pairs.stride()[:-1]):
            pairs = pairs.contiguous()  # view_as_complex needs whole pairs in memory
        factors = torch.view_as_complex(table.to(x.dtype))  # (T, 1, dim/2) complex
        rotated = torch.view_as_complex(pairs) * factors  # (B, T, heads, dim/2) complex
        return torch.view_as_real(rotated).flatten(-2)  # (B, T, heads, dim)
    cos, sin = table[..., 0], table[..., 1]  # each (T, 1, dim/2)
    c = cos.repeat_interleave(2, dim=-1).to(x.dtype)  # (T, 1, dim): c0 c0 c1 c1 ..
    s = torch.stack((-sin, sin), dim=-1).flatten(-2).to(x.dtype)  # (T, 1, dim): -s0 s0 ..
    return x * c + pairs.flip(-1).flatten(-2) * s  # pairs swapped (b, a): (B, T, heads, dim)


class SwiGLU(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)); gate/up column-parallel, down row-parallel.

    Under tensor parallelism gate and up share one input collective (`shared_input`), so the
    MLP communicates once forward (after down) and once backward (before gate/up). With
    `sequence_parallel` x and the output are [B, T / tp, hidden]: x is all-gathered along the
    sequence and the output reduce-scattered.

    Shapes: x [..., hidden] -> [..., hidden]. Parameter names follow Llama/HF
    (`gate_proj`, `up_proj`, `down_proj`).
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        *,
        tp_group: Any = None,
        device: Any = None,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        kw = {"tp_group": tp_group, "device": device, "sequence_parallel": sequence_parallel}
        self.gate_proj = ColumnParallelLinear(hidden, intermediate, shared_input=True, **kw)
        self.up_proj = ColumnParallelLinear(hidden, intermediate, shared_input=True, **kw)
        self.down_proj = RowParallelLinear(intermediate, hidden, **kw)
        self.rebuild_activation = False  # recompute "light" (`set_recompute`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shard = x
        x = enter_tensor_parallel_region(
            x, self.tp_group, sequence_parallel=self.sequence_parallel
        )  # (B, T, hidden): the whole sequence under sequence parallelism
        # gate, up: (B, T, intermediate / tp), this rank's columns; under sequence parallelism
        # they save the input as this rank's shard (`sp_regather`)
        with saved_as_shard(x, shard, self.tp_group, self.sequence_parallel):
            gate, up = self.gate_proj(x), self.up_proj(x)
        # down_proj sums over tp to (B, T, hidden), reduce-scattered to (B, T / tp, hidden)
        # under sequence parallelism
        return swiglu_down(gate, up, self.down_proj, self.rebuild_activation)


def _silu_product(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _scaled_silu_product(gate: torch.Tensor, up: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up * scale


def swiglu_down(
    gate: torch.Tensor,
    up: torch.Tensor,
    down: Callable[[torch.Tensor], torch.Tensor],
    rebuild: bool,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`down(silu(gate) * up)`, or `down(silu(gate) * up * scale)` with a per-row `scale`.

    A routed expert's gate weight enters as `scale`, before the down projection (which is
    linear, so the output is the weight times the expert's): the combine is then a plain sum
    that keeps nothing of width hidden, and the weight's gradient comes from the product,
    which backward has anyway. With `rebuild` (recompute "light") the tensors the activation
    adds to what backward keeps, silu(gate), the product and the scaled product, are made
    again in backward from gate, up and scale, which their ops save anyway
    (`nanotrain.parallel.saved_rebuild`). Inside an open `Fp8Saves` (the routed experts with
    `fp8_saved_activations`) the saves of gate and up are kept in fp8.

    Shapes: gate, up [..., I]; scale [..., 1] (or None); `down` maps [..., I] to the output.
    """
    keep_in_fp8(gate), keep_in_fp8(up)
    if not rebuild:
        product = F.silu(gate) * up
        return down(product if scale is None else product * scale)
    with RebuiltSaves() as saves:
        act = saves.track(F.silu(gate), F.silu, gate)  # (..., I)
        product = saves.track(act * up, _silu_product, gate, up)  # (..., I)
        if scale is not None:
            product = saves.track(product * scale, _scaled_silu_product, gate, up, scale)
        return down(product)  # product (..., I)
