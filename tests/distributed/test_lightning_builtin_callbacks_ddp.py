"""Lightning's built-in callbacks under data parallelism (a 2-rank gloo world): a
prediction writer gets each rank's batch indices as Lightning's predict sampler deals them, a
gradient accumulation schedule gives the weights of one process reading the same global
batches (which tests/unit/test_lightning_builtin_callbacks.py shows are Lightning's),
StochasticWeightAveraging ends with the weights of lightning.Trainer on one process, and
BackboneFinetuning is refused with the reason."""

from __future__ import annotations

import copy
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    GradientAccumulationScheduler,
    StochasticWeightAveraging,
)
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import BatchSampler, DataLoader

import nanotrain as nt
from tests.distributed.spawn import run_world
from tests.unit.test_lightning_builtin_callbacks import ListWriter, Regression, WithBackbone, _data
from tests.unit.test_lightning_round2_b import WithStepLR
from tests.unit.test_lightning_round2_b import _data as _swa_data

pytestmark = pytest.mark.distributed


LAYOUTS = {
    "ddp": nt.DDPStrategy,
    "megatron dp=2": nt.MegatronStrategy,
    "megatron zero-1": lambda: nt.MegatronStrategy(zero_stage=1),
    "fsdp": nt.FSDPStrategy,
}


def _trainer(strategy, callbacks, **args) -> nt.Trainer:
    return nt.Trainer(
        strategy=strategy, callbacks=callbacks, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_monitors=False, **args,
    )  # fmt: skip


def _fit_schedule(strategy, module: Regression, batch_size: int) -> dict[str, torch.Tensor]:
    schedule = GradientAccumulationScheduler(scheduling={1: 3, 2: 2})
    trainer = _trainer(strategy, [schedule], max_epochs=3)
    trainer.fit(module, DataLoader(_data(24), batch_size=batch_size))
    assert trainer.global_step == 6 + 2 + 3  # 24 samples: global batches of 4, 12, 8
    whole = {k: getattr(v, "full_tensor", lambda v=v: v)() for k, v in module.state_dict().items()}
    return {k: v.detach().clone() for k, v in whole.items()}  # FSDP's shards gathered


def _fit_swa(trainer, batch_size: int) -> dict[str, torch.Tensor]:
    """WithStepLR for 3 epochs with SWA from epoch 1 (32 samples in global batches of 8)."""
    torch.manual_seed(0)
    module = WithStepLR()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader(_swa_data(), batch_size=batch_size))
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _swa() -> list:
    return [StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2, annealing_epochs=2)]


def _on_rank(rank: int, world_size: int, start: Regression) -> dict:
    writer = ListWriter("batch_and_epoch")
    _trainer(nt.DDPStrategy(), [writer]).predict(
        copy.deepcopy(start), DataLoader(_data(10), batch_size=3), return_predictions=False
    )
    weights = {
        name: _fit_schedule(make(), copy.deepcopy(start), 2) for name, make in LAYOUTS.items()
    }
    with pytest.raises(ValueError, match="BackboneFinetuning cannot run here: under DDPStrategy"):
        _trainer(nt.DDPStrategy(), [BackboneFinetuning(1)], max_epochs=2).fit(
            WithBackbone(), DataLoader(_data(24), batch_size=2)
        )
    swa = _fit_swa(_trainer(nt.DDPStrategy(), _swa(), max_epochs=3), 4)
    return {"written": writer.written, "weights": weights, "swa": swa}


def test_builtin_callbacks_under_data_parallelism():
    torch.manual_seed(0)
    start = Regression()
    ranks = run_world(_on_rank, 2, start, timeout=120)
    single = _fit_schedule(nt.SingleDeviceStrategy("cpu"), copy.deepcopy(start), 4)
    lightning = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=3, callbacks=_swa(), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    reference_swa = _fit_swa(lightning, 8)
    for rank, result in enumerate(ranks):
        sampler = UnrepeatedDistributedSampler(_data(10), num_replicas=2, rank=rank, shuffle=False)
        lightnings = [list(b) for b in BatchSampler(sampler, batch_size=3, drop_last=False)]
        per_batch = [entry[2] for entry in result["written"] if entry[0] == "batch"]
        assert per_batch == lightnings
        assert result["written"][-1][0] == "epoch" and result["written"][-1][2] == [lightnings]
        for key, value in result["swa"].items():
            torch.testing.assert_close(value, reference_swa[key], rtol=0, atol=1e-6, msg=key)
        for layout, weights in result["weights"].items():
            for key, value in weights.items():
                torch.testing.assert_close(
                    value, single[key], rtol=0, atol=1e-6, msg=lambda m, k=(layout, key): f"{k} {m}"
                )
