"""What `self.log` leaves in `callback_metrics` and the loggers, and how validation and test
read their data, equal lightning.Trainer's: the same tiny module runs under both Trainers and
their weights, metric values, CSV rows and hook observations are compared; the habits
nanotrain refuses raise one clear error at the start."""

from __future__ import annotations

import copy
import csv
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nanotrain as nt
import nanotrain.callbacks as ntc

torch.set_num_threads(1)
INTERNAL = ("train/loss", "train/grad_norm", "trainer/consumed_samples")


def _data(n: int = 64, seed: int = 123) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def _train(n: int = 64) -> DataLoader:
    return DataLoader(_data(n), batch_size=8)


def _val(n: int = 20, **kwargs) -> DataLoader:
    return DataLoader(_data(n, seed=7), batch_size=8, **kwargs)


class Regression(pl.LightningModule):
    """Linear regression; `val_log` / `train_log` are the `self.log` options of its losses
    (None: not logged); it records what its steps see."""

    def __init__(self, train_log: dict | None = None, val_log: dict | None = None) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.train_log, self.val_log = train_log, val_log
        self.val_batch_sizes: list[int] = []
        self.flags: list[tuple[bool, bool]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.lin(x), y)
        if self.train_log is not None:
            self.log("train_loss", loss, **self.train_log)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_batch_sizes.append(len(x))
        self.flags.append((self.trainer.training, self.trainer.validating))
        if self.val_log is not None:
            self.log("val_loss", F.mse_loss(self.lin(x), y), **self.val_log)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self.lin(x), y))

    def predict_step(self, batch, batch_idx):
        return self.lin(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


class EpochEndReader(pl.Callback):
    """`callback_metrics` (as floats) at each epoch-end hook."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, float]]] = []

    def _read(self, hook: str, trainer) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k not in INTERNAL}
        self.seen.append((hook, metrics))

    def on_train_epoch_end(self, trainer, module) -> None:
        self._read("on_train_epoch_end", trainer)

    def on_validation_epoch_end(self, trainer, module) -> None:
        self._read("on_validation_epoch_end", trainer)


def _trainer(kind: str, tmp_path: Path, callbacks=(), **args):
    common = dict(
        logger=CSVLogger(str(tmp_path / kind), name="", version=""),
        enable_checkpointing=False, enable_progress_bar=False, callbacks=list(callbacks),
        default_root_dir=str(tmp_path / kind), log_every_n_steps=1, **args,
    )  # fmt: skip
    if kind == "lightning":
        return pl.Trainer(
            accelerator="cpu", devices=1, enable_model_summary=False, num_sanity_val_steps=0,
            **common,
        )  # fmt: skip
    return nt.Trainer(enable_monitors=False, **common)


def _fit_both(module, tmp_path, val=None, callbacks=None, **args):
    """Fit a copy of `module` under each Trainer, seeded alike; `val` builds the validation
    DataLoader, `callbacks(kind)` the callbacks. Returns {kind: (trainer, module, reader)}."""
    runs = {}
    for kind in ("lightning", "nanotrain"):
        copy_of, reader = copy.deepcopy(module), EpochEndReader()
        pl.seed_everything(0, verbose=False)
        extra = callbacks(kind) if callbacks else []
        trainer = _trainer(kind, tmp_path, [reader, *extra], **args)
        trainer.fit(copy_of, _train(), val() if val else None)
        runs[kind] = (trainer, copy_of, reader)
    return runs


def _same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6, msg=name)


def _close(a: dict[str, float], b: dict[str, float]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == pytest.approx(b[k], abs=1e-6), k


def _column(tmp_path: Path, kind: str, name: str) -> list[tuple[int, float]]:
    """(step, value) of every CSV row that has `name` (none without a CSV file)."""
    path = tmp_path / kind / "metrics.csv"
    if not path.exists():
        return []
    with open(path) as f:
        return [(int(r["step"]), float(r[name])) for r in csv.DictReader(f) if r.get(name)]


def _same_column(tmp_path: Path, name: str) -> None:
    ours, theirs = _column(tmp_path, "nanotrain", name), _column(tmp_path, "lightning", name)
    assert [s for s, _ in ours] == [s for s, _ in theirs]
    assert [v for _, v in ours] == pytest.approx([v for _, v in theirs], abs=1e-6)


def _same_epoch_end_metrics(runs) -> None:
    ours, theirs = runs["nanotrain"][2].seen, runs["lightning"][2].seen
    assert [hook for hook, _ in ours] == [hook for hook, _ in theirs]
    for (_, a), (_, b) in zip(ours, theirs, strict=True):
        _close(a, b)


def test_on_train_epoch_end_reads_the_epoch_mean_of_a_value_logged_per_step_and_epoch(
    tmp_path,
):
    module = Regression(train_log=dict(on_step=True, on_epoch=True))

    def early_stopping(kind):
        own = pl.callbacks if kind == "lightning" else ntc
        return [own.EarlyStopping("train_loss", patience=0)]

    runs = _fit_both(module, tmp_path, callbacks=early_stopping, max_epochs=12)
    _same_epoch_end_metrics(runs)
    # EarlyStopping checks the epoch mean, so both stop at the same epoch
    assert runs["nanotrain"][0].global_step == runs["lightning"][0].global_step < 12 * 8
    _same_weights(runs["lightning"][1], runs["nanotrain"][1])


def test_a_value_logged_with_logger_false_is_in_callback_metrics_but_not_the_loggers(tmp_path):
    module = Regression(val_log=dict(logger=False))

    def early_stopping(kind):
        own = pl.callbacks if kind == "lightning" else ntc
        return [own.EarlyStopping("val_loss", patience=0)]

    runs = _fit_both(module, tmp_path, val=_val, callbacks=early_stopping, max_epochs=3)
    _same_epoch_end_metrics(runs)
    assert "val_loss" in runs["nanotrain"][0].callback_metrics
    assert _column(tmp_path, "nanotrain", "val_loss") == []
    assert _column(tmp_path, "lightning", "val_loss") == []


def test_validation_epoch_means_are_weighted_by_batch_size(tmp_path):
    # 20 validation samples in batches of 8: the last batch has 4
    module = Regression(train_log=dict(on_step=False, on_epoch=True), val_log={})
    runs = _fit_both(module, tmp_path, val=_val, max_epochs=3)
    _same_epoch_end_metrics(runs)
    _same_column(tmp_path, "val_loss")
    _same_column(tmp_path, "train_loss")
    _same_weights(runs["lightning"][1], runs["nanotrain"][1])


def test_test_results_are_weighted_by_batch_size(tmp_path):
    results = {}
    torch.manual_seed(0)
    module = Regression()
    for kind in ("lightning", "nanotrain"):
        results[kind] = _trainer(kind, tmp_path, max_epochs=1).test(
            copy.deepcopy(module), dataloaders=_val(20), verbose=False
        )
    _close(results["nanotrain"][0], results["lightning"][0])


def test_a_validation_dataloader_with_drop_last_leaves_out_its_partial_batch(tmp_path):
    module = Regression(val_log={})
    runs = _fit_both(module, tmp_path, val=lambda: _val(20, drop_last=True), max_epochs=2)
    ours, theirs = runs["nanotrain"], runs["lightning"]
    assert ours[1].val_batch_sizes == theirs[1].val_batch_sizes == [8, 8, 8, 8]
    assert ours[0].num_val_batches == theirs[0].num_val_batches == [2]
    _same_epoch_end_metrics(runs)
    _same_column(tmp_path, "val_loss")


@pytest.mark.parametrize("fraction", [0.3, 0.9])
def test_a_fractional_limit_val_batches_runs_that_share_of_whole_batches(tmp_path, fraction):
    module = Regression(val_log={})
    runs = _fit_both(
        module, tmp_path, val=lambda: _val(32), max_epochs=1, limit_val_batches=fraction
    )
    ours, theirs = runs["nanotrain"], runs["lightning"]
    assert ours[1].val_batch_sizes == theirs[1].val_batch_sizes
    assert ours[0].num_val_batches == theirs[0].num_val_batches == [int(4 * fraction)]
    _same_epoch_end_metrics(runs)


def test_a_fractional_limit_val_batches_below_one_batch_is_refused(tmp_path):
    trainer = _trainer("nanotrain", tmp_path, max_epochs=1, limit_val_batches=0.1)
    with pytest.raises(ValueError, match=r"limit_val_batches=0.1 of 4 validation batches"):
        trainer.fit(Regression(), _train(), _val(32))


def test_on_step_values_of_validation_step_are_written_per_batch(tmp_path):
    module = Regression(val_log=dict(on_step=True, on_epoch=True))
    runs = _fit_both(module, tmp_path, val=_val, max_epochs=2)
    _same_column(tmp_path, "val_loss_step")  # at steps 0, 1, 2, then 3, 4, 5
    _same_column(tmp_path, "val_loss_epoch")
    _same_epoch_end_metrics(runs)  # "val_loss" is the run's epoch value, no "val_loss_step"


def test_trainer_training_is_false_in_the_steps_of_fits_validation(tmp_path):
    runs = _fit_both(Regression(), tmp_path, val=_val, max_epochs=1)
    assert runs["nanotrain"][1].flags == runs["lightning"][1].flags == [(False, True)] * 3


@pytest.mark.parametrize("stage", ["fit", "validate", "predict"])
def test_several_dataloaders_are_refused_at_the_start(tmp_path, stage):
    trainer = _trainer("nanotrain", tmp_path, max_epochs=1)
    module = Regression()
    module.training_step = None  # training must not start
    two = [_val(16), _val(8)]
    run = {
        "fit": lambda: trainer.fit(module, _train(), two),
        "validate": lambda: trainer.validate(module, dataloaders=two),
        "predict": lambda: trainer.predict(module, dataloaders=two),
    }[stage]
    with pytest.raises(ValueError, match=r"^got 2 \w+ DataLoaders; nanotrain reads one"):
        run()


def test_test_verbose_and_predict_return_predictions_are_lightnings(tmp_path, capsys):
    torch.manual_seed(0)
    module = Regression()
    for kind in ("lightning", "nanotrain"):
        trainer = _trainer(kind, tmp_path, max_epochs=1)
        capsys.readouterr()
        results = trainer.test(copy.deepcopy(module), dataloaders=_val(20), verbose=True)
        assert "test_loss" in capsys.readouterr().out
        assert trainer.predict(module, dataloaders=_val(20), return_predictions=False) is None
        assert len(trainer.predict(module, dataloaders=_val(20))) == 3
        assert math.isfinite(results[0]["test_loss"])


def test_num_val_batches_stays_after_fit(tmp_path):
    runs = _fit_both(Regression(), tmp_path, val=_val, max_epochs=1, limit_val_batches=2)
    assert runs["nanotrain"][0].num_val_batches == runs["lightning"][0].num_val_batches == [2]


class FlagReader(pl.Callback):
    """`trainer.training` / `trainer.validating` at the hooks around fit's validation and at
    the end of fit."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bool, bool]] = []

    def _read(self, hook: str, trainer) -> None:
        self.seen.append((hook, trainer.training, trainer.validating))

    def on_validation_start(self, trainer, module) -> None:
        self._read("on_validation_start", trainer)

    def on_validation_end(self, trainer, module) -> None:
        self._read("on_validation_end", trainer)

    def on_train_end(self, trainer, module) -> None:
        self._read("on_train_end", trainer)

    def on_fit_end(self, trainer, module) -> None:
        self._read("on_fit_end", trainer)


def test_trainer_training_around_fits_validation_and_at_its_end_is_lightnings(tmp_path):
    readers = {}

    def reader(kind):
        readers[kind] = FlagReader()
        return [readers[kind]]

    _fit_both(Regression(), tmp_path, val=_val, callbacks=reader, max_epochs=1)
    assert readers["nanotrain"].seen == readers["lightning"].seen
    assert ("on_validation_start", False, True) in readers["nanotrain"].seen
    assert ("on_fit_end", True, False) in readers["nanotrain"].seen


def test_a_training_value_logged_with_logger_false_reaches_callback_metrics_only(tmp_path):
    module = Regression(train_log=dict(logger=False))
    runs = _fit_both(module, tmp_path, max_epochs=2)
    _same_epoch_end_metrics(runs)
    assert "train_loss" in runs["nanotrain"][2].seen[0][1]
    assert _column(tmp_path, "nanotrain", "train_loss") == []


def test_validate_prints_its_results_unless_verbose_is_false(tmp_path, capsys):
    torch.manual_seed(0)
    module = Regression(val_log={})
    for kind in ("lightning", "nanotrain"):
        trainer = _trainer(kind, tmp_path, max_epochs=1)
        capsys.readouterr()
        trainer.validate(copy.deepcopy(module), dataloaders=_val(20))
        assert "val_loss" in capsys.readouterr().out, kind
        trainer.validate(copy.deepcopy(module), dataloaders=_val(20), verbose=False)
        assert "val_loss" not in capsys.readouterr().out, kind


def test_an_evaluation_run_after_fit_starts_with_no_metrics_as_lightning(tmp_path):
    runs = _fit_both(Regression(train_log={}, val_log={}), tmp_path, val=_val, max_epochs=1)
    seen = {}
    for kind, (trainer, module, _) in runs.items():
        trainer.predict(module, dataloaders=_val(8))
        seen[kind] = dict(trainer.callback_metrics)
    assert seen["nanotrain"] == seen["lightning"] == {}
