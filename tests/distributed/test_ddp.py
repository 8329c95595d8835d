"""DDPStrategy on 2 gloo ranks matches one process with the same seed and global batch."""

from __future__ import annotations

import pytest
import torch

import nanotrain as nt
from nanotrain.testing import BlobsData, Classifier
from tests.distributed.spawn import run_world

pytestmark = pytest.mark.distributed


class StepRecorder(nt.Callback):
    """Keeps each step's global loss and grad norm (as reported by the strategy)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []

    def on_train_step_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs.loss))
        self.grad_norms.append(float(outputs.grad_norm))


def _fit(strategy, root: str, steps: int = 5) -> dict:
    """Train the toy classifier for `steps` steps; return losses, grad norms, final weights."""
    recorder = StepRecorder()
    module = Classifier(lr=0.2, scheduler=True)
    trainer = nt.Trainer(
        strategy=strategy,
        max_steps=steps,
        global_batch_size=16,
        micro_batch_size=4,
        gradient_clip_val=0.5,
        callbacks=[recorder],
        default_root_dir=root,
        loggers=[],
        seed=7,
        val_check_interval=steps,
    )
    trainer.fit(module, BlobsData(batch_size=4))
    return {
        "losses": recorder.losses,
        "grad_norms": recorder.grad_norms,
        "params": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "val": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")},
    }


def _ddp_rank(rank: int, world_size: int, root: str) -> dict:
    return _fit(nt.strategies.DDPStrategy(), root)


def test_two_ranks_match_single_process(tmp_path):
    reference = _fit(nt.SingleDeviceStrategy("cpu"), str(tmp_path / "single"))
    results = run_world(_ddp_rank, 2, str(tmp_path / "ddp"))

    for rank_result in results:
        # fp32 with different reduction orders (2×2 microbatches + all-reduce vs 4 microbatches)
        torch.testing.assert_close(rank_result["losses"], reference["losses"], rtol=1e-5, atol=0)
        torch.testing.assert_close(
            rank_result["grad_norms"], reference["grad_norms"], rtol=1e-5, atol=0
        )
        for name, value in reference["params"].items():
            torch.testing.assert_close(rank_result["params"][name], value, rtol=1e-5, atol=1e-6)
        # sync_dist=True validation metrics: averaged over both ranks' halves of the val set
        assert rank_result["val"].keys() == reference["val"].keys()
        for name, value in reference["val"].items():
            assert rank_result["val"][name] == pytest.approx(value, rel=1e-5)
    assert len(reference["losses"]) == 5
    assert reference["losses"][-1] < reference["losses"][0]
