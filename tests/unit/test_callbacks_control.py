"""NaNGuard and EarlyStopping: the callbacks that skip steps or end training."""

from __future__ import annotations

import functools
import json
import logging
from types import SimpleNamespace

import pytest
import torch

import nanotrain as nt
from nanotrain import testing as toy
from nanotrain.callbacks.early_stopping import EarlyStopping
from nanotrain.callbacks.nan_guard import NaNGuard
from nanotrain.testing import BlobsData, Classifier

make_trainer = functools.partial(toy.make_trainer, max_steps=5)


class NaNLossAt(Classifier):
    """Returns a NaN loss at the given step numbers (1-based, as in the logs)."""

    def __init__(self, bad_steps: set[int]) -> None:
        super().__init__()
        self.bad_steps = bad_steps

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step + 1 in self.bad_steps else loss


class ParamSnapshots(nt.Callback):
    """Parameters as they were at the start of each step, and at the very end."""

    def __init__(self) -> None:
        self.before: dict[int, list[torch.Tensor]] = {}
        self.final: list[torch.Tensor] = []

    def on_train_step_start(self, trainer, module, batch, batch_idx):
        self.before[trainer.global_step + 1] = [p.detach().clone() for p in module.parameters()]

    def on_train_end(self, trainer, module):
        self.final = [p.detach().clone() for p in module.parameters()]


def fake_save(trainer: nt.Trainer, saved: list):
    def save_checkpoint(path):
        path.mkdir(parents=True)
        saved.append((path, trainer.global_step))
        return path

    return save_checkpoint


def test_skip_leaves_the_weights_of_a_nan_step_unchanged_and_goes_on(tmp_path):
    guard, snaps = NaNGuard(action="skip"), ParamSnapshots()
    trainer = make_trainer(tmp_path, callbacks=[guard, snaps])
    trainer.fit(NaNLossAt({3}), BlobsData())
    # the update of step 3 was dropped: step 4 starts from the weights step 3 started from
    for a, b in zip(snaps.before[3], snaps.before[4], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # ... and training went on: step 4 changed them
    assert any(not torch.equal(a, b) for a, b in zip(snaps.before[4], snaps.before[5], strict=True))
    assert all(torch.isfinite(p).all() for p in snaps.final)
    assert trainer.global_step == 5 and trainer.state.skipped_steps == 1
    lines = [json.loads(x) for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    # logged at the bad step's 0-based step (Lightning's convention), with its train/loss
    assert [x["step"] for x in lines if "nan_guard/skipped_steps" in x] == [2]
    assert any("train/loss" in x and x["step"] == 2 for x in lines)


def test_stop_writes_a_checkpoint_and_ends_with_a_clear_message(tmp_path, caplog):
    guard, snaps, saved = NaNGuard(action="stop"), ParamSnapshots(), []
    trainer = make_trainer(tmp_path, max_steps=10, callbacks=[guard, snaps])
    trainer.save_checkpoint = fake_save(trainer, saved)
    with caplog.at_level(logging.ERROR):
        trainer.fit(NaNLossAt({3}), BlobsData())
    assert trainer.global_step == 3  # stopped after the bad step
    expected_dir = trainer.checkpoint_dir / "nan-step-3"
    assert saved == [(expected_dir, 2)]  # saved before step 3 counted: the last good state
    assert expected_dir.is_dir()
    assert "NaNGuard stopped training: non-finite values at step 3" in caplog.text
    assert str(expected_dir) in guard.stop_reason
    for a, b in zip(snaps.before[3], snaps.final, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_too_many_consecutive_bad_steps_stop_even_when_skipping(tmp_path):
    guard, saved = NaNGuard(action="skip", max_consecutive=2), []
    trainer = make_trainer(tmp_path, max_steps=10, callbacks=[guard])
    trainer.save_checkpoint = fake_save(trainer, saved)
    trainer.fit(NaNLossAt({2, 4, 5, 6}), BlobsData())
    # 2 is isolated (reset by the good step 3); 4 and 5 are two in a row
    assert trainer.global_step == 5 and guard.bad_steps == 3
    assert [path.name for path, _ in saved] == ["nan-step-5"]
    assert "2 bad steps in a row" in guard.stop_reason


def test_nan_guard_rejects_unknown_action():
    with pytest.raises(ValueError, match="'skip' or 'stop'"):
        NaNGuard(action="ignore")


# -- early stopping --------------------------------------------------------------------------
def test_training_stops_once_validation_stops_improving(tmp_path):
    stopper = EarlyStopping(monitor="val/loss", patience=2)
    # lr=0: the validation loss never changes, so runs 2 and 3 do not improve on run 1
    trainer = make_trainer(
        tmp_path, max_steps=20, val_check_interval=1, limit_val_batches=2, callbacks=[stopper]
    )
    trainer.fit(Classifier(lr=0.0), BlobsData())
    assert trainer.global_step == 3
    assert stopper.stopped_step == 3 and stopper.wait_count == 2


def test_improvement_must_exceed_min_delta_in_the_monitored_direction():
    stopper = EarlyStopping(mode="max", patience=2, min_delta=0.01)
    assert stopper.update(1.0) is None  # first value is the best so far
    assert stopper.update(1.05) is None and stopper.best == 1.05  # improved by > 0.01
    assert stopper.update(1.04) is None and stopper.wait_count == 1
    reason = stopper.update(1.059)  # better, but not by more than min_delta
    assert reason is not None and "did not improve" in reason


def test_non_finite_metric_stops_at_once():
    stopper = EarlyStopping(patience=5)
    stopper.update(1.0)
    assert "not finite" in stopper.update(float("nan"))


def test_missing_monitor_is_an_error_naming_the_logged_metrics():
    stopper = EarlyStopping(monitor="val/acc")
    trainer = SimpleNamespace(
        is_fitting=True, validation_is_extra=False, callback_metrics={"val/loss": torch.tensor(1.0)}
    )
    with pytest.raises(ValueError, match=r"'val/acc'.*\['val/loss'\]"):
        stopper.on_validation_end(trainer, None)


def test_state_of_another_monitor_is_refused():
    with pytest.raises(ValueError, match="same monitor"):
        EarlyStopping(monitor="val/acc", mode="max").load_state_dict(EarlyStopping().state_dict())


def test_stop_checkpoint_holds_the_last_good_weights(tmp_path):
    from nanotrain.checkpoint import load_model_weights, read_meta

    guard, snaps = NaNGuard(action="stop"), ParamSnapshots()
    trainer = make_trainer(tmp_path, max_steps=10, callbacks=[guard, snaps])
    module = NaNLossAt({3})
    trainer.fit(module, BlobsData())
    weights = load_model_weights(guard.checkpoint_path)
    names = [name for name, _ in module.named_parameters()]
    for name, before in zip(names, snaps.before[3], strict=True):
        torch.testing.assert_close(weights[name], before, rtol=0, atol=0)
    assert read_meta(guard.checkpoint_path)["global_step"] == 2  # the state before the bad step
