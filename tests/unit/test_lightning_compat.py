"""A LightningModule written as Lightning's tutorials write one runs unchanged under
`nanotrain.Trainer` and matches `lightning.Trainer` on the same module and data."""

from __future__ import annotations

import copy
import csv
import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nanotrain as nt
from nanotrain.testing import blobs


class TutorialData(pl.LightningDataModule):
    """A LightningDataModule as the tutorials write one (setup builds the splits)."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        x, y = blobs(96 + 32 + 16)
        self.train_set = TensorDataset(x[:96], y[:96])
        self.val_set = TensorDataset(x[96:128], y[96:128])
        self.test_set = TensorDataset(x[128:], y[128:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.batch_size)


class TutorialClassifier(pl.LightningModule):
    """Plain LightningModule: torchmetrics, epoch-end logging, OneCycleLR, scheduler dict."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
        self.test_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.seen: dict[str, object] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        self.losses.append(loss.item())
        self.lrs.append(self.lr_schedulers().get_last_lr()[0])
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_acc", self.val_acc)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True)

    def on_validation_epoch_end(self):
        self.log("val_epoch_marker", float(self.current_epoch + 10))
        self.seen["num_val_batches"] = list(self.trainer.num_val_batches)

    def on_train_epoch_start(self):
        self.seen["num_training_batches"] = self.trainer.num_training_batches

    def on_train_epoch_end(self):
        self.log("train_epoch_marker", float(self.current_epoch))
        self.print(f"epoch {self.current_epoch} done")

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.test_acc(self(x), y)
        self.log("test_acc", self.test_acc)

    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return self(x).argmax(-1)

    def configure_optimizers(self):
        t = self.trainer
        self.seen.update(
            max_steps=t.max_steps,
            max_epochs=t.max_epochs,
            estimated_stepping_batches=t.estimated_stepping_batches,
        )
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=self.hparams.lr, total_steps=t.estimated_stepping_batches
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def read_csv(path) -> list[dict[str, float]]:
    with open(path) as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def column(rows: list[dict[str, float]], name: str) -> list[float]:
    return [row[name] for row in rows if name in row]


@pytest.fixture(scope="module")
def both_runs(tmp_path_factory):
    """The same initial module fitted for 2 epochs by lightning.Trainer and nanotrain.Trainer."""
    tmp = tmp_path_factory.mktemp("runs")
    torch.manual_seed(0)
    original = TutorialClassifier()
    lit_module, nt_module = copy.deepcopy(original), copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lit = pl.Trainer(
            max_epochs=2,
            accelerator="cpu",
            devices=1,
            logger=CSVLogger(tmp / "lit", name="", version=""),
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            log_every_n_steps=1,
        )
        lit.fit(lit_module, TutorialData())
        lit_test = lit.test(lit_module, TutorialData(), verbose=False)
        lit_pred = lit.predict(lit_module, TutorialData())
    ours = nt.Trainer(
        strategy=nt.SingleDeviceStrategy("cpu"),
        max_epochs=2,
        micro_batch_size=8,
        shuffle=False,
        log_every_n_steps=1,
        default_root_dir=str(tmp / "nt"),
        loggers=["csv", "jsonl"],
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    ours.fit(nt_module, TutorialData())
    fit_dir = ours.run_dir
    nt_test = ours.test(nt_module, TutorialData())
    nt_pred = ours.predict(nt_module, TutorialData())
    return dict(
        lit=(lit_module, read_csv(tmp / "lit" / "metrics.csv"), lit_test, lit_pred),
        nt=(nt_module, read_csv(fit_dir / "csv" / "metrics.csv"), nt_test, nt_pred),
    )


def test_first_losses_and_learning_rates_equal_lightnings(both_runs):
    lit_module, nt_module = both_runs["lit"][0], both_runs["nt"][0]
    assert len(nt_module.losses) == len(lit_module.losses) == 24  # 2 epochs × 12 batches
    torch.testing.assert_close(nt_module.losses, lit_module.losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(nt_module.lrs, lit_module.lrs, rtol=1e-6, atol=0)
    assert nt_module.losses[-1] < nt_module.losses[0]  # it trained


def test_trainer_properties_read_as_in_lightning(both_runs):
    lit_seen, nt_seen = both_runs["lit"][0].seen, both_runs["nt"][0].seen
    assert nt_seen == lit_seen
    assert nt_seen["estimated_stepping_batches"] == 24
    assert nt_seen["max_steps"] == -1 and nt_seen["num_val_batches"] == [4]
    assert nt_seen["num_training_batches"] == 12


def test_epoch_values_torchmetrics_and_epoch_end_logs_match(both_runs):
    lit_rows, nt_rows = both_runs["lit"][1], both_runs["nt"][1]
    for name in ("val_acc", "val_loss", "train_loss_epoch"):
        lit_values, nt_values = column(lit_rows, name), column(nt_rows, name)
        assert len(nt_values) == 2, name  # once per epoch
        torch.testing.assert_close(nt_values, lit_values, rtol=1e-5, atol=0)
    torch.testing.assert_close(
        column(nt_rows, "train_loss_step"), column(lit_rows, "train_loss_step"), rtol=1e-5, atol=0
    )
    assert column(nt_rows, "train_epoch_marker") == column(lit_rows, "train_epoch_marker")
    assert column(nt_rows, "val_epoch_marker") == [10.0, 11.0]
    # the accuracy is of the whole validation set (a Metric computed per epoch, then reset)
    assert 0.0 < column(nt_rows, "val_acc")[-1] <= 1.0


def test_test_and_predict_match_lightning(both_runs):
    _, _, lit_test, lit_pred = both_runs["lit"]
    _, _, nt_test, nt_pred = both_runs["nt"]
    assert list(nt_test[0]) == ["test_acc"]
    assert math.isclose(nt_test[0]["test_acc"], lit_test[0]["test_acc"], rel_tol=1e-6)
    assert len(nt_pred) == len(lit_pred) == 2
    for ours, theirs in zip(nt_pred, lit_pred, strict=True):
        assert torch.equal(ours, theirs)


def test_self_print_prints_on_rank_zero(both_runs, capsys):
    module = both_runs["nt"][0]
    trainer = nt.Trainer(max_steps=1, enable_checkpointing=False, enable_progress_bar=False)
    module.trainer = trainer
    module.print("hello", 3)
    assert capsys.readouterr().out == "hello 3\n"


def quiet_trainer(tmp_path, **kw) -> nt.Trainer:
    return nt.Trainer(
        strategy=nt.SingleDeviceStrategy("cpu"), max_steps=1, micro_batch_size=8,
        default_root_dir=str(tmp_path), loggers=[], enable_checkpointing=False,
        enable_progress_bar=False, enable_monitors=False, **kw,
    )  # fmt: skip


def test_what_nanotrain_refuses_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="accelerator='tpu': nanotrain trains on cpu, gpu, cuda"):
        nt.Trainer(max_steps=1, accelerator="tpu")
    with pytest.raises(ValueError, match="num_sanity_val_steps=2: nanotrain runs no sanity"):
        nt.Trainer(max_steps=1, num_sanity_val_steps=2)
    with pytest.raises(TypeError, match="'min_steps', which nanotrain does not take: nanotrain"):
        nt.Trainer(max_steps=1, min_steps=2)
    with pytest.raises(TypeError, match="unknown argument 'max_stepz'; settings are: max_steps"):
        nt.Trainer(max_steps=1, max_stepz=4)
    with pytest.raises(TypeError, match="Lightning.s EarlyStopping.*use nanotrain.callbacks.Early"):
        nt.Trainer(max_steps=1, callbacks=[pl.callbacks.EarlyStopping("val_loss")])
    with pytest.raises(TypeError, match="trains a LightningModule"):
        quiet_trainer(tmp_path).fit(nn.Linear(2, 2), TutorialData())


def test_predict_is_refused_under_pipeline_parallelism():
    strategy = nt.MegatronStrategy(pp=2)
    strategy._pipeline = object()  # what setup_module builds for pp > 1
    with pytest.raises(ValueError, match="predict is not supported under pipeline parallelism"):
        strategy.predict_step(TutorialClassifier(), None, 0)


def test_test_without_test_step_or_data_is_a_clear_error(tmp_path):
    from nanotrain.testing import BlobsData, Classifier

    with pytest.raises(ValueError, match="Trainer.test needs Classifier.test_step"):
        quiet_trainer(tmp_path).test(Classifier(), BlobsData())
    with pytest.raises(
        ValueError, match=r"predict needs data: .*predict_dataloader\(\) on Classifier"
    ):
        quiet_trainer(tmp_path).predict(Classifier(), BlobsData())
