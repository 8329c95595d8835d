"""Precision plugins under the single-device strategy: names and errors, dtypes kept, loss
curves against fp32 (the distances documented in docs/precision.md), policy report, MFU peak,
and the loss-scaler state through a checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

import nanotrain as nt
from nanotrain.precision import (
    BF16True,
    EmulatedFP8,
    FP16Mixed,
    Precision,
    PrecisionPolicy,
    TransformerEnginePrecision,
    resolve_precision,
)
from tests.precision_helpers import VOCAB, fit


def test_names_resolve_to_plugins_and_bad_values_fail_at_construction():
    assert type(resolve_precision("bf16-mixed")).__name__ == "BF16Mixed"
    assert resolve_precision("32-true").name == "32-true"
    assert resolve_precision(16).name == "16-mixed"  # Lightning's short forms
    plugin = BF16True()
    assert resolve_precision(plugin) is plugin
    with pytest.raises(ValueError, match="unknown precision 'bf15'; use one of"):
        nt.Trainer(precision="bf15", max_steps=1)
    with pytest.raises(TypeError, match="precision must be a name"):
        resolve_precision(torch.bfloat16)
    with pytest.raises(ValueError, match="unknown fp8 recipe 'rowwise'"):
        EmulatedFP8(recipe="rowwise")
    with pytest.raises(ValueError, match="reduce_dtype must be torch.float32 or torch.bfloat16"):
        Precision(reduce_dtype=torch.float16)
    with pytest.raises(TypeError, match="must be a list of name patterns"):
        PrecisionPolicy(low_precision="*mlp*")


def test_transformer_engine_missing_says_what_to_install(failing_import):
    failing_import("transformer_engine", ImportError("No module named 'transformer_engine'"))
    with pytest.raises(
        ValueError, match=r"needs Transformer Engine.*pip install \"nanotrain\[te\]\""
    ):
        resolve_precision("transformer-engine")


def test_transformer_engine_empty_meta_package_runtime_error_is_caught(failing_import):
    failing_import(
        "transformer_engine",
        RuntimeError("Found no Transformer Engine framework extension installed"),
    )
    with pytest.raises(ValueError, match="RuntimeError: Found no Transformer Engine"):
        TransformerEnginePrecision(recipe="blockwise")


def _te_usable() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, RuntimeError, OSError):
        return False
    return True


@pytest.mark.skipif(not _te_usable(), reason="needs a CUDA GPU and Transformer Engine")
def test_transformer_engine_tiny_run_on_gpu(tmp_path):
    _, rec = fit(TransformerEnginePrecision(recipe="delayed"), steps=3, root=str(tmp_path))
    assert all(torch.isfinite(torch.tensor(rec.losses)))


# Distances to the fp32 curve over 40 steps of the tiny DeepSeek preset (seq 16, batch 2,
# lr 3e-3): mean |loss - loss_fp32| over the steps, and |difference of the last-10 means|.
# Measured (docs/precision.md; the largest under ATEN_CPU_CAPABILITY avx512, avx2 and default,
# 1 and 2 threads): bf16-mixed 0.006 / 0.002, bf16-true 0.005 / 0.004, 16-mixed 0.006 / 0.004,
# fp8-emulated vs bf16-mixed 0.022 / 0.015. Bounds: 2.7x / 4x that or more; a broken
# precision path (no master weights, unscaled fp16 gradients, a wrong quantizer, the router's
# GEMM under fp16 autocast: 0.096) moves these curves by about 0.1 or more. 40 steps: the
# reference still learns by more than 1.0 (1.55), and 10 more steps cost ~3 s of CPU.
CURVE_STEPS = 40
CURVE_TOLERANCE = {
    "bf16-mixed": (0.02, 0.02),
    "bf16-true": (0.02, 0.02),
    "16-mixed": (0.02, 0.02),
}


@pytest.fixture(scope="module")
def curves(tmp_path_factory):
    torch.set_num_threads(1)
    root = str(tmp_path_factory.mktemp("curves"))
    out = {}
    for name in ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "fp8-emulated"):
        _, rec = fit(name, steps=CURVE_STEPS, root=root, preset="tiny", global_batch=2, lr=3e-3)
        out[name] = torch.tensor(rec.losses)
    # the routed experts' fp8 options under 32-true (`fp8_dispatch`; `fp8_expert_activations`
    # with the recompute "light" it is meant for)
    for name, options in FP8_OPTIONS.items():
        module = nt.LanguageModelModule(
            "tiny", vocab_size=VOCAB, lr=3e-3, warmup_steps=2, **options
        )
        _, rec = fit("32-true", steps=CURVE_STEPS, root=root, global_batch=2, module=module)
        out[name] = torch.tensor(rec.losses)
    return out


def _distance(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    return float((a - b).abs().mean()), float((a[-10:].mean() - b[-10:].mean()).abs())


@pytest.mark.parametrize("name", sorted(CURVE_TOLERANCE))
def test_loss_curve_stays_near_fp32(curves, name):
    ref = curves["32-true"]
    assert ref[-10:].mean() < ref[:5].mean() - 1.0  # the reference learns
    mean_gap, end_gap = _distance(curves[name], ref)
    assert mean_gap <= CURVE_TOLERANCE[name][0], (name, mean_gap)
    assert end_gap <= CURVE_TOLERANCE[name][1], (name, end_gap)


FP8_OPTIONS = {
    "fp8 dispatch": {"fp8_dispatch": True},
    "fp8 expert saves": {"recompute": "light", "fp8_expert_activations": True},
}


@pytest.mark.parametrize("name", sorted(FP8_OPTIONS))
def test_fp8_expert_options_stay_near_fp32(curves, name):
    # measured (docs/precision.md, as above): fp8 dispatch 0.008 / 0.002, fp8 expert saves
    # 0.007 / 0.005; bounds 4x / 4x that or more, where a broken path moves the curve by 0.1
    # or more
    mean_gap, end_gap = _distance(curves[name], curves["32-true"])
    assert mean_gap <= 0.03 and end_gap <= 0.02, (name, mean_gap, end_gap)
    assert not torch.equal(curves[name], curves["32-true"])  # it did round


def test_emulated_fp8_curve_tracks_bf16(curves):
    mean_gap, end_gap = _distance(curves["fp8-emulated"], curves["bf16-mixed"])
    assert mean_gap <= 0.06 and end_gap <= 0.07, (mean_gap, end_gap)
    assert not torch.equal(curves["fp8-emulated"], curves["bf16-mixed"])  # it did quantize


def test_bf16_true_keeps_bf16_params_fp32_masters_grads_and_moments(tmp_path):
    class GradProbe(nt.Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            params = list(module.parameters())
            self.main = {p.main_grad.dtype for p in params}
            self.low_grads_freed = all(p.grad is None for p in params)

    probe = GradProbe()
    trainer, rec = fit(
        "bf16-true", steps=2, root=str(tmp_path), global_batch=4, micro_batch=2, callbacks=[probe]
    )
    # two microbatches per step were summed in fp32, the bf16 .grad freed after each
    assert probe.main == {torch.float32} and probe.low_grads_freed
    strategy, module = trainer.strategy, trainer.module
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    masters = strategy._master_holder.masters
    assert masters and {m.dtype for m in masters} == {torch.float32}
    assert sum(m.numel() for m in masters) == sum(p.numel() for p in module.parameters())
    moments = [v for s in strategy.optimizer.state.values() for v in s.values() if v.dim() > 0]
    assert moments and {v.dtype for v in moments} == {torch.float32}
    # the bf16 weights are the rounded masters
    for p, m in strategy._master_holder.pairs:
        assert torch.equal(p, m.to(torch.bfloat16))


def test_policy_printed_once_and_written_to_the_run_dir(tmp_path, capfd):
    policy = PrecisionPolicy(keep_high_precision=["*lm_head*", "*mlp*"])
    trainer, _ = fit(EmulatedFP8(policy=policy), steps=1, root=str(tmp_path), preset="tiny")
    err = capfd.readouterr().err
    assert err.count("precision fp8-emulated:") == 1
    report = json.loads((trainer.run_dir / "precision.json").read_text())
    mods = report["modules"]
    assert report["precision"] == "fp8-emulated"
    assert mods["model.layers.0.self_attn.q_a_proj"] == "low"
    assert mods["model.lm_head"] == "high"
    assert mods["model.layers.0.mlp.gate_proj"] == "high"  # kept by the custom pattern


def test_deepseek_default_policy_keeps_head_high(tmp_path):
    trainer, _ = fit("fp8-emulated", steps=1, root=str(tmp_path), preset="tiny")
    mods = json.loads((trainer.run_dir / "precision.json").read_text())["modules"]
    assert mods["model.lm_head"] == "high"
    assert mods["model.layers.1.mlp.shared_experts.down_proj"] == "low"
    assert mods["model.layers.0.mlp.gate_proj"] == "low"


@pytest.mark.parametrize(
    ("precision", "peak"),
    [("bf16-mixed", "bf16"), ("bf16-true", "bf16"), ("16-mixed", "fp16"), ("fp8-emulated", "bf16")],
)
def test_throughput_uses_the_peak_of_the_precision(tmp_path, precision, peak, capfd):
    monitor = nt.callbacks.ThroughputMonitor(peak_flops_per_device=1e12)
    fit(precision, steps=1, root=str(tmp_path), callbacks=[monitor])
    assert monitor.precision == peak
    assert f"MFU against the {peak} peak" in capfd.readouterr().err


def test_loss_scale_is_checkpointed_and_restored(tmp_path):
    # 2**24 overflows fp16 on the first steps: the scale halves on each skipped step
    plugin = FP16Mixed(init_scale=2.0**24)
    trainer, rec = fit(plugin, steps=3, root=str(tmp_path))
    assert rec.metrics[0]["precision/skipped"] == 1.0
    assert plugin.scaler.scale < 2.0**24
    saved = plugin.scaler.state_dict()
    path = trainer.save_checkpoint(tmp_path / "ckpt")
    resumed = FP16Mixed(init_scale=1.0)

    class Probe(nt.Callback):
        def on_train_start(self, trainer, module):
            self.state = trainer.strategy.precision.scaler.state_dict()

    probe = Probe()
    fit(resumed, steps=4, root=str(tmp_path), callbacks=[probe], ckpt_path=path)
    assert probe.state == saved


def test_cli_flag_reaches_the_strategy(tmp_path):
    from pathlib import Path

    from nanotrain.cli import main

    config = Path(__file__).resolve().parents[2] / "examples/configs/tiny_deepseek.yaml"
    code = main(
        [
            "fit",
            "--config",
            str(config),
            "--trainer.precision",
            "bf16-true",
            "--trainer.max_steps",
            "1",
            "--trainer.global_batch_size",
            "2",
            "--trainer.micro_batch_size",
            "2",
            "--trainer.limit_val_batches",
            "0",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--trainer.loggers",
            "[]",
            "--callbacks",
            "[]",
        ]
    )
    run_dirs = list(tmp_path.glob("*/version_*"))
    assert len(run_dirs) == 1
    report = json.loads((run_dirs[0] / "precision.json").read_text())
    assert report["precision"] == "bf16-true"
    assert code == 0


def test_setting_up_the_same_module_twice_does_not_nest_wrappers(tmp_path):
    import unittest.mock

    from nanotrain.precision.emulated import _LinearMode

    module = nt.LanguageModelModule("tiny-dense", vocab_size=128, lr=1e-2, warmup_steps=2)
    fit("fp8-emulated", steps=1, root=str(tmp_path), module=module)
    fit("fp8-emulated", steps=1, root=str(tmp_path), module=module)
    layer = module.model.layers[0].mlp.up_proj
    entered = []
    orig_init = _LinearMode.__init__

    def spy(self, *args, **kwargs):
        entered.append(1)
        orig_init(self, *args, **kwargs)

    with unittest.mock.patch.object(_LinearMode, "__init__", spy), torch.no_grad():
        # the model is where the default strategy put it (the GPU on a CUDA machine)
        layer(torch.randn(1, 2, layer.weight.shape[1], device=layer.weight.device))
    assert len(entered) == 1  # one quantizing mode per call, not one per setup
