"""The fp8 wire format of the expert dispatch (DeepSeek-V3 section 3.3: activations go to the
experts' ranks in fp8, one scale per 1 x 128 tile, and the combine comes back in 16 bits).

A row of H values crosses ranks as H e4m3 bytes followed by its T = ceil(H / 128) fp32
scales (4T bytes), packed into one uint8 row so that one all-to-all carries both (gloo and
NCCL move bytes of any dtype). The receiver gets exactly ``qdq_fp8(x, "e4m3", "tile")``
(`nanotrain.precision.quant`), the values an fp8 GEMM with DeepSeek's activation tiles reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["TILE", "fp8_row_bytes", "fp8_wire_roundtrip", "pack_fp8_rows", "unpack_fp8_rows"]

TILE = 128
_E4M3 = torch.float8_e4m3fn
_TINY = 1e-30  # an all-zero tile gets scale 1 instead of a division by zero


def fp8_row_bytes(hidden: int) -> int:
    """Bytes one row of `hidden` values takes on the wire: the values and their tile scales."""
    return hidden + 4 * -(-hidden // TILE)


@torch.no_grad()
def pack_fp8_rows(x: Tensor) -> Tensor:
    """x [M, H] (any float dtype) -> [M, `fp8_row_bytes`(H)] uint8: each row's values scaled
    per 1 x 128 tile so the tile's largest magnitude maps to e4m3's max (448), rounded to
    e4m3, then the tiles' fp32 scales."""
    m, h = x.shape
    tiles = -(-h // TILE)
    grouped = F.pad(x.float(), (0, tiles * TILE - h)).view(m, tiles, TILE)
    amax = grouped.abs().amax(dim=-1, keepdim=True)  # (M, T, 1)
    fmax = torch.finfo(_E4M3).max
    scale = fmax / amax.clamp(min=_TINY)
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    values = (grouped * scale).clamp(-fmax, fmax).to(_E4M3).view(m, tiles * TILE)[:, :h]
    scales = scale.view(m, tiles).contiguous().view(torch.uint8)  # (M, 4T)
    return torch.cat([values.contiguous().view(torch.uint8), scales], dim=1)


def unpack_fp8_rows(packed: Tensor, hidden: int, dtype: torch.dtype) -> Tensor:
    """[R, `fp8_row_bytes`(hidden)] uint8 from `pack_fp8_rows` -> [R, hidden] in `dtype`."""
    r = packed.shape[0]
    tiles = -(-hidden // TILE)
    values = packed[:, :hidden].contiguous().view(_E4M3).float()  # (R, H)
    scales = packed[:, hidden:].contiguous().view(torch.float32).view(r, tiles, 1)
    grouped = F.pad(values, (0, tiles * TILE - hidden)).view(r, tiles, TILE)
    return (grouped / scales).view(r, tiles * TILE)[:, :hidden].to(dtype)


class _WireRoundTrip(torch.autograd.Function):
    """Forward: what the fp8 wire delivers; backward: the gradient as it is, as the wire's
    all-to-all hands it back."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return unpack_fp8_rows(pack_fp8_rows(x), x.shape[-1], x.dtype)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad


def fp8_wire_roundtrip(x: Tensor) -> Tensor:
    """x [M, H] as the fp8 wire would deliver it (``unpack_fp8_rows(pack_fp8_rows(x))``), with
    the gradient passed straight through: the rows of a dispatch in fp8 that crosses no rank
    (one expert-parallel rank), so that every layout computes on the same values."""
    return _WireRoundTrip.apply(x)
