"""Manual optimization under data parallelism: a GAN with two optimizers and toggling, and a
module that clips by hand, trained under DDPStrategy on 2 ranks (4 samples each) end with the
weights of one process training on the whole batch of 8."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import nanotrain as nt
from tests.distributed.spawn import run_world
from tests.unit.test_lightning_manual import ManualRegression, TinyGAN, data

pytestmark = pytest.mark.distributed


def _fit(module_class, strategy, batch_size: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    module = module_class()
    nt.Trainer(
        strategy=strategy, max_steps=6, loggers=[], enable_checkpointing=False,
        enable_progress_bar=False, enable_monitors=False,
    ).fit(module, DataLoader(data(), batch_size=batch_size))  # fmt: skip
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    weights["global_step"] = torch.tensor(module.trainer.global_step)
    return weights


def _ddp(rank: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    return {m.__name__: _fit(m, nt.DDPStrategy(), 4) for m in (TinyGAN, ManualRegression)}


def test_manual_optimization_under_ddp_equals_one_process():
    ranks = run_world(_ddp, 2, timeout=120)
    for module_class in (TinyGAN, ManualRegression):
        single = _fit(module_class, nt.SingleDeviceStrategy("cpu"), 8)
        for rank in ranks:
            for key, value in rank[module_class.__name__].items():
                torch.testing.assert_close(value, single[key], rtol=0, atol=1e-6, msg=key)


def test_manual_optimization_is_refused_under_megatron_with_the_reason(tmp_path):
    trainer = nt.Trainer(strategy=nt.MegatronStrategy(), max_steps=1, loggers=[],
                         enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    with pytest.raises(ValueError, match="MegatronStrategy owns backward and the optimizer"):
        trainer.fit(TinyGAN(), DataLoader(data(), batch_size=8))
