"""Checkpoints under DDP on 2 gloo ranks: exact resume, a failing rank, resume on one process."""

from __future__ import annotations

import pytest
import torch

import nanotrain as nt
from nanotrain.callbacks.checkpoint import ModelCheckpoint
from nanotrain.checkpoint import files as ckpt_files
from tests.distributed.spawn import run_world
from tests.unit.test_checkpoint import DropoutAdamClassifier, LossRecorder, data, make_trainer

pytestmark = pytest.mark.distributed


def _fit(root: str, max_steps: int, strategy, dropout: float, ckpt_path=None, save=False):
    recorder = LossRecorder()
    callbacks = [recorder, ModelCheckpoint()] if save else [recorder]
    trainer = make_trainer(root, max_steps, callbacks, strategy=strategy)
    module = DropoutAdamClassifier(dropout=dropout)
    trainer.fit(module, data(), ckpt_path=ckpt_path)
    params = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {step: float(loss) for step, loss in recorder.losses.items()}, params, trainer


def _rank(rank: int, world_size: int, root: str) -> dict:
    ddp = nt.strategies.DDPStrategy
    straight, straight_params, _ = _fit(f"{root}/straight", 10, ddp(), 0.3)
    _fit(f"{root}/split", 5, ddp(), 0.3, save=True)
    resumed, resumed_params, _ = _fit(f"{root}/split", 10, ddp(), 0.3, ckpt_path="last")
    # A checkpoint without dropout, to be resumed on one process by the test.
    _, _, trainer = _fit(f"{root}/layout", 5, ddp(), 0.0, save=True)
    return {
        "save_errors": _save_failing_on_rank_1(trainer, rank),
        "straight": straight,
        "resumed": resumed,
        "params_equal": all(
            torch.equal(straight_params[k], resumed_params[k]) for k in straight_params
        ),
        "layout_ckpt": str(trainer.checkpoint_dir / "step-00000005"),
    }


def _save_failing_on_rank_1(trainer: nt.Trainer, rank: int) -> dict:
    """Save once more with rank 1's write failing: both ranks must raise, none may hang."""
    original = ckpt_files.write_torch

    def disk_full(obj, path):
        raise OSError("No space left on device")

    ckpt_files.write_torch = disk_full if rank == 1 else original
    try:
        trainer.save_checkpoint(trainer.checkpoint_dir / "step-99999999")
        message = None
    except RuntimeError as exc:
        message = str(exc)
    finally:
        ckpt_files.write_torch = original
    return {
        "message": message,
        "committed": (trainer.checkpoint_dir / "step-99999999").exists(),
        "last": (trainer.checkpoint_dir / "last").read_text().strip(),
    }


def test_ddp_resume_is_bitwise_and_loads_on_one_process(tmp_path):
    results = run_world(_rank, 2, str(tmp_path))

    for rank, result in enumerate(results):
        assert sorted(result["resumed"]) == [6, 7, 8, 9, 10], rank
        for step in range(6, 11):
            assert result["resumed"][step] == result["straight"][step], (rank, step)
        assert result["params_equal"], rank
    assert results[0]["straight"] == results[1]["straight"]  # the global loss on every rank

    # A write failing on rank 1 makes both ranks raise; nothing is committed.
    errors = [r["save_errors"] for r in results]
    # Every rank names the failing rank and its cause (was "failed on another rank").
    assert "failed on rank 1" in errors[0]["message"] and "No space" in errors[0]["message"]
    assert "No space left on device" in errors[1]["message"]
    assert not errors[0]["committed"] and errors[0]["last"] == "step-00000005"

    # Saved by 2 ranks, resumed on 1: model, Adam state, LR schedule and data position carry
    # over, so steps 6-10 match a 1-process run to the DDP-vs-single tolerance (rtol 1e-5).
    single = nt.SingleDeviceStrategy("cpu")
    reference, _, _ = _fit(str(tmp_path / "single"), 10, single, 0.0)
    with pytest.warns(UserWarning, match="saved by 2 ranks and is loaded on 1"):
        losses, _, _ = _fit(
            str(tmp_path / "single"),
            10,
            nt.SingleDeviceStrategy("cpu"),
            0.0,
            ckpt_path=results[0]["layout_ckpt"],
        )
    assert sorted(losses) == [6, 7, 8, 9, 10]
    for step in range(6, 11):
        assert losses[step] == pytest.approx(reference[step], rel=1e-5, abs=0), step
