"""Small modules, data and a hook recorder for tests of nanotrain code (Lightning's
BoringModel / BoringDataModule, for the nanotrain Trainer). Everything trains in well under a
second on one CPU core and needs no download."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nanotrain.callbacks.base import Callback
from nanotrain.module import NanoModule
from nanotrain.strategies import SingleDeviceStrategy
from nanotrain.trainer import Trainer


def blobs(
    num_samples: int, num_features: int = 8, num_classes: int = 3, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian blobs: class c is centred at 2·e_c; returns (x [N, F], y [N])."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, num_classes, (num_samples,), generator=g)
    centres = torch.zeros(num_classes, num_features)
    centres[torch.arange(num_classes), torch.arange(num_classes)] = 2.0
    x = centres[y] + 0.5 * torch.randn(num_samples, num_features, generator=g)
    return x, y


class BlobsData(pl.LightningDataModule):
    """Train/val split of `blobs`, served as TensorDatasets of (x, y)."""

    def __init__(self, num_train: int = 256, num_val: int = 64, batch_size: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        x, y = blobs(num_train + num_val)
        self.train_set = TensorDataset(x[:num_train], y[:num_train])
        self.val_set = TensorDataset(x[num_train:], y[num_train:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)


class Classifier(NanoModule):
    """A two-layer MLP classifier of `blobs` (8 features, 3 classes) with SGD, logging
    `train/ce`, `val/loss` and `val/acc`: nothing about it is a language model.

    Args:
        lr: SGD learning rate.
        hidden: width of the hidden layer.
        scheduler: add a per-step StepLR (halves the LR every 2 steps).
    """

    def __init__(self, lr: float = 0.05, hidden: int = 16, scheduler: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net: nn.Module | None = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = nn.Sequential(
                nn.Linear(8, self.hparams.hidden), nn.Tanh(), nn.Linear(self.hparams.hidden, 3)
            )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train/ce", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val/loss", F.cross_entropy(logits, y), sync_dist=True, batch_size=len(y))
        self.log(
            "val/acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True, batch_size=len(y)
        )

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        if not self.hparams.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class HookRecorder(Callback):
    """Records the name of every hook in `HOOKS` as it is called, in `calls`."""

    HOOKS = [
        "setup",
        "on_fit_start",
        "on_train_start",
        "on_train_epoch_start",
        "on_train_step_start",
        "on_before_optimizer_step",
        "on_train_step_end",
        "on_validation_start",
        "on_validation_epoch_start",
        "on_validation_batch_end",
        "on_validation_epoch_end",
        "on_validation_end",
        "on_train_epoch_end",
        "on_train_end",
        "on_fit_end",
        "teardown",
        "on_exception",
    ]

    def __init__(self) -> None:
        self.calls: list[str] = []
        for hook in self.HOOKS:
            setattr(self, hook, self._recorder(hook))

    def _recorder(self, hook: str):
        def record(*args, **kwargs):
            self.calls.append(hook)

        return record


def make_trainer(tmp_path: str | Path, **settings: Any) -> Trainer:
    """A single-CPU Trainer for callback tests: 4 steps of micro-batches of 8, logging every
    step to metrics.jsonl under `tmp_path`, without the default callbacks (each test names
    the callbacks it checks); `settings` override any of these."""
    defaults = dict(
        strategy=SingleDeviceStrategy("cpu"),
        default_root_dir=str(tmp_path),
        max_steps=4,
        micro_batch_size=8,
        log_every_n_steps=1,
        loggers=["jsonl"],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_monitors=False,
    )
    defaults.update(settings)
    return Trainer(**defaults)
