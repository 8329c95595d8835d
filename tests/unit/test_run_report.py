"""The run report: files written at the end of fit, numbers equal to the logged metrics,
rebuilt by `nanotrain report`, written after a stop or a failure; validation at step 0."""

from __future__ import annotations

import json
import math

import pytest
import torch
from PIL import Image

import nanotrain as nt
from nanotrain.callbacks import (
    Callback,
    LearningRateMonitor,
    ModelCheckpoint,
    RunReport,
    ThroughputMonitor,
)
from nanotrain.cli import main
from nanotrain.report import build_report
from nanotrain.report.plots import Series, line_chart, nice_ticks
from nanotrain.testing import BlobsData, Classifier, make_trainer


def logged(run_dir) -> list[dict]:
    """metrics.jsonl parsed independently of the report code."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def series(records: list[dict], name: str) -> list[tuple[int, float]]:
    return [(r["step"], r[name]) for r in records if name in r]


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    """A 4-step fit of the tiny LM (seq 32, global batch 4), validating at the start and
    after steps 2 and 4 (logged at 0, 1 and 3: Lightning's 0-based steps)."""
    tmp = tmp_path_factory.mktemp("lm")
    mp = pytest.MonkeyPatch()
    mp.setenv("NANOTRAIN_CACHE", str(tmp / "cache"))
    trainer = nt.Trainer(
        strategy=nt.SingleDeviceStrategy("cpu"),
        max_steps=4,
        global_batch_size=4,
        micro_batch_size=2,
        val_check_interval=2,
        limit_val_batches=2,
        log_every_n_steps=1,
        validate_at_start=True,
        default_root_dir=str(tmp),
        callbacks=[
            ModelCheckpoint(every_n_steps=2, monitor="val/loss"),
            LearningRateMonitor(),
            ThroughputMonitor(),
            RunReport(),
        ],
    )
    module = nt.LanguageModelModule(model="tiny", warmup_steps=1)
    trainer.fit(module, nt.data.TokenDataModule(seq_len=32, demo_max_bytes=100_000))
    mp.undo()
    return trainer, module


def test_fit_writes_report_files_and_pictures(lm_run):
    trainer, _ = lm_run
    run_dir = trainer.run_dir
    for name in ("report.md", "report.json", "run_info.json", "report/loss.png", "report/lr.png"):
        assert (run_dir / name).is_file(), name
    for picture in ("loss", "lr"):
        with Image.open(run_dir / "report" / f"{picture}.png") as image:
            assert image.format == "PNG" and image.size == (800, 450)
    text = (run_dir / "report.md").read_text()
    assert "![loss](report/loss.png)" in text and "![lr](report/lr.png)" in text
    assert "| status | finished |" in text


def test_report_numbers_equal_the_logged_metrics(lm_run):
    trainer, module = lm_run
    report = json.loads((trainer.run_dir / "report.json").read_text())
    records = logged(trainer.run_dir)
    val = series(records, "val/loss")
    assert [s for s, _ in val] == [0, 1, 3]  # validate_at_start, the cadence, the last step
    best_step, best_loss = min(val, key=lambda sv: sv[1])
    assert report["validation"]["best"]["step"] == best_step
    assert report["validation"]["best"]["loss"] == best_loss
    assert report["validation"]["last"] == {
        "step": 3,
        "loss": val[-1][1],
        "bpb": dict(series(records, "val/bpb"))[3],
    }
    # 4 steps, the last logged at 3
    assert report["training"]["steps"] == 4 == max(s for s, _ in series(records, "train/loss")) + 1
    assert report["training"]["epochs"] == pytest.approx(
        trainer.state.epoch + 4 / trainer.state.steps_per_epoch
    )
    tokens = dict(series(records, "trainer/consumed_tokens"))[3]
    assert report["training"]["tokens"] == tokens == 4 * 4 * 32  # steps × batch × seq_len
    assert report["training"]["skipped_steps"] == 0
    # model size: the accounting formula equals the parameters the built model holds
    assert report["model"]["total_params"] == sum(p.numel() for p in module.parameters())
    assert report["model"]["active_params"] < report["model"]["total_params"]
    assert report["data"]["vocab_size"] == 257 and report["data"]["tokenizer"]["kind"] == "byte"
    assert report["strategy"]["name"] == "SingleDeviceStrategy"
    assert report["strategy"]["data_parallel_replicas"] == 1
    tps = [v for _, v in series(records, "throughput/tokens_per_sec")]
    assert report["throughput"]["tokens_per_sec"]["last"] == tps[-1]
    assert report["throughput"]["tokens_per_sec"]["mean"] == pytest.approx(
        sum(tps[1:]) / len(tps[1:])
    )
    checkpoints = report["checkpoints"]
    assert checkpoints["last"].endswith("step-00000004")
    assert (
        checkpoints["best"]["path"]
        == next(cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)).best_model_path
    )
    assert checkpoints["best"]["monitor"] == "val/loss"
    assert report["wall_time_s"] > 0
    assert report["config"]["trainer"]["validate_at_start"] is True


def test_report_command_rebuilds_the_report_from_the_run_dir(lm_run, capsys):
    trainer, _ = lm_run
    run_dir = trainer.run_dir
    before = json.loads((run_dir / "report.json").read_text())
    for name in ("report.md", "report.json", "report/loss.png", "report/lr.png"):
        (run_dir / name).unlink()
    assert main(["report", str(run_dir)]) == 0
    assert "report.md" in capsys.readouterr().out
    after = json.loads((run_dir / "report.json").read_text())
    before.pop("generated"), after.pop("generated")
    assert after == before
    assert (run_dir / "report/loss.png").is_file() and (run_dir / "report.md").is_file()


def test_report_of_a_missing_run_dir_raises_with_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a run directory"):
        build_report(tmp_path / "nope")


class FailAt(Callback):
    def __init__(self, step: int, stop: bool = False) -> None:
        self.step, self.stop = step, stop

    def on_train_step_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            if self.stop:
                trainer.request_stop()
            else:
                raise RuntimeError("boom")


def test_report_is_written_after_an_exception(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=6, callbacks=[FailAt(3), RunReport()])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Classifier(), BlobsData())
    report = json.loads((trainer.run_dir / "report.json").read_text())
    assert report["status"] == "failed: RuntimeError: boom"
    assert report["training"]["steps"] == 3
    assert report["validation"] is None  # never validated
    assert report["checkpoints"] == {"kept": [], "last": None, "best": None}


def test_report_is_written_after_a_stop_request(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=6, callbacks=[FailAt(2, stop=True), RunReport()])
    trainer.fit(Classifier(), BlobsData())
    report = json.loads((trainer.run_dir / "report.json").read_text())
    assert report["status"] == "stopped early at step 2"
    assert report["training"]["steps"] == 2
    # the final validation still ran, logged at step 2's 0-based step
    assert report["validation"]["last"]["step"] == 1
    module = Classifier()
    module.configure_model()
    assert report["model"]["total_params"] == sum(p.numel() for p in module.parameters())


def test_report_reads_tensorboard_when_there_is_no_jsonl(tmp_path):
    trainer = make_trainer(
        tmp_path, loggers=["tensorboard"], val_check_interval=2, callbacks=[RunReport()]
    )
    trainer.fit(Classifier(), BlobsData())
    report = json.loads((trainer.run_dir / "report.json").read_text())
    assert report["metrics_source"] == "tensorboard"
    assert [trainer.callback_metrics["val/loss"].item()] == [
        pytest.approx(report["validation"]["last"]["loss"])
    ]
    assert report["validation"]["evaluations"] == 2 and report["validation"]["last"]["step"] == 3


def test_validation_at_step_zero_is_off_by_default(tmp_path):
    records = []
    for at_start in (False, True):
        trainer = make_trainer(tmp_path / str(at_start), validate_at_start=at_start)
        trainer.fit(Classifier(), BlobsData())
        records.append([s for s, _ in series(logged(trainer.run_dir), "val/loss")])
    assert records == [[3], [0, 3]]  # after step 4 at its 0-based step; at the start at 0


def test_nice_ticks_and_empty_chart():
    assert nice_ticks(0, 100) == [0, 25, 50, 75, 100]
    assert nice_ticks(1.7, 5.5) == [1, 2, 3, 4, 5, 6]
    assert nice_ticks(3, 3) == [3, 4, 5, 6]  # an empty range is widened to [3, 6]
    with pytest.raises(ValueError, match="no finite points"):
        line_chart([Series("x", [(0, math.nan)])], "unused.png", "empty")
    assert torch.isfinite(torch.tensor(nice_ticks(-1e-3, 2e-3))).all()


def test_best_checkpoint_without_monitor_is_the_one_at_the_best_validation_step(tmp_path):
    trainer = make_trainer(
        tmp_path,
        val_check_interval=2,
        callbacks=[ModelCheckpoint(every_n_steps=2), RunReport()],
    )
    trainer.fit(Classifier(), BlobsData())
    report = json.loads((trainer.run_dir / "report.json").read_text())
    val = series(logged(trainer.run_dir), "val/loss")
    # validation after step N is logged at N - 1; the checkpoint of step N is named N
    best_step = min(val, key=lambda sv: sv[1])[0] + 1
    assert report["checkpoints"]["best"] == {
        "path": str(trainer.checkpoint_dir / f"step-{best_step:08d}"),
        "monitor": "val/loss",
        "step": best_step,
    }
    assert [c["step"] for c in report["checkpoints"]["kept"]] == [2, 4]
