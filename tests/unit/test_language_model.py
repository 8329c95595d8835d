"""LanguageModelModule: loss terms, vocabulary checks, router-bias updates, schedule, export."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

import nanotrain as nt
from nanotrain.cli import main
from nanotrain.language_model import warmup_cosine
from nanotrain.models import presets

SEQ = 16


class RandomTokens(Dataset):
    """Items like TokenShardDataset's: input_ids and the next tokens as labels."""

    def __init__(self, n: int, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (n, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


class Recorder(nt.Callback):
    def __init__(self) -> None:
        self.biases: list[torch.Tensor] = []

    def on_train_step_start(self, trainer, module, batch, batch_idx) -> None:
        # module hooks run after the callbacks' (as in Lightning), so the bias update of a
        # step is visible at the start of the next one
        moe = module.model.moe_layers()
        if moe:
            self.biases.append(moe[0].gate.e_score_correction_bias.clone())


def fit(module, tmp_path, steps=3, data=None, **settings):
    recorder = Recorder()
    trainer = nt.Trainer(
        strategy=nt.SingleDeviceStrategy("cpu"),
        max_steps=steps,
        global_batch_size=4,
        micro_batch_size=2,
        default_root_dir=str(tmp_path),
        loggers=[],
        log_every_n_steps=1,
        callbacks=[recorder],
        **settings,
    )
    data = data if data is not None else RandomTokens(32, 257)
    trainer.fit(module, train_dataloaders=data, val_dataloaders=RandomTokens(8, 257, seed=1))
    return trainer, recorder


def test_loss_terms_are_logged_and_total_is_what_trains(tmp_path):
    module = nt.LanguageModelModule(model="tiny", vocab_size=257)
    trainer, _ = fit(module, tmp_path)
    m = {k: float(v) for k, v in trainer.callback_metrics.items()}
    weight = module.config.mtp_loss_weight
    # the step loss is the total; its parts were logged separately and add up to it
    expected_total = m["train/lm_loss"] + m["train/aux_loss"] + weight * m["train/mtp_loss"]
    assert m["train/loss"] == pytest.approx(expected_total, rel=1e-5)
    assert m["val/ppl"] == pytest.approx(math.exp(m["val/loss"]), rel=1e-5)
    assert trainer.state.consumed_tokens == 3 * 4 * SEQ


def test_val_loss_is_the_token_mean_cross_entropy(tmp_path):
    module = nt.LanguageModelModule(model="tiny-dense", vocab_size=257)
    trainer, _ = fit(module, tmp_path, steps=1)
    val = RandomTokens(8, 257, seed=1)
    module.eval()
    with torch.no_grad():
        ids = torch.stack([val[i]["input_ids"] for i in range(8)])
        labels = torch.stack([val[i]["labels"] for i in range(8)])
        logits = module.model(ids).logits
        expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    assert float(trainer.callback_metrics["val/loss"]) == pytest.approx(float(expected), rel=1e-5)


def test_router_biases_move_after_every_step_and_get_no_gradient(tmp_path):
    module = nt.LanguageModelModule(model="tiny", vocab_size=257)
    _, recorder = fit(module, tmp_path, steps=3)
    speed = module.config.bias_update_speed
    start, after_one, after_two = recorder.biases
    assert not start.any()
    # each step moves every expert's bias by -γ (overloaded), +γ (underloaded) or 0 (at the
    # mean)
    for moved in (after_one, after_two - after_one):
        steps = moved / speed
        assert torch.allclose(steps, steps.round(), atol=1e-4)
        assert set(steps.round().tolist()) <= {-1.0, 0.0, 1.0}
        assert moved.abs().sum() > 0
    bias = module.model.moe_layers()[0].gate.e_score_correction_bias
    assert not bias.requires_grad and bias.grad is None


def test_token_ids_outside_the_vocabulary_are_rejected(tmp_path):
    module = nt.LanguageModelModule(model="tiny", vocab_size=100)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 100\)"):
        fit(module, tmp_path, data=RandomTokens(32, 257))


def test_data_vocabulary_larger_than_the_model_is_rejected(tmp_path):
    class BigVocabData(nt.data.TokenDataModule):
        vocab_size = 1000

    module = nt.LanguageModelModule(model="tiny", model_overrides={"vocab_size": 300})
    module._trainer = type("T", (), {"datamodule": BigVocabData(), "is_nanotrain": False})()
    with pytest.raises(ValueError, match="tokenizer has 1000 token ids"):
        module.configure_model()


def test_warmup_then_cosine_schedule():
    f = warmup_cosine(warmup_steps=10, decay_steps=110, min_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the cosine
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    assert warmup_cosine(0, None, 0.1)(1000) == 1.0


def test_greedy_generation_extends_with_argmax_tokens():
    module = nt.LanguageModelModule(model="tiny-dense", vocab_size=257)
    module.configure_model()
    prompt = torch.tensor([[1, 2, 3]])
    out = module.generate(prompt, max_new_tokens=4)
    assert out.shape == (1, 7) and torch.equal(out[:, :3], prompt)
    with torch.no_grad():
        expected = module.model(out[:, :6]).logits[0, -1].argmax()
    assert out[0, 6] == expected


def test_export_import_round_trip_keeps_the_logits(tmp_path):
    module = nt.LanguageModelModule(model="tiny", vocab_size=257)
    trainer, _ = fit(module, tmp_path, steps=2)
    ckpt = trainer.save_checkpoint(trainer.checkpoint_dir / "manual")
    assert main(["export", "--to", "hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")]) == 0
    # the run's `last` pointer names the newest checkpoint: the same one
    last = trainer.checkpoint_dir / "last"
    assert last.read_text().strip() == ckpt.name
    assert (
        main(["export", "--to", "nanotrain", "--ckpt", str(last), "--out", str(tmp_path / "last")])
        == 0
    )

    ids = torch.randint(0, 257, (2, SEQ), generator=torch.Generator().manual_seed(3))
    module.eval()
    with torch.no_grad():
        reference = module.model(ids).logits
    for folder in ("hf", "ours", "last"):  # transformers and nanotrain weights folders
        restored = nt.LanguageModelModule(model=str(tmp_path / folder))
        restored.configure_model()
        restored.eval()
        assert restored.config == module.config or folder == "hf"
        with torch.no_grad():
            torch.testing.assert_close(restored.model(ids).logits, reference, rtol=0, atol=1e-5)


def test_presets_used_by_the_module_exist():
    assert {"tiny", "tiny-dense"} <= set(presets.names())
