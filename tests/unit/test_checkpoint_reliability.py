"""Checkpoint reliability on one process: integrity checks, restart semantics, failed saves,
NaN-aware retention and preemption (the multi-rank cases are in tests/distributed)."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

import nanotrain as nt
from nanotrain.callbacks.checkpoint import ModelCheckpoint
from nanotrain.checkpoint import files as ckpt_files
from nanotrain.checkpoint.files import UnsafeCheckpointError
from nanotrain.runtime.exit_codes import EXIT_NONFINITE, EXIT_PREEMPTED
from nanotrain.runtime.run_files import RunFilesError
from tests.unit.test_checkpoint import DropoutAdamClassifier, data, fit, make_trainer


def experiment(root: Path) -> Path:
    return root / "default"


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def rewrite_meta(ckpt: Path, name: str) -> None:
    """Record `name`'s new size and checksum, as someone who also rewrote meta.json would."""
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["files"][name] = (ckpt / name).stat().st_size
    meta["sha256"][name] = ckpt_files.sha256_of(ckpt / name)
    (ckpt / "meta.json").write_text(json.dumps(meta))


# -- restart semantics ---------------------------------------------------------------------------
def test_last_starts_fresh_then_resumes_the_newest_checkpoint_across_versions(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="nanotrain.checkpoint.resume"):
        first, _, losses = fit(tmp_path, 2, ckpt_path="last", callbacks=[ModelCheckpoint()])
    assert "no complete checkpoint" in caplog.text and sorted(losses) == [1, 2]
    assert first.run_dir == experiment(tmp_path) / "version_0"
    # Newer versions without a checkpoint (e.g. launches that failed under older releases).
    (experiment(tmp_path) / "version_1").mkdir()
    (experiment(tmp_path) / "version_2" / "checkpoints").mkdir(parents=True)

    resumed, _, losses = fit(tmp_path, 4, ckpt_path="last", callbacks=[ModelCheckpoint()])
    assert resumed.run_dir == first.run_dir and sorted(losses) == [3, 4]


def test_rejected_resume_writes_nothing_and_a_resume_keeps_the_original_config(tmp_path):
    first, _, _ = fit(tmp_path, 2, callbacks=[ModelCheckpoint()])
    config = (first.run_dir / "config.yaml").read_text()
    ckpt = first.checkpoint_dir / "step-00000002"
    model = bytearray((ckpt / "model.safetensors").read_bytes())
    (ckpt / "model.safetensors").write_bytes(bytes(model[:-8]) + b"\x7f" * 8)  # same size
    before = listing(tmp_path)

    with pytest.raises(ValueError, match=r"model\.safetensors is corrupt.*checksum"):
        fit(tmp_path, 4, ckpt_path="last", max_epochs=None)
    assert listing(tmp_path) == before  # no new version_N, config.yaml untouched
    # A launch rejected for its inputs (no full global batch of data) writes nothing either.
    empty = TensorDataset(torch.zeros(0, 8), torch.zeros(0, dtype=torch.long))
    trainer = make_trainer(tmp_path, 2)
    with pytest.raises(ValueError):
        trainer.fit(DropoutAdamClassifier(), train_dataloaders=empty)
    assert listing(tmp_path) == before

    (ckpt / "model.safetensors").write_bytes(bytes(model))
    resumed, _, losses = fit(tmp_path, 4, ckpt_path="last", log_every_n_steps=7)
    assert sorted(losses) == [3, 4]
    assert (first.run_dir / "config.yaml").read_text() == config
    assert "log_every_n_steps: 7" in (first.run_dir / "config-1.yaml").read_text()


# -- integrity -------------------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path):
    trainer, _, _ = fit(tmp_path, 2, callbacks=[ModelCheckpoint()])
    return tmp_path, trainer.checkpoint_dir / "step-00000002"


def test_same_size_corruption_of_the_optimizer_is_named(saved):
    root, ckpt = saved
    data_bytes = bytearray((ckpt / "optimizer.pt").read_bytes())
    data_bytes[len(data_bytes) // 2] ^= 0xFF
    (ckpt / "optimizer.pt").write_bytes(bytes(data_bytes))
    with pytest.raises(ValueError, match=r"optimizer\.pt is corrupt: its content does not match"):
        fit(root, 3, ckpt_path="last")


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_code_carrying_pickle_is_refused_as_unsafe_not_corrupt(saved):
    root, ckpt = saved
    marker = root / "code-ran"
    torch.save({"rng": _RunsCode(str(marker))}, ckpt / "rank-00000.pt")
    rewrite_meta(ckpt, "rank-00000.pt")
    with pytest.raises(UnsafeCheckpointError, match="refused to load.*GLOBAL.*system") as info:
        fit(root, 3, ckpt_path="last")
    assert "corrupt" not in str(info.value) and "weights_only=False" not in str(info.value)
    assert not marker.exists()


class RecordsConfig(DropoutAdamClassifier):
    """Records a model config the way LanguageModelModule does."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.width = width

    def on_save_checkpoint(self, checkpoint):
        checkpoint["model_config"] = {"family": "Toy", "config": {"width": self.width, "n": 2}}


def test_a_different_model_is_reported_as_a_list_of_differences(saved, tmp_path):
    root = tmp_path / "cfg"
    trainer = make_trainer(root, 2, [ModelCheckpoint()])
    trainer.fit(RecordsConfig(width=16), data())
    with pytest.raises(
        ValueError, match=r"(?s)differs in 1 field.*config\.width: saved 16, now 32"
    ):
        make_trainer(root, 3).fit(RecordsConfig(width=32), data(), ckpt_path="last")

    # A module that records no config: parameter names and shapes are listed instead.
    other_root, _ = saved
    module = DropoutAdamClassifier()
    module.configure_model()
    module.net[0] = torch.nn.Linear(8, 32)
    module.net[3] = torch.nn.Linear(32, 3)
    with pytest.raises(
        ValueError, match=r"(?s)net\.0\.weight: saved shape \[16, 8\].*\[32, 8\]"
    ) as e:
        make_trainer(other_root, 3).fit(module, data(), ckpt_path="last")
    assert "size mismatch" not in str(e.value)


# -- failed saves ------------------------------------------------------------------------------
def test_disk_full_names_enospc_and_removes_the_partial_save(tmp_path, monkeypatch):
    trainer, _, _ = fit(tmp_path, 2, callbacks=[ModelCheckpoint()])
    original = ckpt_files._HashingFile.__init__

    def full_disk_for_optimizer(self, path):
        original(self, Path("/dev/full") if path.name == "optimizer.pt" else path)
        self.path = path

    monkeypatch.setattr(ckpt_files._HashingFile, "__init__", full_disk_for_optimizer)
    with pytest.raises(OSError, match="no space left on the disk of") as info:
        fit(tmp_path, 4, ckpt_path="last", callbacks=[ModelCheckpoint()])
    ckpts = trainer.checkpoint_dir
    # one line: the folder, the bytes the checkpoint needs, and that nothing was lost
    message = str(info.value)
    assert str(ckpts) in message and "needs about" in message and "was removed" in message
    assert "\n" not in message
    assert not [p for p in ckpts.iterdir() if ".tmp-" in p.name]
    assert (ckpts / "last").read_text().strip() == "step-00000002"


def test_unwritable_checkpoint_folder_is_an_error_at_start(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    steps = []
    recorder = nt.Callback()
    recorder.on_train_step_start = lambda *a: steps.append(1)  # type: ignore[method-assign]
    bad = ModelCheckpoint(dirpath=tmp_path / "a-file" / "ckpts")
    with pytest.raises(ValueError, match="a-file is a file, not a directory"):
        make_trainer(tmp_path, 2, [bad, recorder]).fit(DropoutAdamClassifier(), data())
    # A folder without write permission (simulated: this suite may run as root).
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(RunFilesError, match="ckpts is not writable|is not writable"):
        make_trainer(tmp_path, 2, [ModelCheckpoint(dirpath=tmp_path / "new" / "ckpts")]).fit(
            DropoutAdamClassifier(), data()
        )
    assert steps == []


# -- never lose the last good state ------------------------------------------------------------
class NaNFrom(DropoutAdamClassifier):
    """Loss is NaN from step `start` on (so the weights turn NaN after that update)."""

    def __init__(self, start: int) -> None:
        super().__init__()
        self.start = start

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step + 1 >= self.start else loss


def test_retention_keeps_the_newest_finite_checkpoint_of_a_run_gone_nan(tmp_path):
    ckpt = ModelCheckpoint(every_n_steps=1, save_top_k=2)
    trainer = make_trainer(tmp_path, 6, [ckpt])
    # Without the default NaN guard, so the NaN updates do reach the weights.
    trainer.callbacks = [
        cb for cb in trainer.callbacks if not isinstance(cb, nt.callbacks.NaNGuard)
    ]
    trainer.fit(NaNFrom(3), data())
    kept = sorted(p.name for p in trainer.checkpoint_dir.iterdir() if p.is_dir())
    assert kept == ["step-00000002", "step-00000005", "step-00000006"]
    meta = ckpt_files.read_meta(trainer.checkpoint_dir / "step-00000006")
    assert meta["nonfinite"] == ["loss", "weights"]
    assert ckpt_files.read_meta(trainer.checkpoint_dir / "step-00000002")["nonfinite"] == []

    with pytest.warns(UserWarning, match="non-finite.*newest finite checkpoint step-00000002"):
        _, _, losses = fit(tmp_path, 4, ckpt_path="last")
    assert sorted(losses) == [3, 4] and all(torch.isfinite(v) for v in losses.values())


def test_nan_stop_exits_non_zero_from_the_command_line(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        f"""
trainer: {{max_steps: 5, micro_batch_size: 4, global_batch_size: 16, loggers: [],
          default_root_dir: {tmp_path}, limit_val_batches: 0}}
model: {{class_path: tests.unit.test_checkpoint_reliability.NaNFrom, init_args: {{start: 3}}}}
data: {{class_path: nanotrain.testing.BlobsData, init_args: {{num_train: 64, num_val: 16, batch_size: 4}}}}
callbacks:
  - {{class_path: nanotrain.callbacks.checkpoint.ModelCheckpoint,
     init_args: {{every_n_steps: 1, save_top_k: 1}}}}
  - {{class_path: nanotrain.callbacks.nan_guard.NaNGuard, init_args: {{action: stop}}}}
"""
    )
    from nanotrain.cli import main

    assert main(["fit", "--config", str(config)]) == EXIT_NONFINITE
    ckpts = tmp_path / "default" / "version_0" / "checkpoints"
    kept = sorted(p.name for p in ckpts.iterdir() if p.is_dir())
    assert kept == ["nan-step-3", "step-00000003"]  # the NaN step's update was skipped
    for name in kept:
        assert ckpt_files.read_meta(ckpts / name)["nonfinite"] == []


# -- preemption ------------------------------------------------------------------------------
class SignalAt(nt.Callback):
    """Sends `signum` to this process at the start of step `step` (mid-step, as a scheduler
    would)."""

    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_train_step_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step + 1 == self.step:
            os.kill(os.getpid(), self.signum)


def _fit_until_signalled(root: str, signum: int) -> None:
    torch.set_num_threads(1)
    trainer, _, _ = fit(
        root, 8, callbacks=[ModelCheckpoint(every_n_steps=100), SignalAt(3, signum)]
    )
    sys.exit(trainer.exit_code)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_preemption_signal_saves_the_current_step_and_resumes_exactly(tmp_path, signum):
    child = mp.get_context("fork").Process(
        target=_fit_until_signalled, args=(str(tmp_path / "split"), signum)
    )
    child.start()
    child.join(timeout=60)
    assert child.exitcode == EXIT_PREEMPTED
    run = tmp_path / "split" / "default" / "version_0"
    assert (run / "checkpoints" / "last").read_text().strip() == "step-00000003"

    _, _, straight = fit(tmp_path / "straight", 8)
    resumed, _, losses = fit(tmp_path / "split", 8, ckpt_path="last")
    assert sorted(losses) == [4, 5, 6, 7, 8] and resumed.exit_code == 0
    for step in losses:
        assert torch.equal(losses[step], straight[step]), step


def test_preemption_signals_are_validated():
    with pytest.raises(ValueError, match="'SIGKILL' is not a signal that can be caught"):
        nt.Trainer(max_steps=1, preemption_signals=["SIGKILL"])
    with pytest.raises(ValueError, match="'SIGNOPE'"):
        nt.Trainer(max_steps=1, preemption_signals=["SIGNOPE"])


class WeightsGoNaNAt(nt.Callback):
    """Turns one weight NaN at the start of step `step` (before its forward), as a blown-up
    update would: that step's loss, and the state at the stop, are then non-finite."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_step_start(self, trainer, module, batch, batch_idx) -> None:
        if trainer.global_step + 1 == self.step:
            with torch.no_grad():
                next(module.parameters()).view(-1)[0] = float("nan")


def test_nan_stop_names_the_checkpoint_that_is_actually_finite(tmp_path):
    guard = nt.callbacks.NaNGuard(action="stop")
    ckpt = ModelCheckpoint(every_n_steps=1)
    trainer = make_trainer(tmp_path, 6, [guard, ckpt, WeightsGoNaNAt(3)])
    trainer.fit(DropoutAdamClassifier(), data())
    stopped = trainer.checkpoint_dir / "nan-step-3"
    assert ckpt_files.read_meta(stopped)["nonfinite"]  # the weights were NaN at the stop
    assert "last good state" not in guard.stop_reason
    assert f"saved in {stopped}" in guard.stop_reason
    assert f"the last finite checkpoint is {trainer.checkpoint_dir / 'step-00000002'}" in (
        guard.stop_reason
    )


def test_a_raw_pickle_is_reported_as_such_without_torchs_advice(tmp_path):
    import pickle

    path = tmp_path / "optimizer.pt"
    path.write_bytes(pickle.dumps({"state": 1}))
    with pytest.raises(UnsafeCheckpointError, match="it is a raw pickle") as info:
        ckpt_files.read_torch(path)
    assert "weights_only" not in str(info.value).replace("weights_only=True", "")
    truncated = tmp_path / "model.pt"
    torch.save({"w": torch.ones(3)}, truncated)
    truncated.write_bytes(truncated.read_bytes()[:40])
    with pytest.raises(ValueError, match="corrupt or truncated") as info:
        ckpt_files.read_torch(truncated)
    assert "weights_only=False" not in str(info.value)
