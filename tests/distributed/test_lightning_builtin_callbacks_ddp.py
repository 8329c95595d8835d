"""Lightning's built-in callbacks under data parallelism (a 2-rank gloo world): a
prediction writer gets each rank's batch indices as Lightning's predict sampler deals them, a
gradient accumulation schedule gives the weights of one process reading the same global
batches (which tests/unit/test_lightning_builtin_callbacks.py shows are Lightning's),
StochasticWeightAveraging and BackboneFinetuning (unfreezing at epoch 1) end with the weights
of lightning.Trainer on one process, and BackboneFinetuning under a sharded layout is refused
with the reason."""

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
from torch import nn
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


class PlainBackbone(WithBackbone):
    """WithBackbone without its BatchNorm, whose batch statistics depend on the per-rank batch."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 6), nn.Tanh())


def _fit_finetuning(trainer, start: PlainBackbone, batch_size: int) -> dict[str, torch.Tensor]:
    """`start` for 3 epochs, the backbone unfrozen at epoch 1 (24 samples, global batches of 4)."""
    module = copy.deepcopy(start)
    trainer.fit(module, DataLoader(_data(24), batch_size=batch_size))
    assert len(trainer.optimizers[0].param_groups) == 2  # the backbone's group was added
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _finetuning() -> list:
    return [BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.1)]


def _swa() -> list:
    return [StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2, annealing_epochs=2)]


def _on_rank(rank: int, world_size: int, start: Regression, backbone: PlainBackbone) -> dict:
    writer = ListWriter("batch_and_epoch")
    _trainer(nt.DDPStrategy(), [writer]).predict(
        copy.deepcopy(start), DataLoader(_data(10), batch_size=3), return_predictions=False
    )
    weights = {
        name: _fit_schedule(make(), copy.deepcopy(start), 2) for name, make in LAYOUTS.items()
    }
    finetuned = _fit_finetuning(
        _trainer(nt.DDPStrategy(), _finetuning(), max_epochs=3), backbone, 2
    )
    zero = nt.MegatronStrategy(zero_stage=1)
    with pytest.raises(ValueError, match="cannot run here: under MegatronStrategy.*DDPStrategy"):
        _trainer(zero, [BackboneFinetuning(1)], max_epochs=2).fit(
            PlainBackbone(), DataLoader(_data(24), batch_size=2)
        )
    swa = _fit_swa(_trainer(nt.DDPStrategy(), _swa(), max_epochs=3), 4)
    return {"written": writer.written, "weights": weights, "swa": swa, "finetuned": finetuned}


def test_builtin_callbacks_under_data_parallelism():
    torch.manual_seed(0)
    start = Regression()
    backbone = PlainBackbone()
    ranks = run_world(_on_rank, 2, start, backbone, timeout=120)
    single = _fit_schedule(nt.SingleDeviceStrategy("cpu"), copy.deepcopy(start), 4)
    lightning = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=3, callbacks=_swa(), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    reference_swa = _fit_swa(lightning, 8)
    lightning = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=3, callbacks=_finetuning(), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    reference_finetuned = _fit_finetuning(lightning, backbone, 4)
    assert not torch.equal(reference_finetuned["backbone.0.weight"], backbone.backbone[0].weight)
    for rank, result in enumerate(ranks):
        sampler = UnrepeatedDistributedSampler(_data(10), num_replicas=2, rank=rank, shuffle=False)
        lightnings = [list(b) for b in BatchSampler(sampler, batch_size=3, drop_last=False)]
        per_batch = [entry[2] for entry in result["written"] if entry[0] == "batch"]
        assert per_batch == lightnings
        assert result["written"][-1][0] == "epoch" and result["written"][-1][2] == [lightnings]
        for key, value in result["swa"].items():
            torch.testing.assert_close(value, reference_swa[key], rtol=0, atol=1e-6, msg=key)
        for key, value in result["finetuned"].items():
            torch.testing.assert_close(value, reference_finetuned[key], rtol=0, atol=1e-6, msg=key)
        for layout, weights in result["weights"].items():
            for key, value in weights.items():
                torch.testing.assert_close(
                    value, single[key], rtol=0, atol=1e-6, msg=lambda m, k=(layout, key): f"{k} {m}"
                )
