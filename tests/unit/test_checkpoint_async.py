"""Asynchronous saves: the loop waits only for the host copy; the result is the same
checkpoint a synchronous save writes, committed by the next save or at the end of training."""

from __future__ import annotations

import time

import torch

from nanotrain.callbacks.checkpoint import ModelCheckpoint
from nanotrain.checkpoint import files as ckpt_files
from tests.unit.test_checkpoint import LossRecorder, fit


class SaveTimer(ModelCheckpoint):
    """Records how long each `save_now` kept the training loop waiting."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.blocked: list[float] = []

    def save_now(self, trainer, tag=None):
        start = time.perf_counter()
        try:
            return super().save_now(trainer, tag)
        finally:
            self.blocked.append(time.perf_counter() - start)


def test_async_save_resumes_bitwise_and_blocks_only_for_the_copy(tmp_path, monkeypatch):
    original = ckpt_files.write_torch

    def slow_write(obj, path):  # a slow disk: 0.3 s per .pt file
        time.sleep(0.3)
        return original(obj, path)

    monkeypatch.setattr(ckpt_files, "write_torch", slow_write)
    timers = {}
    for mode in ("sync", "async"):
        timers[mode] = SaveTimer(every_n_steps=2, async_save=mode == "async")
        trainer, _, _ = fit(tmp_path / mode, 5, callbacks=[timers[mode]])
        ckpts = trainer.checkpoint_dir
        assert sorted(p.name for p in ckpts.iterdir()) == [
            "last",
            "step-00000002",
            "step-00000004",
            "step-00000005",
        ]
        assert (ckpts / "last").read_text().strip() == "step-00000005"
        for step in (2, 4, 5):  # the step of the state, not the step at commit time
            assert ckpt_files.read_meta(ckpts / f"step-{step:08d}")["global_step"] == step
    # A synchronous save waits for 3 slow files (rank, optimizer, trainer state); the
    # asynchronous one only for the copy (the first one), or for the previous save.
    assert min(timers["sync"].blocked) > 0.85
    assert timers["async"].blocked[0] < 0.3
    monkeypatch.setattr(ckpt_files, "write_torch", original)

    _, _, straight = fit(tmp_path / "straight", 8)
    for mode in ("sync", "async"):
        _, _, resumed = fit(tmp_path / mode, 8, ckpt_path="last")
        assert sorted(resumed) == [6, 7, 8]
        assert all(torch.equal(resumed[s], straight[s]) for s in resumed), mode
    sync_files = (tmp_path / "sync/default/version_0/checkpoints/step-00000004").iterdir()
    assert {p.name for p in sync_files} == {
        p.name for p in (tmp_path / "async/default/version_0/checkpoints/step-00000004").iterdir()
    }


def test_an_exception_leaves_the_async_save_uncommitted_and_the_previous_one_intact(tmp_path):
    class FailAfterSave(LossRecorder):
        def on_train_step_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if trainer.global_step == 4:
                raise RuntimeError("boom")

    saver = ModelCheckpoint(every_n_steps=2, async_save=True)
    try:
        fit(tmp_path, 6, callbacks=[saver, FailAfterSave()])
    except RuntimeError as exc:
        assert "boom" in str(exc)
    ckpts = tmp_path / "default" / "version_0" / "checkpoints"
    # step 2 was committed when step 4's save started; step 4's never was
    assert (ckpts / "last").read_text().strip() == "step-00000002"
    assert not (ckpts / "step-00000004").exists()
    _, _, losses = fit(tmp_path, 5, ckpt_path="last")
    assert sorted(losses) == [3, 4, 5]
