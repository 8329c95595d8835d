"""Memory-bound operations of a pipeline stage, priced at the GPU's HBM bandwidth.

The step-time model's "compute" counts matmul FLOPs; what moves bytes without doing many
FLOPs costs time too: RMSNorm, the residual adds, RoPE, the SwiGLU activation, the MoE
permute / unpermute of the routed copies, the loss's softmax over the vocabulary, and under
fp8 the casts (packing) of the linear layers' inputs and gradients. Each is priced at the
bytes a fused kernel moves (forward reads its inputs and writes its output; backward reads
the saved input and the output gradient and writes the input gradient), at
`calibration.HBM_EFFICIENCY` of the datasheet bandwidth. This code runs several of them as
separate eager ops (RMSNorm in fp32, for one), so the figure is a lower bound for it.

Per token of one layer, with a = activation bytes, h the hidden size, T the rank's residual
tokens (N / tp under sequence parallelism), N the sequence tokens, n heads / tp:

=================  ===========================================  ==========
operation          bytes (forward + backward)                   tokens
=================  ===========================================  ==========
RMSNorm (each)     5 h a (+2 h a recomputed)                    T
residual add (2)   6 h a each                                   T
RoPE (q and k)     4 (n_q + n_k) d_rope a                       N
SwiGLU             8 I a (I: the MLP's width / tp)              N
permute+unpermute  8 h a per routed copy                        copies
softmax (loss)     4 V/tp fp32 per token (last stage)           N
fp8 cast           2 (a + 1) per linear-input element           N
=================  ===========================================  ==========

Under `Workload(kernels="eager")` RMSNorm and SwiGLU are priced as eager PyTorch runs them
(`nanotrain.models.layers.RMSNorm`, `silu(gate) * up`; torchtitan's are the same ops), one
kernel per op, each reading its inputs and writing its output (a [tokens, 1] statistic
counted as nothing), backward by autograd's formulas; per element of the normalized /
activated tensor, with fp32 = 4 bytes:

==========  ====================================================  ================
operation   ops                                                   bytes (a = 2)
==========  ====================================================  ================
RMSNorm     forward: float() a+4, pow 8, mean 4, x*rsqrt 8,       36 (fused 2a)
            .to(a) 4+a, weight* 2a
            backward: weight* 6a (input grad 2a, weight grad 3a   84 (fused 3a)
            + its sum a), .to a+4, x*rsqrt 24 (grad 8, the
            statistic's grad 12 + its sum 4), mean 4, pow 20
            (2x 8, times grad 12), the two grads summed 12,
            float() 4+a
SwiGLU      forward: silu 2a, product 3a; backward: product 6a,   28 (fused 8a)
            silu_backward 3a
==========  ====================================================  ================

Under "full" recomputation the forward's bytes come again (36 per norm element, and 5a per
SwiGLU element, which the fused pricing does not count); the routed experts' scaled product
is priced as a SwiGLU. RoPE, the residual adds and the loss keep their fused bytes
(torchtitan's complex fp32 RoPE moves about 40 bytes per element against the 4a priced).
"""

from __future__ import annotations

from typing import Any

from nanotrain.planning.calibration import HBM_EFFICIENCY
from nanotrain.planning.communication_tp import is_moe_layer
from nanotrain.planning.gpus import GPUSpec, peak_column
from nanotrain.planning.layout import KERNELS, PlanLayout, Workload
from nanotrain.planning.stage_flops import routed_rows_per_copy

__all__ = ["EAGER_NORM_BYTES", "EAGER_SWIGLU_BYTES", "memory_bound_bytes", "memory_bound_seconds"]


def _eager_norm_bytes(a: float) -> tuple[float, float]:
    """(forward, backward) bytes per element of an eager fp32 RMSNorm of an `a`-byte input."""
    forward = (a + 4) + 8 + 4 + 8 + (4 + a) + 2 * a
    backward = 6 * a + (a + 4) + 24 + 4 + 20 + 12 + (4 + a)
    return forward, backward


#: (forward, backward) bytes per element of eager RMSNorm and SwiGLU on bf16 activations
EAGER_NORM_BYTES = _eager_norm_bytes(2.0)
EAGER_SWIGLU_BYTES = (5 * 2.0, 9 * 2.0)


def _layer_bytes(config: Any, layout: PlanLayout, workload: Workload, layer: int,
                 mode: str | None) -> float:  # fmt: skip
    """Bytes one tp rank moves per token of its replica through decoder layer `layer`."""
    c, tp, a = config, layout.tp, 2.0
    h = c.hidden_size
    residual = 1 / tp if layout.sequence_parallel else 1.0  # T / N
    fp8 = peak_column(workload.precision) == "fp8"
    norms = 2
    if hasattr(c, "kv_lora_rank"):  # MLA: the q and kv latent norms
        norms += 1 + (c.q_lora_rank is not None)
        rope = (c.num_heads / tp + 1) * c.qk_rope_head_dim
        linear_in = h + (c.q_lora_rank or 0) + c.kv_lora_rank + c.num_heads / tp * c.v_head_dim
    else:
        d = c.head_dim or h // c.num_heads
        kv = c.num_kv_heads or c.num_heads
        rope = (c.num_heads + kv) / tp * d
        linear_in = h + c.num_heads / tp * d
    eager = KERNELS[workload.kernels][0] == "eager"
    recomputed = mode == "full"
    if eager:
        forward, backward = _eager_norm_bytes(a)
        norm = h * (forward * (1 + recomputed) + backward)
        swiglu = EAGER_SWIGLU_BYTES[0] * (1 + recomputed) + EAGER_SWIGLU_BYTES[1]
    else:
        norm, swiglu = 5 * h * a + (2 * h * a if recomputed else 0.0), 8 * a
    out = residual * (norms * norm + 2 * 6 * h * a) + 4 * rope * a
    if is_moe_layer(c, layer):
        copies = c.num_experts_per_tok * routed_rows_per_copy(c, layout, workload)
        width = c.moe_intermediate_size
        out += copies * (8 * h * a + swiglu * width)
        shared = c.n_shared_experts * width / tp
        out += swiglu * shared
        linear_in += h + shared
        if layout.fp8_dispatch or layout.fp8_expert_activations or fp8:
            out += copies * 2 * (a + 1) * (h + width)
    else:
        width = c.intermediate_size / tp
        out += swiglu * width
        linear_in += h + width
    if fp8:
        out += 2 * (a + 1) * linear_in
    return out


def memory_bound_bytes(config: Any, layout: PlanLayout, workload: Workload,
                       chunks: list[list[int]], last: bool) -> float:  # fmt: skip
    """HBM bytes one rank of the stage holding `chunks` moves per step in memory-bound
    operations (module docstring); `last`: it runs the head and loss."""
    per_token = 0.0
    for c in chunks:
        for i, mode in zip(c, layout.chunk_recomputes(c), strict=True):
            per_token += _layer_bytes(config, layout, workload, i, mode)
    if last:
        per_token += 4 * 4 * config.vocab_size / layout.tp
    return per_token * workload.tokens_per_step / layout.dp


def memory_bound_seconds(config: Any, layout: PlanLayout, workload: Workload,
                         chunks: list[list[int]], last: bool, gpu: GPUSpec) -> float:  # fmt: skip
    """`memory_bound_bytes` at `HBM_EFFICIENCY` of the GPU's `mem_bw` (0 when the spec
    gives no memory bandwidth)."""
    if not gpu.mem_bw:
        return 0.0
    nbytes = memory_bound_bytes(config, layout, workload, chunks, last)
    return nbytes / (gpu.mem_bw * HBM_EFFICIENCY.value)
