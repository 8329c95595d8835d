"""GEMM efficiency by shape: each GEMM of a dense decoder layer priced by its M, N, K.

`gemm_efficiency` derives, from the hardware constants of `nanotrain.planning.calibration`
(`GEMM_TILE`, `SMS`, `HBM_EFFICIENCY`) and the large-shape `GEMM_EFFICIENCY`, the fraction
of the peak one GEMM reaches: the large-shape efficiency times the share of the SMs' tile
slots that hold useful output (partial tiles, a partial last wave), capped by the HBM
roofline. `dense_layer_gemms` lists the GEMMs one tp rank runs for one microbatch through a
dense (non-MLA, non-MoE) decoder layer, as the model code runs them (q, k, v, o, gate, up,
down: `nanotrain.models.attention`, `nanotrain.models.layers`), forward and backward, and
`layer_shape_factor` is their FLOP-weighted efficiency over the large-shape one (1.0 for
shapes that fill whole waves of whole tiles).
"""

from __future__ import annotations

import math
from typing import Any

from nanotrain.planning.calibration import GEMM_EFFICIENCY, GEMM_TILE, HBM_EFFICIENCY, SMS
from nanotrain.planning.gpus import GPUSpec
from nanotrain.planning.layout import PlanLayout, Workload

__all__ = ["dense_layer_gemms", "gemm_efficiency", "layer_shape_factor"]


def gemm_efficiency(m: int, n: int, k: int, gpu: GPUSpec, element_bytes: int = 2) -> float:
    """Fraction of `gpu`'s bf16 peak an (m x k) @ (k x n) GEMM reaches.

    The large-shape efficiency times ``m n / (tiles * tile^2)`` times ``tiles / (waves *
    sms)``, with ``tiles = ceil(m / tile) * ceil(n / tile)`` and ``waves = ceil(tiles /
    sms)``; then no faster than moving ``element_bytes (mk + kn + mn)`` at the HBM's
    sustained bandwidth (when the spec gives one).

    Raises:
        ValueError: a dimension below 1, or a GPU with no SM count in `calibration.SMS`.
    """
    if min(m, n, k) < 1:
        raise ValueError(f"GEMM dimensions must be >= 1, got m={m}, n={n}, k={k}")
    family = gpu.name.split("-")[0]
    if family not in SMS:
        raise ValueError(f"no SM count for {gpu.name!r}; known: {sorted(SMS)}")
    tile, sms = int(GEMM_TILE.value), int(SMS[family].value)
    tiles = math.ceil(m / tile) * math.ceil(n / tile)
    waves = math.ceil(tiles / sms)
    useful = m * n / (waves * sms * tile * tile)
    efficiency = GEMM_EFFICIENCY.value * useful
    if gpu.mem_bw:
        flops = 2.0 * m * n * k
        peak = gpu.column_flops("bf16")
        memory_s = element_bytes * (m * k + k * n + m * n) / (gpu.mem_bw * HBM_EFFICIENCY.value)
        efficiency = min(efficiency, flops / memory_s / peak)
    return efficiency


def dense_layer_gemms(
    config: Any, layout: PlanLayout, workload: Workload
) -> list[tuple[int, int, int]]:
    """(m, n, k) of each GEMM one tp rank runs per microbatch through a dense decoder layer:
    forward (q, k, v, o, gate, up, down; m the microbatch's tokens, the whole sequences
    under sequence parallelism, over cp), then for each its input gradient (m, k, n) and
    weight gradient (n, k, m)."""
    c, tp = config, layout.tp
    h, d = c.hidden_size, c.head_dim or c.hidden_size // c.num_heads
    kv = c.num_kv_heads or c.num_heads
    m = workload.micro_batch_size * workload.seq_len // layout.cp
    q, kvw, width = c.num_heads * d // tp, kv * d // tp, c.intermediate_size // tp
    forward = [(m, q, h), (m, kvw, h), (m, kvw, h), (m, h, q),
               (m, width, h), (m, width, h), (m, h, width)]  # fmt: skip
    return forward + [(m, k, n) for m, n, k in forward] + [(n, k, m) for m, n, k in forward]


def layer_shape_factor(config: Any, layout: PlanLayout, workload: Workload, gpu: GPUSpec) -> float:
    """The FLOP-weighted efficiency of `dense_layer_gemms` over `GEMM_EFFICIENCY`: what a
    dense layer's linear layers run at, relative to the large-shape figure (<= 1)."""
    gemms = dense_layer_gemms(config, layout, workload)
    flops = [2.0 * m * n * k for m, n, k in gemms]
    seconds = sum(f / gemm_efficiency(*g, gpu) for f, g in zip(flops, gemms, strict=True))
    return sum(flops) / seconds / GEMM_EFFICIENCY.value
