"""fp8 training through NVIDIA Transformer Engine ("transformer-engine").

The GEMM of every linear layer the policy sends low is run by a ``transformer_engine.pytorch
.Linear`` *without* its own communication (``parallel_mode=None``) that shares the layer's
weight parameter: nanotrain's Column/RowParallelLinear keep their tp/sp gathers and reductions
and their sharding, names and state dict; only the local ``F.linear`` becomes an fp8 GEMM.
The forward runs under ``fp8_autocast`` with the chosen recipe and bf16 autocast elsewhere.

Recipes, as TE names them (`transformer_engine.common.recipe`):

- "delayed": ``DelayedScaling`` (per-tensor scale from an amax history; e4m3/e5m2 hybrid),
- "current": ``Float8CurrentScaling`` (per-tensor scale from this step's amax),
- "blockwise": ``Float8BlockScaling`` (DeepSeek-V3: 1x128 activation tiles, 128x128 weight
  blocks; Hopper),
- "mxfp8": ``MXFP8BlockScaling`` (32-element blocks with e8m0 scales; Blackwell).

The import is guarded: TE missing (ImportError) and an installed-but-empty TE meta package
(which raises RuntimeError on import) both give the same clear error at construction.
This path needs a CUDA GPU; it was not run in the session that wrote it (no GPU was available).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any

import torch
from torch import nn

from nanotrain.precision.base import SwapLinearMode, wrap_forward
from nanotrain.precision.mixed import BF16Mixed
from nanotrain.precision.policy import PrecisionPolicy, is_plain_linear

__all__ = ["TE_RECIPES", "TransformerEnginePrecision", "import_transformer_engine"]

#: our recipe name -> TE's recipe class name in transformer_engine.common.recipe
TE_RECIPES: dict[str, str] = {
    "delayed": "DelayedScaling",
    "current": "Float8CurrentScaling",
    "blockwise": "Float8BlockScaling",
    "mxfp8": "MXFP8BlockScaling",
}
_INSTALL = (
    'install Transformer Engine for your CUDA and torch: `pip install "nanotrain[te]"` '
    "(or `pip install --no-build-isolation transformer_engine[pytorch]`) on a machine with an "
    "NVIDIA GPU; without one use precision='fp8-emulated' to study fp8 numerics"
)


def import_transformer_engine() -> Any:
    """Import ``transformer_engine.pytorch`` or raise a ValueError that says what to install.

    Raises:
        ValueError: when TE is not installed (ImportError) or is an empty meta package /
            has no usable build (RuntimeError or OSError on import).
    """
    try:
        import transformer_engine.pytorch as te  # noqa: PLC0415
    except (ImportError, RuntimeError, OSError) as exc:
        raise ValueError(
            f"precision='transformer-engine' needs Transformer Engine, which cannot be "
            f"imported here ({type(exc).__name__}: {exc}); {_INSTALL}"
        ) from exc
    return te


def _check_support(te: Any, recipe: str) -> None:
    """Raise ValueError when this GPU cannot run ``recipe`` (TE's own checks where present)."""
    fp8 = getattr(te, "fp8", None)
    checks = {
        "delayed": "check_fp8_support",
        "current": "check_fp8_support",
        "blockwise": "check_fp8_block_scaling_support",
        "mxfp8": "check_mxfp8_support",
    }
    check = getattr(fp8, checks[recipe], None) if fp8 is not None else None
    if check is None:
        return
    ok, reason = check()
    if not ok:
        raise ValueError(
            f"Transformer Engine cannot run the {recipe!r} fp8 recipe on this GPU: {reason}; "
            "pick another recipe (e.g. 'delayed' or 'current' on Hopper, 'mxfp8' on Blackwell)"
        )


def te_fp8_context(te: Any, recipe: Any) -> contextlib.AbstractContextManager:
    """Transformer Engine's fp8 region for `recipe`: `te.autocast(recipe=...)` where this TE
    has it (the newer name), else `te.fp8_autocast(fp8_recipe=...)`. `te`: the imported
    `transformer_engine.pytorch`."""
    autocast = getattr(te, "autocast", None)
    if autocast is not None and "recipe" in inspect.signature(autocast).parameters:
        return autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


class TransformerEnginePrecision(BF16Mixed):
    """ "transformer-engine": fp8 GEMMs through Transformer Engine, bf16 autocast elsewhere.

    Args:
        recipe: "delayed", "current", "blockwise" or "mxfp8" (see module docstring), or a TE
            recipe object.
        fp8_format: "hybrid" (e4m3 forward, e5m2 backward) or "e4m3" for the named recipes.
        policy, reduce_dtype: see `Precision`.

    Raises:
        ValueError: for an unknown recipe or format; when Transformer Engine cannot be
            imported, there is no CUDA device, or the GPU does not support the recipe
            (all at construction, with what to install or pick instead).
    """

    name = "transformer-engine"

    def __init__(
        self,
        recipe: str | Any = "delayed",
        fp8_format: str = "hybrid",
        policy: PrecisionPolicy | None = None,
        reduce_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(policy, reduce_dtype)
        if isinstance(recipe, str) and recipe not in TE_RECIPES:
            raise ValueError(f"unknown fp8 recipe {recipe!r}; use one of {sorted(TE_RECIPES)}")
        if fp8_format not in ("hybrid", "e4m3"):
            raise ValueError(f"fp8_format must be 'hybrid' or 'e4m3', got {fp8_format!r}")
        self.te = import_transformer_engine()
        if not torch.cuda.is_available():
            raise ValueError(
                "precision='transformer-engine' needs a CUDA GPU (fp8 GEMMs run on Hopper or "
                "newer); on this machine use precision='fp8-emulated'"
            )
        if isinstance(recipe, str):
            _check_support(self.te, recipe)
            self.recipe_name = recipe
            self.recipe = self._make_recipe(recipe, fp8_format)
        else:
            self.recipe_name, self.recipe = type(recipe).__name__, recipe
        self.low_precision_format = f"fp8 via Transformer Engine ({self.recipe_name})"
        self._te_linears: list[Any] = []

    @staticmethod
    def _make_recipe(recipe: str, fp8_format: str) -> Any:
        from transformer_engine.common import recipe as te_recipe  # noqa: PLC0415

        fmt = te_recipe.Format.HYBRID if fp8_format == "hybrid" else te_recipe.Format.E4M3
        cls = getattr(te_recipe, TE_RECIPES[recipe])
        if recipe in ("blockwise", "mxfp8"):
            return cls(fp8_format=te_recipe.Format.E4M3)  # these recipes are e4m3-only
        return cls(fp8_format=fmt)

    def apply_to_linear(self, name: str, layer: nn.Module, low: bool) -> None:
        if not low or not is_plain_linear(layer):
            # kept high, or the grouped experts (no TE swap yet: they run in bf16 autocast)
            super().apply_to_linear(name, layer, low)
            return
        weight = layer.weight
        out_features, in_features = weight.shape
        te_linear = self.te.Linear(
            in_features,
            out_features,
            bias=False,
            params_dtype=weight.dtype,
            device=weight.device,
        )
        # share the layer's weight: names, sharding and state dict stay nanotrain's
        te_linear.weight = weight
        self._te_linears.append(te_linear)  # not a submodule: no duplicate state-dict entry
        wrap_forward(layer, functools.partial(SwapLinearMode, te_linear, weight))

    def forward_context(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        stack.enter_context(super().forward_context())
        stack.enter_context(te_fp8_context(self.te, self.recipe))
        return stack

    def peak_precision(self) -> str:
        return "fp8"

    def summary(self) -> str:
        return (
            f"fp32 parameters and optimizer state; bf16 autocast; policy-selected linear GEMMs "
            f"in {self.low_precision_format}"
        )
