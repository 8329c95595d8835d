"""Per-module precision policy: which layers run their GEMMs in low precision, by name pattern.

A module is *low precision* when it is a GEMM layer (``nn.Linear``, `ColumnParallelLinear`,
`RowParallelLinear`, the MoE router `TopKRouter`, the routed experts' `GroupedExperts`), its
full name (as ``module.named_modules()`` gives it) matches one of
``low_precision`` and none of ``keep_high_precision`` (fnmatch patterns, ``*`` matches dots too).
Everything the policy keeps high runs in the plugin's higher precision (fp32 under autocast,
with autocast switched off for it).

The defaults follow DeepSeek-V3 (tech report, section 3.3): the embedding, the output head,
the MoE router (gating), the normalizations and the attention softmax stay in higher precision;
the GEMMs of attention projections, MLPs, shared and routed experts go low. The attention
softmax and the norms are not GEMM layers, so they never go low; the router is kept high by
``*.gate`` (under autocast its GEMM then really runs in fp32).
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from torch import nn

__all__ = ["DEEPSEEK_V3_KEEP_HIGH", "PrecisionPolicy", "is_linear"]

#: name patterns DeepSeek-V3 keeps in higher precision
DEEPSEEK_V3_KEEP_HIGH: tuple[str, ...] = (
    "*embed*",
    "*lm_head*",
    "*output*",
    "*.gate",
    "*router*",
    "*norm*",
)


def is_linear(module: nn.Module) -> bool:
    """True for the GEMM layers a policy decides about: those whose forward is one
    ``F.linear`` (nn.Linear, Column/RowParallelLinear, the MoE router) and the grouped routed
    experts (one ``x @ W.T`` per expert)."""
    from nanotrain.models.moe import TopKRouter

    return is_plain_linear(module) or is_grouped_experts(module) or isinstance(module, TopKRouter)


def is_plain_linear(module: nn.Module) -> bool:
    """True for nn.Linear and the tensor-parallel linears (forward = one ``F.linear``)."""
    from nanotrain.parallel.tensor import ColumnParallelLinear, RowParallelLinear

    return isinstance(module, (nn.Linear, ColumnParallelLinear, RowParallelLinear))


def is_grouped_experts(module: nn.Module) -> bool:
    """True for the MoE layer's routed experts (`nanotrain.models.expert_compute.GroupedExperts`)."""
    from nanotrain.models.moe import GroupedExperts

    return isinstance(module, GroupedExperts)


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which modules run low precision (see the module docstring).

    Args:
        low_precision: fnmatch patterns of module names that may go low (default: all).
        keep_high_precision: patterns that stay high even when they match ``low_precision``.

    Raises:
        TypeError: when a pattern list is a plain string or holds a non-string.
    """

    low_precision: Sequence[str] = ("*",)
    keep_high_precision: Sequence[str] = DEEPSEEK_V3_KEEP_HIGH

    def __post_init__(self) -> None:
        for name in ("low_precision", "keep_high_precision"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise TypeError(
                    f"PrecisionPolicy.{name} must be a list of name patterns, got {value!r}; "
                    f"e.g. {name}=['*mlp*']"
                )
            object.__setattr__(self, name, tuple(value))

    def goes_low(self, name: str) -> bool:
        """Whether a linear layer called ``name`` runs in low precision."""
        matches = any(fnmatch.fnmatchcase(name, p) for p in self.low_precision)
        return matches and not any(fnmatch.fnmatchcase(name, p) for p in self.keep_high_precision)

    def resolve(self, module: nn.Module) -> dict[str, str]:
        """``{name: "low" | "high"}`` for every linear layer of ``module`` (in module order)."""
        return {
            name: "low" if self.goes_low(name) else "high"
            for name, sub in module.named_modules()
            if is_linear(sub)
        }


def _collapse(names: list[str]) -> str:
    """Names with layer indices folded (``layers.*.mlp.up_proj``), each once, in order."""
    folded = dict.fromkeys(re.sub(r"\.\d+\.", ".*.", n) for n in names)
    return ", ".join(folded) or "-"


def describe(precision_name: str, resolved: dict[str, str], detail: str) -> str:
    """The human-readable policy report printed at start (layer indices folded; the full
    per-module list is in ``precision.json``)."""
    low = [n for n, v in resolved.items() if v == "low"]
    high = [n for n, v in resolved.items() if v == "high"]
    lines = [f"precision {precision_name}: {detail}"]
    lines.append(f"  low precision ({len(low)} linear layers): {_collapse(low)}")
    lines.append(f"  kept high precision ({len(high)}): {_collapse(high)}")
    return "\n".join(lines)


def write_report(run_dir: Path, payload: dict) -> Path:
    """Write the resolved policy as ``<run_dir>/precision.json``; returns the path."""
    path = Path(run_dir) / "precision.json"
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return path
