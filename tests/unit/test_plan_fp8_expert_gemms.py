"""`PlanLayout(fp8_expert_gemms=True)`: the routed experts' GEMMs priced at the fp8 peak, as
Megatron-Core's Transformer Engine grouped GEMMs run them, with a note that nanotrain does
not run them so yet (docs/planning.md, "What the estimate covers")."""

from __future__ import annotations

import dataclasses

import pytest

from nanotrain.models import presets
from nanotrain.planning import GPUS, PlanLayout, Workload, plan_layout, search_layouts
from nanotrain.precision.te import TransformerEnginePrecision

#: H100 SXM dense tensor-core peaks (NVIDIA H100 datasheet: 989.4 bf16, 1,978.9 fp8 TFLOP/s)
#: and the measured large-GEMM efficiency (calibration.GEMM_EFFICIENCY, pinned in
#: test_plan_calibration) at which fp8 linears are priced
BF16_PEAK, FP8_PEAK, EFFICIENCY = 989.4e12, 1978.9e12, 0.75
#: 4 layers, the first dense: 3 MoE layers of 16 experts, 2 per token; no MTP module
CONFIG = presets.get("deepseek-100m", num_layers=4, mtp_depth=0)
LAYOUT = PlanLayout(dp=2, ep=2)
WORK = Workload(
    seq_len=256, micro_batch_size=1, global_batch_size=8, precision="transformer-engine"
)
NOTE = "does not run in nanotrain yet"
#: the H100 under a name with no SM count: every GEMM at the large-shape efficiency, so the
#: time saved is the FLOPs' alone (the shape factor is `test_plan_shape_and_sms`'s)
FLAT = dataclasses.replace(GPUS["h100"], name="flat")


def _routed_flops_per_rank() -> float:
    """The routed experts' training FLOPs on one rank per step, from the shapes: per token
    and MoE layer, k experts of three h x I matrices (gate, up, down), 6 FLOPs per weight
    (forward 2, backward 4); each of the dp = 2 ranks trains half the batch's tokens."""
    h, inter, k = 512, 384, 2
    moe_layers = 3
    tokens = 8 * 256 / 2
    return 6 * 3 * h * inter * k * moe_layers * tokens


def test_the_routed_experts_gemm_time_halves_at_the_fp8_peak_and_nothing_else_moves():
    bf16 = plan_layout(CONFIG, LAYOUT, WORK, FLAT)
    fp8 = plan_layout(CONFIG, LAYOUT.replace(fp8_expert_gemms=True), WORK, FLAT)
    flops = _routed_flops_per_rank()
    at_bf16, at_fp8 = flops / (BF16_PEAK * EFFICIENCY), flops / (FP8_PEAK * EFFICIENCY)
    assert at_fp8 == pytest.approx(at_bf16 / 2, rel=1e-3)
    saved = bf16.time_parts["compute"] - fp8.time_parts["compute"]
    assert saved == pytest.approx(at_bf16 - at_fp8, rel=1e-6)
    # the FLOPs, the memory-bound operations, the blocking traffic and the memory stay as
    # they were (the gradient reduction, which starts with the last backward, starts earlier)
    assert fp8.ranks[0].flops == bf16.ranks[0].flops
    for part in ("memory_bound", "blocking_comm"):
        assert fp8.time_parts[part] == bf16.time_parts[part]
    assert fp8.largest.memory == bf16.largest.memory
    assert fp8.step_time_s < bf16.step_time_s


def test_the_plan_says_nanotrain_does_not_run_it_from_the_plugins_own_statement(monkeypatch):
    layout = LAYOUT.replace(fp8_expert_gemms=True)
    assert "fp8-expert-gemms" in layout.describe()
    plan = plan_layout(CONFIG, layout, WORK, GPUS["h100"])
    notes = [n for n in plan.notes if NOTE in n]
    assert len(notes) == 1 and "GroupedExperts" in notes[0] and "bf16" in notes[0]
    assert not [n for n in plan_layout(CONFIG, LAYOUT, WORK, GPUS["h100"]).notes if NOTE in n]
    # the note follows the plugin: one that ran its grouped experts in fp8 would drop it
    monkeypatch.setattr(TransformerEnginePrecision, "fp8_grouped_experts", True)
    assert not [n for n in plan_layout(CONFIG, layout, WORK, GPUS["h100"]).notes if NOTE in n]


def test_a_precision_without_fp8_gemms_is_refused():
    layout = LAYOUT.replace(fp8_expert_gemms=True)
    work = Workload(seq_len=256, micro_batch_size=1, global_batch_size=8)
    with pytest.raises(ValueError, match="'bf16-mixed' runs its matmuls at bf16"):
        plan_layout(CONFIG, layout, work, GPUS["h100"])


def test_the_search_does_not_offer_it():
    result = search_layouts(
        CONFIG, 4, GPUS["h100"], seq_len=256, global_batch_size=8, micro_batch_sizes=(1,),
        zero_stages=(1,), recompute=(None,), precision="transformer-engine",
    )  # fmt: skip
    assert result.fitting
    assert not any(p.layout.fp8_expert_gemms for p in result.fitting)
    assert not any(NOTE in n for p in result.fitting for n in p.notes)
