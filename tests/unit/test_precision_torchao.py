"""precision="torchao-float8": torchao's float8 linear layers behind nanotrain's precision
plugin (on the CPU through torch._scaled_mm; the GPU test skips without CUDA)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanotrain as nt
from nanotrain.precision import EmulatedFP8, PrecisionPolicy, TorchaoFloat8
from tests.precision_helpers import fit

pytest.importorskip("torchao", reason="torchao is in the dev extra")

EVERY_LAYER = PrecisionPolicy(low_precision=("*",), keep_high_precision=())


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))


def _fwd_bwd(plugin, device: str = "cpu", autocast: bool = False):
    """Output, input grad and first weight grad of the MLP under `plugin` (fp32, no autocast
    unless asked)."""
    model = _mlp().to(device)
    plugin.setup_module(model, torch.device(device), is_global_zero=False)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)).to(device)
    x.requires_grad_()
    if autocast:
        with plugin.forward_context():
            y = model(x)
    else:
        y = model(x)
    y.float().pow(2).sum().backward()
    return [t.detach().float().cpu() for t in (y, x.grad, model[0].weight.grad)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_tensorwise_equals_the_emulated_tensorwise_fp8_gemm():
    # the same casts (e4m3 inputs and weights, e5m2 output gradients, one dynamic scale per
    # tensor) and fp32 accumulation: torchao's GEMM and the emulation agree to fp32 rounding
    ao = _fwd_bwd(TorchaoFloat8("tensorwise", filter_small=False, policy=EVERY_LAYER))
    emulated = _fwd_bwd(EmulatedFP8("tensorwise", fmt="hybrid", policy=EVERY_LAYER))
    plain = _fwd_bwd(nt.precision.Precision())
    for got, want, exact in zip(ao, emulated, plain, strict=True):
        assert _rel(got, want) < 1e-5
        assert _rel(got, exact) > 1e-3  # it did run in fp8


def test_rowwise_runs_and_differs_from_tensorwise():
    rowwise = _fwd_bwd(TorchaoFloat8("rowwise", filter_small=False, policy=EVERY_LAYER))
    tensorwise = _fwd_bwd(TorchaoFloat8("tensorwise", filter_small=False, policy=EVERY_LAYER))
    plain = _fwd_bwd(nt.precision.Precision())
    assert _rel(rowwise[0], plain[0]) < 0.1
    assert not torch.equal(rowwise[0], tensorwise[0])


def test_under_autocast_the_fp8_layers_give_bf16_outputs():
    y, _, _ = _fwd_bwd(
        TorchaoFloat8(filter_small=False, policy=EVERY_LAYER), autocast=True
    )  # values checked above; here: it runs inside bf16 autocast on the CPU
    assert torch.isfinite(y).all()


def test_small_layers_and_experts_stay_bf16_with_the_reason_recorded(tmp_path):
    trainer, rec = fit(TorchaoFloat8(), steps=2, root=str(tmp_path), preset="tiny")
    plugin = trainer.strategy.precision
    low = [name for name, where in plugin.resolved_policy.items() if where == "low"]
    # the tiny preset's layers are far below torchao's thresholds: every low layer stays bf16
    assert low and set(plugin.kept_bf16) == set(low)
    reasons = set(plugin.kept_bf16.values())
    assert any("too small" in r for r in reasons)
    assert any("routed experts" in r for r in reasons)
    assert plugin.report()["kept_bf16"] == plugin.kept_bf16
    assert all(torch.isfinite(torch.tensor(rec.losses)))


def test_trains_the_tiny_model_near_bf16_mixed_and_keeps_the_state_dict(tmp_path):
    policy = PrecisionPolicy()  # DeepSeek-V3's: embeddings, head, router and norms high
    ao_trainer, ao = fit(
        TorchaoFloat8(filter_small=False, policy=policy), steps=8, root=str(tmp_path / "a"), lr=3e-3
    )
    bf16_trainer, bf16 = fit("bf16-mixed", steps=8, root=str(tmp_path / "b"), lr=3e-3)
    plugin = ao_trainer.strategy.precision
    converted = [n for n, w in plugin.resolved_policy.items() if w == "low"]
    assert converted and not plugin.kept_bf16  # tiny-dense widths are multiples of 16
    assert "lm_head" not in " ".join(converted)
    gaps = (torch.tensor(ao.losses) - torch.tensor(bf16.losses)).abs()
    assert gaps.max() < 0.05 and not torch.equal(torch.tensor(ao.losses), torch.tensor(bf16.losses))
    # checkpoints hold the same names: the fp8 layers share the layers' weights
    assert ao_trainer.module.state_dict().keys() == bf16_trainer.module.state_dict().keys()
    assert plugin.peak_precision() == "fp8"


def test_megatron_in_one_process_equals_single_device(tmp_path):
    plugin = lambda: TorchaoFloat8(filter_small=False)  # noqa: E731
    _, single = fit(plugin(), steps=3, root=str(tmp_path / "s"))
    _, megatron = fit(plugin(), strategy=nt.MegatronStrategy(), steps=3, root=str(tmp_path / "m"))
    assert single.losses == pytest.approx(megatron.losses, rel=1e-5)


def test_unknown_recipe_and_missing_torchao_are_refused_with_the_fix(failing_import):
    assert isinstance(nt.precision.resolve_precision("torchao-float8"), TorchaoFloat8)
    with pytest.raises(ValueError, match="unknown torchao fp8 recipe 'blockwise'"):
        TorchaoFloat8("blockwise")
    failing_import("torchao", ImportError("No module named 'torchao'"))
    with pytest.raises(ValueError, match=r"pip install \"nanotrain\[torchao\]\""):
        TorchaoFloat8()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_torchao_on_the_gpu_equals_the_emulation_on_the_cpu():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 GEMMs need sm89 or newer")
    ao = _fwd_bwd(TorchaoFloat8("tensorwise", filter_small=False, policy=EVERY_LAYER), "cuda")
    emulated = _fwd_bwd(EmulatedFP8("tensorwise", fmt="hybrid", policy=EVERY_LAYER))
    for got, want in zip(ao, emulated, strict=True):
        assert _rel(got, want) < 1e-3  # the GPU GEMM accumulates in its own order
