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
