"""Lightning's own demos (`lightning.pytorch.demos`) and a tutorial-style module, run unchanged
on nanotrain.Trainer with the arguments lightning.Trainer takes: the same weights (fp32,
<= 1e-6), the same `callback_metrics`, the same logged rows, and the same test / predict
results as lightning.Trainer. The WikiText2 demos read random tokens instead of downloading."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from lightning.pytorch.demos import (
    BoringDataModule,
    BoringModel,
    DemoModel,
    LightningLSTM,
    LightningTransformer,
    SequenceSampler,
)
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import nanotrain as nt

#: what both Trainers get: Lightning's own argument names and values
ARGS = dict(
    accelerator="cpu", devices=1, num_sanity_val_steps=0, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False, logger=False,
)  # fmt: skip

VOCAB = 50


@pytest.fixture(autouse=True)
def no_global_seed(monkeypatch):
    """Every test seeds with `seed_everything` itself and leaves no PL_GLOBAL_SEED behind."""
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)


class RandomTokens(Dataset):
    """WikiText2's items ((input, target) blocks of `block` tokens, target shifted by one)
    over a random token stream instead of the downloaded text."""

    def __init__(self, tokens: int = 2000, block: int = 12) -> None:
        self.data = torch.randint(0, VOCAB, (tokens,), generator=torch.Generator().manual_seed(3))
        self.block = block

    def __len__(self) -> int:
        return len(self.data) // self.block - 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block
        return self.data[start : start + self.block], self.data[start + 1 : start + self.block + 1]


class Transformer(LightningTransformer):
    """The demo with its data on random tokens (the demo downloads WikiText2)."""

    def prepare_data(self) -> None:
        pass

    def train_dataloader(self) -> DataLoader:
        # 48 samples: whole batches of 8 (nanotrain leaves a partial last batch out)
        return DataLoader(RandomTokens(49 * 12), batch_size=8)


class LSTM(LightningLSTM):
    """The demo (its hidden state carried over batches, its SequenceSampler batch_sampler),
    on random tokens."""

    def prepare_data(self) -> None:
        pass

    def train_dataloader(self) -> DataLoader:
        dataset = RandomTokens(1200)
        return DataLoader(dataset, batch_sampler=SequenceSampler(dataset, batch_size=10))


class Tutorial(pl.LightningModule):
    """A module as Lightning's tutorials write one: save_hyperparameters, torchmetrics objects
    in self.log, logging at the epoch's end, OneCycleLR over estimated_stepping_batches."""

    def __init__(self, hidden: int = 32, lr: float = 0.2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 3))
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.losses.append(loss.detach())
        return loss

    def on_train_epoch_end(self):
        self.log("epoch_mean_loss", torch.stack(self.losses).mean())
        self.losses.clear()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.val_acc.update(logits, y)
        self.log("val_loss", nn.functional.cross_entropy(logits, y))
        self.log("val_acc", self.val_acc)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        total = self.trainer.estimated_stepping_batches
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.hparams.lr, total_steps=total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Blobs(pl.LightningDataModule):
    """Three Gaussian blobs in 4 dimensions, split in setup as tutorials do."""

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(5)
        y = torch.randint(0, 3, (160,), generator=g)
        x = torch.randn(160, 4, generator=g) + 2.0 * nn.functional.one_hot(y, 4).float()
        self.train, self.val, self.test = (
            TensorDataset(x[:96], y[:96]),
            TensorDataset(x[96:128], y[96:128]),
            TensorDataset(x[128:], y[128:]),
        )

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=16)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=16)

    def test_dataloader(self):
        return DataLoader(self.test, batch_size=16)


def _run(trainer_class, make, root: Path, stages: tuple[str, ...], **args):
    """seed_everything, build the module (and data), fit, then the other `stages`."""
    pl.seed_everything(7, verbose=False)
    module, data = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trainer_class(default_root_dir=str(root), **{**ARGS, **args})
        trainer.fit(module, datamodule=data)
        results = {"fit": dict(trainer.callback_metrics)}
        if "test" in stages:
            results["test"] = trainer.test(module, datamodule=data)
        if "predict" in stages:
            results["predict"] = trainer.predict(module, datamodule=data)
    return module, trainer, results


def _assert_same_run(theirs, ours) -> None:
    (lit_module, _, lit_results), (nt_module, _, nt_results) = theirs, ours
    for (name, p), (_, q) in zip(
        lit_module.named_parameters(), nt_module.named_parameters(), strict=True
    ):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    for key, value in lit_results["fit"].items():
        assert key in nt_results["fit"], key
        torch.testing.assert_close(
            torch.as_tensor(nt_results["fit"][key]), value, rtol=0, atol=1e-6, msg=key
        )
    if "test" in lit_results:
        assert nt_results["test"][0].keys() == lit_results["test"][0].keys()
        for key, value in lit_results["test"][0].items():
            assert nt_results["test"][0][key] == pytest.approx(value, abs=1e-6), key
    if "predict" in lit_results:
        for mine, reference in zip(nt_results["predict"], lit_results["predict"], strict=True):
            torch.testing.assert_close(mine, reference, rtol=0, atol=1e-6)


DEMOS = {
    # name: (build module and datamodule, stages after fit, Trainer arguments)
    "BoringModel": (lambda: (BoringModel(), None), ("test", "predict"), dict(max_epochs=2)),
    "BoringDataModule": (
        lambda: (BoringModel(), BoringDataModule()),
        ("test",),
        dict(max_epochs=1, val_check_interval=16, check_val_every_n_epoch=None),
    ),
    "DemoModel": (lambda: (DemoModel(), BoringDataModule()), (), dict(max_steps=20)),
    "LightningTransformer": (lambda: (Transformer(vocab_size=VOCAB), None), (), dict(max_epochs=1)),
    "LightningLSTM": (lambda: (LSTM(vocab_size=VOCAB), None), (), dict(max_epochs=2)),
    "tutorial": (
        lambda: (Tutorial(), Blobs()),
        ("test",),
        dict(max_epochs=3, gradient_clip_val=1.0, log_every_n_steps=2),
    ),
}


@pytest.mark.parametrize("demo", list(DEMOS))
def test_lightning_demo_gives_lightnings_run(tmp_path, demo):
    make, stages, args = DEMOS[demo]
    if demo == "LightningLSTM":  # a small LSTM: the demo's 4 x 512 is slow on two cores
        make = lambda: (_small_lstm(), None)  # noqa: E731
    theirs = _run(pl.Trainer, make, tmp_path / "pl", stages, **args)
    ours = _run(nt.Trainer, make, tmp_path / "nt", stages, **args)
    assert ours[1].global_step == theirs[1].global_step
    _assert_same_run(theirs, ours)


def _small_lstm() -> LSTM:
    from lightning.pytorch.demos.lstm import SimpleLSTM

    module = LSTM(vocab_size=VOCAB)
    module.model = SimpleLSTM(vocab_size=VOCAB, ninp=32, nhid=32, nlayers=2)
    return module


def _csv_rows(path: Path) -> dict[tuple[str, int], float]:
    """metrics.csv as {(column, step): value}, with each row's epoch as column "epoch"."""
    rows: dict[tuple[str, int], float] = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            for key, value in row.items():
                if key != "step" and value != "":
                    rows[(key, step)] = float(value)
    return rows


def test_tutorial_module_writes_lightnings_csv_rows(tmp_path):
    """The tutorial module with a CSVLogger, fitted then tested: every value Lightning writes,
    at the same step and epoch, is written by nanotrain (nanotrain's own monitors may add
    columns)."""
    make, stages, args = DEMOS["tutorial"]
    files = []
    for trainer_class, name in ((pl.Trainer, "pl"), (nt.Trainer, "nt")):
        logger = CSVLogger(str(tmp_path / name), name="csv")
        _run(trainer_class, make, tmp_path / name, ("test",), **{**args, "logger": logger})
        files.append(Path(logger.log_dir) / "metrics.csv")
    theirs, ours = (_csv_rows(f) for f in files)
    assert any(key == "test_loss" for key, _ in theirs)
    missing = sorted(k for k in theirs if k not in ours)
    assert not missing, f"Lightning wrote these (column, step) that nanotrain did not: {missing}"
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value, abs=1e-6), key
