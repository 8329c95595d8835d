"""Lightning Logger objects receive the same scalars and hyperparameters as the built-in ones."""

from __future__ import annotations

import json

import pytest
import yaml
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import nanotrain as nt
from nanotrain.testing import BlobsData, Classifier, make_trainer
from tests.unit.test_lightning_compat import read_csv


class RecordingLogger(Logger):
    """A third-party logger (as WandbLogger / MLFlowLogger would be): records every call."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[int, dict]] = []
        self.hparams: dict = {}
        self.finalized = ""

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> str:
        return "0"

    def log_metrics(self, metrics, step=None) -> None:
        self.metrics.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        self.hparams.update(params)

    def finalize(self, status: str) -> None:
        self.finalized = status


def tb_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_lightning_loggers_get_the_same_scalars_and_hparams_as_the_built_in_ones(tmp_path):
    user_csv = CSVLogger(tmp_path / "user", name="csv", version="")
    user_tb = TensorBoardLogger(tmp_path / "user", name="tb", version="", default_hp_metric=False)
    recording = RecordingLogger()
    trainer = make_trainer(
        tmp_path / "runs",
        max_steps=4,
        val_check_interval=2,
        limit_val_batches=2,
        loggers=["tensorboard", "csv", "jsonl"],
        logger=[True, user_csv, user_tb, recording],
    )
    trainer.fit(Classifier(lr=0.1), BlobsData())
    run = trainer.run_dir
    # CSV: the user's file and the built-in one hold identical rows
    ours, theirs = (
        read_csv(run / "csv" / "metrics.csv"),
        read_csv(tmp_path / "user/csv/metrics.csv"),
    )
    assert theirs == ours and len(ours) >= 4
    # TensorBoard: identical scalars, step by step
    built_in, user = tb_scalars(run / "tensorboard"), tb_scalars(tmp_path / "user" / "tb")
    assert user == built_in and "train/loss" in user and "val/acc" in user
    # JSON lines hold the same values again (one line per logging call)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    jsonl_loss = [(x["step"], x["train/loss"]) for x in lines if "train/loss" in x]
    assert jsonl_loss == [(s, pytest.approx(v)) for s, v in built_in["train/loss"]]
    assert recording.metrics == [
        (x["step"], pytest.approx({k: v for k, v in x.items() if k not in ("step", "time")}))
        for x in lines
    ]
    # hyperparameters: the module's and the datamodule's, in every logger
    for hparams_file in (run / "csv" / "hparams.yaml", tmp_path / "user/csv/hparams.yaml"):
        saved = yaml.safe_load(hparams_file.read_text())
        assert saved["lr"] == 0.1 and saved["num_train"] == 256
    assert yaml.safe_load((run / "tensorboard" / "hparams.yaml").read_text())["hidden"] == 16
    assert json.loads((run / "hparams.json").read_text())["batch_size"] == 8
    assert recording.hparams["lr"] == 0.1 and recording.finalized == "success"


def test_logger_false_writes_nothing_and_bad_loggers_are_refused(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=1, logger=False, loggers=["tensorboard", "csv"])
    trainer.fit(Classifier(), BlobsData())
    assert not (trainer.run_dir / "tensorboard").exists() and not (trainer.run_dir / "csv").exists()
    with pytest.raises(TypeError, match="lightning.pytorch.loggers.Logger"):
        nt.Trainer(max_steps=1, logger="wandb")
    with pytest.raises(ValueError, match="choose from tensorboard, csv, jsonl"):
        nt.Trainer(max_steps=1, loggers=["wandb"])
