"""MoELoadMonitor: load-balance scalars, the heatmap image, cadence, pipeline gather, dense no-op."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import Dataset, TensorDataset

import nanotrain as nt
from nanotrain.callbacks.moe_load import (
    HEATMAP_TAG,
    MoELoadMonitor,
    load_heatmap,
    merge_stage_stats,
    moe_load_metrics,
)
from nanotrain.models.balance import MoEStats
from nanotrain.testing import Classifier, blobs, make_trainer
from tests.distributed.spawn import run_world

IDLE = (0.23, 0.30, 0.75)  # the heatmap's blue, as documented in load_heatmap
HOT = (0.71, 0.02, 0.15)  # its red


def fake_stats(step: int) -> MoEStats:
    """Layer 3 unbalanced in a way that depends on the step, layer 5 perfectly balanced."""
    return MoEStats(
        layers=[5, 3],
        loads=torch.tensor(
            [[2.0, 2.0, 2.0, 2.0], [1.0, 2.0, 3.0, 6.0 + step]], dtype=torch.float64
        ),
        dropped=torch.tensor([0.0, float(step)], dtype=torch.float64),
        biases=torch.tensor([[0.0] * 4, [-0.5 * step, 0.1, 0.2, 0.3]]),
    )


class FakeMoEClassifier(Classifier):
    """Publishes `fake_stats` of each step where LanguageModelModule publishes real ones."""

    def __init__(self, stats: bool = True) -> None:
        super().__init__()
        self.with_stats = stats
        self.last_moe_stats = None

    def on_before_optimizer_step(self, optimizer) -> None:
        step = self.trainer.global_step + 1
        self.last_moe_stats = fake_stats(step) if self.with_stats else None


def jsonl_by_step(trainer: nt.Trainer) -> dict[int, dict]:
    """metrics.jsonl merged by logged step: optimizer step N's records are at N - 1
    (Lightning's convention), the Trainer's train/loss and the monitor's alike."""
    merged: dict[int, dict] = {}
    for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        merged.setdefault(record["step"], {}).update(record)
    return merged


def moe_keys(record: dict) -> set[str]:
    return {k for k in record if k.startswith("moe/")}


def heatmap_events(trainer: nt.Trainer) -> list:
    acc = EventAccumulator(str(trainer.run_dir / "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    return acc.Images(HEATMAP_TAG) if HEATMAP_TAG in acc.Tags()["images"] else []


def fit(module, tmp_path, monitor, steps=4, **settings) -> nt.Trainer:
    x, y = blobs(64)
    trainer = make_trainer(
        tmp_path, max_steps=steps, callbacks=[monitor], loggers=["tensorboard", "jsonl"], **settings
    )
    trainer.fit(module, train_dataloaders=TensorDataset(x, y))
    return trainer


# -- the numbers --------------------------------------------------------------------------------
def test_ratios_dropped_fraction_and_bias_match_hand_computed_values():
    metrics = moe_load_metrics(fake_stats(step=2))
    # layer 3: loads 1, 2, 3, 8 → mean 14/4 = 3.5; 2 copies dropped of 14 + 2
    assert metrics["moe/layer3/max_over_mean"] == pytest.approx(8 / 3.5)
    assert metrics["moe/layer3/min_over_mean"] == pytest.approx(1 / 3.5)
    assert metrics["moe/layer3/dropped_fraction"] == pytest.approx(2 / 16)
    assert metrics["moe/layer3/bias_abs_max"] == pytest.approx(1.0)
    # layer 5: every expert at the mean, nothing dropped, biases untouched
    assert metrics["moe/layer5/max_over_mean"] == pytest.approx(1.0)
    assert metrics["moe/layer5/min_over_mean"] == pytest.approx(1.0)
    assert metrics["moe/layer5/dropped_fraction"] == 0.0
    assert metrics["moe/layer5/bias_abs_max"] == 0.0
    assert metrics["moe/max_over_mean"] == pytest.approx((8 / 3.5 + 1.0) / 2)
    assert not any("/load/" in k for k in metrics)  # per-expert loads are opt-in


def test_per_expert_loads_are_logged_only_when_asked():
    metrics = moe_load_metrics(fake_stats(step=2), per_expert=True)
    loads = {k: v for k, v in metrics.items() if "/load/" in k}
    assert loads == {
        **{f"moe/layer5/load/expert{e}": 2.0 for e in range(4)},
        "moe/layer3/load/expert0": 1.0,
        "moe/layer3/load/expert1": 2.0,
        "moe/layer3/load/expert2": 3.0,
        "moe/layer3/load/expert3": 8.0,
    }


def test_a_layer_without_tokens_has_no_ratio_and_zero_dropped_fraction():
    stats = MoEStats([0], torch.zeros(1, 4), torch.zeros(1), torch.zeros(1, 4))
    metrics = moe_load_metrics(stats)
    assert "moe/layer0/max_over_mean" not in metrics and "moe/max_over_mean" not in metrics
    assert metrics["moe/layer0/dropped_fraction"] == 0.0


def test_stages_merge_in_layer_order_and_dense_stages_are_skipped():
    first = MoEStats(
        [4, 1], torch.tensor([[4.0], [1.0]]), torch.tensor([40.0, 10.0]), torch.ones(2, 1)
    )
    second = MoEStats([2], torch.tensor([[2.0]]), torch.tensor([20.0]), torch.ones(1, 1))
    empty = MoEStats([], torch.zeros(0, 1), torch.zeros(0), torch.zeros(0, 1))
    merged = merge_stage_stats([first, None, empty, second])
    assert merged.layers == [1, 2, 4]
    assert merged.loads.flatten().tolist() == [1.0, 2.0, 4.0]
    assert merged.dropped.tolist() == [10.0, 20.0, 40.0]
    assert merge_stage_stats([None, empty]) is None


# -- the heatmap --------------------------------------------------------------------------------
def test_heatmap_is_white_at_the_mean_blue_when_idle_red_when_twice_overloaded():
    # mean load 12 / 6 = 2: ratios 0 (idle), 0.5, 1 (balanced), 2 and 2.5 (both saturated)
    image = load_heatmap(torch.tensor([[0.0, 1.0, 2.0, 4.0, 5.0, 0.0]]))
    assert image.dtype == torch.uint8 and image.shape == (3, 42, 252)  # 256 // 6 = 42 px cells
    pixel = [image[:, 0, 42 * e + 21].float() for e in range(5)]  # a pixel inside each cell
    white = torch.full((3,), 255.0)
    idle, hot = torch.tensor(IDLE) * 255, torch.tensor(HOT) * 255
    assert torch.equal(pixel[2], white)
    assert torch.allclose(pixel[0], idle, atol=0.51)
    assert torch.allclose(pixel[1], (white + idle) / 2, atol=0.51)  # halfway to idle
    assert torch.allclose(pixel[3], hot, atol=0.51)
    assert torch.equal(pixel[4], pixel[3])  # saturated


def test_heatmap_of_a_large_model_is_one_pixel_per_expert():
    image = load_heatmap(torch.ones(61, 256))  # DeepSeek-V3: 58 MoE layers + MTP, 256 experts
    assert image.shape == (3, 61, 256) and bool((image == 255).all())


def test_heatmap_rejects_a_tensor_that_is_not_layers_by_experts():
    with pytest.raises(ValueError, match="layers, experts"):
        load_heatmap(torch.ones(8))


# -- in a Trainer -------------------------------------------------------------------------------
def test_scalars_on_log_steps_and_heatmap_on_its_own_cadence(tmp_path):
    monitor = MoELoadMonitor(heatmap_every_n_steps=3)  # scalars every 2 steps: the Trainer's
    trainer = fit(FakeMoEClassifier(), tmp_path, monitor, steps=4, log_every_n_steps=2)
    logged = jsonl_by_step(trainer)
    # steps 2 and 4, logged at 1 and 3 with their train/loss
    assert {step for step, rec in logged.items() if moe_keys(rec)} == {1, 3}
    assert all("train/loss" in logged[step] for step in (1, 3))
    # step 4's values are step 4's stats: layer 3 loads 1, 2, 3, 10, mean 4, 4 dropped of 20
    last = logged[3]
    assert last["moe/layer3/max_over_mean"] == pytest.approx(10 / 4)
    assert last["moe/layer3/min_over_mean"] == pytest.approx(1 / 4)
    assert last["moe/layer3/dropped_fraction"] == pytest.approx(4 / 20)
    assert last["moe/layer3/bias_abs_max"] == pytest.approx(2.0)
    assert last["moe/max_over_mean"] == pytest.approx((10 / 4 + 1) / 2)
    images = heatmap_events(trainer)
    assert [im.step for im in images] == [2]  # step 3
    # 2 layers × 4 experts, cells of 256 // 4 = 64 px
    assert (images[0].height, images[0].width) == (2 * 64, 4 * 64)


def test_dense_model_logs_nothing_and_raises_nothing(tmp_path):
    for i, module in enumerate([Classifier(), FakeMoEClassifier(stats=False)]):
        monitor = MoELoadMonitor(heatmap_every_n_steps=1, per_expert=True)
        trainer = fit(module, tmp_path / str(i), monitor, steps=2)
        assert not any(moe_keys(rec) for rec in jsonl_by_step(trainer).values())
        assert heatmap_events(trainer) == []


def test_loggers_without_images_are_skipped(tmp_path):
    monitor = MoELoadMonitor(heatmap_every_n_steps=1)
    x, y = blobs(64)
    trainer = make_trainer(tmp_path, max_steps=1, callbacks=[monitor])  # jsonl only
    trainer.fit(FakeMoEClassifier(), train_dataloaders=TensorDataset(x, y))
    assert "moe/layer3/max_over_mean" in jsonl_by_step(trainer)[0]


def test_invalid_cadences_are_rejected():
    with pytest.raises(ValueError, match="log_every_n_steps"):
        MoELoadMonitor(log_every_n_steps=0)
    with pytest.raises(ValueError, match="heatmap_every_n_steps"):
        MoELoadMonitor(heatmap_every_n_steps=-1)


# -- pipeline parallel: every stage's layers reach the logging rank -----------------------------
def _gather_over_world(obj: Any) -> list[Any]:
    """A strategy's `gather_from_stages` when the whole world is one pipeline."""
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


def _stage_world(rank: int, world_size: int) -> dict[int, dict]:
    """Stage `rank` of a 2-stage pipeline: stage 0 holds MoE layer 1, stage 1 layers 3 and 2;
    at step 4 stage 0 reports nothing (as a dense stage would)."""
    logged: dict[int, dict] = {}
    trainer = SimpleNamespace(
        global_step=0,
        settings=SimpleNamespace(log_every_n_steps=2),
        loggers=SimpleNamespace(loggers=[]),
        log_metrics=lambda metrics, step: logged.setdefault(step, {}).update(metrics),
        strategy=SimpleNamespace(gather_from_stages=_gather_over_world),
    )
    module = SimpleNamespace()
    monitor = MoELoadMonitor(heatmap_every_n_steps=0)
    for step in range(1, 5):
        trainer.global_step, trainer.logged_step = step, step - 1  # after the step's update
        if rank == 0:
            loads = torch.tensor([[1.0, float(step)]])
            module.last_moe_stats = MoEStats([1], loads, torch.zeros(1), torch.zeros(1, 2))
            if step == 4:
                module.last_moe_stats = None
        else:
            loads = torch.tensor([[3.0, 1.0], [2.0, 2.0]])
            module.last_moe_stats = MoEStats([3, 2], loads, torch.zeros(2), torch.zeros(2, 2))
        monitor.on_train_step_end(trainer, module, None, [], step - 1)
    return {
        step: {k: round(v, 6) for k, v in m.items() if "max_over" in k}
        for step, m in logged.items()
    }


@pytest.mark.distributed
def test_pipeline_stages_are_gathered_so_every_layer_is_logged():
    results = run_world(_stage_world, 2, timeout=60.0, pg_timeout=10.0)
    expected = {
        # layer 1: loads 1, 2 → 2 / 1.5; layer 2: balanced; layer 3: loads 3, 1 → 3 / 2
        1: {  # step 2
            "moe/layer1/max_over_mean": round(2 / 1.5, 6),
            "moe/layer2/max_over_mean": 1.0,
            "moe/layer3/max_over_mean": 1.5,
            "moe/max_over_mean": round((2 / 1.5 + 1.0 + 1.5) / 3, 6),
        },
        3: {  # step 4
            "moe/layer2/max_over_mean": 1.0,
            "moe/layer3/max_over_mean": 1.5,
            "moe/max_over_mean": 1.25,
        },
    }
    assert results == [expected, expected]


def _pipeline_fit(rank: int, world_size: int, root: str) -> dict[str, float]:
    """2 steps of a 4-layer tiny DeepSeek split over 2 pipeline stages; the logged loads."""
    module = nt.LanguageModelModule(
        "tiny", vocab_size=257, warmup_steps=2, model_overrides={"num_layers": 4}
    )
    trainer = nt.Trainer(
        strategy=nt.MegatronStrategy(pp=2),
        max_steps=2,
        global_batch_size=4,
        micro_batch_size=2,
        default_root_dir=root,
        loggers=[],
        log_every_n_steps=1,
        callbacks=[MoELoadMonitor(per_expert=True, heatmap_every_n_steps=0)],
    )
    trainer.fit(module, train_dataloaders=RandomTokens(16))
    return {k: float(v) for k, v in trainer.callback_metrics.items() if "/load/" in k}


@pytest.mark.distributed
def test_every_stage_of_a_real_pipeline_reports_its_moe_layers(tmp_path):
    results = run_world(_pipeline_fit, 2, str(tmp_path), timeout=120.0, pg_timeout=20.0)
    assert results[0] == results[1]  # every rank sees the layers of both stages
    per_layer: dict[str, float] = {}
    for name, load in results[0].items():
        layer = name.split("/")[1]
        per_layer[layer] = per_layer.get(layer, 0.0) + load
    # layer 0 is dense; MoE decoder layers 1-3 span both stages; 4 × 16 tokens × top-2 each
    for layer in ("layer1", "layer2", "layer3"):
        assert per_layer[layer] == 4 * 16 * 2


# -- a real MoE language model ------------------------------------------------------------------
class RandomTokens(Dataset):
    """Next-token items of random ids, like TokenShardDataset's."""

    def __init__(self, n: int, seq: int = 16, vocab: int = 257) -> None:
        self.tokens = torch.randint(
            0, vocab, (n, seq + 1), generator=torch.Generator().manual_seed(0)
        )

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


def test_tiny_deepseek_logs_loads_that_add_up_to_top_k_copies_per_token(tmp_path):
    module = nt.LanguageModelModule(model="tiny", vocab_size=257)
    monitor = MoELoadMonitor(heatmap_every_n_steps=2, per_expert=True)
    trainer = nt.Trainer(
        strategy=nt.SingleDeviceStrategy("cpu"),
        max_steps=2,
        global_batch_size=4,
        micro_batch_size=2,
        default_root_dir=str(tmp_path),
        loggers=["tensorboard", "jsonl"],
        log_every_n_steps=1,
        callbacks=[monitor],
    )
    trainer.fit(module, train_dataloaders=RandomTokens(16))
    logged = jsonl_by_step(trainer)
    cfg = module.config
    layer = cfg.first_k_dense_replace  # the first MoE decoder layer
    for step in (0, 1):  # steps 1 and 2, logged 0-based
        loads = [
            logged[step][f"moe/layer{layer}/load/expert{e}"] for e in range(cfg.n_routed_experts)
        ]
        # every one of the step's 4 × 16 tokens is sent to top-k experts, none dropped
        assert sum(loads) == 4 * 16 * cfg.num_experts_per_tok
        assert logged[step][f"moe/layer{layer}/dropped_fraction"] == 0.0
        assert logged[step][f"moe/layer{layer}/max_over_mean"] == pytest.approx(
            max(loads) / (sum(loads) / len(loads))
        )
    # biases after the last step, read from the model itself
    bias = module.model.moe_layers()[0].gate.e_score_correction_bias
    assert logged[1][f"moe/layer{layer}/bias_abs_max"] == pytest.approx(bias.abs().max().item())
    images = heatmap_events(trainer)
    assert [im.step for im in images] == [1]  # step 2
