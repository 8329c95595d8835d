"""What the kernels a run computes with add to its step time (`Workload.kernels`).

The step-time model prices the matmuls at `calibration.GEMM_EFFICIENCY` (large GEMMs and
FlashAttention-3's attention reach it) and the memory-bound operations at a fused kernel's
bytes (`nanotrain.planning.memory_bound`). A run on PyTorch's `scaled_dot_product_attention`
gets FlashAttention-2 instead ("compiled", "eager"): its attention core (the score and value
matmuls, `6 n (d_qk + d_v) s / 2` training FLOPs per token and causal layer) takes
`calibration.FA2_SLOWDOWN` times as long, forward and backward each; the eager elementwise
ops' bytes are `memory_bound`'s.
"""

from __future__ import annotations

from typing import Any

from nanotrain.planning.calibration import FA2_SLOWDOWN
from nanotrain.planning.gpus import GPUSpec, peak_column
from nanotrain.planning.layout import KERNELS, PlanLayout, Workload

__all__ = ["attention_core_flops", "attention_kernel_seconds"]


def attention_core_flops(config: Any, layout: PlanLayout, workload: Workload,
                         chunks: list[list[int]]) -> tuple[float, float]:  # fmt: skip
    """(forward, backward) FLOPs per step of the causal attention core on one rank of the
    stage holding `chunks`: the score and value matmuls of its heads (n / tp), forward once
    more in each layer that "full" or "selective" recomputation rebuilds."""
    c = config
    if hasattr(c, "kv_lora_rank"):
        qk, v = c.qk_head_dim, c.v_head_dim
    else:
        qk = v = c.head_dim or c.hidden_size // c.num_heads
    # forward per token and layer: q k^T and p v over the s / 2 keys a causal query sees
    forward = 2.0 * c.num_heads / layout.tp * (qk + v) * workload.seq_len / 2
    passes = sum(
        1 + (mode in ("full", "selective")) for ch in chunks for mode in layout.chunk_recomputes(ch)
    )
    layers = sum(len(ch) for ch in chunks)
    tokens = workload.tokens_per_step / layout.dp
    return forward * passes * tokens, 2 * forward * layers * tokens


def attention_kernel_seconds(config: Any, layout: PlanLayout, workload: Workload,
                             chunks: list[list[int]], gpu: GPUSpec,
                             efficiency: float) -> float:  # fmt: skip
    """Seconds per step the stage's attention kernel takes beyond what the compute term
    prices (the attention core at `efficiency` of its peak): 0 under FlashAttention-3
    ("fused"), else the core's forward and backward FLOPs times `FA2_SLOWDOWN` less one."""
    if KERNELS[workload.kernels][1] == "fa3":
        return 0.0
    forward, backward = attention_core_flops(config, layout, workload, chunks)
    slow_f, slow_b = FA2_SLOWDOWN
    extra = forward * (slow_f.value - 1) + backward * (slow_b.value - 1)
    # the peak `stage_flops.compute_seconds` prices the core at (bf16 under an fp8 precision)
    fp8 = peak_column(workload.precision) == "fp8"
    peak = gpu.column_flops("bf16") if fp8 else gpu.flops_for(workload.precision)
    return extra / (peak * efficiency)
