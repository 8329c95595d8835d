"""The step-time model's GEMM shape term and the SMs communication takes from compute, as
`plan_layout` applies them, against figures worked by hand from the datasheet numbers and
the formula of `calibration.comm_sm_seconds`."""

from __future__ import annotations

import dataclasses
import math

import pytest

from nanotrain.models import presets
from nanotrain.planning import GPUS, PlanLayout, Workload, plan_layout
from nanotrain.planning.calibration import comm_sm_seconds

H100 = GPUS["h100"]  # 132 SMs, 989.4 TFLOP/s bf16, 3.35 TB/s HBM at 0.9 sustained
#: the same GPU with no known SM count: the flat large-shape efficiency, no SMs taken
FLAT = dataclasses.replace(H100, name="flat")


def _by_hand(m: int, n: int, k: int) -> float:
    """An (m x k) @ (k x n) bf16 GEMM's fraction of the H100's peak: 0.75 times the useful
    share of the 128 x 128 tiles' waves over 132 SMs, no faster than its bytes at 0.9 of
    3.35 TB/s."""
    tiles = math.ceil(m / 128) * math.ceil(n / 128)
    waves = math.ceil(tiles / 132)
    by_tiles = 0.75 * m * n / (waves * 132 * 128 * 128)
    seconds_at_hbm = 2 * (m * k + k * n + m * n) / (3.35e12 * 0.9)
    return min(by_tiles, 2.0 * m * n * k / seconds_at_hbm / 989.4e12)


def test_small_gemms_are_priced_below_the_large_shape_efficiency():
    # a dense model of 1,024 hidden, 8 heads of 128 (no GQA), FFN 4,096; 256-token
    # microbatches: every forward GEMM fills under one wave of tiles
    config = presets.get("dense-8b", hidden_size=1024, num_layers=2, num_heads=8,
                         num_kv_heads=8, intermediate_size=4096, vocab_size=1024)  # fmt: skip
    work = Workload(seq_len=256, micro_batch_size=1, global_batch_size=4, precision="bf16-true")
    shaped = plan_layout(config, PlanLayout(), work, H100)
    flat = plan_layout(config, PlanLayout(), work, FLAT)
    m, h, f = 256, 1024, 4096
    forward = [(m, h, h)] * 4 + [(m, f, h)] * 2 + [(m, h, f)]  # q, k, v, o, gate, up, down
    gemms = forward + [(a, c, b) for a, b, c in forward] + [(b, c, a) for a, b, c in forward]
    per_micro = config.num_layers
    flops = [2.0 * a * b * c for a, b, c in gemms]
    at_large = sum(flops) / (989.4e12 * 0.75)
    by_shape = sum(fl / (989.4e12 * _by_hand(*g)) for fl, g in zip(flops, gemms, strict=True))
    micro = 4
    expected = flat.time_parts["compute"] + (by_shape - at_large) * per_micro * micro
    assert shaped.time_parts["compute"] == pytest.approx(expected, rel=1e-9)
    # the shape term is large here: most of each GEMM's wave is empty
    assert shaped.time_parts["compute"] > 1.5 * flat.time_parts["compute"]


def test_large_shapes_keep_the_large_shape_efficiency_within_their_last_wave():
    config = presets.get("dense-8b", num_layers=2)
    work = Workload(seq_len=8192, micro_batch_size=2, global_batch_size=2, precision="bf16-true")
    shaped = plan_layout(config, PlanLayout(), work, H100).time_parts["compute"]
    flat = plan_layout(config, PlanLayout(), work, FLAT).time_parts["compute"]
    assert flat < shaped < flat * 1.05


def test_the_comm_sm_formula_is_the_slower_compute_of_the_overlapped_span():
    # 20 of 132 SMs held: a 1 s collective beside 10 s of compute leaves it 20/132 s late;
    # a 10 s collective beside 1 s of compute runs all of it on 112 SMs: 1 s x 132/112
    assert comm_sm_seconds(1.0, 10.0, 132) == pytest.approx(20 / 132)
    assert comm_sm_seconds(10.0, 1.0, 132) == pytest.approx(132 / 112 - 1)
    assert comm_sm_seconds(0.0, 10.0, 132) == 0.0 == comm_sm_seconds(5.0, 0.0, 132)
    with pytest.raises(ValueError, match="SMs"):
        comm_sm_seconds(1.0, 1.0, 20)


def test_nothing_overlapping_takes_no_sms():
    config = presets.get("deepseek-100m")
    work = Workload(seq_len=1024, micro_batch_size=2, global_batch_size=8, precision="bf16-true")
    plan = plan_layout(config, PlanLayout(), work, H100)  # one GPU: no communication at all
    assert "comm_sms" not in plan.time_parts
    assert plan.step_time_s == pytest.approx(
        plan.time_parts["compute"] + plan.time_parts["memory_bound"]
    )


def _zero3(gpu):
    config = presets.get("dense-8b", num_layers=2, vocab_size=4096)
    work = Workload(seq_len=4096, micro_batch_size=1, global_batch_size=8, precision="bf16-true")
    return plan_layout(config, PlanLayout(dp=8, zero_stage=3), work, gpu)


def test_zero3s_collectives_beside_the_compute_slow_it_by_their_seconds_x_20_of_132():
    plan = _zero3(H100)
    parts, dp = plan.time_parts, plan.slowest_comm_s["dp"]
    # NVLink inside one node: the gathers and the reduce-scatter hide behind the compute but
    # for the root's gathers (exposed_dp_comm); the rest ran beside it on 112 of 132 SMs
    assert 0 < parts["exposed_dp_comm"] < dp < parts["compute"]
    assert parts["comm_sms"] == pytest.approx((dp - parts["exposed_dp_comm"]) * 20 / 132)
    assert plan.step_time_s == pytest.approx(sum(parts.values()))


def test_zero3_gathers_outlasting_the_compute_slow_all_of_it():
    # a link 1,000x slower: the collectives outlast the compute, which runs all on 112 SMs;
    # the step is then the collectives' seconds, the SMs lost hidden behind them
    slow = dataclasses.replace(H100, intra_node_bw=H100.intra_node_bw / 1000)
    plan = _zero3(slow)
    parts = plan.time_parts
    assert parts["comm_sms"] == pytest.approx(parts["compute"] * 20 / 112)
    blocking = parts["blocking_comm"]
    assert plan.step_time_s == pytest.approx(
        parts["memory_bound"] + blocking + plan.slowest_comm_s["dp"], rel=1e-6
    )


def test_data_parallel_reductions_beside_the_last_backward_take_sms():
    config = presets.get("dense-8b", num_layers=2, vocab_size=4096)
    work = Workload(seq_len=4096, micro_batch_size=1, global_batch_size=8, precision="bf16-true")
    plan = plan_layout(config, PlanLayout(dp=8, zero_stage=1), work, H100)
    flat = plan_layout(config, PlanLayout(dp=8, zero_stage=1), work, FLAT)
    assert plan.time_parts["comm_sms"] > 0 and "comm_sms" not in flat.time_parts
    # ZeRO-1's all-reduce runs beside the last backward; its gather after the step does not
    # overlap anything: at most 20/132 of the all-reduce's seconds are lost
    assert plan.time_parts["comm_sms"] <= plan.slowest_comm_s["dp"] * 20 / 132 + 1e-12
