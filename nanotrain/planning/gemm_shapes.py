"""GEMM efficiency by shape: each GEMM a pipeline stage runs priced by its M, N, K.

`gemm_efficiency` derives, from the hardware constants of `nanotrain.planning.calibration`
(`GEMM_TILE`, `SMS`, `HBM_EFFICIENCY`) and the large-shape `GEMM_EFFICIENCY`, the fraction
of the peak one GEMM (or one grouped GEMM over several equal groups) reaches: the
large-shape efficiency times the share of the SMs' tile slots that hold useful output
(partial tiles, a partial last wave), capped by the HBM roofline.

The GEMMs are those the model code runs per microbatch on one tp rank, forward, input
gradient and weight gradient of each:

* `layer_linear_gemms`: a decoder layer's plain linear layers (the FLOPs
  `linear_flops_per_token_parts` counts): dense attention's q, k, v, o
  (`nanotrain.models.attention`) or MLA's q (or q_a, q_b), kv_a, kv_b, o (the
  down-projections replicated over tp, on T / tp tokens under sequence parallelism), then
  the dense SwiGLU's gate, up, down (`nanotrain.models.layers`) or a MoE layer's shared
  experts (one SwiGLU of ``n_shared_experts * moe_intermediate_size``, split over tp);
* `routed_expert_gemms`: the routed experts' three grouped GEMMs over the rank's
  ``n_routed_experts / ep`` experts (`nanotrain.models.expert_compute.grouped_swiglu`), each
  expert receiving ``ep * T * rows_per_copy * top_k / n_routed_experts`` rows (balanced
  routing, as the rest of the planner assumes).

`stage_shape_factors` is their FLOP-weighted efficiency over the large-shape one, for the
plain linears of the stage's layers (and MTP blocks on the last stage) and for the routed
experts: what `plan_layout` divides their matmul seconds by (1.0 for shapes that fill whole
waves of whole tiles). Not covered: the attention scores (FlashAttention's kernels, measured
as such: `calibration.GEMM_EFFICIENCY`), the MoE router and the output head (one large GEMM).
"""

from __future__ import annotations

import math
from typing import Any

from nanotrain.planning.calibration import GEMM_EFFICIENCY, GEMM_TILE, HBM_EFFICIENCY, gpu_sms
from nanotrain.planning.communication_tp import is_moe_layer, mtp_is_moe
from nanotrain.planning.gpus import GPUSpec, peak_column
from nanotrain.planning.layout import PlanLayout, Workload
from nanotrain.planning.rank_model import config_key
from nanotrain.planning.stage_flops import flop_parts, routed_rows_per_copy

__all__ = [
    "dense_layer_gemms",
    "gemm_efficiency",
    "layer_linear_gemms",
    "layer_shape_factor",
    "routed_expert_gemms",
    "stage_shape_factors",
]

Gemm = tuple[int, int, int]


def gemm_efficiency(m: int, n: int, k: int, gpu: GPUSpec, element_bytes: int = 2,
                    groups: int = 1, column: str = "bf16") -> float:  # fmt: skip
    """Fraction of `gpu`'s `column` peak an (m x k) @ (k x n) GEMM reaches, or a grouped GEMM
    of `groups` such GEMMs in one kernel (their tiles share the waves).

    The large-shape efficiency times ``groups m n / (tiles * tile^2)`` times ``tiles /
    (waves * sms)``, with ``tiles = groups * ceil(m / tile) * ceil(n / tile)`` and ``waves =
    ceil(tiles / sms)``; then no faster than moving ``groups * element_bytes (mk + kn + mn)``
    at the HBM's sustained bandwidth (when the spec gives one).

    Raises:
        ValueError: a dimension or `groups` below 1, or a GPU with no SM count in
            `calibration.SMS`.
    """
    if min(m, n, k, groups) < 1:
        raise ValueError(f"GEMM dimensions must be >= 1, got m={m}, n={n}, k={k}, groups={groups}")
    sms = gpu_sms(gpu.name)
    if sms is None:
        raise ValueError(f"no SM count for {gpu.name!r}; known: see calibration.SMS")
    tile = int(GEMM_TILE.value)
    tiles = groups * math.ceil(m / tile) * math.ceil(n / tile)
    waves = math.ceil(tiles / sms)
    useful = groups * m * n / (waves * sms * tile * tile)
    efficiency = GEMM_EFFICIENCY.value * useful
    if gpu.mem_bw:
        flops = 2.0 * m * n * k * groups
        moved = groups * element_bytes * (m * k + k * n + m * n)
        memory_s = moved / (gpu.mem_bw * HBM_EFFICIENCY.value)
        efficiency = min(efficiency, flops / memory_s / gpu.column_flops(column))
    return efficiency


def _passes(forward: list[Gemm]) -> list[Gemm]:
    """Forward GEMMs, then each one's input gradient (m, k, n) and weight gradient (n, k, m)."""
    return forward + [(m, k, n) for m, n, k in forward] + [(n, k, m) for m, n, k in forward]


def _tokens(layout: PlanLayout, workload: Workload) -> int:
    """Rows of a tp rank's column-parallel GEMMs per microbatch: the whole sequences (gathered
    under sequence parallelism), over cp."""
    return workload.micro_batch_size * workload.seq_len // layout.cp


def dense_layer_gemms(config: Any, layout: PlanLayout, workload: Workload) -> list[Gemm]:
    """(m, n, k) of each GEMM one tp rank runs per microbatch through a dense decoder layer:
    forward (q, k, v, o, gate, up, down; m the microbatch's tokens, the whole sequences
    under sequence parallelism, over cp), then for each its input gradient (m, k, n) and
    weight gradient (n, k, m)."""
    return _passes(layer_linear_gemms(config, layout, workload, moe=False))


def layer_linear_gemms(config: Any, layout: PlanLayout, workload: Workload,
                       moe: bool) -> list[Gemm]:  # fmt: skip
    """Forward (m, n, k) of a decoder layer's plain linear layers on one tp rank per
    microbatch (module docstring): attention projections, then the dense SwiGLU or (`moe`)
    the shared experts (none without shared experts)."""
    c, tp = config, layout.tp
    h, m = c.hidden_size, _tokens(layout, workload)
    if hasattr(c, "kv_lora_rank"):  # MLA
        n, local = c.num_heads // tp, m // tp if layout.sequence_parallel else m
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        if c.q_lora_rank is None:
            attention = [(m, n * qk, h)]
        else:
            attention = [(local, c.q_lora_rank, h), (m, n * qk, c.q_lora_rank)]
        attention += [
            (local, c.kv_lora_rank + c.qk_rope_head_dim, h),
            (m, n * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
            (m, h, n * c.v_head_dim),
        ]
    else:
        d = c.head_dim or h // c.num_heads
        q, kv = c.num_heads * d // tp, (c.num_kv_heads or c.num_heads) * d // tp
        attention = [(m, q, h), (m, kv, h), (m, kv, h), (m, h, q)]
    width = (c.n_shared_experts * c.moe_intermediate_size if moe else c.intermediate_size) // tp
    mlp = [(m, width, h), (m, width, h), (m, h, width)] if width else []
    return attention + mlp


def routed_expert_gemms(config: Any, layout: PlanLayout,
                        workload: Workload) -> tuple[int, list[Gemm]]:  # fmt: skip
    """(experts on one rank, forward (m, n, k) of one expert's gate, up and down GEMMs) of a
    MoE layer per microbatch: each of the rank's ``n_routed_experts / ep`` experts gets
    ``ep * T * rows_per_copy * top_k / n_routed_experts`` rows (at least one), T the rank's
    tokens (`_tokens`), `routed_rows_per_copy` its rows per routed copy."""
    c = config
    experts = c.n_routed_experts // layout.ep
    copies = _tokens(layout, workload) * routed_rows_per_copy(c, layout, workload)
    rows = max(1, round(layout.ep * copies * c.num_experts_per_tok / c.n_routed_experts))
    h, width = c.hidden_size, c.moe_intermediate_size
    return experts, [(rows, width, h), (rows, width, h), (rows, h, width)]


def _factor(gemms: list[Gemm], gpu: GPUSpec, element_bytes: int, column: str,
            groups: int = 1) -> tuple[float, float]:  # fmt: skip
    """(FLOPs, FLOPs / efficiency-relative-to-large-shape) of `gemms`, forward and backward."""
    flops = seconds = 0.0
    for g in _passes(gemms):
        f = 2.0 * g[0] * g[1] * g[2]
        eff = gemm_efficiency(*g, gpu, element_bytes, groups, column) / GEMM_EFFICIENCY.value
        flops, seconds = flops + f, seconds + f / eff
    return flops, seconds


def layer_shape_factor(config: Any, layout: PlanLayout, workload: Workload, gpu: GPUSpec) -> float:
    """The FLOP-weighted efficiency of `dense_layer_gemms` over `GEMM_EFFICIENCY`: what a
    dense layer's linear layers run at, relative to the large-shape figure (<= 1)."""
    flops, seconds = _factor(layer_linear_gemms(config, layout, workload, False), gpu, 2, "bf16")
    return flops / seconds


def stage_shape_factors(config: Any, layout: PlanLayout, workload: Workload,
                        chunks: list[list[int]], last: bool, gpu: GPUSpec) -> tuple[float, float]:  # fmt: skip
    """(plain linears' factor, routed experts' factor) of the pipeline stage holding `chunks`
    (the MTP blocks too when `last`): each kind's FLOP-weighted efficiency over the
    large-shape `GEMM_EFFICIENCY`, its layers weighted by their linear FLOPs per token
    (`linear_flops_per_token_parts`). The linears run in fp8 (1-byte operands, fp8 peak)
    under an fp8 precision, the routed experts in bf16 (as `compute_seconds` prices them).
    (1.0, 1.0) on a device with no SM count (`calibration.gpu_sms`: the CPU)."""
    if gpu_sms(gpu.name) is None:
        return 1.0, 1.0
    kinds = {is_moe_layer(config, i) for c in chunks for i in c}
    if last and getattr(config, "mtp_depth", 0):
        kinds.add(mtp_is_moe(config))
    per_kind = _kind_factors(config, layout, workload, gpu, tuple(sorted(kinds)))
    _, (linear_parts, mtp_linear, _) = flop_parts(config, workload.seq_len)
    weights = {True: 0.0, False: 0.0}
    for c in chunks:
        for i in c:
            weights[is_moe_layer(config, i)] += linear_parts[i]
    if last and getattr(config, "mtp_depth", 0):
        weights[mtp_is_moe(config)] += mtp_linear
    total = sum(weights.values())
    linear = 1.0
    if total > 0:
        linear = total / sum(w / per_kind[kind][0] for kind, w in weights.items() if w)
    routed = per_kind.get(True, (1.0, 1.0))[1]
    return linear, routed


_KINDS: dict[tuple, dict[bool, tuple[float, float]]] = {}


def _kind_factors(config: Any, layout: PlanLayout, workload: Workload, gpu: GPUSpec,
                  kinds: tuple[bool, ...]) -> dict[bool, tuple[float, float]]:  # fmt: skip
    """Per layer kind (MoE or not): (linear factor, routed factor); cached per model, the
    sizes the shapes depend on and the GPU (a search prices thousands of layouts)."""
    fp8 = peak_column(workload.precision) == "fp8"
    key = (config_key(config), layout.tp, layout.cp, layout.ep, layout.sequence_parallel,
           workload.micro_batch_size, workload.seq_len, fp8, gpu.name, gpu.mem_bw,
           gpu.column_flops("bf16"), gpu.column_flops("fp8") if fp8 else 0.0, kinds,
           routed_rows_per_copy(config, layout, workload) if True in kinds else 0.0)  # fmt: skip
    if key in _KINDS:
        return _KINDS[key]
    size, column = (1, "fp8") if fp8 else (2, "bf16")
    out = {}
    for moe in kinds:
        gemms = layer_linear_gemms(config, layout, workload, moe)
        flops, seconds = _factor(gemms, gpu, size, column)
        routed = 1.0
        if moe:
            experts, expert_gemms = routed_expert_gemms(config, layout, workload)
            r_flops, r_seconds = _factor(expert_gemms, gpu, 2, "bf16", groups=experts)
            routed = r_flops / r_seconds
        out[moe] = (flops / seconds, routed)
    _KINDS[key] = out
    return out
