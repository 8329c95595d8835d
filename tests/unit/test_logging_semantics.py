"""`self.log` under nt.Trainer: on_step / on_epoch defaults, reductions and every hook, with
hand-computed values (16 steps of 2 microbatches in one epoch, 8 validation batches)."""

from __future__ import annotations

import json

import pytest
import torch

from nanotrain.testing import BlobsData, Classifier, make_trainer


class LogsEverywhere(Classifier):
    def on_train_start(self):
        self.log("start", 3.0)  # epoch scope: written at the end of the epoch

    def training_step(self, batch, batch_idx):
        self.log("const", 2.0, on_step=True, on_epoch=True, reduce_fx="sum")
        self.log("bidx", float(batch_idx), on_epoch=True, on_step=False, reduce_fx=torch.max)
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.log("hook", float(batch_idx))  # on_step by default: the step's mean

    def on_train_epoch_end(self):
        self.log("epoch_end", 5.0)

    def validation_step(self, batch, batch_idx):
        self.log("v", 1.0, reduce_fx="sum", prog_bar=True)

    def on_validation_epoch_end(self):
        self.log("v_end", self.trainer.callback_metrics["v"] * 10)


def records(trainer) -> list[dict]:
    return [json.loads(x) for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]


def test_values_land_where_lightning_puts_them(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=None, max_epochs=1, global_batch_size=16)
    trainer.fit(LogsEverywhere(), BlobsData())  # 256 / 16 = 16 steps; 64 / 8 = 8 val batches
    lines = records(trainer)

    def values(name):
        return [(x["step"], x[name]) for x in lines if name in x]

    # at Lightning's steps: optimizer step N's values at N - 1, the epoch's and the
    # validation after its last step at that step's (15), each record with the epoch (0)
    assert values("const_step") == [(s, 4.0) for s in range(16)]  # 2 microbatches × 2.0
    assert values("const_epoch") == [(15, 64.0)]  # 32 microbatches × 2.0
    # batch_idx counts the loader's batches (Lightning's meaning): 32 microbatches, max 31
    assert values("bidx") == [(15, 31.0)]
    # on_train_batch_end runs per microbatch (2 a step): the step's value is their mean
    assert values("hook") == [(s, 2.0 * s + 0.5) for s in range(16)]
    assert values("epoch_end") == [(15, 5.0)] and values("start") == [(15, 3.0)]
    assert values("v") == [(15, 8.0)]  # one validation, at the epoch's end
    assert values("v_end") == [(15, 80.0)]  # callback_metrics held the pass's value
    assert {x["epoch"] for x in lines} == {0}
    assert float(trainer.progress_bar_metrics["v"]) == 8.0
    # both flags: "_step" / "_epoch" names, and the plain name for monitors (latest value)
    assert float(trainer.callback_metrics["const_epoch"]) == 64.0
    assert float(trainer.callback_metrics["const"]) == 64.0
    assert "const" not in lines[0]


class BadLogs(Classifier):
    def __init__(self, **log_kwargs):
        super().__init__()
        self.log_kwargs = log_kwargs

    def training_step(self, batch, batch_idx):
        self.log("bad", **self.log_kwargs)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(value=torch.ones(2)), r"needs a scalar .* shape \(2,\)"),
        (dict(value=1.0, reduce_fx="median"), "reduce_fx must be 'mean', 'sum', 'max' or 'min'"),
        (dict(value=1.0, on_step=False, on_epoch=False), "cannot both be False"),
    ],
)
def test_bad_log_calls_raise_with_the_fix(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_trainer(tmp_path, max_steps=1).fit(BadLogs(**kwargs), BlobsData())
