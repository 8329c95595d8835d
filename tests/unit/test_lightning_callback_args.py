"""ModelCheckpoint and EarlyStopping take Lightning's arguments with Lightning's meaning: the
same scripted metric values give the same kept checkpoints, best checkpoint and stopping step
under `nanotrain.Trainer` as Lightning's own callbacks under `lightning.Trainer`; arguments
nanotrain cannot honour are refused at construction."""

from __future__ import annotations

import logging
import math
import re
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import nanotrain as nt
from nanotrain import testing as toy
from nanotrain.callbacks.checkpoint import ModelCheckpoint
from nanotrain.callbacks.early_stopping import EarlyStopping, EarlyStoppingReason
from nanotrain.checkpoint import files as ckpt_files
from nanotrain.checkpoint import load_model_weights, plan_resume, resolve_checkpoint_path
from tests.unit.test_checkpoint_callback import StepClock

STEPS_PER_EPOCH = 4  # 32 training samples, batches of 8


def data() -> toy.BlobsData:
    return toy.BlobsData(num_train=32, num_val=16, batch_size=8)


class Scripted(pl.LightningModule):
    """A tiny classifier whose logged metrics are scripted: `val_scores[i]` is logged as
    "val_loss" by every batch of the i-th validation run (the last one by every later run),
    or `val_scores[s]` at global step s when it is a dict; `train_scores[s]` as "score" by
    the training step that makes global step s."""

    def __init__(self, val_scores=(), train_scores=None) -> None:
        super().__init__()
        self.net = nn.Linear(8, 3)
        self.val_scores = val_scores if isinstance(val_scores, dict) else list(val_scores)
        self.train_scores = train_scores or {}
        self.val_runs = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        step = self.trainer.global_step + 1
        if step in self.train_scores:
            self.log("score", float(self.train_scores[step]))
        return F.cross_entropy(self.net(x), y)

    def on_validation_epoch_start(self) -> None:
        self.val_runs += 1

    def validation_step(self, batch, batch_idx):
        if isinstance(self.val_scores, dict):
            value = self.val_scores[self.trainer.global_step]
        else:
            value = self.val_scores[min(self.val_runs, len(self.val_scores)) - 1]
        self.log("val_loss", float(value), batch_size=len(batch[0]))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self.net(x), y), batch_size=len(y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def nano_fit(tmp_path, module, callbacks, ckpt_path=None, **settings) -> nt.Trainer:
    settings = {"max_steps": None, "max_epochs": 6, **settings}
    trainer = toy.make_trainer(tmp_path / "nano", callbacks=callbacks, **settings)
    trainer.fit(module, data(), ckpt_path=ckpt_path)
    return trainer


def lightning_fit(tmp_path, module, callbacks, **settings) -> pl.Trainer:
    settings = {"max_epochs": 6, **settings}
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path / "lightning",
        callbacks=callbacks,
        **settings,
    )
    trainer.fit(module, data())
    return trainer


def step_of(path: str | Path) -> int:
    """The global step of a Lightning checkpoint file or a nanotrain checkpoint directory."""
    path = Path(path)
    if path.is_dir():
        return ckpt_files.read_meta(path)["global_step"]
    return int(re.search(r"step=(\d+)", path.name).group(1))


def kept_steps(folder: Path) -> list[int]:
    return sorted(step_of(p) for p in folder.iterdir() if p.is_dir())


def lightning_kept_steps(ckpt: pl.callbacks.ModelCheckpoint) -> list[int]:
    folder = Path(ckpt.dirpath)
    files = [p for p in folder.iterdir() if p.name != "last.ckpt"] if folder.is_dir() else []
    return sorted(step_of(p) for p in files)


def assert_same_top_k(ours: ModelCheckpoint, theirs: pl.callbacks.ModelCheckpoint) -> None:
    assert sorted(step_of(p) for p in ours.best_k_models) == sorted(
        step_of(p) for p in theirs.best_k_models
    )
    for path, score in ours.best_k_models.items():
        (same,) = [s for p, s in theirs.best_k_models.items() if step_of(p) == step_of(path)]
        assert float(score) == float(same)
    if theirs.best_model_path:
        assert step_of(ours.best_model_path) == step_of(theirs.best_model_path)
    else:
        assert ours.best_model_path == ""
    assert (ours.best_model_score is None) == (theirs.best_model_score is None)
    if theirs.best_model_score is not None:
        assert float(ours.best_model_score) == float(theirs.best_model_score)
    if theirs.kth_best_model_path:
        assert step_of(ours.kth_best_model_path) == step_of(theirs.kth_best_model_path)


# -- ModelCheckpoint: save_top_k, monitor, mode, save_last ---------------------------------------
SCORES = {
    "distinct": [3.0, 1.0, 2.0, 0.5, 4.0, 1.5],
    # ties and a NaN (ranked as the worst), where the order of entry decides
    "ties and nan": [2.0, math.nan, 1.0, 1.0, 0.5, 1.0],
}


@pytest.mark.parametrize("scores", sorted(SCORES))
@pytest.mark.parametrize("mode", ["min", "max"])
@pytest.mark.parametrize("save_last", [True, False])
def test_save_top_k_keeps_the_k_best_by_monitor_as_lightning(tmp_path, scores, mode, save_last):
    values = SCORES[scores]
    options = dict(monitor="val_loss", save_top_k=2, mode=mode, save_last=save_last)
    ours = ModelCheckpoint(**options)
    trainer = nano_fit(tmp_path, Scripted(values), [ours])
    theirs = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "lightning-ckpts", **options)
    lightning_fit(tmp_path, Scripted(values), [theirs])

    assert_same_top_k(ours, theirs)
    top_k = lightning_kept_steps(theirs)
    assert len(top_k) == 2
    final = 6 * STEPS_PER_EPOCH
    # on disk: Lightning's top k, and (with save_last, Lightning's last.ckpt) the final state
    assert kept_steps(trainer.checkpoint_dir) == sorted(
        set(top_k) | ({final} if save_last else set())
    )
    assert (trainer.checkpoint_dir / "last").is_file()
    newest = trainer.checkpoint_dir / (trainer.checkpoint_dir / "last").read_text().strip()
    assert step_of(newest) == max(kept_steps(trainer.checkpoint_dir))


def test_save_top_k_scores_are_what_was_logged(tmp_path):
    ours = ModelCheckpoint(monitor="val_loss", save_top_k=2)
    nano_fit(tmp_path, Scripted(SCORES["distinct"]), [ours])
    # epochs 4 and 2 (steps 16 and 8) logged the two lowest values, 0.5 and 1.0
    assert {step_of(p): float(s) for p, s in ours.best_k_models.items()} == {16: 0.5, 8: 1.0}
    assert step_of(ours.best_model_path) == 16 and float(ours.best_model_score) == 0.5
    assert step_of(ours.kth_best_model_path) == 8 and float(ours.kth_value) == 1.0
    assert Path(ours.last_model_path).name == "step-00000024"


@pytest.mark.parametrize("save_top_k", [1, -1, 0])
def test_without_monitor_top_k_keeps_the_newest_as_lightning(tmp_path, save_top_k):
    ours = ModelCheckpoint(every_n_epochs=2, save_top_k=save_top_k, save_last=False)
    trainer = nano_fit(tmp_path, Scripted([1.0]), [ours])
    theirs = pl.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "lightning-ckpts", every_n_epochs=2, save_top_k=save_top_k
    )
    lightning_fit(tmp_path, Scripted([1.0]), [theirs])
    saved = [8, 16, 24]  # the ends of epochs 2, 4 and 6
    expected = {1: saved[-1:], -1: saved, 0: []}[save_top_k]
    assert lightning_kept_steps(theirs) == expected
    assert kept_steps(trainer.checkpoint_dir) == expected
    assert_same_top_k(ours, theirs)  # best_model_path: the newest, as Lightning's


def test_default_cadence_is_every_epoch_and_save_top_k_one_with_a_monitor(tmp_path):
    ours = ModelCheckpoint(monitor="val_loss", save_last=False)
    trainer = nano_fit(tmp_path, Scripted(SCORES["distinct"]), [ours])
    theirs = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "lightning-ckpts", monitor="val_loss")
    lightning_fit(tmp_path, Scripted(SCORES["distinct"]), [theirs])
    assert kept_steps(trainer.checkpoint_dir) == lightning_kept_steps(theirs) == [16]
    assert_same_top_k(ours, theirs)


def test_a_stop_inside_an_epoch_still_saves_on_the_epoch_cadence_as_lightning(tmp_path):
    # max_steps ends the second epoch after 2 of its 4 steps: Lightning ends it with
    # on_train_epoch_end, which saves it as a top-k candidate
    values = [2.0, 1.0]
    ours = ModelCheckpoint(monitor="val_loss", save_top_k=-1, save_last=False)
    trainer = nano_fit(tmp_path, Scripted(values), [ours], max_steps=6)
    theirs = pl.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "lightning-ckpts", monitor="val_loss", save_top_k=-1
    )
    lightning_fit(tmp_path, Scripted(values), [theirs], max_steps=6)
    assert kept_steps(trainer.checkpoint_dir) == lightning_kept_steps(theirs) == [4, 6]
    # the stopped epoch's end saves step 6 before nanotrain's final validation (which
    # Lightning does not run): ranked, as Lightning's, by the value of step 4
    scores = {step_of(p): float(s) for p, s in ours.best_k_models.items()}
    assert scores == {step_of(p): float(s) for p, s in theirs.best_k_models.items()}
    assert scores == {4: 2.0, 6: 2.0}


def test_save_on_train_epoch_end_false_saves_after_each_validation_as_lightning(tmp_path):
    values = [3.0, 1.0, 2.0, 0.5, 4.0, 1.5]  # validation every 2 steps: 6 runs in 3 epochs
    options = dict(monitor="val_loss", save_top_k=2, save_on_train_epoch_end=False)
    ours = ModelCheckpoint(save_last=False, **options)
    nano_fit(tmp_path, Scripted(values), [ours], max_epochs=3, val_check_interval=2)
    theirs = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "lightning-ckpts", **options)
    lightning_fit(tmp_path, Scripted(values), [theirs], max_epochs=3, val_check_interval=2)
    assert_same_top_k(ours, theirs)
    assert sorted(step_of(p) for p in ours.best_k_models) == [4, 8]  # 1.0 and 0.5


def test_a_step_cadence_waits_for_validation_to_log_the_monitor_as_lightning(tmp_path):
    # every 2 steps, validation every 4: step 2 has no val_loss yet, so its save waits for
    # the validation at step 4 (Lightning defers it the same way)
    values = [3.0, 1.0, 2.0, 0.5, 4.0, 1.5]
    ours = ModelCheckpoint(monitor="val_loss", save_top_k=2, every_n_train_steps=2, save_last=False)
    nano_fit(tmp_path, Scripted(values), [ours], max_epochs=3, val_check_interval=4)
    theirs = pl.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "lightning-ckpts",
        monitor="val_loss",
        save_top_k=2,
        every_n_train_steps=2,
    )
    lightning_fit(tmp_path, Scripted(values), [theirs], max_epochs=3, val_check_interval=4)
    assert_same_top_k(ours, theirs)


def test_a_missing_monitor_is_a_value_error_naming_what_was_logged(tmp_path):
    with pytest.raises(ValueError, match=r"monitor='val/acc'.*'val_loss'"):
        nano_fit(tmp_path, Scripted([1.0]), [ModelCheckpoint(monitor="val/acc")])
    # without validation data the metric can never come: at the first save
    saver = ModelCheckpoint(monitor="val_loss", every_n_steps=2)
    with pytest.raises(ValueError, match="found no 'val_loss'.*at step 2"):
        nano_fit(tmp_path / "noval", Scripted([1.0]), [saver], limit_val_batches=0)


def test_keep_best_k_still_keeps_more_of_the_best(tmp_path):
    ours = ModelCheckpoint(monitor="val_loss", save_top_k=1, keep_best_k=3, save_last=False)
    trainer = nano_fit(tmp_path, Scripted(SCORES["distinct"]), [ours])
    assert ours.save_top_k == 3  # keep_best_k raises the k
    assert kept_steps(trainer.checkpoint_dir) == [8, 16, 24]  # 1.0, 0.5 and 1.5
    assert step_of(ours.best_model_path) == 16


def test_top_k_state_survives_a_resume(tmp_path):
    values = dict(zip((4, 8, 12, 16, 20, 24), SCORES["distinct"], strict=True))
    first = ModelCheckpoint(monitor="val_loss", save_top_k=2)
    nano_fit(tmp_path, Scripted(values), [first], max_epochs=3)
    second = ModelCheckpoint(monitor="val_loss", save_top_k=2)
    trainer = nano_fit(tmp_path, Scripted(values), [second], ckpt_path="last")
    straight = ModelCheckpoint(monitor="val_loss", save_top_k=2)
    nano_fit(tmp_path / "straight", Scripted(values), [straight])
    assert {step_of(p): float(s) for p, s in second.best_k_models.items()} == {
        step_of(p): float(s) for p, s in straight.best_k_models.items()
    }
    assert kept_steps(trainer.checkpoint_dir) == [8, 16, 24]


# -- ModelCheckpoint: filename, auto_insert_metric_name, enable_version_counter ----------------------
def test_filename_template_names_the_checkpoint_directories_as_lightning(tmp_path):
    options = dict(monitor="val_loss", save_top_k=2, filename="{epoch}-{step}-{val_loss:.2f}")
    ours = ModelCheckpoint(save_last=False, **options)
    trainer = nano_fit(tmp_path, Scripted(SCORES["distinct"]), [ours])
    theirs = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "lightning-ckpts", **options)
    lightning_fit(tmp_path, Scripted(SCORES["distinct"]), [theirs])
    names = sorted(p.name for p in trainer.checkpoint_dir.iterdir() if p.is_dir())
    assert names == sorted(Path(p).stem for p in theirs.best_k_models)
    assert names == ["epoch=1-step=8-val_loss=1.00", "epoch=3-step=16-val_loss=0.50"]
    assert Path(ours.best_model_path).name == "epoch=3-step=16-val_loss=0.50"
    # `last` names the newest of them, and ckpt_path="last" resumes it
    assert (trainer.checkpoint_dir / "last").read_text().strip() == "epoch=3-step=16-val_loss=0.50"
    resumed = nano_fit(
        tmp_path, Scripted([9.0]), [ModelCheckpoint(**options)], max_epochs=5, ckpt_path="last"
    )
    assert resumed.global_step == 5 * STEPS_PER_EPOCH and resumed.run_dir == trainer.run_dir


def test_auto_insert_metric_name_false_takes_the_template_as_written(tmp_path):
    ours = ModelCheckpoint(
        filename="e{epoch:02d}_loss{val_loss:.1f}",
        auto_insert_metric_name=False,
        every_n_epochs=3,
        save_last=False,
    )
    trainer = nano_fit(tmp_path, Scripted([2.0, 1.0, 0.25]), [ours])
    assert sorted(p.name for p in trainer.checkpoint_dir.iterdir() if p.is_dir()) == [
        "e02_loss0.2",
        "e05_loss0.2",
    ]


def test_enable_version_counter_as_lightning(tmp_path):
    # a save every 2 steps, named by the epoch only: two saves per epoch share a name
    scores = {s: float(s) for s in range(1, 13)}
    options = dict(filename="{epoch}", monitor="score", mode="max", save_top_k=-1)
    ours = ModelCheckpoint(every_n_train_steps=2, save_last=False, **options)
    trainer = nano_fit(tmp_path, Scripted([1.0], scores), [ours], max_epochs=3)
    theirs = pl.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "lightning-ckpts", every_n_train_steps=2, **options
    )
    lightning_fit(tmp_path, Scripted([1.0], scores), [theirs], max_epochs=3)
    expected = sorted(Path(p).stem for p in theirs.best_k_models)
    assert expected == ["epoch=0", "epoch=0-v1", "epoch=1", "epoch=1-v1", "epoch=2", "epoch=2-v1"]
    assert sorted(p.name for p in trainer.checkpoint_dir.iterdir() if p.is_dir()) == expected

    overwrite = ModelCheckpoint(
        every_n_train_steps=2, save_last=False, enable_version_counter=False, **options
    )
    trainer = nano_fit(tmp_path / "overwrite", Scripted([1.0], scores), [overwrite], max_epochs=3)
    kept = {p.name: step_of(p) for p in trainer.checkpoint_dir.iterdir() if p.is_dir()}
    assert kept == {"epoch=0": 4, "epoch=1": 8, "epoch=2": 12}  # the later save overwrote


# -- ModelCheckpoint: cadences under Lightning's names -------------------------------------------------
def test_every_n_train_steps_is_every_n_steps(tmp_path):
    steps = []
    for name, ckpt in (
        ("lightning", ModelCheckpoint(every_n_train_steps=3, save_last=False)),
        ("nanotrain", ModelCheckpoint(every_n_steps=3, save_last=False)),
        ("both", ModelCheckpoint(every_n_steps=3, every_n_train_steps=3, save_last=False)),
    ):
        trainer = nano_fit(tmp_path / name, Scripted([1.0]), [ckpt], max_epochs=2)
        steps.append(kept_steps(trainer.checkpoint_dir))
    assert steps == [[3, 6]] * 3


def test_train_time_interval_is_every_n_minutes(tmp_path):
    kept = []
    for name, option in (
        ("lightning", dict(train_time_interval=timedelta(seconds=90))),
        ("nanotrain", dict(every_n_minutes=1.5)),
    ):
        clock = StepClock()  # 40 s per step
        ckpt = ModelCheckpoint(save_last=False, **option)
        ckpt._clock = clock.clock
        trainer = nano_fit(tmp_path / name, Scripted([1.0]), [clock, ckpt], max_steps=7)
        kept.append(kept_steps(trainer.checkpoint_dir))
    assert kept == [[3, 6], [3, 6]]  # 90 s first pass at step 3 (120 s), then at step 6


def test_every_n_epochs_saves_the_end_of_every_nth_epoch(tmp_path):
    ours = ModelCheckpoint(every_n_epochs=3, save_last=False)
    trainer = nano_fit(tmp_path, Scripted([1.0]), [ours], max_epochs=7)
    assert kept_steps(trainer.checkpoint_dir) == [12, 24]  # the ends of epochs 3 and 6


def test_save_last_saves_the_final_step(tmp_path):
    for save_last, expected in ((True, [2, 4, 6, 7]), (False, [2, 4, 6])):
        ckpt = ModelCheckpoint(every_n_train_steps=2, save_top_k=-1, save_last=save_last)
        trainer = nano_fit(tmp_path / str(save_last), Scripted([1.0]), [ckpt], max_steps=7)
        assert kept_steps(trainer.checkpoint_dir) == expected
        newest = (trainer.checkpoint_dir / "last").read_text().strip()
        assert step_of(trainer.checkpoint_dir / newest) == expected[-1]


def test_verbose_logs_the_top_k_decisions(tmp_path, caplog):
    ours = ModelCheckpoint(monitor="val_loss", save_top_k=1, verbose=True)
    with caplog.at_level(logging.INFO, logger="nanotrain.callbacks.checkpoint"):
        nano_fit(tmp_path, Scripted([2.0, 3.0]), [ours], max_epochs=2)
    assert "'val_loss' reached 2.00000 (best 2.00000)" in caplog.text
    assert "global step 8: 'val_loss' was not in top 1" in caplog.text


# -- ModelCheckpoint: save_weights_only ---------------------------------------------------------------
def test_save_weights_only_checkpoint_loads_but_does_not_resume(tmp_path):
    ckpt = ModelCheckpoint(save_weights_only=True)
    module = toy.Classifier()
    trainer = toy.make_trainer(tmp_path, max_steps=4, callbacks=[ckpt])
    trainer.fit(module, data())
    path = Path(ckpt.last_model_path)
    meta = ckpt_files.read_meta(path)
    assert "optimizer.pt" not in meta["files"]  # weights (and config) only
    weights = load_model_weights(path)
    for name, value in module.state_dict().items():
        assert torch.equal(weights[name], value)
    loaded = toy.Classifier.load_from_checkpoint(path)
    for name, value in module.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value)
    # validate loads the weights only: allowed
    validated = toy.make_trainer(tmp_path, callbacks=[ModelCheckpoint()])
    assert "val/loss" in validated.validate(toy.Classifier(), data(), ckpt_path=path)[0]
    for ckpt_path in (path, "last"):
        again = toy.make_trainer(tmp_path, max_steps=6, callbacks=[ModelCheckpoint()])
        with pytest.raises(ValueError, match="holds the model weights only.*load_from_checkpoint"):
            again.fit(toy.Classifier(), data(), ckpt_path=ckpt_path)


class RandomTokens(Dataset):
    def __init__(self, n: int = 8, seq: int = 16, vocab: int = 257) -> None:
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (n, seq + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


def test_save_weights_only_checkpoint_exports(tmp_path):
    from nanotrain.interop.weights import export_checkpoint, load_pretrained

    ckpt = ModelCheckpoint(save_weights_only=True)
    trainer = toy.make_trainer(tmp_path, max_steps=1, micro_batch_size=4, callbacks=[ckpt])
    module = nt.LanguageModelModule(model="tiny", vocab_size=257, warmup_steps=1)
    trainer.fit(module, train_dataloaders=RandomTokens())
    out = export_checkpoint(ckpt.last_model_path, tmp_path / "exported", to="nanotrain")
    _, weights = load_pretrained(out)
    for name, value in module.model.state_dict().items():
        assert torch.equal(weights[name], value), name


# -- ckpt_path="best" ---------------------------------------------------------------------------------
def test_ckpt_path_best_is_the_best_checkpoint(tmp_path):
    ours = ModelCheckpoint(monitor="val_loss", save_top_k=2)
    trainer = nano_fit(tmp_path, Scripted(SCORES["distinct"]), [ours])
    best = Path(ours.best_model_path)
    assert step_of(best) == 16
    assert resolve_checkpoint_path(trainer, "best") == best
    # with the Trainer's callbacks, or from the run directory alone (a new process)
    experiment = trainer.run_dir.parent
    assert plan_resume(experiment, None, "best", trainer.callbacks) == (trainer.run_dir, best)
    assert plan_resume(experiment, None, "best") == (trainer.run_dir, best)
    fresh = toy.make_trainer(tmp_path / "nano", callbacks=[ModelCheckpoint(monitor="val_loss")])
    assert plan_resume(experiment, None, "best", fresh.callbacks).checkpoint == best

    # validate loads the best weights
    module = Scripted([7.0])
    trainer.validate(module, data(), ckpt_path="best")
    for name, value in load_model_weights(best).items():
        assert torch.equal(module.state_dict()[name], value)
    # fit resumes from the best checkpoint (step 16), in its run directory
    saver = ModelCheckpoint(monitor="val_loss")
    resumed = nano_fit(tmp_path, Scripted([1.0]), [saver], max_epochs=5, ckpt_path="best")
    assert resumed.run_dir == trainer.run_dir and resumed.global_step == 20


def test_ckpt_path_best_for_test(tmp_path):
    ours = ModelCheckpoint(monitor="val_loss", save_top_k=2)
    trainer = nano_fit(tmp_path, Scripted(SCORES["distinct"]), [ours])
    module = Scripted([1.0])
    trainer.test(module, dataloaders=data().val_dataloader(), ckpt_path="best")
    for name, value in load_model_weights(ours.best_model_path).items():
        assert torch.equal(module.state_dict()[name], value)


def test_ckpt_path_best_finds_a_custom_dirpath_through_the_callback(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    ours = ModelCheckpoint(dirpath=elsewhere, monitor="val_loss", save_top_k=2)
    trainer = nano_fit(tmp_path, Scripted(SCORES["distinct"]), [ours])
    experiment = trainer.run_dir.parent
    # a new Trainer's ModelCheckpoint has saved nothing: its dirpath holds the record
    again = ModelCheckpoint(dirpath=elsewhere, monitor="val_loss")
    assert plan_resume(experiment, None, "best", [again]).checkpoint == elsewhere / "step-00000016"
    with pytest.raises(ValueError, match="no best checkpoint is known"):
        plan_resume(experiment, None, "best")  # the run directory holds no checkpoint


def test_ckpt_path_best_without_monitor_is_the_newest_top_k_checkpoint(tmp_path):
    ours = ModelCheckpoint(every_n_epochs=2, save_top_k=1, save_last=False)
    trainer = nano_fit(tmp_path, Scripted([1.0]), [ours])
    assert step_of(resolve_checkpoint_path(trainer, "best")) == 24


def test_ckpt_path_best_without_a_best_checkpoint_is_refused(tmp_path):
    with pytest.raises(ValueError, match='ckpt_path="best": no best checkpoint is known'):
        nano_fit(tmp_path, Scripted([1.0]), [ModelCheckpoint()], ckpt_path="best")
    saver = ModelCheckpoint(save_top_k=0)  # keeps no top-k checkpoint: no best one
    nano_fit(tmp_path / "none", Scripted([1.0]), [saver], max_epochs=1)
    with pytest.raises(ValueError, match="no best checkpoint is known"):
        nano_fit(tmp_path / "none", Scripted([1.0]), [ModelCheckpoint()], ckpt_path="best")


# -- EarlyStopping: Lightning's decisions ---------------------------------------------------------------
STOPS = {
    "patience": (dict(patience=2), [1.0, 0.9, 0.95, 0.92, 0.5, 0.4]),
    "min_delta": (dict(patience=1, min_delta=0.05), [1.0, 0.97, 0.9, 0.89, 0.5, 0.4]),
    "max mode": (dict(mode="max", patience=2, min_delta=0.03), [0.5, 0.55, 0.56, 0.6, 0.61, 0.62]),
    "stopping_threshold": (dict(stopping_threshold=0.5), [1.0, 0.8, 0.6, 0.4, 0.3, 0.2]),
    "divergence_threshold": (dict(divergence_threshold=2.0), [1.0, 1.5, 2.5, 1.0, 1.0, 1.0]),
    "check_finite": (dict(), [1.0, math.nan, 1.0, 1.0, 1.0, 1.0]),
    "not finite but unchecked": (
        dict(check_finite=False, patience=2),
        [1.0, math.inf, 0.5, 2, 2, 2],
    ),
    "never": (dict(patience=3), [1.0, 0.9, 0.8, 0.7, 0.6, 0.5]),
    "patience 0": (dict(patience=0), [1.0, 0.9, 0.95, 0.8, 0.7, 0.6]),
}


@pytest.mark.parametrize("case", sorted(STOPS))
def test_early_stopping_stops_at_the_same_step_as_lightning(tmp_path, case):
    options, values = STOPS[case]
    ours = EarlyStopping(monitor="val_loss", **options)
    trainer = nano_fit(tmp_path, Scripted(values), [ours])
    theirs = pl.callbacks.EarlyStopping(monitor="val_loss", **options)
    lightning = lightning_fit(tmp_path, Scripted(values), [theirs])
    assert trainer.global_step == lightning.global_step
    assert ours.stopped_epoch == theirs.stopped_epoch
    assert ours.wait_count == theirs.wait_count
    assert float(ours.best_score) == float(theirs.best_score)
    assert ours.stopping_reason == theirs.stopping_reason
    assert ours.stopping_reason_message == theirs.stopping_reason_message
    stopped = ours.stopping_reason != EarlyStoppingReason.NOT_STOPPED
    assert trainer.should_stop == stopped and (ours.stopped_step is not None) == stopped


def test_early_stopping_counts_on_after_a_resume_as_without_one(tmp_path):
    values = dict(zip((4, 8, 12, 16, 20, 24), [1.0, 0.9, 0.95, 0.93, 0.99, 0.5], strict=True))
    straight = EarlyStopping(monitor="val_loss", patience=3)
    uninterrupted = nano_fit(tmp_path / "straight", Scripted(values), [straight])
    # the checkpoint of epoch 3's end holds the check of that epoch; resuming it repeats the
    # end of epoch 3 (its validation and on_train_epoch_end), which must not count twice
    first = EarlyStopping(monitor="val_loss", patience=3)
    nano_fit(tmp_path, Scripted(values), [first, ModelCheckpoint()], max_epochs=3)
    assert first.wait_count == 1
    resumed = EarlyStopping(monitor="val_loss", patience=3)
    trainer = nano_fit(tmp_path, Scripted(values), [resumed, ModelCheckpoint()], ckpt_path="last")
    assert trainer.global_step == uninterrupted.global_step == 5 * STEPS_PER_EPOCH
    assert resumed.wait_count == straight.wait_count == 3
    assert resumed.stopped_epoch == straight.stopped_epoch == 4


@pytest.mark.parametrize("check_on_train_epoch_end", [None, False, True])
def test_early_stopping_with_validation_inside_epochs_as_lightning(
    tmp_path, check_on_train_epoch_end
):
    # validation every 2 steps, 2 per epoch; checking at epoch ends sees every second value
    values = [1.0, 0.9, 0.95, 0.93, 0.8, 0.85, 0.99, 0.99, 0.99, 0.99, 0.99, 0.99]
    options = dict(
        monitor="val_loss", patience=2, check_on_train_epoch_end=check_on_train_epoch_end
    )
    ours = EarlyStopping(**options)
    trainer = nano_fit(tmp_path, Scripted(values), [ours], val_check_interval=2)
    theirs = pl.callbacks.EarlyStopping(**options)
    lightning = lightning_fit(tmp_path, Scripted(values), [theirs], val_check_interval=2)
    assert trainer.global_step == lightning.global_step < 6 * STEPS_PER_EPOCH
    assert ours.wait_count == theirs.wait_count
    assert float(ours.best_score) == float(theirs.best_score)


def test_early_stopping_strict_false_skips_a_missing_metric(tmp_path, caplog):
    ours = EarlyStopping(monitor="val/acc", strict=False, verbose=True)
    with caplog.at_level(logging.WARNING, logger="nanotrain.callbacks.early_stopping"):
        trainer = nano_fit(tmp_path, Scripted([1.0]), [ours], max_epochs=2)
    assert trainer.global_step == 2 * STEPS_PER_EPOCH and ours.wait_count == 0
    assert "EarlyStopping monitors 'val/acc', which was not logged" in caplog.text
    with pytest.raises(ValueError, match="'val/acc', which was not logged.*'val_loss'"):
        nano_fit(tmp_path / "strict", Scripted([1.0]), [EarlyStopping(monitor="val/acc")])


def test_early_stopping_verbose_and_log_rank_zero_only(caplog):
    def fake(rank: int):
        return SimpleNamespace(
            is_fitting=True,
            validation_is_extra=False,
            global_rank=rank,
            world_size=2,
            is_global_zero=rank == 0,
            global_step=3,
            current_epoch=0,
            callback_metrics={"val_loss": torch.tensor(0.5)},
            request_stop=lambda: None,
        )

    logged = {}
    for only_zero in (False, True):
        for rank in (0, 1):
            stopper = EarlyStopping(monitor="val_loss", verbose=True, log_rank_zero_only=only_zero)
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="nanotrain.callbacks.early_stopping"):
                stopper.on_validation_end(fake(rank), None)
            logged[only_zero, rank] = caplog.text
    assert "[rank: 0] Metric val_loss improved. New best score: 0.500" in logged[False, 0]
    assert "[rank: 1] Metric val_loss improved" in logged[False, 1]
    assert "[rank: 0] Metric val_loss improved" in logged[True, 0]
    assert logged[True, 1] == ""


# -- refusals ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(save_top_k=-2), ValueError, "save_top_k must be an integer >= -1"),
        (dict(mode="best"), ValueError, "mode must be 'min' or 'max'"),
        (
            dict(every_n_steps=2, every_n_train_steps=3),
            ValueError,
            "every_n_steps=2 and every_n_train_steps=3 are two names for the same cadence",
        ),
        (dict(every_n_train_steps=-1), ValueError, "every_n_train_steps must be an integer >= 0"),
        (
            dict(every_n_minutes=1, train_time_interval=timedelta(minutes=2)),
            ValueError,
            "two names for the same cadence and disagree",
        ),
        (dict(train_time_interval=90), TypeError, "must be a datetime.timedelta"),
        (dict(every_n_epochs=-1), ValueError, "every_n_epochs must be an integer >= 0"),
        (dict(filename="runs/{epoch}"), ValueError, "would not be one directory name"),
        (dict(filename="{val/loss:.2f}"), ValueError, "auto_insert_metric_name=False"),
        (dict(filename=100), TypeError, "keyword-only"),
        (dict(save_weights_only=True, async_save=True), ValueError, "async_save"),
        (dict(save_last="always"), ValueError, "save_last must be None, True, False or 'link'"),
        (dict(keep_best_k=2), ValueError, "set monitor"),
    ],
)
def test_model_checkpoint_refuses_what_it_cannot_honour(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message) if "*" not in message else message):
        ModelCheckpoint(**kwargs)


def test_a_positional_every_n_steps_is_caught_as_a_filename():
    with pytest.raises(TypeError, match="every_n_steps.*keyword-only"):
        ModelCheckpoint("ckpts", 100)


def test_a_template_that_formats_to_an_unusable_name_is_refused_at_the_save(tmp_path):
    saver = ModelCheckpoint(filename="last", save_last=False)
    with pytest.raises(ValueError, match="not a usable directory name"):
        nano_fit(tmp_path, Scripted([1.0]), [saver], max_epochs=1)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(mode="best"), ValueError, "mode must be 'min' or 'max'"),
        (dict(patience=-1), ValueError, "patience must be an integer >= 0"),
        (dict(min_delta=-0.1), ValueError, "min_delta must be >= 0"),
        (dict(stopping_threshold="low"), TypeError, "stopping_threshold must be a number"),
        (dict(divergence_threshold=[3]), TypeError, "divergence_threshold must be a number"),
        (dict(check_on_train_epoch_end="yes"), ValueError, "check_on_train_epoch_end must be"),
    ],
)
def test_early_stopping_refuses_what_it_cannot_honour(kwargs, error, message):
    with pytest.raises(error, match=message):
        EarlyStopping(**kwargs)


def test_early_stopping_takes_lightnings_positional_order():
    stopper = EarlyStopping("val_loss", 0.1, 4)
    assert (stopper.monitor, stopper.min_delta, stopper.patience) == ("val_loss", 0.1, 4)
    with pytest.raises(TypeError, match="Lightning's: monitor, min_delta, patience"):
        EarlyStopping("val_loss", "max")  # nanotrain's old order: (monitor, mode)
