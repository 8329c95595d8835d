"""The kernels a run computes with (`Workload.kernels`): eager elementwise ops priced at their
op lists' bytes, SDPA's FlashAttention-2 at the FlashAttention-3 paper's measured speeds.

The byte counts are derived here from the op lists, independently of
`nanotrain.planning.memory_bound`'s formulas.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from nanotrain.models import presets
from nanotrain.planning import GPUS, PlanLayout, Workload, plan_layout
from nanotrain.planning.calibration import FA2_SLOWDOWN, GEMM_EFFICIENCY, HBM_EFFICIENCY
from nanotrain.planning.memory_bound import (
    EAGER_NORM_BYTES,
    EAGER_SWIGLU_BYTES,
    memory_bound_bytes,
    memory_bound_seconds,
)

BF16, F32 = 2, 4

#: eager fp32 RMSNorm on a bf16 input, (bytes read, bytes written) per element of each kernel
NORM_FORWARD = [
    (BF16, F32),  # x.float()
    (F32, F32),  # pow(2)
    (F32, 0),  # mean(-1): a [tokens, 1] result
    (F32, F32),  # x32 * rsqrt(...)
    (F32, BF16),  # .to(bf16)
    (BF16, BF16),  # weight * y
]
NORM_BACKWARD = [
    (BF16, BF16),  # grad_y * weight
    (2 * BF16, BF16),  # grad_y * y, for the weight's gradient
    (BF16, 0),  # ... summed over the tokens
    (BF16, F32),  # .to(bf16) backward: the gradient back to fp32
    (F32, F32),  # grad * rsqrt ([tokens, 1]): x32's first gradient
    (2 * F32, F32),  # grad * x32, for the statistic's gradient
    (F32, 0),  # ... summed over the row
    (0, F32),  # mean backward: the expanded gradient
    (F32, F32),  # pow backward: 2 * x
    (2 * F32, F32),  # ... times the gradient
    (2 * F32, F32),  # x32's two gradients summed
    (F32, BF16),  # .float() backward: the gradient back to bf16
]
#: silu(gate) * up on bf16: forward silu, product; backward the product's two gradients and
#: silu_backward(grad, gate)
SWIGLU_FORWARD = [(BF16, BF16), (2 * BF16, BF16)]
SWIGLU_BACKWARD = [(2 * BF16, BF16), (2 * BF16, BF16), (2 * BF16, BF16)]


def _bytes(ops):
    return sum(r + w for r, w in ops)


def test_eager_rmsnorm_and_swiglu_bytes_are_their_op_lists():
    assert EAGER_NORM_BYTES == (_bytes(NORM_FORWARD), _bytes(NORM_BACKWARD)) == (36, 84)
    assert EAGER_SWIGLU_BYTES == (_bytes(SWIGLU_FORWARD), _bytes(SWIGLU_BACKWARD)) == (10, 18)


def test_eager_kernels_add_the_norm_and_swiglu_bytes_over_the_fused_ones():
    config = presets.get("dense-100m")
    h, width, layers = config.hidden_size, config.intermediate_size, config.num_layers
    layout = PlanLayout(dp=2)
    fused = Workload(512, 1, 4, "bf16-true")
    eager = replace(fused, kernels="eager")
    chunks = [list(range(layers))]
    extra = memory_bound_bytes(config, layout, eager, chunks, True) - memory_bound_bytes(
        config, layout, fused, chunks, True
    )
    # per token and layer: two norms (fused: read x, write y; read x and dy, write dx = 5
    # bf16 elements) and the SwiGLU (fused: 3 + 5 = 8 bf16 elements per activation element)
    norm = 2 * h * (_bytes(NORM_FORWARD) + _bytes(NORM_BACKWARD) - 5 * BF16)
    swiglu = width * (_bytes(SWIGLU_FORWARD) + _bytes(SWIGLU_BACKWARD) - 8 * BF16)
    tokens = 4 * 512 // 2
    assert extra == pytest.approx((norm + swiglu) * layers * tokens)
    # a fully recomputed layer runs both forwards again
    full = replace(layout, recompute="full")
    extra_full = memory_bound_bytes(config, full, eager, chunks, True) - memory_bound_bytes(
        config, full, fused, chunks, True
    )
    again = 2 * h * (_bytes(NORM_FORWARD) - 2 * BF16) + width * _bytes(SWIGLU_FORWARD)
    assert extra_full - extra == pytest.approx(again * layers * tokens)
    gpu = GPUS["h100"]
    assert memory_bound_seconds(config, layout, eager, chunks, True, gpu) == pytest.approx(
        memory_bound_bytes(config, layout, eager, chunks, True)
        / (gpu.mem_bw * HBM_EFFICIENCY.value)
    )


def test_sdpa_runs_the_attention_core_at_flashattention2_speed():
    config = presets.get("dense-100m")
    gpu = GPUS["h100"]
    layout = PlanLayout(dp=2, recompute="selective")
    fused = Workload(2048, 1, 4, "bf16-true")
    plans = {
        k: plan_layout(config, layout, replace(fused, kernels=k), gpu)
        for k in ("fused", "compiled")
    }
    added = plans["compiled"].time_parts["compute"] - plans["fused"].time_parts["compute"]
    # the causal core per token and layer: q k^T and p v over s / 2 keys, each head
    heads, d, s = config.num_heads, config.head_dim or config.hidden_size // config.num_heads, 2048
    core = 2 * heads * 2 * d * s / 2
    tokens = 4 * 2048 // 2
    forward = core * config.num_layers * tokens * 2  # selective recomputation runs it again
    backward = 2 * core * config.num_layers * tokens
    slow_f, slow_b = 602 / 333, 559 / 318  # FlashAttention-3 paper: FA2 vs FA3, H100
    expected = (forward * (slow_f - 1) + backward * (slow_b - 1)) / (
        gpu.column_flops("bf16") * GEMM_EFFICIENCY.value
    )
    assert added == pytest.approx(expected)
    assert (FA2_SLOWDOWN[0].value, FA2_SLOWDOWN[1].value) == pytest.approx((slow_f, slow_b))
    # the default prices fused kernels: FlashAttention-3, no eager bytes
    default = plan_layout(config, layout, fused, gpu)
    assert default.step_time_s == plans["fused"].step_time_s


def test_an_unknown_kernel_set_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="kernels must be one of.*'compiled'.*'eager'"):
        Workload(512, kernels="triton")


def test_plan_cli_prices_the_kernels_given_for_one_layout(capsys):
    from nanotrain.cli.plan import run_plan

    argv = ["--model", "tiny-dense", "--gpus", "2", "--gpu", "h100", "--seq-len", "1024",
            "--global-batch-size", "4", "--dp", "2", "--json"]  # fmt: skip
    steps = {}
    for kernels in ("fused", "eager"):
        run_plan([*argv, "--kernels", kernels])
        out = json.loads(capsys.readouterr().out)
        assert out["workload"]["kernels"] == kernels
        steps[kernels] = out["step_time_s"]
    assert steps["eager"] > steps["fused"]
    run_plan([*argv[:-1], "--kernels", "compiled"])
    assert "precision bf16-mixed, compiled kernels" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--kernels eager prices one layout"):
        run_plan([*argv[:-3], "--kernels", "eager"])
