"""The step-time terms of issue 54: memory-bound operations by their documented bytes, the
data-parallel reduction from the last microbatch's backward, per-stage replay."""

from __future__ import annotations

import pytest

from nanotrain.models import presets
from nanotrain.planning import GPUS, PlanLayout, Workload, plan_layout
from nanotrain.planning.gpus import GPUSpec
from nanotrain.planning.memory_bound import memory_bound_bytes, memory_bound_seconds

DENSE = presets.get("tiny-dense")  # h 64, ffn 160, 4 heads of 16, 2 kv heads, V 257, 2 layers
WORK = Workload(seq_len=64, micro_batch_size=1, global_batch_size=4)  # 256 tokens a step


def _bytes(layout, work=WORK):
    chunks = [list(range(DENSE.num_layers))]
    return memory_bound_bytes(DENSE, layout, work, chunks, last=True)


def test_memory_bound_bytes_are_the_documented_table():
    # per token of a layer, a = 2 bytes: 2 norms x 5ha, 2 residual adds x 6ha, RoPE
    # 4 (4 + 2) 16 a, SwiGLU 8 x 160 a; the loss's softmax 4 passes over 257 fp32 logits
    layer = 2 * 5 * 64 * 2 + 2 * 6 * 64 * 2 + 4 * 6 * 16 * 2 + 8 * 160 * 2
    assert layer == 6144
    assert _bytes(PlanLayout()) == (2 * layer + 16 * 257) * 256
    # tp 2 with sequence parallelism: every term on half the tokens or half the width
    assert _bytes(PlanLayout(tp=2, sequence_parallel=True)) == (2 * layer + 16 * 257) * 128
    # full recomputation: each norm's forward again (2ha per norm)
    full = _bytes(PlanLayout(recompute="full")) - _bytes(PlanLayout())
    assert full == 2 * 2 * (2 * 64 * 2) * 256
    # fp8 linears: a cast of each linear input forward and backward, 2 (a + 1) bytes per
    # element of q/k/v's input h, o's 4 x 16, up's h and down's 160
    fp8 = Workload(64, 1, 4, "transformer-engine")
    casts = _bytes(PlanLayout(), fp8) - _bytes(PlanLayout())
    assert casts == 2 * 2 * 3 * (64 + 64 + 64 + 160) * 256
    seconds = memory_bound_seconds(DENSE, PlanLayout(), WORK, [[0, 1]], True, GPUS["h100"])
    assert seconds == pytest.approx(_bytes(PlanLayout()) / (3.35e12 * 0.9))


#: one GPU per node and a slow network: the data-parallel reduction shows
SLOW = GPUSpec(
    name="slow", memory_bytes=8e10, peak_flops={"bf16": 1e12}, intra_node_bw=1e9,
    inter_node_bw=2e9, gpus_per_node=1, mem_bw=1e11,
)  # fmt: skip


def test_the_reduction_hides_behind_the_last_microbatchs_backward_only():
    # the buckets launch on the last microbatch: eight microbatches hide no more of the
    # reduction than one of the same size (the old rule hid it behind 2/3 of the whole step)
    one = plan_layout(DENSE, PlanLayout(dp=2), Workload(64, 1, 2), SLOW)
    eight = plan_layout(DENSE, PlanLayout(dp=2), Workload(64, 1, 16), SLOW)
    assert one.time_parts["exposed_dp_comm"] > 0
    assert eight.time_parts["exposed_dp_comm"] >= one.time_parts["exposed_dp_comm"]
    assert eight.slowest_comm_s["dp"] == pytest.approx(one.slowest_comm_s["dp"])
    assert eight.slowest_comm_s["dp"] < eight.time_parts["compute"] * 2 / 3


def test_under_pp_a_stage_that_ends_early_hides_its_reduction_in_the_cooldown():
    layout = PlanLayout(pp=2, dp=2)
    plan = plan_layout(DENSE, layout, Workload(64, 1, 16), SLOW)
    assert plan.step_time_s == pytest.approx(sum(plan.time_parts.values()))
    # stage 1 finishes its backwards before stage 0: its reduction starts earlier
    assert plan.time_parts["exposed_dp_comm"] < plan.slowest_comm_s["dp"]
