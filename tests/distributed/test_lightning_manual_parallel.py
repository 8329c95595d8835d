"""Manual optimization under data parallelism: a GAN with two optimizers and toggling, and a
module that clips by hand, trained on 2 ranks (4 samples each) under DDPStrategy and under
MegatronStrategy with data parallelism alone end with the weights of lightning.Trainer on
one process training on the whole batch of 8. Megatron layouts that own backward or the
update (tp, pp, ep, ZeRO) are refused with the reason."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

import nanotrain as nt
from nanotrain.trainer.manual import manual_refusal
from tests.distributed.spawn import run_world
from tests.unit.test_lightning_manual import ManualRegression, TinyGAN, data

pytestmark = pytest.mark.distributed

MODULES = (TinyGAN, ManualRegression)


def _weights(module: pl.LightningModule, trainer) -> dict[str, torch.Tensor]:
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    weights["global_step"] = torch.tensor(trainer.global_step)
    return weights


def _fit(module_class, strategy) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    module = module_class()
    trainer = nt.Trainer(
        strategy=strategy, max_steps=6, loggers=[], enable_checkpointing=False,
        enable_progress_bar=False, enable_monitors=False,
    )  # fmt: skip
    trainer.fit(module, DataLoader(data(), batch_size=4))
    return _weights(module, trainer)


def _lightning_fit(module_class) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    module = module_class()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader(data(), batch_size=8))
    return _weights(module, trainer)


def _data_parallel(rank: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    runs = {}
    for m in MODULES:
        runs[f"ddp/{m.__name__}"] = _fit(m, nt.DDPStrategy())
        runs[f"megatron/{m.__name__}"] = _fit(m, nt.MegatronStrategy(backend="gloo"))
    return runs


def test_manual_optimization_under_data_parallelism_equals_lightning_on_one_process():
    ranks = run_world(_data_parallel, 2, timeout=120)
    for module_class in MODULES:
        reference = _lightning_fit(module_class)
        for rank in ranks:
            for kind in ("ddp", "megatron"):
                run = rank[f"{kind}/{module_class.__name__}"]
                for key, value in run.items():
                    torch.testing.assert_close(
                        value, reference[key], rtol=0, atol=1e-6, msg=f"{kind} {key}"
                    )


def test_manual_optimization_is_refused_under_zero_with_the_reason(tmp_path):
    trainer = nt.Trainer(strategy=nt.MegatronStrategy(zero_stage=1, backend="gloo"),
                         max_steps=1, loggers=[], enable_checkpointing=False,
                         enable_progress_bar=False)  # fmt: skip
    with pytest.raises(ValueError, match="zero_stage=1 keeps optimizer state"):
        trainer.fit(TinyGAN(), DataLoader(data(), batch_size=8))


@pytest.mark.parametrize(
    "layout,reason",
    [
        ({"tp": 2}, "tp=2 splits the weights"),
        ({"pp": 2}, "pp=2 runs backward inside the pipeline schedule"),
        ({"ep": 2}, "ep=2 splits the routed experts"),
        ({"zero_stage": 3}, "zero_stage=3 keeps optimizer state"),
    ],
)
def test_each_megatron_layout_that_owns_the_update_names_its_reason(layout, reason):
    class Stub:  # what manual_refusal reads of a Trainer, before any process group exists
        strategy = nt.MegatronStrategy(**layout)
        settings = None

    message = manual_refusal(Stub())
    assert reason in message and "MegatronStrategy(tp=1, pp=1, ep=1, zero_stage=0)" in message
