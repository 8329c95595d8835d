"""Lightning's daily Trainer switches (fast_dev_run, limit_train_batches, overfit_batches,
max_time, reload_dataloaders_every_n_epochs, ReduceLROnPlateau with a monitor, a Trainer
without a stopping rule for evaluation) give lightning.Trainer's result under
nanotrain.Trainer: the same module and data run under both; weights, steps, epochs and the
calls the module saw are compared."""

from __future__ import annotations

import copy
import warnings
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nanotrain as nt
from tests.nested_approx import nested_approx


def _data(n: int = 64, seed: int = 123) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]))


class Regression(pl.LightningModule):
    """Linear regression with SGD; records the batches and data calls it sees."""

    def __init__(
        self, scheduler: dict | None = None, reload_data: bool = False, shuffle: bool = False
    ) -> None:
        super().__init__()
        self.shuffle = shuffle  # (nanotrain's shuffled order is not Lightning's: see its docs)
        self.lin = nn.Linear(4, 1)
        self.scheduler = scheduler
        self.reload_data = reload_data
        self.first_samples: list[float] = []  # the first feature of each training batch
        self.loader_calls: list[tuple[str, int]] = []
        self.lrs: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.first_samples.append(float(x[0, 0]))
        loss = F.mse_loss(self.lin(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.lin(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.test_batches = getattr(self, "test_batches", 0) + 1
        self.log("test_loss", F.mse_loss(self.lin(x), y))

    def on_train_epoch_end(self):
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05)
        if self.scheduler is None:
            return opt
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, **self.scheduler}}

    def train_dataloader(self):
        epoch = self.current_epoch if self.reload_data else 0
        self.loader_calls.append(("train", epoch))
        return DataLoader(_data(seed=123 + epoch), batch_size=8, shuffle=self.shuffle)

    def val_dataloader(self):
        self.loader_calls.append(("val", self.current_epoch))
        return DataLoader(_data(16, seed=7), batch_size=8)


def _both(module: pl.LightningModule, tmp_path, **trainer_args):
    """Fit a copy of `module` under each Trainer with the same arguments; return
    ((lightning module, trainer), (nanotrain module, trainer))."""
    runs = []
    for kind in ("lightning", "nanotrain"):
        copy_of = copy.deepcopy(module)
        pl.seed_everything(0, verbose=False)
        common = dict(
            logger=False, enable_checkpointing=False, enable_progress_bar=False,
            default_root_dir=str(tmp_path / kind), **trainer_args,
        )  # fmt: skip
        if kind == "lightning":
            trainer = pl.Trainer(
                accelerator="cpu", devices=1, enable_model_summary=False,
                num_sanity_val_steps=0, **common,
            )  # fmt: skip
        else:
            trainer = nt.Trainer(enable_monitors=False, **common)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(copy_of)
        runs.append((copy_of, trainer))
    return runs


def _same(lightning_run, nanotrain_run) -> None:
    (a, ta), (b, tb) = lightning_run, nanotrain_run
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6, msg=name)
    assert b.first_samples == pytest.approx(a.first_samples)
    assert (tb.global_step, tb.current_epoch) == (ta.global_step, ta.current_epoch)
    assert b.lrs == pytest.approx(a.lrs)


@pytest.mark.parametrize(
    "args",
    [
        {"fast_dev_run": True},
        {"fast_dev_run": 3, "max_steps": 100},  # fast_dev_run wins, as in Lightning
        {"limit_train_batches": 3, "max_epochs": 2},
        {"limit_train_batches": 0.5, "max_epochs": 2},
        {"limit_train_batches": 4, "accumulate_grad_batches": 2, "max_epochs": 2},
        {"overfit_batches": 2, "max_epochs": 3, "shuffle": True},  # turned off, as Lightning
        {"max_time": {"microseconds": 1}, "max_epochs": 3},  # stops after the first step
        {"max_time": "00:01:00:00", "max_epochs": 2},
        {"max_time": timedelta(hours=1), "max_epochs": 2},
    ],
    ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()),
)
def test_a_switch_trains_as_lightning(tmp_path, args):
    args = dict(args)
    shuffle = args.pop("shuffle", False)
    _same(*_both(Regression(shuffle=shuffle), tmp_path, **args))


def test_fast_dev_run_writes_no_checkpoint_and_no_log(tmp_path):
    trainer = nt.Trainer(
        fast_dev_run=2, default_root_dir=str(tmp_path), enable_progress_bar=False,
        callbacks=[nt.callbacks.ModelCheckpoint(every_n_steps=1)],
    )  # fmt: skip
    module = Regression()
    trainer.fit(module)
    assert trainer.global_step == 2 and trainer.fast_dev_run == 2
    assert not list(tmp_path.rglob("checkpoints/*")) and not list(tmp_path.rglob("*.jsonl"))
    results = trainer.test(module, DataLoader(_data(64), batch_size=8), verbose=False)
    assert module.test_batches == 2 and "test_loss" in results[0]


@pytest.mark.parametrize(
    "scheduler,args",
    [
        ({"monitor": "val_loss"}, {"max_epochs": 4}),
        ({"monitor": "train_loss", "interval": "step", "frequency": 2}, {"max_steps": 12}),
        # before the first validation the metric is missing: strict=False skips those steps
        ({"monitor": "val_loss", "interval": "step", "strict": False},
         {"max_steps": 9, "val_check_interval": 3, "check_val_every_n_epoch": None}),
    ],
)  # fmt: skip
def test_reduce_lr_on_plateau_steps_with_its_metric_as_lightning(tmp_path, scheduler, args):
    lightning_run, nanotrain_run = _both(Regression(scheduler), tmp_path, **args)
    _same(lightning_run, nanotrain_run)
    lrs = [g["lr"] for g in nanotrain_run[1].optimizers[0].param_groups]
    assert lrs == [g["lr"] for g in lightning_run[1].optimizers[0].param_groups]


def test_reduce_lr_on_plateau_needs_a_monitor_and_a_logged_metric(tmp_path):
    trainer = nt.Trainer(max_epochs=1, default_root_dir=str(tmp_path), logger=False,
                         enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    with pytest.raises(ValueError, match="ReduceLROnPlateau scheduler needs the metric"):
        trainer.fit(Regression({}))
    with pytest.raises(ValueError, match="conditioned on metric 'nope'"):
        trainer.fit(Regression({"monitor": "nope"}))


@pytest.mark.parametrize("every", [1, 2])
def test_reload_dataloaders_every_n_epochs_asks_again_as_lightning(tmp_path, every):
    args = {"reload_dataloaders_every_n_epochs": every, "max_epochs": 4}
    lightning_run, nanotrain_run = _both(Regression(reload_data=True), tmp_path, **args)
    _same(lightning_run, nanotrain_run)
    train_calls = [c for c in nanotrain_run[0].loader_calls if c[0] == "train"]
    assert train_calls == [c for c in lightning_run[0].loader_calls if c[0] == "train"]


def test_a_trainer_without_a_stopping_rule_evaluates_and_refuses_fit(tmp_path):
    module, data = Regression(), DataLoader(_data(16), batch_size=8)
    lightning_out = pl.Trainer(logger=False, enable_progress_bar=False,
                               default_root_dir=str(tmp_path)).validate(module, data, verbose=False)  # fmt: skip
    trainer = nt.Trainer(default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False)
    assert trainer.validate(module, data, verbose=False) == nested_approx(lightning_out)
    with pytest.raises(ValueError, match="fit needs a stopping rule.*max_epochs=1000"):
        trainer.fit(module)


@pytest.mark.parametrize(
    "args,message",
    [
        ({"fast_dev_run": -1}, "fast_dev_run must be"),
        ({"overfit_batches": 1.5}, "overfit_batches=1.5"),
        ({"overfit_batches": 2, "shuffle": True}, "shuffle=True contradicts"),
        ({"limit_train_batches": 1.5}, "limit_train_batches=1.5"),
        ({"max_time": "1 hour"}, "max_time='1 hour' is not a duration"),
        ({"max_time": {"hour": 1}}, "timedelta's arguments"),
        ({"reload_dataloaders_every_n_epochs": -1}, "reload_dataloaders_every_n_epochs"),
    ],
)
def test_bad_switch_values_are_refused_by_name(args, message):
    with pytest.raises(ValueError, match=message):
        nt.Trainer(max_steps=1, **args)


def test_limit_train_batches_that_splits_a_step_is_refused(tmp_path):
    trainer = nt.Trainer(limit_train_batches=3, accumulate_grad_batches=2, max_epochs=1,
                         default_root_dir=str(tmp_path), logger=False, enable_progress_bar=False)  # fmt: skip
    with pytest.raises(ValueError, match="not a whole number of optimizer steps"):
        trainer.fit(Regression())
