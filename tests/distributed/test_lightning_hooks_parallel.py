"""Lightning's optimization hooks under data parallelism: a module that freezes a layer in
`on_after_backward`, warms the LR up in `optimizer_step` and clips by value in
`configure_gradient_clipping` ends with the weights of one process, under DDP and under
MegatronStrategy's data parallelism (its gradients are views of reduced buckets)."""

from __future__ import annotations

import pytest
import torch

import nanotrain as nt
from tests.distributed.spawn import run_world
from tests.unit.test_lightning_hooks import HookedClassifier, data

pytestmark = pytest.mark.distributed


def _fit(strategy, accumulate_over: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    module = HookedClassifier()
    nt.Trainer(
        strategy=strategy, max_epochs=1, micro_batch_size=4, global_batch_size=8 * accumulate_over,
        shuffle=False, loggers=[], enable_checkpointing=False, enable_progress_bar=False,
        enable_monitors=False,
    ).fit(module, train_dataloaders=data(batch_size=4))  # fmt: skip
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _layouts(rank: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    return {
        "ddp": _fit(nt.DDPStrategy(), 1),
        "megatron dp=2": _fit(nt.MegatronStrategy(), 1),
        "megatron dp=2, 2 microbatches": _fit(nt.MegatronStrategy(), 2),
    }


def test_hooks_under_data_parallelism_give_one_process_weights():
    ranks = run_world(_layouts, 2, timeout=120)
    single = {
        1: _fit(nt.SingleDeviceStrategy("cpu"), 1),
        2: _fit(nt.SingleDeviceStrategy("cpu"), 2),
    }
    for name, weights in ranks[0].items():
        reference = single[2 if "2 microbatches" in name else 1]
        for key, value in weights.items():
            assert torch.allclose(value, reference[key], atol=1e-6), (name, key)


class BatchHookRecorder(nt.LanguageModelModule):
    """Records Lightning's per-microbatch hooks and the step's loss."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple] = []

    def on_train_batch_start(self, batch, batch_idx):
        self.calls.append(("start", batch_idx))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.calls.append(("end", batch_idx, float(outputs["loss"])))


class StepLoss(nt.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_step_end(self, trainer, module, outputs, microbatches, step_idx):
        self.losses.append(float(outputs.loss))


def _pipeline_hooks(rank: int, world_size: int, root: str) -> dict:
    from tests.distributed.test_megatron import RandomTokens

    module = BatchHookRecorder("tiny-dense", vocab_size=257, model_overrides={"num_layers": 2})
    steps = StepLoss()
    nt.Trainer(
        strategy=nt.MegatronStrategy(pp=2), max_steps=2, global_batch_size=4, micro_batch_size=2,
        callbacks=[steps], default_root_dir=root, loggers=[], enable_checkpointing=False,
        enable_progress_bar=False, seed=3,
    ).fit(module, train_dataloaders=RandomTokens())  # fmt: skip
    return {"calls": module.calls, "losses": steps.losses}


def test_batch_hooks_under_a_pipeline_wrap_the_schedule(tmp_path):
    """pp > 1: the microbatches run inside the schedule, so every on_train_batch_start of the
    step runs before it and every on_train_batch_end after the optimizer step, each with the
    step's loss over the number of microbatches (docs/lightning.md)."""
    for result in run_world(_pipeline_hooks, 2, str(tmp_path), timeout=120):
        starts_ends = [call[:2] for call in result["calls"]]
        assert starts_ends == [("start", 0), ("start", 1), ("end", 0), ("end", 1),
                               ("start", 2), ("start", 3), ("end", 2), ("end", 3)]  # fmt: skip
        ends = [call[2] for call in result["calls"] if call[0] == "end"]
        expected = [loss / 2 for loss in result["losses"] for _ in range(2)]
        assert ends == pytest.approx(expected, rel=1e-6)
