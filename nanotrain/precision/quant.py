"""Quantize-dequantize to fp8 (e4m3 / e5m2) and fp4 (e2m1) with per-tensor, tile and block scales.

These functions return a tensor of the input's dtype and shape whose values are exactly what a
low-precision GEMM would read: ``dequant(quant(x))``. The fp8 path casts to torch's real
``float8_e4m3fn`` / ``float8_e5m2`` dtypes (round-to-nearest-even, saturating because the values
are scaled into range first), so the rounding is the hardware's, not an integer grid's.

Scaling granularity (the group of elements that share one scale, ``amax`` -> format max):

- ``"tensor"``: one scale for the whole tensor (TE's delayed/current scaling),
- ``"tile"``: 1 x 128 tiles along the last dim (DeepSeek-V3 activations and gradients),
- ``"block"``: 128 x 128 blocks of the last two dims (DeepSeek-V3 weights).

fp4 e2m1 (values 0, 0.5, 1, 1.5, 2, 3, 4, 6) has no torch dtype that can round, so the grid is
applied here (round-to-nearest, ties to the even code); scales are per block of ``block_size``
elements along the last dim, stored as a power of two (MXFP4, "e8m0") or as an fp8 e4m3 number
(NVFP4, "e4m3"), each rounded *up* so the block's largest value never saturates.

Error bound (used by the tests): for a format with ``m`` mantissa bits and smallest normal
``n``, an element scaled to ``v`` is off by at most ``|v| * 2**-(m+1) + n * 2**-(m+1)`` (half a
unit in the last place in the normal range, half the subnormal spacing below it); divide by the
scale for the error in ``x`` units. `rounding_bound` returns these two numbers.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "FP8_FORMATS",
    "FP4_E2M1_MAX",
    "qdq_fp8",
    "qdq_fp4",
    "rounding_bound",
    "GRANULARITIES",
]

FP8_FORMATS: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
GRANULARITIES = ("tensor", "tile", "block")
TILE = 128
FP4_E2M1_MAX = 6.0
_E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# the grid per device, copied once: a copy per call would make the host wait on a GPU
_GRIDS: dict[torch.device, Tensor] = {}
_TINY = 1e-30  # an all-zero group gets scale 1 instead of a division by zero


def rounding_bound(fmt: str) -> tuple[float, float]:
    """``(relative, absolute)`` rounding error bound of one element of `fmt` in scaled units:
    ``|q(v) - v| <= relative * |v| + absolute`` for ``|v| <= max(fmt)``.

    `fmt` is "e4m3", "e5m2" or "e2m1". Computed from the format's mantissa bits and smallest
    normal, e.g. e4m3: 3 mantissa bits -> relative 2**-4, smallest normal 2**-6 ->
    absolute 2**-10.

    Raises:
        ValueError: for an unknown format.
    """
    if fmt == "e2m1":
        mantissa_bits, smallest_normal = 1, 1.0
    elif fmt in FP8_FORMATS:
        info = torch.finfo(FP8_FORMATS[fmt])
        mantissa_bits = round(-math.log2(info.eps))
        smallest_normal = info.smallest_normal
    else:
        raise ValueError(f"unknown low-precision format {fmt!r}; use 'e4m3', 'e5m2' or 'e2m1'")
    half_ulp = 2.0 ** -(mantissa_bits + 1)
    return half_ulp, smallest_normal * half_ulp


def _check(granularity: str, fmt: str) -> None:
    if fmt not in FP8_FORMATS:
        raise ValueError(f"fp8 format must be one of {sorted(FP8_FORMATS)}, got {fmt!r}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


def _pad_last(x: Tensor, multiple: int, dim: int = -1) -> tuple[Tensor, int]:
    size = x.shape[dim]
    pad = -size % multiple
    if pad == 0:
        return x, size
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim=dim), size


def _group_amax(x: Tensor, granularity: str) -> tuple[Tensor, Tensor, tuple[int, ...]]:
    """``(grouped x, amax per group broadcastable to it, original padded shape)``."""
    if granularity == "tensor":
        return x, x.abs().amax(), tuple(x.shape)
    if granularity == "tile":
        xp, _ = _pad_last(x, TILE)
        g = xp.reshape(*xp.shape[:-1], xp.shape[-1] // TILE, TILE)
        return g, g.abs().amax(dim=-1, keepdim=True), tuple(xp.shape)
    # block: 128 x 128 over the last two dims (a 1-D tensor is treated as one row)
    x2 = x if x.dim() >= 2 else x.unsqueeze(0)
    xp, _ = _pad_last(x2, TILE, -1)
    xp, _ = _pad_last(xp, TILE, -2)
    r, c = xp.shape[-2], xp.shape[-1]
    g = xp.reshape(*xp.shape[:-2], r // TILE, TILE, c // TILE, TILE)
    amax = g.abs().amax(dim=(-3, -1), keepdim=True)
    return g, amax, tuple(xp.shape)


def _ungroup(g: Tensor, x: Tensor, granularity: str, padded: tuple[int, ...]) -> Tensor:
    if granularity == "tensor":
        return g
    out = g.reshape(padded)
    if granularity == "block" and x.dim() < 2:
        out = out[0]
    if granularity == "block" and x.dim() >= 2:
        out = out[..., : x.shape[-2], :]
    return out[..., : x.shape[-1]]


@torch.no_grad()
def qdq_fp8(x: Tensor, fmt: str = "e4m3", granularity: str = "tensor") -> Tensor:
    """``x`` rounded through fp8 `fmt` with one scale per `granularity` group (see module).

    Each group is scaled so its amax maps to the format's max, cast to the float8 dtype,
    cast back and unscaled. Arithmetic is in fp32; the result has ``x``'s dtype and shape.

    Raises:
        ValueError: for an unknown format or granularity.
    """
    _check(granularity, fmt)
    dtype = FP8_FORMATS[fmt]
    fmax = torch.finfo(dtype).max
    g, amax, padded = _group_amax(x.float(), granularity)
    scale = fmax / amax.clamp(min=_TINY)
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    q = (g * scale).clamp(-fmax, fmax).to(dtype).float() / scale
    return _ungroup(q, x, granularity, padded).to(x.dtype)


def _round_e2m1(v: Tensor) -> Tensor:
    """Nearest e2m1 value of ``|v| <= 6`` (ties to the even code, i.e. the smaller mantissa)."""
    grid = _GRIDS.get(v.device)
    if grid is None:
        grid = _GRIDS[v.device] = _E2M1_GRID.to(v.device)
    a = v.abs().clamp(max=FP4_E2M1_MAX)
    hi = torch.bucketize(a, grid).clamp(max=len(grid) - 1)  # first grid point >= a
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    # codes alternate even/odd along the grid: on a tie take the even code
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return torch.sign(v) * torch.where(pick_hi, grid[hi], grid[lo])


@torch.no_grad()
def qdq_fp4(x: Tensor, block_size: int = 32, scale_format: str = "e8m0") -> Tensor:
    """``x`` rounded through fp4 e2m1 with one scale per ``block_size`` elements of the last dim.

    ``scale_format`` "e8m0" (MXFP4: a power of two, block 32) or "e4m3" (NVFP4: an fp8 e4m3
    number, block 16). The scale is rounded up so ``amax / scale <= 6`` (no saturation).

    Raises:
        ValueError: for a non-positive block size or an unknown scale format.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if scale_format not in ("e8m0", "e4m3"):
        raise ValueError(
            f"scale_format must be 'e8m0' (MXFP4) or 'e4m3' (NVFP4), got {scale_format!r}"
        )
    xp, size = _pad_last(x.float(), block_size)
    g = xp.reshape(*xp.shape[:-1], xp.shape[-1] // block_size, block_size)
    amax = g.abs().amax(dim=-1, keepdim=True)
    ideal = (amax / FP4_E2M1_MAX).clamp(min=_TINY)
    if scale_format == "e8m0":
        scale = torch.exp2(torch.ceil(torch.log2(ideal)))
    else:
        scale = ideal.to(torch.float8_e4m3fn).float()
        # RNE may round the scale below the ideal one: move it up (>= one e4m3 step)
        up = (scale * (1 + 2.0**-3)).to(torch.float8_e4m3fn).float()
        scale = torch.where(scale < ideal, up, scale)
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    q = _round_e2m1(g / scale) * scale
    return q.reshape(xp.shape)[..., :size].to(x.dtype)
