"""Checkpoint files: exact resume, atomic commit under SIGKILL, and clear errors on bad input."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal

import pytest
import torch
from torch import nn

import nanotrain as nt
from nanotrain.callbacks.checkpoint import ModelCheckpoint
from nanotrain.checkpoint import files as ckpt_files
from nanotrain.checkpoint import load_checkpoint, load_model_weights, resolve_checkpoint_path
from nanotrain.testing import BlobsData, Classifier


class DropoutAdamClassifier(Classifier):
    """Dropout (RNG matters), Adam (optimizer state matters), a step LR schedule."""

    def __init__(self, dropout: float = 0.3) -> None:
        super().__init__()
        self.dropout = dropout

    def configure_model(self) -> None:
        if self.net is None:
            self.net = nn.Sequential(
                nn.Linear(8, 16), nn.Tanh(), nn.Dropout(self.dropout), nn.Linear(16, 3)
            )

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.02)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class LossRecorder(nt.Callback):
    """Records each step's global loss by step number."""

    def __init__(self) -> None:
        self.losses: dict[int, torch.Tensor] = {}

    def on_train_step_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses[trainer.global_step] = outputs.loss.detach().clone()


def make_trainer(root, max_steps, callbacks=(), strategy=None, **kwargs) -> nt.Trainer:
    settings = dict(
        strategy=strategy or nt.SingleDeviceStrategy("cpu"),
        default_root_dir=str(root),
        max_steps=max_steps,
        micro_batch_size=4,
        global_batch_size=16,
        loggers=[],
        seed=3,
        callbacks=list(callbacks),
        limit_val_batches=0,  # validation would not change the weights; keep tests fast
    )
    settings.update(kwargs)
    return nt.Trainer(**settings)


def data() -> BlobsData:
    # 64 samples / 16 per step = 4 steps per epoch: step 5 is inside the second epoch.
    return BlobsData(num_train=64, num_val=16, batch_size=4)


def fit(root, max_steps, ckpt_path=None, callbacks=(), **settings):
    recorder = LossRecorder()
    module = DropoutAdamClassifier()
    trainer = make_trainer(root, max_steps, [recorder, *callbacks], **settings)
    trainer.fit(module, data(), ckpt_path=ckpt_path)
    return trainer, module, recorder.losses


def test_resume_reproduces_the_uninterrupted_run_bitwise(tmp_path):
    # Validation every 3 steps, and a final one at step 5 that only the interrupted run has
    # (just before it saves): validating must not disturb the training RNG.
    val = dict(limit_val_batches=None, val_check_interval=3)
    _, straight_module, straight = fit(tmp_path / "straight", 10, **val)
    first, _, _ = fit(tmp_path / "split", 5, callbacks=[ModelCheckpoint()], **val)
    assert (first.checkpoint_dir / "step-00000005" / "meta.json").is_file()

    resumed, resumed_module, losses = fit(tmp_path / "split", 10, ckpt_path="last", **val)

    assert resumed.run_dir == first.run_dir  # "last" resumes the latest run in place
    assert sorted(losses) == [6, 7, 8, 9, 10]
    for step in range(6, 11):
        assert torch.equal(losses[step], straight[step]), f"loss of step {step} differs"
    for (name, p_resumed), p_straight in zip(
        resumed_module.state_dict().items(), straight_module.state_dict().values(), strict=True
    ):
        assert torch.equal(p_resumed, p_straight), name
    assert resumed.state.epoch == 2 and resumed.state.steps_in_epoch == 2


def test_checkpoint_directory_holds_the_documented_files(tmp_path):
    trainer, module, _ = fit(tmp_path, 2, callbacks=[ModelCheckpoint()])
    ckpt = trainer.checkpoint_dir / "step-00000002"
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == sorted(
        ["meta.json", "model.safetensors", "optimizer.pt", "trainer_state.pt", "rank-00000.pt"]
    )
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["world_size"] == 1 and meta["global_step"] == 2 and meta["version"] == 1
    assert meta["files"]["model.safetensors"] == (ckpt / "model.safetensors").stat().st_size
    assert meta["optimizer_param_names"] == [
        ["net.0.weight", "net.0.bias", "net.3.weight", "net.3.bias"]
    ]
    assert (trainer.checkpoint_dir / "last").read_text().strip() == "step-00000002"
    assert not [p for p in trainer.checkpoint_dir.iterdir() if ".tmp-" in p.name]
    weights = load_model_weights(ckpt)
    for name, value in module.state_dict().items():
        assert torch.equal(weights[name], value)


def _train_then_die_in_second_save(root: str) -> None:
    """Child: save at step 2, then get SIGKILLed halfway through the save at step 4."""
    torch.set_num_threads(1)
    original = ckpt_files.write_torch

    def write_then_die(obj, path):
        original(obj, path)
        if "step-00000004" in str(path):
            os.kill(os.getpid(), signal.SIGKILL)  # a crash after one file of the new save

    ckpt_files.write_torch = write_then_die
    fit(root, 4, callbacks=[ModelCheckpoint(every_n_steps=2)])


def test_sigkill_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    child = mp.get_context("fork").Process(
        target=_train_then_die_in_second_save, args=(str(tmp_path),)
    )
    child.start()
    child.join(timeout=60)
    assert child.exitcode == -signal.SIGKILL

    ckpt_dir = tmp_path / "default" / "version_0" / "checkpoints"
    leftovers = [p for p in ckpt_dir.iterdir() if ".tmp-" in p.name]
    assert len(leftovers) == 1 and leftovers[0].name.startswith("step-00000004.tmp-")
    assert (ckpt_dir / "last").read_text().strip() == "step-00000002"
    assert not (ckpt_dir / "step-00000004").exists()

    trainer, _, losses = fit(tmp_path, 5, ckpt_path="last", callbacks=[ModelCheckpoint()])
    assert sorted(losses) == [3, 4, 5]  # resumed after step 2
    assert (ckpt_dir / "last").read_text().strip() == "step-00000005"
    assert not [p for p in ckpt_dir.iterdir() if ".tmp-" in p.name]  # cleaned by the save


@pytest.fixture
def saved(tmp_path):
    """A trainer that saved one checkpoint at step 2; returns (trainer, checkpoint dir)."""
    trainer, _, _ = fit(tmp_path, 2, callbacks=[ModelCheckpoint()])
    return trainer, trainer.checkpoint_dir / "step-00000002"


def test_missing_checkpoint_path_is_a_clear_error(saved, tmp_path):
    trainer, _ = saved
    with pytest.raises(FileNotFoundError, match="nope.*does not exist"):
        resolve_checkpoint_path(trainer, tmp_path / "nope")


def test_last_without_any_checkpoint_starts_a_fresh_run(tmp_path):
    # Was an error; issue 13: one command serves the first start and every restart.
    trainer, _, losses = fit(tmp_path, 2, ckpt_path="last")
    assert sorted(losses) == [1, 2] and trainer.run_dir.name == "version_0"


def test_missing_file_is_named(saved):
    trainer, ckpt = saved
    (ckpt / "optimizer.pt").unlink()
    with pytest.raises(FileNotFoundError, match="optimizer.pt is missing"):
        load_checkpoint(trainer, ckpt)


@pytest.mark.parametrize("name", ["model.safetensors", "trainer_state.pt", "rank-00000.pt"])
def test_truncated_file_is_named(saved, name):
    trainer, ckpt = saved
    path = ckpt / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=f"{name} has .* bytes.*truncated"):
        load_checkpoint(trainer, ckpt)


def test_corrupt_file_of_the_right_size_is_named(saved):
    trainer, ckpt = saved
    path = ckpt / "trainer_state.pt"
    path.write_bytes(b"\0" * path.stat().st_size)
    with pytest.raises(ValueError, match="trainer_state.pt is corrupt"):
        load_checkpoint(trainer, ckpt)


def test_directory_without_meta_is_an_incomplete_save(saved):
    trainer, ckpt = saved
    (ckpt / "meta.json").unlink()
    with pytest.raises(FileNotFoundError, match="meta.json is missing.*never finished"):
        load_checkpoint(trainer, ckpt)


class _Arbitrary:
    """Not a tensor or plain value: unpickling it would mean trusting the file."""


def test_pickled_objects_are_refused(saved):
    trainer, ckpt = saved
    path = ckpt / "rank-00000.pt"
    torch.save({"rng": _Arbitrary()}, path)
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["files"]["rank-00000.pt"] = path.stat().st_size
    meta["sha256"]["rank-00000.pt"] = ckpt_files.sha256_of(path)  # as if meta was rewritten too
    (ckpt / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="refuses to unpickle"):
        load_checkpoint(trainer, ckpt)


def test_other_world_size_warns_and_uses_rank_zero_rng(saved):
    trainer, ckpt = saved
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["world_size"] = 2  # as if saved by 2 ranks; rank 1's file would be ignored
    (ckpt / "meta.json").write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match="saved by 2 ranks.*rank 0's RNG"):
        payload = load_checkpoint(trainer, ckpt)
    expected = torch.load(ckpt / "rank-00000.pt", weights_only=True)["rng"]["torch"]
    assert torch.equal(payload["rng"]["torch"], expected)
