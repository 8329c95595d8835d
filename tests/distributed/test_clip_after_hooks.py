"""The clip measures the gradients as `on_before_optimizer_step` and
`configure_gradient_clipping` left them under data parallelism too: modules that edit their
gradients in those hooks end with the weights of one process under DDP and under
MegatronStrategy's data parallelism (gradients that are views of reduced buckets). An
optimizer whose step calls its closure again (LBFGS) does too under DDP."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import nanotrain as nt
from tests.distributed.spawn import run_world
from tests.unit.test_lightning_round2_a import (
    ScalesInBeforeStep,
    ScalesInConfigureClipping,
    WithLBFGS,
    _data,
)

pytestmark = pytest.mark.distributed

MODULES = {"before_step": ScalesInBeforeStep, "configure_clipping": ScalesInConfigureClipping}


def _fit(strategy, module_class: type, micro_batch_size: int) -> dict[str, torch.Tensor]:
    clip = None if module_class is WithLBFGS else 0.5  # LBFGS's line search, unclipped
    torch.manual_seed(0)
    module = module_class()
    nt.Trainer(
        strategy=strategy, max_steps=4, micro_batch_size=micro_batch_size, global_batch_size=8,
        shuffle=False, gradient_clip_val=clip, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_monitors=False,
    ).fit(module, DataLoader(_data(), batch_size=micro_batch_size))  # fmt: skip
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _layouts(rank: int, world_size: int) -> dict[tuple[str, str], dict[str, torch.Tensor]]:
    weights = {
        (layout, name): _fit(make(), module_class, 4)
        for layout, make in (("ddp", nt.DDPStrategy), ("megatron dp=2", nt.MegatronStrategy))
        for name, module_class in MODULES.items()
    }
    weights[("ddp", "lbfgs")] = _fit(nt.DDPStrategy(), WithLBFGS, 4)
    return weights


def test_the_clip_after_gradient_editing_hooks_is_layout_independent():
    ranks = run_world(_layouts, 2, timeout=120)
    single = {
        name: _fit(nt.SingleDeviceStrategy("cpu"), module_class, 8)
        for name, module_class in {**MODULES, "lbfgs": WithLBFGS}.items()
    }
    for (layout, name), weights in ranks[0].items():
        for key, value in weights.items():
            assert torch.allclose(value, single[name][key], atol=1e-6), (layout, name, key)
