"""Logged steps and columns as Lightning writes them: the same module fitted and validated by
`lightning.Trainer` and `nanotrain.Trainer`, each with a CSVLogger, gives every logged name at
the same (step, epoch) rows: 0-based steps (the optimizer steps completed before the one
logged) and an `epoch` column. nanotrain's callbacks log at the step of that step's
`train/loss`."""

from __future__ import annotations

import copy
import csv
import json
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor as LightningLRMonitor
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger

import nanotrain as nt
from nanotrain.callbacks import GradNormMonitor, LearningRateMonitor, ThroughputMonitor
from nanotrain.testing import BlobsData, Classifier, make_trainer

# what the module logs, and from where
LOGGED = ("tr", "tr_both_step", "tr_both_epoch", "tr_ep", "tr_end", "va", "va_end")


class Logs(BoringModel):
    """BoringModel (data drawn at construction) logging per step, per epoch and both in
    training, per epoch in validation, and from the epoch-end hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.train_data, self.val_data = torch.randn(64, 32), torch.randn(16, 32)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.train_data, batch_size=8)  # 8 steps an epoch

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.val_data, batch_size=8)

    def training_step(self, batch, batch_idx):
        loss = self.step(batch)
        self.log("tr", loss)
        self.log("tr_both", loss, on_step=True, on_epoch=True)
        self.log("tr_ep", loss, on_step=False, on_epoch=True)
        return loss

    def on_train_epoch_end(self):
        self.log("tr_end", float(self.current_epoch))

    def validation_step(self, batch, batch_idx):
        self.log("va", self.step(batch))

    def on_validation_epoch_end(self):
        self.log("va_end", float(self.trainer.global_step))


def read_csv(path) -> list[dict[str, float]]:
    with open(path) as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def rows_of(rows: list[dict[str, float]], name: str) -> list[tuple[float, float, float]]:
    """(step, epoch, value) of every row holding `name`, in the order written."""
    return [(r["step"], r["epoch"], r[name]) for r in rows if name in r]


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """2 epochs of 8 steps, validating every 4 steps (so also at each epoch's end), then
    validate() on the same trainer; `logged` with the LR monitors too."""
    tmp = tmp_path_factory.mktemp("steps")
    torch.manual_seed(0)
    original = Logs()
    settings = dict(
        max_epochs=2,
        log_every_n_steps=1,
        val_check_interval=4,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    out = {}
    for name, trainer_class, monitor in (
        ("pl", pl.Trainer, LightningLRMonitor(logging_interval="step")),
        ("nt", nt.Trainer, LearningRateMonitor(logging_interval="step")),
    ):
        module = copy.deepcopy(original)
        logger = CSVLogger(tmp / name, name="", version="")
        extra = {"enable_monitors": False} if name == "nt" else {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = trainer_class(
                default_root_dir=str(tmp / f"{name}_root"),
                logger=logger,
                callbacks=[monitor],
                **settings,
                **extra,
            )
            trainer.fit(module)
            trainer.validate(module)
        out[name] = read_csv(tmp / name / "metrics.csv")
    return out


@pytest.mark.parametrize("name", LOGGED)
def test_every_logged_name_has_lightnings_step_and_epoch(both, name):
    ours, theirs = rows_of(both["nt"], name), rows_of(both["pl"], name)
    assert [r[:2] for r in ours] == [r[:2] for r in theirs]
    torch.testing.assert_close([r[2] for r in ours], [r[2] for r in theirs], rtol=1e-5, atol=0)


def test_the_steps_lightning_writes(both):
    """What the comparison above pins down, spelled out on nanotrain's file."""
    rows = both["nt"]
    steps = lambda name: [(int(s), int(e)) for s, e, _ in rows_of(rows, name)]  # noqa: E731
    # per step: optimizer step N at N - 1, with the epoch it ran in
    assert steps("tr") == [(s, s // 8) for s in range(16)]
    # epoch values: at the epoch's last step (7, 15)
    assert steps("tr_both_epoch") == steps("tr_end") == [(7, 0), (15, 1)]
    # in fit, after steps 4, 8, 12, 16: at their steps (8 and 16 are the epochs' ends); after
    # fit, validate() at global_step (16) and current_epoch (2)
    assert steps("va") == [(3, 0), (7, 0), (11, 1), (15, 1), (16, 2)]
    assert [v for *_, v in rows_of(rows, "va_end")] == [4, 8, 12, 16, 16]


def test_learning_rate_monitor_logs_at_lightnings_steps(both):
    ours = [r["step"] for r in both["nt"] if "lr/group0" in r]
    theirs = [r["step"] for r in both["pl"] if "lr-SGD" in r]
    assert ours == theirs == list(range(16))
    # an explicit step: no epoch column, as Lightning's own monitor's records
    assert not any("epoch" in r for r in both["nt"] if "lr/group0" in r)


def test_validate_on_a_fresh_trainer_logs_at_step_zero_epoch_zero(tmp_path):
    written = {}
    for name, trainer_class in (("pl", pl.Trainer), ("nt", nt.Trainer)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = trainer_class(
                default_root_dir=str(tmp_path / f"{name}_root"),
                logger=CSVLogger(tmp_path / name, name="", version=""),
                enable_progress_bar=False,
                enable_model_summary=False,
            )
            trainer.validate(Logs())
        written[name] = [(r["step"], r["epoch"]) for r in read_csv(tmp_path / name / "metrics.csv")]
    assert written["nt"] == written["pl"] == [(0, 0)]


def test_callbacks_log_at_the_step_of_their_steps_train_loss(tmp_path):
    # logging_interval="step": the rates on log steps only (None adds the epoch's start)
    monitors = [
        LearningRateMonitor(logging_interval="step"),
        GradNormMonitor(detail_every_n_steps=2),
        ThroughputMonitor(),
    ]
    trainer = make_trainer(tmp_path, max_steps=6, log_every_n_steps=2, callbacks=monitors)
    trainer.fit(Classifier(), BlobsData())
    lines = [json.loads(x) for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    train_steps = {x["step"] for x in lines if "train/loss" in x}
    assert train_steps == {1, 3, 5}  # steps 2, 4, 6
    for prefix in ("lr/", "grad_norm/", "throughput/"):
        steps = {x["step"] for x in lines if any(k.startswith(prefix) for k in x)}
        assert steps and steps <= train_steps, prefix
    # the step's own records carry the epoch; callbacks passing step= do not (as Lightning)
    assert all("epoch" in x for x in lines if "train/loss" in x or "throughput/step_time" in x)


def test_log_metrics_takes_a_logged_step_value_as_the_step(tmp_path):
    """Lightning's rule: a "step" value among the metrics is the step (no epoch column); an
    empty dict writes nothing."""

    class StepKey(nt.Callback):
        def on_train_step_end(self, trainer, module, *args):
            trainer.log_metrics({"step": 100 + trainer.global_step, "custom": 1.0})
            trainer.log_metrics({})

    trainer = make_trainer(tmp_path, max_steps=2, callbacks=[StepKey()])
    trainer.fit(Classifier(), BlobsData())
    lines = [json.loads(x) for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    custom = [x for x in lines if "custom" in x]
    assert [(x["step"], "epoch" in x) for x in custom] == [(101, False), (102, False)]
    assert all(set(x) - {"step", "time"} for x in lines)  # no empty records


class EpochEnd(Classifier):
    def on_train_epoch_end(self):
        self.log("ep_end", float(self.current_epoch))


def test_a_resumed_epoch_end_is_written_where_the_uninterrupted_run_writes_it(tmp_path):
    """A checkpoint saved at an epoch's end, resumed: the epoch's end (validation, epoch
    values) runs again and is written at its last step's step, as without the resume."""
    from nanotrain.callbacks import ModelCheckpoint

    def fit(root, max_epochs, ckpt_path=None):
        trainer = make_trainer(
            root, max_steps=None, max_epochs=max_epochs, callbacks=[ModelCheckpoint()]
        )
        trainer.fit(EpochEnd(), BlobsData(num_train=64, num_val=16), ckpt_path=ckpt_path)
        lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x) for x in lines]

    def epoch_ends(records):
        return [(x["step"], x["epoch"]) for x in records if "ep_end" in x or "val/loss" in x]

    straight = fit(tmp_path / "straight", 2)
    assert epoch_ends(straight) == [(7, 0), (7, 0), (15, 1), (15, 1)]  # 8 steps an epoch
    fit(tmp_path / "resumed", 1)
    resumed = fit(tmp_path / "resumed", 2, ckpt_path="last")
    assert epoch_ends(resumed)[-4:] == epoch_ends(straight)
