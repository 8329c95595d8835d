"""fp8 training through torchao's float8 linear layers ("torchao-float8").

Every linear layer the policy sends low has its local GEMM run by a torchao `Float8Linear`
(`torchao.float8.convert_to_float8_training`) that shares the layer's weight Parameter, as the
Transformer Engine plugin does: nanotrain's Column/RowParallelLinear keep their tp/sp
communication, sharding, names and state dict. Parameters, gradients and optimizer state stay
fp32; the rest of the model runs under bf16 autocast (as "bf16-mixed").

Recipes, as torchao names them (`Float8LinearConfig.from_recipe_name`):

- "tensorwise": one dynamic scale per tensor; e4m3 inputs and weights, e5m2 output gradients
  (torchao's fastest on H100: +25% tokens/s on Llama-3 8B in its own table);
- "rowwise": one scale per row, e4m3 throughout, power-of-two scales (more accurate, about
  +10% on the same model).

fp8 GEMMs lose to bf16 on small matrices (torchao's table: 0.80x at 1024 x 2048 x 1024), and
need every dimension a multiple of 16. With `filter_small=True` (default) a layer is kept in
bf16 where torchao's own filter for the recipe says fp8 will not pay
(`torchao.float8.float8_linear_utils._auto_filter_for_recipe`, the thresholds torchtitan uses);
`filter_small=False` converts every layer whose dimensions are multiples of 16. The routed
experts (`GroupedExperts`) run in bf16: torchao's float8 layers are linear layers.

Runs on CUDA GPUs with fp8 tensor cores (sm89 and newer) at fp8 speed, and on CPU through
`torch._scaled_mm` (for tests and numerics, not speed). torchao is optional:
`pip install "nanotrain[torchao]"`.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import Tensor, nn

from nanotrain.precision.base import SwapLinearMode, wrap_forward
from nanotrain.precision.mixed import BF16Mixed
from nanotrain.precision.policy import PrecisionPolicy, is_plain_linear

__all__ = ["TORCHAO_RECIPES", "TorchaoFloat8", "import_torchao_float8"]

#: recipe names torchao's `Float8LinearConfig.from_recipe_name` takes that this plugin offers
TORCHAO_RECIPES = ("tensorwise", "rowwise")


def import_torchao_float8() -> Any:
    """Import `torchao.float8` or raise a ValueError that says what to install.

    torchao logs a warning for each optional CUDA extension it cannot load (every CPU
    machine); those are not errors for float8 training, so they are silenced here.
    """
    quiet = logging.getLogger("torchao")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8  # noqa: PLC0415
    except (ImportError, RuntimeError, OSError) as exc:
        raise ValueError(
            f"precision='torchao-float8' needs torchao, which cannot be imported here "
            f'({type(exc).__name__}: {exc}); install it with `pip install "nanotrain[torchao]"` '
            "(or `pip install torchao`), or use precision='fp8-emulated'"
        ) from exc
    finally:
        quiet.setLevel(level)
    return float8


class TorchaoFloat8(BF16Mixed):
    """ "torchao-float8": fp8 GEMMs through torchao's float8 training, bf16 autocast elsewhere.

    Args:
        recipe: "tensorwise" (default) or "rowwise" (see the module docstring).
        filter_small: keep in bf16 the layers torchao's filter for the recipe says are too
            small for fp8 to pay; False converts every layer whose dims are multiples of 16.
        policy, reduce_dtype: see `Precision`.

    Raises:
        ValueError: for an unknown recipe, or when torchao cannot be imported (with what to
            install), at construction.
    """

    name = "torchao-float8"

    def __init__(
        self,
        recipe: str = "tensorwise",
        filter_small: bool = True,
        policy: PrecisionPolicy | None = None,
        reduce_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(policy, reduce_dtype)
        if recipe not in TORCHAO_RECIPES:
            raise ValueError(f"unknown torchao fp8 recipe {recipe!r}; use one of {TORCHAO_RECIPES}")
        self.float8 = import_torchao_float8()
        self.recipe, self.filter_small = recipe, filter_small
        self.config = self.float8.Float8LinearConfig.from_recipe_name(recipe)
        self.low_precision_format = f"fp8 via torchao ({recipe} scaling)"
        #: names of the layers the policy sends low that stay bf16, and why
        self.kept_bf16: dict[str, str] = {}

    def _fp8_linear(self, name: str, weight: nn.Parameter) -> nn.Module | None:
        """A torchao Float8Linear sharing `weight` ([out, in]), or None (and the reason in
        `kept_bf16`) where the filter keeps the layer in bf16."""
        out_features, in_features = weight.shape
        with torch.device("meta"):
            shell = nn.Linear(in_features, out_features, bias=False)
        shell.weight = weight
        holder = nn.Sequential(shell)
        from torchao.float8.float8_linear_utils import _auto_filter_for_recipe  # noqa: PLC0415

        if self.filter_small:
            keep = _auto_filter_for_recipe(self.recipe, filter_fqns=[])
        else:

            def keep(module: nn.Module, fqn: str) -> bool:
                return in_features % 16 == 0 and out_features % 16 == 0

        if not keep(shell, name):
            self.kept_bf16[name] = (
                f"{out_features}x{in_features}: "
                + ("a dim not a multiple of 16" if (in_features % 16 or out_features % 16)
                   else "too small for fp8 to pay (torchao's filter)")
            )  # fmt: skip
            return None
        self.float8.convert_to_float8_training(holder, config=self.config)
        return holder[0]

    def apply_to_linear(self, name: str, layer: nn.Module, low: bool) -> None:
        if not low or not is_plain_linear(layer):
            if low:
                self.kept_bf16[name] = "routed experts: torchao's float8 covers linear layers"
            super().apply_to_linear(name, layer, low)
            return
        weight = layer.weight
        linear = self._fp8_linear(name, weight)
        if linear is None:
            super().apply_to_linear(name, layer, low)  # bf16 under autocast
            return
        # `linear` is not a submodule of `layer`: no duplicate state-dict entry
        gemm = _in_autocast_dtype(linear, self.device_type)
        wrap_forward(layer, functools.partial(SwapLinearMode, gemm, weight))

    def setup_module(self, module: nn.Module, device: torch.device, is_global_zero: bool = True):
        self.kept_bf16 = {}
        super().setup_module(module, device, is_global_zero)

    def peak_precision(self) -> str:
        return "fp8"

    def summary(self) -> str:
        kept = f"; {len(self.kept_bf16)} of them kept bf16" if self.kept_bf16 else ""
        return (
            f"fp32 parameters and optimizer state; bf16 autocast; policy-selected linear GEMMs "
            f"in {self.low_precision_format}{kept}"
        )

    def report(self) -> dict[str, Any]:
        return {**super().report(), "kept_bf16": dict(self.kept_bf16)}


def _in_autocast_dtype(linear: nn.Module, device_type: str) -> Any:
    """`linear` called on its input cast to autocast's dtype (torchao's layer reads only
    CUDA's autocast state, so on the CPU the cast is done here), with autocast off inside."""

    def run(x: Tensor) -> Tensor:
        if torch.is_autocast_enabled(device_type):
            x = x.to(torch.get_autocast_dtype(device_type))
        with torch.autocast(device_type, enabled=False):
            return linear(x)

    return run
