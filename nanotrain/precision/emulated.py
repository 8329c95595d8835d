"""Emulated fp8 / fp4 training on any machine: quantize-dequantize around the linear GEMMs.

Each linear layer the policy sends low computes ``y = q(x) q(W)^T + b`` where ``q`` rounds
through the low-precision format with the recipe's scales (`nanotrain.precision.quant`); in
backward the output gradient is rounded too when the recipe says so (e5m2 in the "hybrid"
format, as TE's default fp8 recipe; e4m3 otherwise), and ``dx = q(g) q(W)``,
``dW = q(g)^T q(x)``. The GEMMs themselves run in bf16 (under bf16 autocast, like the rest of
the model), so the numbers are those of an fp8/fp4 GEMM with bf16 accumulation, not its speed:
emulation is for studying numerics and testing recipes without an fp8 GPU.

The swap happens inside the layer's own forward (a `TorchFunctionMode` that catches its
``F.linear``), so tensor-/sequence-parallel layers keep their communication and sharding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nanotrain.models.fp8_saves import keep_in_fp8_like
from nanotrain.precision.base import wrap_forward
from nanotrain.precision.mixed import BF16Mixed
from nanotrain.precision.policy import PrecisionPolicy, is_grouped_experts
from nanotrain.precision.quant import qdq_fp4, qdq_fp8

__all__ = ["EmulatedFP4", "EmulatedFP8", "FP8_RECIPES"]

#: recipe -> (activation/gradient granularity, weight granularity)
FP8_RECIPES: dict[str, tuple[str, str]] = {
    "tensorwise": ("tensor", "tensor"),  # TE delayed/current scaling: one scale per tensor
    "blockwise": ("tile", "block"),  # DeepSeek-V3: 1x128 activation tiles, 128x128 weights
    "tile": ("tile", "tile"),  # 1x128 tiles everywhere (MXFP8-like, coarser blocks)
}

Quantizer = Callable[[Tensor], Tensor]
_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)


class _QuantizedLinear(torch.autograd.Function):
    """forward: ``F.linear(q_x(x), q_w(w), b)``; backward: grads of that with ``q_g(g)``."""

    @staticmethod
    def forward(ctx, x, w, b, q_x, q_w, q_g, compute_dtype):  # type: ignore[override]
        # the routed experts' rows kept in fp8 (`Fp8Saves`) keep this copy of them so too
        xq = keep_in_fp8_like(x, q_x(x).to(compute_dtype))
        wq = q_w(w).to(compute_dtype)
        ctx.save_for_backward(xq, wq)
        ctx.q_g, ctx.has_bias = q_g, b is not None
        ctx.dtypes = (x.dtype, w.dtype, None if b is None else b.dtype)
        bias = None if b is None else b.to(compute_dtype)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(xq, wq, bias)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        xq, wq = ctx.saved_tensors
        g = g.to(xq.dtype)
        if ctx.q_g is not None:
            g = ctx.q_g(g)
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        g2 = g.reshape(-1, g.shape[-1])
        dx = (g @ wq).to(x_dtype)
        dw = (g2.t() @ xq.reshape(-1, xq.shape[-1])).to(w_dtype)
        db = g2.sum(0).to(b_dtype) if ctx.has_bias else None
        return dx, dw, db, None, None, None, None


class _LinearMode(torch.overrides.TorchFunctionMode):
    """Replaces ``F.linear(x, W, b)`` and ``x @ W.T`` (the grouped experts' form, a 2-D weight
    view as second operand) inside one layer's forward with `_QuantizedLinear`."""

    def __init__(self, q_x: Quantizer, q_w: Quantizer, q_g: Quantizer | None, device: str):
        super().__init__()
        self.q_x, self.q_w, self.q_g, self.device = q_x, q_w, q_g, device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if torch.is_autocast_enabled(self.device):
                dtype = torch.get_autocast_dtype(self.device)
            else:
                dtype = x.dtype
            return _QuantizedLinear.apply(x, w, b, self.q_x, self.q_w, self.q_g, dtype)
        if func in _MATMULS and len(args) == 2 and args[1].dim() == 2 and args[0].dim() >= 2:
            x, w_t = args
            dtype = self._dtype(x)
            # x @ W^T == F.linear(x, W): quantize W in its own [out, in] layout
            return _QuantizedLinear.apply(x, w_t.t(), None, self.q_x, self.q_w, self.q_g, dtype)
        return func(*args, **kwargs)

    def _dtype(self, x: Tensor) -> torch.dtype:
        if torch.is_autocast_enabled(self.device):
            return torch.get_autocast_dtype(self.device)
        return x.dtype


class _Emulated(BF16Mixed):
    """Shared by the fp8 and fp4 emulations: bf16 autocast plus quantized linear layers."""

    quantize_grads = True

    def quantizers(self) -> tuple[Quantizer, Quantizer, Quantizer | None]:
        raise NotImplementedError

    def apply_to_linear(self, name: str, layer: nn.Module, low: bool) -> None:
        if not low:
            super().apply_to_linear(name, layer, low)
            return
        q_x, q_w, q_g = self.quantizers()
        device = self.device_type
        wrap_forward(layer, lambda: _LinearMode(q_x, q_w, q_g, device))

    def peak_precision(self) -> str:
        # emulation runs bf16 GEMMs: the hardware peak that applies is bf16's
        return "bf16"


class EmulatedFP8(_Emulated):
    """ "fp8-emulated": fp8 quantize-dequantize of linear inputs, weights (and output grads).

    Args:
        recipe: "blockwise" (DeepSeek-V3: 1x128 activation/gradient tiles, 128x128 weight
            blocks; default), "tensorwise" (one scale per tensor) or "tile" (1x128 everywhere).
        fmt: "e4m3" (forward and backward in e4m3, as DeepSeek-V3) or "hybrid" (e4m3 forward,
            e5m2 gradients).
        quantize_grads: also round the output gradient in backward.
        policy, reduce_dtype: see `Precision`.

    Raises:
        ValueError: for an unknown recipe or format.
    """

    name = "fp8-emulated"

    def __init__(
        self,
        recipe: str = "blockwise",
        fmt: str = "e4m3",
        quantize_grads: bool = True,
        policy: PrecisionPolicy | None = None,
        reduce_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(policy, reduce_dtype)
        if recipe not in FP8_RECIPES:
            raise ValueError(f"unknown fp8 recipe {recipe!r}; use one of {sorted(FP8_RECIPES)}")
        if fmt not in ("e4m3", "hybrid"):
            raise ValueError(f"fmt must be 'e4m3' or 'hybrid', got {fmt!r}")
        self.recipe, self.fmt, self.quantize_grads = recipe, fmt, quantize_grads
        self.low_precision_format = f"fp8 {fmt} ({recipe} scaling, emulated)"

    def apply_to_linear(self, name: str, layer: nn.Module, low: bool) -> None:
        super().apply_to_linear(name, layer, low)
        if low and is_grouped_experts(layer):
            # DeepSeek-V3's dispatch: the experts' inputs cross ranks in fp8 with 1x128 tile
            # scales; under the blockwise and tile recipes the experts' GEMMs round to those
            # same tiles (rounding twice changes nothing), under "tensorwise" they round the
            # arrived values once more with one scale per tensor
            layer.dispatches_fp8 = True

    def quantizers(self) -> tuple[Quantizer, Quantizer, Quantizer | None]:
        act, weight = FP8_RECIPES[self.recipe]
        grad_fmt = "e5m2" if self.fmt == "hybrid" else "e4m3"

        def q_x(t: Tensor) -> Tensor:
            return qdq_fp8(t, "e4m3", act)

        def q_w(t: Tensor) -> Tensor:
            return qdq_fp8(t, "e4m3", weight)

        def q_g(t: Tensor) -> Tensor:
            return qdq_fp8(t, grad_fmt, act)

        return q_x, q_w, (q_g if self.quantize_grads else None)

    def summary(self) -> str:
        return (
            f"fp32 parameters and optimizer state; bf16 autocast; policy-selected linear layers "
            f"quantize-dequantized to {self.low_precision_format}"
            + ("; output gradients too" if self.quantize_grads else "")
        )


class EmulatedFP4(_Emulated):
    """ "fp4-emulated": fp4 e2m1 quantize-dequantize with block scales.

    Args:
        block_size: elements per scale along the last dim (32: MXFP4, 16: NVFP4).
        scale_format: "e8m0" (power-of-two scales, MXFP4) or "e4m3" (fp8 scales, NVFP4).
        quantize_grads: also round the output gradient to fp4 in backward (default off:
            published fp4 recipes keep at least some gradient GEMMs higher).
        policy, reduce_dtype: see `Precision`.

    Raises:
        ValueError: for a bad block size or scale format.
    """

    name = "fp4-emulated"

    def __init__(
        self,
        block_size: int = 32,
        scale_format: str = "e8m0",
        quantize_grads: bool = False,
        policy: PrecisionPolicy | None = None,
        reduce_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(policy, reduce_dtype)
        qdq_fp4(torch.zeros(1), block_size, scale_format)  # validates both, raises ValueError
        self.block_size, self.scale_format = block_size, scale_format
        self.quantize_grads = quantize_grads
        self.low_precision_format = (
            f"fp4 e2m1 (block {block_size}, {scale_format} scales, emulated)"
        )

    def quantizers(self) -> tuple[Quantizer, Quantizer, Quantizer | None]:
        def q(t: Tensor) -> Tensor:
            return qdq_fp4(t, self.block_size, self.scale_format)

        return q, q, (q if self.quantize_grads else None)

    def summary(self) -> str:
        return (
            f"fp32 parameters and optimizer state; bf16 autocast; policy-selected linear layers "
            f"quantize-dequantized to {self.low_precision_format}"
        )
