"""GEMM efficiency by shape (`nanotrain.planning.gemm_shapes`): tiles, waves and the HBM
roofline, with the expected figures worked by hand from the datasheet numbers."""

from __future__ import annotations

import pytest

from nanotrain.models import presets
from nanotrain.planning import GPUS, PlanLayout, Workload
from nanotrain.planning.gemm_shapes import dense_layer_gemms, gemm_efficiency, layer_shape_factor

H100 = GPUS["h100"]  # 132 SMs, 989.4 TFLOP/s bf16, 3.35 TB/s at 0.9


def test_a_small_m_fills_part_of_one_wave_of_tiles():
    # 2 x 32 = 64 tiles of 128 x 128 on 132 SMs: 256 * 4096 useful of 132 * 128^2 slots
    assert gemm_efficiency(256, 4096, 4096, H100) == pytest.approx(
        0.75 * 256 * 4096 / (132 * 128 * 128)
    )


def test_a_large_gemm_loses_only_its_last_partial_wave():
    # 128 x 32 = 4,096 tiles: 32 waves of 132 (the last one 4 tiles short)
    assert gemm_efficiency(16384, 4096, 4096, H100) == pytest.approx(0.75 * 4096 / (32 * 132))


def test_a_thin_k_gemm_is_priced_at_hbm_speed():
    m = n = 16384
    k = 16
    flops = 2.0 * m * n * k
    seconds = 2 * (m * k + k * n + m * n) / (3.35e12 * 0.9)
    assert gemm_efficiency(m, n, k, H100) == pytest.approx(flops / seconds / 989.4e12, rel=1e-3)


def test_bad_shapes_and_unknown_gpus_are_refused():
    with pytest.raises(ValueError, match="dimensions"):
        gemm_efficiency(0, 4096, 4096, H100)
    with pytest.raises(ValueError, match="no SM count"):
        gemm_efficiency(128, 128, 128, GPUS["cpu"])


def test_a_dense_layer_lists_its_seven_linears_forward_and_backward():
    config = presets.get("dense-8b")  # 4096 hidden, 32 heads, 8 KV heads of 128, FFN 14336
    gemms = dense_layer_gemms(config, PlanLayout(tp=2, dp=4), Workload(8192, 2, 16))
    m = 2 * 8192
    forward = [(m, 2048, 4096), (m, 512, 4096), (m, 512, 4096), (m, 4096, 2048),
               (m, 7168, 4096), (m, 7168, 4096), (m, 4096, 7168)]  # fmt: skip
    assert gemms[:7] == forward
    assert gemms[7:14] == [(m, k, n) for _, n, k in forward]  # input gradients
    assert gemms[14:] == [(n, k, m) for _, n, k in forward]  # weight gradients


def test_the_layer_factor_weights_each_gemm_by_its_flops():
    config = presets.get("dense-8b")
    layout, work = PlanLayout(dp=8), Workload(8192, 2, 16)
    gemms = dense_layer_gemms(config, layout, work)
    flops = [2.0 * m * n * k for m, n, k in gemms]
    seconds = sum(f / gemm_efficiency(*g, H100) for f, g in zip(flops, gemms, strict=True))
    factor = layer_shape_factor(config, layout, work, H100)
    assert factor == pytest.approx(sum(flops) / seconds / 0.75)
    assert 0.95 < factor < 1.0  # torchtitan's 8B shapes: a few percent of partial waves
    short = layer_shape_factor(config, layout, Workload(256, 1, 16), H100)
    assert short < factor  # 256-token microbatches leave most SMs idle in the forward
