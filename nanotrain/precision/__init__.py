"""Precision plugins: fp32, bf16 (mixed and true), fp16 with loss scaling, fp8 through
Transformer Engine or torchao, emulated fp8/fp4, and the per-module policy. See docs/precision.md.

A strategy applies the plugin (`Strategy.precision`); the Trainer only accepts
``precision=`` (a name or a plugin) and hands it over.
"""

from __future__ import annotations

from typing import Any

from nanotrain.precision.base import Precision
from nanotrain.precision.emulated import FP8_RECIPES, EmulatedFP4, EmulatedFP8
from nanotrain.precision.master import MainGrads, MasterWeights, grad_of
from nanotrain.precision.mixed import BF16Mixed, BF16True, FP16Mixed
from nanotrain.precision.policy import DEEPSEEK_V3_KEEP_HIGH, PrecisionPolicy
from nanotrain.precision.quant import qdq_fp4, qdq_fp8, rounding_bound
from nanotrain.precision.scaler import DynamicLossScaler
from nanotrain.precision.te import TE_RECIPES, TransformerEnginePrecision
from nanotrain.precision.torchao_fp8 import TORCHAO_RECIPES, TorchaoFloat8

#: the names `resolve_precision` accepts and the plugin each builds (with its defaults)
PRECISIONS: dict[str, Any] = {
    "32-true": Precision,
    "bf16-mixed": BF16Mixed,
    "bf16-true": BF16True,
    "16-mixed": FP16Mixed,
    "transformer-engine": TransformerEnginePrecision,
    "torchao-float8": TorchaoFloat8,
    "fp8-emulated": EmulatedFP8,
    "fp4-emulated": EmulatedFP4,
}
_ALIASES = {"32": "32-true", "fp32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}


def precision_name(precision: Precision | str | int | None) -> str:
    """The canonical name of a precision given as `resolve_precision` takes it (an alias such
    as "bf16" or 32, a plugin object, None), without constructing a plugin.

    Raises:
        ValueError: for an unknown name. TypeError: for anything else.
    """
    if precision is None:
        return Precision.name
    if isinstance(precision, Precision):
        return precision.name
    if isinstance(precision, (str, int)) and not isinstance(precision, bool):
        name = _ALIASES.get(str(precision).lower(), str(precision).lower())
        if name not in PRECISIONS:
            raise ValueError(
                f"unknown precision {precision!r}; use one of {sorted(PRECISIONS)} or a "
                "nanotrain.precision plugin object"
            )
        return name
    raise TypeError(
        f"precision must be a name such as 'bf16-mixed' or a nanotrain.precision plugin, got "
        f"{type(precision).__name__}"
    )


def resolve_precision(precision: Precision | str | int | None) -> Precision:
    """A plugin for a name (Lightning's where Lightning has one) or the plugin itself.

    Raises:
        ValueError: for an unknown name (the message lists the valid ones), or what the
            plugin raises at construction (e.g. Transformer Engine missing).
        TypeError: for anything else.
    """
    if precision is None:
        return Precision()
    if isinstance(precision, Precision):
        return precision
    return PRECISIONS[precision_name(precision)]()


__all__ = [
    "BF16Mixed",
    "BF16True",
    "DEEPSEEK_V3_KEEP_HIGH",
    "DynamicLossScaler",
    "EmulatedFP4",
    "EmulatedFP8",
    "FP16Mixed",
    "FP8_RECIPES",
    "MainGrads",
    "MasterWeights",
    "PRECISIONS",
    "Precision",
    "PrecisionPolicy",
    "TE_RECIPES",
    "TORCHAO_RECIPES",
    "TorchaoFloat8",
    "TransformerEnginePrecision",
    "grad_of",
    "precision_name",
    "qdq_fp4",
    "qdq_fp8",
    "resolve_precision",
    "rounding_bound",
]
