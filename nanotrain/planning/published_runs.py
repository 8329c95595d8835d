"""Published large training runs with their layout and measured throughput (and memory where
stated), and the planner's prediction of each: the calibration table of docs/planning.md.

Each run is priced as its layout (`plan_layout` of a fixed layout, no search) with the
planner's measured constants (`nanotrain.planning.calibration`): nothing here is fitted to
the runs. Throughput is compared as tokens/s. A published "model TFLOP/s per GPU" is turned
into tokens/s with the FLOPs per token of the MFU convention it was counted in
(`published_flops_per_token`: attention over the full sequence x sequence square), not with
this planner's causal count (`accounting.flops_per_token`, which halves the attention
scores because causal kernels skip the masked half).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nanotrain.models import presets
from nanotrain.models.accounting import flops_per_token
from nanotrain.planning.gpus import GPUS, GPUSpec
from nanotrain.planning.layout import PlanLayout, Workload
from nanotrain.planning.plan import Plan, plan_layout

__all__ = [
    "PUBLISHED_RUNS",
    "PublishedRun",
    "memory_ratio",
    "predict",
    "published_flops_per_token",
    "published_tokens_per_s",
]

GiB = 2**30


def _llama31_405b() -> Any:
    """Llama 3.1 405B's shapes (Llama 3 paper Table 3: 126 layers, 16,384 hidden, 128
    heads, 8 KV heads, FFN 53,248, vocabulary 128,256), from the 70B preset's fields."""
    return presets.get(
        "dense-70b", hidden_size=16384, num_layers=126, num_heads=128, intermediate_size=53248
    )


#: torchtitan's Grand Teton H100s: 96 GB HBM2e at 2.4 TB/s, 500 W (its docs/performance.md)
_H100_96GB = GPUSpec(
    name="h100-96gb",
    memory_bytes=94.5 * GiB,
    peak_flops=GPUS["h100"].peak_flops,
    intra_node_bw=GPUS["h100"].intra_node_bw,
    inter_node_bw=GPUS["h100"].inter_node_bw,
    mem_bw=2.4e12,
)


#: where the Megatron-Core rows come from: NVIDIA-NeMo/Megatron-Bridge's performance summary
#: (docs/performance-summary.md, now docs/performance-summary-archive.md; published at
#: docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary-archive.html), and the
#: recipe that ran it
_MBRIDGE = (
    "NVIDIA Megatron-Bridge performance summary, NeMo {} row (tokens/s/GPU); recipe "
    "scripts/performance/{} at commit {}"
)


@dataclass(frozen=True)
class PublishedRun:
    """One published run: its `source` (paper / report, table or section), the model, the
    layout and batch as published, and what it measured: `tflops_per_gpu` (model TFLOP/s
    per GPU, FLOPs counted as `published_flops_per_token` counts them) or `tokens_per_s`
    (whole run), and `memory_gib` where stated. `pending`: why the planner cannot price it
    yet (None when it can); `outside`: why its prediction is outside the calibration bounds
    (None when inside)."""

    name: str
    source: str
    config: Callable[[], Any]
    gpus: int
    gpu: GPUSpec
    layout: PlanLayout
    workload: Workload
    tflops_per_gpu: float | None = None
    tokens_per_s: float | None = None
    memory_gib: float | None = None
    pending: str | None = None
    outside: str | None = None


def _llama3(gpus: int, dp: int, per_dp: int, tflops: float) -> PublishedRun:
    """A row of the Llama 3 paper's Table 4 (8K context, TP8 CP1 PP16)."""
    return PublishedRun(
        name=f"Llama 3 405B, {gpus:,} H100, TP8 PP16 DP{dp}",
        source="Dubey et al. 2024, 'The Llama 3 Herd of Models', Table 4",
        config=_llama31_405b,
        gpus=gpus,
        gpu=GPUS["h100"],
        # §3.3.2: interleaved 1F1B, one layer off the first and the last stage; not
        # published: the depth of the interleaving (2 chunks per rank here) and the
        # recomputation (full: the lightest mode whose activations fit in this planner)
        layout=PlanLayout(
            tp=8,
            pp=16,
            dp=dp,
            virtual_pp=2,
            zero_stage=1,
            sequence_parallel=True,
            pipeline_layout=(3, *([4] * 30), 3),
            recompute="full",
        ),  # fmt: skip
        workload=Workload(8192, 1, per_dp * dp, "bf16-true"),
        tflops_per_gpu=tflops,
    )


def _torchtitan_8b(
    techniques: str, kernels: str, tokens_per_gpu: float, memory_gib: float, outside: str
) -> PublishedRun:
    """A row of torchtitan's Table 1 (docs/performance.md, torchtitan 9dec370, 2024-12):
    Llama 3.1 8B on 8 GPUs, FSDP, local batch 2 of 8,192 tokens, selective activation
    checkpointing; `techniques` as the table names them."""
    return PublishedRun(
        name=f"Llama 3.1 8B, 8 H100 (96 GB, 500 W), FSDP{techniques}",
        source="torchtitan docs/performance.md Table 1 (Liang et al. 2024, TorchTitan)",
        config=lambda: presets.get("dense-8b"),
        gpus=8,
        gpu=_H100_96GB,
        # train_configs/llama3_8b.toml: selective_ac_option = 'op' (per-op: every other
        # matmul's output and SDPA's saved, the rest rebuilt), which no recompute mode here
        # runs; priced as its layer-wise option at 2: half the layers fully recomputed, the
        # others keeping everything
        layout=PlanLayout(dp=8, zero_stage=3, recompute_full_layers=16),
        # FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): bf16 copies of
        # fp32 shards, bf16 compute, as ZeRO-3 under "bf16-true"
        workload=Workload(8192, 2, 16, "bf16-true", kernels=kernels),
        tokens_per_s=tokens_per_gpu * 8,
        memory_gib=memory_gib,
        outside=outside,
    )


PUBLISHED_RUNS: tuple[PublishedRun, ...] = (
    _llama3(8192, 64, 32, 430.0),
    _llama3(16384, 128, 16, 400.0),
    PublishedRun(
        name="Llama 3 405B, 16,384 H100, TP8 CP16 PP16 DP8, 131K context",
        source="Dubey et al. 2024, 'The Llama 3 Herd of Models', Table 4",
        config=_llama31_405b,
        gpus=16384,
        gpu=GPUS["h100"],
        # the 8K rows' unpublished choices kept (2 chunks per rank, full recompute), so the
        # three rows differ only in what Table 4 states
        layout=PlanLayout(
            tp=8,
            cp=16,
            pp=16,
            dp=8,
            virtual_pp=2,
            zero_stage=1,
            sequence_parallel=True,
            pipeline_layout=(3, *([4] * 30), 3),
            recompute="full",
        ),  # fmt: skip
        # Table 4: 16 sequences of 131,072 tokens per data-parallel replica, 16M tokens
        workload=Workload(131072, 1, 16 * 8, "bf16-true"),
        tflops_per_gpu=380.0,
    ),
    _torchtitan_8b(
        "",
        "eager",
        5762.0,
        82.4,
        "predicted 1.47x: eager RMSNorm and SwiGLU (memory-bound, 0.44 s) and SDPA's "
        "FlashAttention-2 (+0.13 s) are priced; what is left (2.84 s measured, 1.94 s "
        "priced) has no public measurement to derive it from: the 500 W cap's clocks under "
        "GEMM load and eager launch gaps",
    ),
    _torchtitan_8b(
        " + torch.compile",
        "compiled",
        6667.0,
        77.0,
        "predicted 1.51x: the same GPUs at 500 W; compiled norms and SwiGLU, SDPA's "
        "FlashAttention-2 priced (1.63 s priced, 2.46 s measured); memory 1.15x: what "
        "torch.compile changes in the saved and rebuilt tensors is not priced",
    ),
    PublishedRun(
        name="Llama 3.1 405B, 128 H100 (94 GB), FSDP16 TP8",
        source="torchtitan docs/performance.md (2024), 405B table: no optimizations row",
        config=_llama31_405b,
        gpus=128,
        gpu=_H100_96GB,
        layout=PlanLayout(tp=8, dp=16, zero_stage=3, sequence_parallel=True, recompute="full"),
        # FSDP2 gathers bf16 copies of fp32 shards and the blocks compute in bf16
        # ("bf16-true"); its train_configs/llama3_405b.toml (torchtitan 9515a14) sets
        # compile = true: compiled blocks around SDPA
        workload=Workload(8192, 2, 32, "bf16-true", kernels="compiled"),
        tokens_per_s=109.0 * 128,
        outside=(
            "predicted 1.42x: the same 500 W GPUs as the 8B runs (their cap unpriced); "
            "the FSDP all-gathers and reduce-scatters over 16 nodes (8.4 s at 45 GB/s) are "
            "priced hidden behind the 9.8 s of compute, which they slow by 1.3 s (20 of "
            "132 SMs taken while they run), not the HBM bandwidth they take"
        ),
    ),
    PublishedRun(
        name="DeepSeek-V3, 2,048 H800, DualPipe PP16 EP64",
        source="DeepSeek-AI 2024, 'DeepSeek-V3 Technical Report', Table 1 and §3.2, §3.3",
        config=lambda: presets.get("deepseek-v3-671b"),
        gpus=2048,
        gpu=GPUS["h800"],
        # §3.3.1: every GEMM in fp8 (forward, input and weight gradients) but those of the
        # embedding, the head, the MoE gating and attention, so the routed experts' too
        # (`fp8_expert_gemms`: priced, not run here, like the paired chunks on GPUs)
        layout=PlanLayout(
            pp=16,
            dp=128,
            ep=64,
            zero_stage=1,
            schedule="dualpipev",
            recompute="light",
            overlap_forward_backward=True,
            fp8_expert_activations=True,
            fp8_dispatch=True,
            fp8_expert_gemms=True,
            pipeline_layout=(1, *([2] * 30), 0),
        ),  # fmt: skip
        workload=Workload(4096, 1, 15360, "transformer-engine"),
        # 180K H800 GPU hours per trillion tokens on 2,048 GPUs
        tokens_per_s=1e12 / (180e3 * 3600) * 2048,
    ),
    # NVIDIA Megatron-Core (Megatron-Bridge) performance recipes on DGX-H100 (80 GB), fp8
    # per-tensor current scaling for every layer's linears ("transformer-engine" here); the
    # layouts and batches are the recipes' (scripts/performance at the commits cited)
    PublishedRun(
        name="Llama 3 70B, 64 H100, Megatron-Core TP4 PP8x5 DP2, fp8",
        source=_MBRIDGE.format(
            "25.11, DGX-H100: LLAMA3_70B",
            "configs/llama/llama3_workload_base_configs.py",
            "5776a6d9",
        ),
        config=lambda: presets.get("dense-70b"),
        gpus=64,
        gpu=GPUS["h100"],
        # distributed optimizer (ZeRO-1), sequence parallel with tp, no recomputation
        layout=PlanLayout(tp=4, pp=8, dp=2, virtual_pp=5, zero_stage=1, sequence_parallel=True),
        workload=Workload(8192, 1, 128, "transformer-engine"),
        tokens_per_s=1602.0 * 64,
    ),
    PublishedRun(
        name="Llama 3.1 405B, 1,024 H100, Megatron-Core TP8 CP2 PP8x8 DP8, fp8",
        source=_MBRIDGE.format(
            "25.11, DGX-H100: LLAMA3.1_405B",
            "configs/llama/llama31_workload_base_configs.py",
            "5776a6d9",
        ),
        config=_llama31_405b,
        gpus=1024,
        gpu=GPUS["h100"],
        # account_for_embedding / _loss_in_pipeline_split: 126 layers + embedding + loss over
        # 64 virtual stages of 2, the first and the last with one layer
        layout=PlanLayout(
            tp=8,
            cp=2,
            pp=8,
            dp=8,
            virtual_pp=8,
            zero_stage=1,
            sequence_parallel=True,
            pipeline_layout=(1, *([2] * 62), 1),
        ),  # fmt: skip
        workload=Workload(8192, 1, 512, "transformer-engine"),
        tokens_per_s=292.0 * 1024,
    ),
    PublishedRun(
        name="DeepSeek-V3, 1,024 H100, Megatron-Core TP2 PP8x4 EP64, fp8",
        source=_MBRIDGE.format(
            "25.09, DGX-H100: DeepSeekV3 (dropless)",
            "run_script.py and configs/deepseek/deepseek_v3_llm_pretrain.yaml",
            "fa0315ae",
        ),
        config=lambda: presets.get("deepseek-v3-671b"),
        gpus=1024,
        gpu=GPUS["h100"],
        # pipeline layout "Et|(tt|)*30mL": 1 layer, 30 x 2, then MTP and loss alone; the
        # recipe recomputes mla_up_proj (and the 3 dense layers' MLPs): "light" here, the
        # mode that recomputes MLA's up-projections (it also rebuilds norms and SwiGLU).
        # fp8 expert GEMMs: the recipe's DeepSeekModelProvider sets moe_grouped_gemm=True
        # with the Transformer Engine layer spec (TEGroupedMLP, TE grouped linears) and its
        # fp8 precision config (bf16_with_fp8_current_scaling_mixed, first/last layers not
        # kept in bf16) runs them under TE's fp8 autocast; nanotrain's experts stay bf16,
        # so the plan carries the option's "does not run yet" note. Not priced: the
        # recipe's overlap_moe_expert_parallel_comm (with delay_wgrad_compute), which hides
        # expert all-to-alls behind another microbatch's compute under interleaved 1F1B;
        # the strategy refuses paired chunks with tp > 1 or four chunks per rank, so the
        # planner prices these all-to-alls as blocking (16.4 of the 31.0 s step)
        layout=PlanLayout(
            tp=2,
            pp=8,
            dp=64,
            ep=64,
            virtual_pp=4,
            zero_stage=1,
            sequence_parallel=True,
            pipeline_layout=(1, *([2] * 30), 0),
            recompute="light",
            fp8_expert_gemms=True,
        ),  # fmt: skip
        workload=Workload(4096, 1, 8192, "transformer-engine"),
        tokens_per_s=1297.0 * 1024,
    ),
)


def published_flops_per_token(config: Any, seq_len: int) -> float:
    """Training FLOPs per token as published model-TFLOP/s and MFU figures count them:
    6 N + 12 L H Q T (PaLM, Chowdhery et al. 2022, Appendix B), with N the parameters a
    token computes with (here as torchtitan counts them: all but the input embedding, so the
    output head counts) and the attention scores and values over the full T x T square,
    causal masking not discounted.

    Sources: Meta's public PyTorch training code for Llama 3 models, torchtitan, computes
    its MFU so:
    `get_num_flop_per_token` (torchtitan/utils.py, 2024: `6 * num_params + 12 * l * h * q *
    t`, "we follow the convention and do not account for sparsity in causal attention"), fed
    `get_num_params(model, exclude_embedding=True)` in its train.py; its current
    `quadratic_attention_flops_per_token` (torchtitan/models/utils.py) keeps that
    convention. Megatron-LM's `num_floating_point_operations` (megatron/training/training.py,
    after Narayanan et al. 2021's appendix on floating-point operations) counted the same
    full square (its `seq_length / hidden_size` term) until March 2025 (commit 8873b55,
    "Fixes in number of floating-point operation estimates", which halved it). The Llama 3
    paper does not state its formula. N here leaves out the RMSNorm weights, which
    torchtitan's count includes: 4.1M of Llama 3 405B's 404B, 1e-5 of the FLOPs.

    Raises: ValueError if seq_len < 1.
    """
    return flops_per_token(config, seq_len, causal=False)


def published_tokens_per_s(run: PublishedRun) -> float:
    """The whole run's published throughput in tokens/s: `tokens_per_s`, or
    `tflops_per_gpu` x GPUs over `published_flops_per_token` at the run's sequence length."""
    if run.tokens_per_s is not None:
        return run.tokens_per_s
    flops = published_flops_per_token(run.config(), run.workload.seq_len)
    return run.tflops_per_gpu * 1e12 * run.gpus / flops


def predict(run: PublishedRun, compute_efficiency: float | None = None) -> tuple[Plan, float]:
    """(the plan of `run`'s layout, predicted / published tokens/s); `compute_efficiency`
    as `plan_layout`'s (default: the measured `calibration.GEMM_EFFICIENCY`).

    Raises:
        ValueError: a pending run (its reason).
    """
    if run.pending:
        raise ValueError(f"{run.name}: {run.pending}")
    config = run.config()
    plan = plan_layout(
        config, run.layout, run.workload, run.gpu, compute_efficiency=compute_efficiency
    )
    return plan, plan.tokens_per_s / published_tokens_per_s(run)


def memory_ratio(run: PublishedRun, plan: Plan) -> float | None:
    """Predicted / published peak memory per GPU (None where none is published)."""
    if run.memory_gib is None:
        return None
    return plan.largest.memory / GiB / run.memory_gib
