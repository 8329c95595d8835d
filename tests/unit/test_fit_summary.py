"""`nanotrain fit`'s closing summary from a trainer after fit: what it shows with the report
and the monitors, and what it leaves out without them."""

from __future__ import annotations

import json

import nanotrain as nt
from nanotrain import testing as toy
from nanotrain.callbacks.progress import ProgressBar
from nanotrain.callbacks.report import RunReport
from nanotrain.callbacks.throughput import ThroughputMonitor
from nanotrain.cli.fit_summary import fit_summary
from nanotrain.testing import BlobsData, Classifier


class Tokens(Classifier):
    def count_tokens(self, batch):
        return 10 * len(batch[0])


def _last_logged(run_dir, name):
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[name] for r in records if name in r][-1]


def test_summary_names_the_final_validation_rate_and_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # paths below the working directory are shown relative
    callbacks = [ProgressBar(mode="off"), ThroughputMonitor(), RunReport()]
    trainer = toy.make_trainer("runs", callbacks=callbacks, val_check_interval=2, max_steps=5)
    trainer.fit(Tokens(), BlobsData())
    lines = fit_summary(trainer).splitlines()
    run_dir = trainer.run_dir.resolve().relative_to(tmp_path.resolve())
    assert lines[0].startswith("finished: 5 steps, 400 tokens in 0:00:")
    assert "tokens/s; MFU n/a: no peak FLOP/s is known for cpu at fp32" in lines[0]
    loss = _last_logged(trainer.run_dir, "val/loss")
    assert lines[1] == f"last validation (step 5): val/loss {loss:.4f}"  # no bits per byte
    assert lines[2:] == [f"run folder:  {run_dir}", f"report:      {run_dir}/report.md"]


def test_summary_without_monitors_or_validation_keeps_what_it_knows(tmp_path):
    trainer = toy.make_trainer(tmp_path, max_steps=2)
    trainer.fit(Tokens(), train_dataloaders=BlobsData().train_dataloader())
    lines = fit_summary(trainer).splitlines()
    assert lines[0] == "finished: 2 steps"
    assert lines[1] == f"run folder:  {trainer.run_dir}"
    assert len(lines) == 2


class StopAtTwo(nt.Callback):
    def on_train_step_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == 2:
            trainer.request_stop()


def test_summary_of_a_run_stopped_early_names_the_step_once(tmp_path):
    callbacks = [StopAtTwo(), RunReport()]
    trainer = toy.make_trainer(tmp_path, callbacks=callbacks, max_steps=5)
    trainer.fit(Tokens(), train_dataloaders=BlobsData().train_dataloader())
    assert (
        fit_summary(trainer)
        .splitlines()[0]
        .startswith(
            "stopped early at step 2, 160 tokens in 0:00:"  # 2 steps x 8 samples x 10 tokens
        )
    )
