"""The Trainer loop on one process: accumulation, hooks, stopping rules, logging, errors."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

import nanotrain as nt
from nanotrain import testing as toy
from nanotrain.testing import BlobsData, Classifier, HookRecorder

# these tests read TensorBoard too
make_trainer = functools.partial(toy.make_trainer, loggers=["tensorboard", "jsonl"])


class LossRecorder(nt.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []

    def on_train_step_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(outputs.loss.item())
        self.grad_norms.append(outputs.grad_norm.item())


def fit_and_record(tmp_path, **kwargs):
    torch.manual_seed(0)
    recorder = LossRecorder()
    module = Classifier()
    trainer = make_trainer(tmp_path, callbacks=[recorder], **kwargs)
    trainer.fit(module, BlobsData(batch_size=kwargs["micro_batch_size"]))
    return recorder, module


def test_gradient_accumulation_equals_one_big_microbatch(tmp_path):
    big, big_module = fit_and_record(tmp_path / "a", micro_batch_size=8, global_batch_size=8)
    acc, acc_module = fit_and_record(tmp_path / "b", micro_batch_size=4, global_batch_size=8)
    torch.testing.assert_close(acc.losses, big.losses, rtol=1e-6, atol=0)
    torch.testing.assert_close(acc.grad_norms, big.grad_norms, rtol=1e-5, atol=0)
    for p_acc, p_big in zip(acc_module.parameters(), big_module.parameters(), strict=True):
        torch.testing.assert_close(p_acc, p_big, rtol=1e-5, atol=1e-7)


def test_hook_order_matches_the_documented_sequence(tmp_path):
    recorder = HookRecorder()
    # 256 samples / 64 per step = 4 steps per epoch; 6 steps = 1.5 epochs; val every 3 steps.
    trainer = make_trainer(
        tmp_path,
        callbacks=[recorder],
        max_steps=6,
        micro_batch_size=32,
        global_batch_size=64,
        val_check_interval=3,
        limit_val_batches=1,
    )
    trainer.fit(Classifier(), BlobsData(batch_size=32))
    step = ["on_train_step_start", "on_before_optimizer_step", "on_train_step_end"]
    # limit_val_batches=1 is one *global* batch (64 samples): two microbatches of 32
    val = [
        "on_validation_start",
        "on_validation_epoch_start",
        "on_validation_batch_end",
        "on_validation_batch_end",
        "on_validation_epoch_end",
        "on_validation_end",
    ]
    expected = (
        ["setup", "on_fit_start", "on_train_start", "on_train_epoch_start"]
        + step * 3
        + val  # val_check_interval=3 counts within the epoch (check_val_every_n_epoch=1)
        + step  # as Lightning: no validation at the epoch's end (4 is no multiple of 3)
        + ["on_train_epoch_end", "on_train_epoch_start"]
        + step * 2  # the epoch's steps 1 and 2
        + ["on_train_epoch_end"]  # as Lightning: max_steps ends the epoch midway
        + val  # the final validation of fit
        + ["on_train_end", "on_fit_end", "teardown"]
    )
    assert recorder.calls == expected


def test_classifier_learns_and_logs_to_run_directory(tmp_path):
    module = Classifier(lr=0.2)
    trainer = make_trainer(
        tmp_path, max_epochs=3, max_steps=None, val_check_interval=10, name="blobs"
    )
    trainer.fit(module, BlobsData())
    assert trainer.run_dir == tmp_path / "blobs" / "version_0"
    assert (trainer.run_dir / "config.yaml").is_file()
    lines = [json.loads(x) for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    train_lines = [x for x in lines if "train/loss" in x]
    assert train_lines[-1]["train/loss"] < 0.5 * train_lines[0]["train/loss"]
    # 256 samples / 8 per step = 32 steps per epoch; as Lightning, step N's record is at
    # N - 1 with the epoch it ran in (steps 1-32: epoch 0, 33-64: epoch 1, ...)
    epochs = {x["step"]: x["epoch"] for x in train_lines}
    assert sorted(epochs) == list(range(96))
    assert (epochs[0], epochs[31], epochs[32], epochs[95]) == (0, 0, 1, 2)
    val_acc = [x["val/acc"] for x in lines if "val/acc" in x]
    assert val_acc[-1] > 0.9
    assert trainer.global_step == 96 and trainer.current_epoch == 3
    # a second run gets the next version
    trainer2 = make_trainer(tmp_path, max_steps=1, name="blobs")
    trainer2.fit(Classifier(), BlobsData())
    assert trainer2.run_dir.name == "version_1"


def test_tensorboard_scalars_are_readable(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = make_trainer(tmp_path, max_steps=3)
    trainer.fit(Classifier(), BlobsData())
    acc = EventAccumulator(str(trainer.run_dir / "tensorboard"))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("train/loss")]
    assert steps == [0, 1, 2]  # Lightning's 0-based steps of steps 1, 2, 3
    # the epoch column with every record (the final validation's too, at the last step's 2)
    assert {(e.step, e.value) for e in acc.Scalars("epoch")} == {(0, 0), (1, 0), (2, 0)}
    assert "train/ce" in acc.Tags()["scalars"]


def test_step_interval_lr_scheduler_steps_every_optimizer_step(tmp_path):
    module = Classifier(lr=0.08, scheduler=True)
    make_trainer(tmp_path, max_steps=5).fit(module, BlobsData())
    # StepLR(step_size=2, gamma=0.5) after 5 scheduler steps: 0.08 * 0.5**2
    assert module.optimizers().param_groups[0]["lr"] == pytest.approx(0.02)


def test_max_tokens_stops_training(tmp_path):
    class Counting(Classifier):
        def count_tokens(self, batch):
            return 10 * len(batch[0])  # pretend every sample holds 10 tokens

    trainer = make_trainer(tmp_path, max_steps=None, max_tokens=250)
    trainer.fit(Counting(), BlobsData())
    assert trainer.global_step == 4  # 80 tokens per step: 3 steps = 240 < 250, 4 steps = 320
    assert trainer.state.consumed_tokens == 320


def test_request_stop_ends_after_the_current_step(tmp_path):
    class StopAt(nt.Callback):
        def on_train_step_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                trainer.request_stop()

    trainer = make_trainer(tmp_path, max_steps=10, callbacks=[StopAt()])
    trainer.fit(Classifier(), BlobsData())
    assert trainer.global_step == 2


def test_grads_are_clipped_after_on_before_optimizer_step_as_in_lightning(tmp_path):
    # Lightning: inside optimizer.step(closure), on_before_optimizer_step sees the unclipped
    # gradients; configure_gradient_clipping runs after it; the update applies the clipped ones
    seen = {}

    def total(module):
        return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in module.parameters()]))

    class Check(nt.Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            seen["norm"] = trainer.step_output.grad_norm.item()
            seen["before"] = total(module).item()

    class Stepping(Classifier):
        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
            optimizer.step(closure=optimizer_closure)
            seen["at_step"] = total(self).item()  # what the update applied

    torch.manual_seed(0)
    trainer = make_trainer(tmp_path, max_steps=1, gradient_clip_val=1e-3, callbacks=[Check()])
    trainer.fit(Stepping(), BlobsData())
    assert seen["norm"] > 1e-2 and seen["before"] == pytest.approx(seen["norm"], rel=1e-5)
    assert seen["at_step"] == pytest.approx(1e-3, rel=1e-4)


def test_exception_reaches_on_exception_and_teardown(tmp_path):
    class Boom(Classifier):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("boom")

    recorder = HookRecorder()
    with pytest.raises(RuntimeError, match="boom"):
        make_trainer(tmp_path, callbacks=[recorder]).fit(Boom(), BlobsData())
    assert recorder.calls[-2:] == ["on_exception", "teardown"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_steps=2, fast_dev_run=-1), "fast_dev_run must be"),
        (dict(global_batch_size=12, micro_batch_size=8), "not a multiple of micro_batch_size"),
        (dict(max_steps=0), "max_steps must be a positive integer"),
        (dict(loggers=["wandb"]), "unknown loggers"),
    ],
)
def test_invalid_trainer_settings_raise_at_construction(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_trainer(tmp_path, **kwargs)


def test_a_pathlib_root_dir_is_taken_and_recorded_as_text(tmp_path):
    trainer = make_trainer(tmp_path, default_root_dir=tmp_path / "root", max_steps=1)
    trainer.fit(Classifier(), BlobsData())
    assert (tmp_path / "root" / "default" / "version_0" / "config.yaml").is_file()
    assert trainer.settings.default_root_dir == str(tmp_path / "root")
    with pytest.raises(TypeError, match="default_root_dir must be a path"):
        make_trainer(tmp_path, default_root_dir=3)


def test_max_tokens_without_token_counting_is_rejected_before_work(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=None, max_tokens=100)
    with pytest.raises(ValueError, match="count_tokens"):
        trainer.fit(Classifier(), BlobsData())


def test_empty_and_iterable_datasets_are_rejected(tmp_path):
    empty = TensorDataset(torch.zeros(0, 8), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="empty"):
        make_trainer(tmp_path).fit(Classifier(), train_dataloaders=empty)

    class Stream(IterableDataset):
        def __iter__(self):
            yield torch.zeros(8), torch.tensor(0)

    # a stream trains (tests/unit/test_data_streaming.py); evaluation data must be map-style
    with pytest.raises(TypeError, match="validation data is an IterableDataset.*map-style"):
        make_trainer(tmp_path).validate(Classifier(), dataloaders=Stream())


def test_validate_returns_reduced_metrics(tmp_path):
    module = Classifier()
    (metrics,) = make_trainer(tmp_path).validate(module, BlobsData())
    x, y = BlobsData().val_set.tensors
    with torch.no_grad():
        expected = (module.net(x).argmax(-1) == y).float().mean().item()
    assert metrics["val/acc"] == pytest.approx(expected, abs=1e-6)


def test_same_module_runs_under_lightning_trainer(tmp_path):
    import lightning.pytorch as pl

    module = Classifier(lr=0.2)
    trainer = pl.Trainer(
        max_steps=20,
        val_check_interval=10,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(module, BlobsData())
    assert trainer.global_step == 20
    assert trainer.callback_metrics["val/acc"] > 0.8
