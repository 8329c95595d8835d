"""The FLOPs one pipeline stage computes per training step, and their seconds at the GPU's
peaks (the compute part of `nanotrain.planning.plan`'s step-time model, docs/planning.md)."""

from __future__ import annotations

from typing import Any

from nanotrain.models.accounting import (
    FlopParts,
    attention_flops_per_token,
    flops_per_token_parts,
    linear_flops_per_token_parts,
    up_projection_flops_per_token,
)
from nanotrain.models.moe import expert_capacity
from nanotrain.planning.gpus import GPUSpec, peak_column
from nanotrain.planning.layout import PlanLayout, Workload
from nanotrain.planning.rank_model import config_key

__all__ = ["compute_seconds", "flop_parts", "routed_rows_per_copy", "stage_flops"]


def stage_flops(config: Any, layout: PlanLayout, workload: Workload, chunks: list[list[int]],
                 last: bool) -> tuple[float, float, float]:  # fmt: skip
    """Training FLOPs per step on one rank of the stage holding `chunks` (recompute included),
    the part of them in plain linear layers (`linear_flops_per_token_parts`: what an fp8
    precision runs in fp8) and the part in the routed experts (in fp8 too with
    `layout.fp8_expert_gemms`: `compute_seconds`'s `fp8_expert_gemms`)."""
    parts, (linear_parts, mtp_linear, projections) = flop_parts(config, workload.seq_len)
    attention = attention_flops_per_token(config, workload.seq_len)
    up = up_projection_flops_per_token(config)
    layers = routed = linear = 0.0
    for c in chunks:
        for i, mode in zip(c, layout.chunk_recomputes(c), strict=True):
            layer, layer_routed, layer_linear = parts.layers[i], parts.routed[i], linear_parts[i]
            if mode == "full":  # one more forward of the layer
                layer, layer_routed, layer_linear = (
                    x * 4 / 3 for x in (layer, layer_routed, layer_linear)
                )
            elif mode == "selective":  # the attention block's forward again
                layer, layer_linear = layer + attention / 3, layer_linear + projections / 3
            elif mode == "light":  # MLA's up-projections twice more
                layer, layer_linear = layer + 2 * up, layer_linear + 2 * up
            layers, routed, linear = layers + layer, routed + layer_routed, linear + layer_linear
    extras = (parts.head + parts.mtp) if last else 0.0
    mtp_routed = parts.mtp_routed if last else 0.0
    extras_linear = mtp_linear if last else 0.0
    depth = getattr(config, "mtp_depth", 0) if last else 0
    if layout.recompute == "full":  # the head + loss and the MTP modules' forward again
        extras, mtp_routed, extras_linear = (
            extras * 4 / 3,
            mtp_routed * 4 / 3,
            extras_linear * 4 / 3,
        )
    elif layout.recompute == "light":  # the MTP blocks' up-projections
        extras, extras_linear = extras + 2 * up * depth, extras_linear + 2 * up * depth
    elif layout.recompute == "selective":  # the MTP blocks' attention
        extras, extras_linear = (
            extras + attention / 3 * depth,
            extras_linear + projections / 3 * depth,
        )
    routed += mtp_routed
    split = layers + extras - routed  # tensor parallelism divides all of this
    tokens = workload.tokens_per_step / layout.dp  # each dp replica sees its share
    routed_rank = routed * routed_rows_per_copy(config, layout, workload) * tokens
    total = split / layout.tp * tokens + routed_rank
    return total, (linear + extras_linear) / layout.tp * tokens, routed_rank


def compute_seconds(
    flops: tuple[float, float, float],
    gpu: GPUSpec,
    precision: str,
    efficiency: float,
    shape_factors: tuple[float, float] = (1.0, 1.0),
    fp8_expert_gemms: bool = False,
) -> float:
    """Seconds for a stage's (FLOPs, FLOPs in plain linear layers, FLOPs in routed experts:
    `stage_flops`) at `efficiency` of the peak: under an fp8 precision the linear layers at
    the fp8 peak, the routed experts too with `fp8_expert_gemms` (priced, not run yet:
    `PlanLayout.fp8_expert_gemms`), and the rest (attention scores, router, head) at the bf16
    one, as the plugins run them; else all at the precision's peak. `shape_factors` (plain
    linears, routed experts: `gemm_shapes.stage_shape_factors`) scale the efficiency of
    those GEMMs for their shapes."""
    total, linear, routed = flops
    f_linear, f_routed = shape_factors
    peak = gpu.flops_for(precision)
    rest_peak = gpu.column_flops("bf16") if peak_column(precision) == "fp8" else peak
    routed_peak = peak if fp8_expert_gemms else rest_peak
    rest = total - linear - routed
    return (linear / (peak * f_linear) + routed / (routed_peak * f_routed) + rest / rest_peak) / (
        efficiency
    )


def routed_rows_per_copy(config: Any, layout: PlanLayout, workload: Workload) -> float:
    """Rows the routed experts compute on one tp rank per routed token copy of its replica.

    The routed experts are replicated over tp (`DeepSeekMoE`): without sequence parallelism
    every tp rank runs them on all of its replica's tokens (1); with it each runs only its own
    T / tp tokens (1 / tp), unless a capacity factor makes it gather the whole sequences
    first (1 again). A capacity factor f runs E x C slots per sequence of S tokens,
    C = ceil(f S K / E), whether filled or not: E C / (S K) rows per copy (about f)."""
    capacity = expert_capacity(config, workload.seq_len)
    if capacity is None:
        return 1 / layout.tp if layout.sequence_parallel else 1.0
    return config.n_routed_experts * capacity / (workload.seq_len * config.num_experts_per_tok)


_FLOPS: dict[tuple[str, int], tuple[FlopParts, tuple[tuple[float, ...], float, float]]] = {}


def flop_parts(
    config: Any, seq_len: int
) -> tuple[FlopParts, tuple[tuple[float, ...], float, float]]:
    """`flops_per_token_parts` and `linear_flops_per_token_parts`, cached (a search prices
    thousands of layouts of one model)."""
    key = (config_key(config), seq_len)
    if key not in _FLOPS:
        _FLOPS[key] = (
            flops_per_token_parts(config, seq_len),
            linear_flops_per_token_parts(config),
        )
    return _FLOPS[key]
