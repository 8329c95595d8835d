"""Every script in examples/ runs, with tiny settings (the Megatron one on four ranks)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
from pathlib import Path

import pytest
import torch

from nanotrain.callbacks import ModelCheckpoint
from tests.distributed.spawn import run_world

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


def load_example(name: str):
    """Import examples/<name>.py as a module (examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_custom_module_example_fits_sine_with_its_callbacks(tmp_path, capsys):
    trainer = load_example("custom_module").main(["--max_steps", "6", "--root", str(tmp_path)])
    assert trainer.global_step == 6
    val_steps = [r["step"] for r in metrics(trainer.run_dir) if "val/mse" in r]
    # validate_at_start, and the final validation after step 6 (logged 0-based)
    assert val_steps[0] == 0 and val_steps[-1] == 5
    out = capsys.readouterr().out
    assert "step 0: val/mse" in out and "max |net(x) - sin(x)|" in out
    assert (trainer.run_dir / "report.md").is_file()
    assert next(
        cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)
    ).best_model_path  # ranked by val/mse


def test_custom_callback_example_logs_and_saves(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOTRAIN_CACHE", str(tmp_path / "cache"))
    example = load_example("custom_callback")
    args = ["--max_steps", "3", "--seq_len", "16", "--demo_max_bytes", "100000"]
    trainer = example.main(args + ["--root", str(tmp_path)])
    logged = [r for r in metrics(trainer.run_dir) if "spikes/loss_ema" in r]
    # steps 1-3, at Lightning's 0-based steps with the epoch (log_metrics without step=)
    assert [(r["step"], r["epoch"]) for r in logged] == [(0, 0), (1, 0), (2, 0)]
    ema = {r["step"]: r["spikes/loss_ema"] for r in logged}
    assert logged[0]["spikes/ratio"] == 1.0  # the first step starts the average
    # step 3 is a Trainer log step: its train/loss, at the same step, checks the EMA by hand
    loss3 = next(
        r["train/loss"]
        for r in metrics(trainer.run_dir)
        if r.get("step") == 2 and "train/loss" in r
    )
    assert ema[2] == pytest.approx(0.9 * ema[1] + 0.1 * loss3, rel=1e-6)
    assert logged[-1]["spikes/ratio"] == pytest.approx(loss3 / ema[2], rel=1e-6)
    saved = json.loads((trainer.run_dir / "loss_spikes.json").read_text())
    assert saved["threshold"] == 1.5 and isinstance(saved["spikes"], list)
    with pytest.raises(ValueError, match="threshold > 1"):
        example.LossSpikeRecorder(threshold=1.0)


def test_finetune_hf_example_round_trips_through_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    text = tmp_path / "text"
    text.mkdir()
    for i in range(5):
        (text / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox " * 40)
    out = load_example("finetune_hf").main(
        ["--hf", str(tmp_path / "base"), "--text", str(text), "--work", str(tmp_path / "work")]
        + ["--max_steps", "2", "--seq_len", "16", "--lr", "1e-2"]
    )
    assert (tmp_path / "work/data/metadata.json").is_file()  # prepared by `nanotrain prepare`
    base = load_file(str(tmp_path / "base/model.safetensors"))
    tuned = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert tuned.config.vocab_size == 300 and tuned.config.num_hidden_layers == 2
    tuned_state = tuned.state_dict()
    assert set(base) <= set(tuned_state)
    changed = [k for k in base if not torch.equal(base[k], tuned_state[k])]
    assert "model.embed_tokens.weight" in changed and "lm_head.weight" in changed
    ids = torch.tensor([[100, 101, 102, 32]])
    assert torch.isfinite(tuned(ids).logits).all()
    run = tmp_path / "work/runs/finetune/version_0"
    report = json.loads((run / "report.json").read_text())
    # validated at the start (0) and after steps 1 and 2 (logged 0-based: 0 and 1)
    assert report["training"]["steps"] == 2 and report["validation"]["best"]["step"] in (0, 1)
    assert report["model"]["family"] == "DenseConfig"


def _megatron_example_rank(rank: int, world_size: int, root: str, args: list[str]) -> str:
    """One rank of examples/megatron_4d.py on a forked gloo world, with the variables torchrun
    sets that the script reads (its thread count, and the shared demo-data cache); returns
    what the rank printed."""
    os.environ.update(LOCAL_WORLD_SIZE=str(world_size), NANOTRAIN_CACHE=f"{root}/cache")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        load_example("megatron_4d").main(args)
    return printed.getvalue()


@pytest.mark.distributed
def test_megatron_4d_example_on_four_ranks_pp2_ep2_zero1(tmp_path):
    # 4 gloo ranks: pp=2 stages x dp=2, with the routed experts split ep=2 over dp and the
    # optimizer state sharded (ZeRO-1). tp needs 8 ranks on top of these (tp=2 × pp=2 × ep=2).
    # The script's own main() on forked ranks: a torchrun launch would only add four fresh
    # interpreters (torchrun itself is exercised by tests/integration/test_torchrun_restart.py).
    args = ["--tp", "1", "--pp", "2", "--ep", "2", "--zero_stage", "1", "--max_steps", "2"]
    args += ["--global_batch_size", "8", "--micro_batch_size", "2", "--seq_len", "16"]
    args += ["--demo_max_bytes", "100000", "--root", str(tmp_path / "runs")]
    printed = run_world(_megatron_example_rank, 4, str(tmp_path), args, timeout=240)
    assert "done: 2 steps" in printed[0] and not any(printed[1:])  # rank 0 reports
    report = json.loads((tmp_path / "runs/megatron_4d/version_0/report.json").read_text())
    assert report["strategy"]["layout"] == {
        "strategy": "MegatronStrategy", "world_size": 4,
        "tp": 1, "pp": 2, "ep": 2, "dp": 2, "cp": 1, "zero_stage": 1,
    }  # fmt: skip
    assert report["training"]["steps"] == 2 and report["training"]["tokens"] == 2 * 8 * 16
    assert report["checkpoints"]["last"].endswith("step-00000002")
    markdown = (tmp_path / "runs/megatron_4d/version_0/report.md").read_text()
    assert "| layout | world_size=4, tp=1, pp=2, ep=2, dp=2, cp=1, zero_stage=1 |" in markdown
    assert "schedule=1f1b" in markdown
