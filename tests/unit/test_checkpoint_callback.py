"""ModelCheckpoint: cadences, retention of the newest k and best k, saving on exception/request."""

from __future__ import annotations

import pytest
import torch

import nanotrain as nt
from nanotrain.callbacks.checkpoint import ModelCheckpoint
from nanotrain.checkpoint import load_checkpoint
from nanotrain.testing import Classifier
from tests.unit.test_checkpoint import LossRecorder, data, make_trainer


class ScriptedMetric(nt.Callback):
    """Logs `score` = scores[step] after each step (before ModelCheckpoint looks at it)."""

    def __init__(self, scores: dict[int, float]) -> None:
        self.scores = scores

    def on_train_step_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        trainer.log_metrics({"score": self.scores[trainer.global_step]})


def run(tmp_path, max_steps, *callbacks, module=None, ckpt_path=None) -> nt.Trainer:
    trainer = make_trainer(tmp_path, max_steps, callbacks)
    trainer.fit(module or Classifier(), data(), ckpt_path=ckpt_path)
    return trainer


def saved_steps(trainer: nt.Trainer) -> list[str]:
    return sorted(p.name for p in trainer.checkpoint_dir.iterdir() if p.is_dir())


def test_every_n_steps_keeps_the_last_k_and_saves_at_the_end(tmp_path):
    ckpt = ModelCheckpoint(every_n_steps=2, save_top_k=2)
    trainer = run(tmp_path, 7, ckpt)
    # saves at 2, 4, 6 (the cadence: without a monitor the two newest remain) and, with
    # save_last, at 7 (Lightning's last.ckpt: kept as the newest, not one of the top k)
    assert saved_steps(trainer) == ["step-00000004", "step-00000006", "step-00000007"]
    assert (trainer.checkpoint_dir / "last").read_text().strip() == "step-00000007"
    assert ckpt.last_model_path == str(trainer.checkpoint_dir / "step-00000007")


@pytest.mark.parametrize(
    "mode, kept, best",
    [
        # best 2 by the lowest score (step 2: 1.0, step 5: 2.0) + the newest (6)
        ("min", ["step-00000002", "step-00000005", "step-00000006"], (2, 1.0)),
        # best 2 by the highest score (step 6: 6.0, step 1: 5.0), 6 also the newest
        ("max", ["step-00000001", "step-00000006"], (6, 6.0)),
    ],
)
def test_keep_best_k_by_monitor_plus_last_k(tmp_path, mode, kept, best):
    scores = {1: 5.0, 2: 1.0, 3: 4.0, 4: 3.0, 5: 2.0, 6: 6.0}
    ckpt = ModelCheckpoint(every_n_steps=1, save_top_k=2, monitor="score", mode=mode, keep_best_k=2)
    trainer = run(tmp_path, 6, ScriptedMetric(scores), ckpt)
    assert saved_steps(trainer) == kept
    assert ckpt.best_model_path == str(trainer.checkpoint_dir / f"step-{best[0]:08d}")
    assert ckpt.best_model_score == best[1]


def test_state_survives_resume_and_retention_continues(tmp_path):
    scores = {1: 3.0, 2: 1.0, 3: 2.0, 4: 5.0, 5: 4.0, 6: 6.0}
    options = dict(every_n_steps=1, save_top_k=1, monitor="score", keep_best_k=1)
    first = ModelCheckpoint(**options)
    trainer = run(tmp_path, 3, ScriptedMetric(scores), first)
    assert saved_steps(trainer) == ["step-00000002", "step-00000003"]

    restored = ModelCheckpoint(**options)
    restored.load_state_dict(first.state_dict())
    assert restored.best_model_path == first.best_model_path
    assert restored.saved_paths == first.saved_paths

    second = ModelCheckpoint(**options)
    trainer = run(tmp_path, 6, ScriptedMetric(scores), second, ckpt_path="last")
    # step 2 (score 1.0, saved before the resume) is still the best and still kept
    assert second.best_model_path == str(trainer.checkpoint_dir / "step-00000002")
    assert saved_steps(trainer) == ["step-00000002", "step-00000006"]


class StepClock(nt.Callback):
    """A clock that reads 40·s seconds at the end of step s (`clock()`)."""

    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def on_train_step_start(self, trainer, module, batch, batch_idx) -> None:
        self.now = 40.0 * (trainer.global_step + 1)


def timed_checkpoint() -> tuple[StepClock, ModelCheckpoint]:
    """A ModelCheckpoint every 1.5 minutes of a `StepClock`, and that clock."""
    clock = StepClock()
    ckpt = ModelCheckpoint(every_n_minutes=1.5, save_last=False)
    ckpt._clock = clock.clock
    return clock, ckpt


def test_every_n_minutes_follows_the_clock(tmp_path):
    trainer = run(tmp_path, 7, *timed_checkpoint())
    # 90 s after the start (t=0) first passes at step 3 (120 s); then 90 s after 120 s at
    # step 6 (240 s); step 7 (280 s) is only 40 s later.
    assert saved_steps(trainer) == ["step-00000003", "step-00000006"]


class FailAtStep3(Classifier):
    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == 2:
            raise RuntimeError("diverged")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("save_on_exception", [True, False])
def test_save_on_exception(tmp_path, save_on_exception):
    ckpt = ModelCheckpoint(save_on_exception=save_on_exception)
    trainer = make_trainer(tmp_path, 5, [ckpt])
    with pytest.raises(RuntimeError, match="diverged"):
        trainer.fit(FailAtStep3(), data())
    path = trainer.checkpoint_dir / "step-00000002-exception"
    assert path.is_dir() == save_on_exception
    if save_on_exception:
        assert (trainer.checkpoint_dir / "last").read_text().strip() == path.name
        assert load_checkpoint(trainer, path)["train_state"]["global_step"] == 2


def test_save_now_lets_another_callback_stop_with_a_checkpoint(tmp_path):
    ckpt = ModelCheckpoint()

    class StopWithCheckpoint(nt.Callback):
        def on_train_step_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if trainer.global_step == 3:
                ckpt.save_now(trainer)
                trainer.request_stop()

    module = Classifier()
    trainer = run(tmp_path, 10, StopWithCheckpoint(), ckpt, module=module)
    assert trainer.global_step == 3
    assert saved_steps(trainer) == ["step-00000003"]  # save_last did not save step 3 again
    weights = load_checkpoint(trainer, trainer.checkpoint_dir / "step-00000003")["model"]
    for name, value in module.state_dict().items():
        assert torch.equal(weights[name], value)


def test_custom_dirpath_is_resumed_by_passing_the_folder(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    run(tmp_path / "runs", 2, ModelCheckpoint(dirpath=elsewhere))
    assert (elsewhere / "last").read_text().strip() == "step-00000002"
    recorder = LossRecorder()
    run(tmp_path / "runs", 3, recorder, ckpt_path=elsewhere)  # the folder: `last` is followed
    assert sorted(recorder.losses) == [3]  # only step 3 ran: steps 1-2 came from the checkpoint


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(every_n_steps=0), "every_n_steps must be a positive integer"),
        (dict(every_n_minutes=-1), "every_n_minutes must be positive"),
        (dict(save_top_k=-2), "save_top_k must be an integer >= -1"),
        (dict(mode="best"), "mode must be 'min' or 'max'"),
        (dict(keep_best_k=2), "set monitor"),
    ],
)
def test_invalid_options_raise_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelCheckpoint(**kwargs)
