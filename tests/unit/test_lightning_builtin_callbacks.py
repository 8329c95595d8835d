"""Lightning's built-in callbacks that run under nanotrain.Trainer give lightning.Trainer's
result: the same module, seed and data run under both Trainers with the callback, and the
files it writes and the weights are compared."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

import nanotrain as nt


def _data(n: int = 10) -> TensorDataset:
    g = torch.Generator().manual_seed(123)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]))


def _trainer(kind: str, tmp_path, callbacks=(), **args):
    """A Trainer of `kind` ("lightning" or "nanotrain") on one CPU process, with no logger,
    checkpoint or progress bar."""
    common = dict(
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        default_root_dir=str(tmp_path / kind), callbacks=list(callbacks), **args,
    )  # fmt: skip
    if kind == "lightning":
        return pl.Trainer(accelerator="cpu", devices=1, enable_model_summary=False, **common)
    return nt.Trainer(enable_monitors=False, **common)


class Regression(pl.LightningModule):
    """Linear regression with SGD; its prediction of a batch is (inputs' sum, output)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.lin(x), y)

    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return {"sum": x.sum(dim=1), "out": self.lin(x)}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class ListWriter(BasePredictionWriter):
    """Writes what Lightning's writer hands it into `self.written`, as a user's writer would
    write files: per batch (prediction, batch indices, batch_idx, dataloader_idx) and per epoch
    (predictions, batch indices)."""

    def __init__(self, write_interval: str) -> None:
        super().__init__(write_interval)
        self.written: list = []

    def write_on_batch_end(
        self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx
    ):
        self.written.append(("batch", prediction, list(batch_indices), batch_idx, dataloader_idx))

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        self.written.append(("epoch", predictions, batch_indices))


def _predict_both(tmp_path, interval: str, return_predictions, loader_args: dict):
    """Run `predict` of the same module under each Trainer with a `ListWriter(interval)`;
    return [(written, returned)] for lightning then nanotrain."""
    module = Regression()
    runs = []
    for kind in ("lightning", "nanotrain"):
        writer = ListWriter(interval)
        trainer = _trainer(kind, tmp_path, callbacks=[writer])
        loader = DataLoader(_data(), **loader_args)
        returned = trainer.predict(
            copy.deepcopy(module), loader, return_predictions=return_predictions
        )
        runs.append((writer.written, returned))
    return runs


def _same(a, b) -> None:
    """`a` and `b` are equal nested lists/tuples/dicts of tensors and plain values."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("interval", ["batch", "epoch", "batch_and_epoch"])
@pytest.mark.parametrize("return_predictions", [None, False])
def test_a_prediction_writer_writes_what_it_writes_under_lightning(
    tmp_path, interval, return_predictions
):
    lightning_run, nanotrain_run = _predict_both(
        tmp_path, interval, return_predictions, dict(batch_size=3)
    )
    assert lightning_run[0], "the writer wrote nothing under Lightning"
    _same(lightning_run, nanotrain_run)


class GivenBatches(Sampler[list[int]]):
    """A custom batch sampler: the given batches, in order."""

    def __init__(self, batches: list[list[int]]) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def test_a_prediction_writer_gets_a_custom_batch_samplers_indices(tmp_path):
    batches = [[7, 1], [0, 9, 4], [2]]  # in this order, as the batch sampler yields them
    lightning_run, nanotrain_run = _predict_both(
        tmp_path, "batch_and_epoch", None, dict(batch_sampler=GivenBatches(batches))
    )
    assert lightning_run[0][-1][2] == [batches]
    _same(lightning_run, nanotrain_run)


class StepRecorder(pl.Callback):
    """Records (epoch, global_step, accumulate_grad_batches) at each epoch's end."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int]] = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.seen.append(
            (trainer.current_epoch, trainer.global_step, trainer.accumulate_grad_batches)
        )


def _fit_both(tmp_path, callbacks, n: int = 24, module=None, **args):
    """Fit copies of one module under each Trainer with deep copies of `callbacks`, batches of
    2 of `n` samples in order; return [(module, recorder)] per Trainer."""
    module = Regression() if module is None else module
    runs = []
    for kind in ("lightning", "nanotrain"):
        recorder = StepRecorder()
        pl.seed_everything(0, verbose=False)
        trainer = _trainer(kind, tmp_path, [*copy.deepcopy(callbacks), recorder], **args)
        fitted = copy.deepcopy(module)
        trainer.fit(fitted, DataLoader(_data(n), batch_size=2))
        runs.append((fitted, recorder))
    return runs


def _same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_a_gradient_accumulation_schedule_gives_lightnings_steps_and_weights(tmp_path):
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    schedule = GradientAccumulationScheduler(scheduling={1: 3, 2: 2})  # epoch 0: 1 (its default)
    (lightning_module, lightning_seen), (nanotrain_module, nanotrain_seen) = _fit_both(
        tmp_path, [schedule], max_epochs=3
    )
    # 12 batches per epoch: 12 steps of 1, then 4 steps of 3, then 6 of 2
    assert lightning_seen.seen == [(0, 12, 1), (1, 16, 3), (2, 22, 2)]
    assert nanotrain_seen.seen == lightning_seen.seen
    _same_weights(lightning_module, nanotrain_module)


def test_a_gradient_accumulation_schedule_that_splits_an_epochs_last_step_is_refused(tmp_path):
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    trainer = _trainer(
        "nanotrain", tmp_path, [GradientAccumulationScheduler(scheduling={1: 3})], max_epochs=2
    )
    with pytest.raises(ValueError, match=r"GradientAccumulationScheduler.*multiple of 6"):
        trainer.fit(Regression(), DataLoader(_data(20), batch_size=2))
    assert trainer.global_step == 0


def test_accumulate_grad_batches_changes_only_at_an_epochs_start(tmp_path):
    class SetsMidEpoch(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            trainer.accumulate_grad_batches = 2

    trainer = _trainer("nanotrain", tmp_path, [SetsMidEpoch()], max_epochs=1)
    with pytest.raises(ValueError, match="only in on_train_epoch_start"):
        trainer.fit(Regression(), DataLoader(_data(8), batch_size=2))


def test_a_run_with_an_accumulation_schedule_resumes_mid_epoch_exactly(tmp_path):
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    def schedule():
        return GradientAccumulationScheduler(scheduling={1: 3, 2: 2})

    start = Regression()
    (whole, _), _ = _fit_both(tmp_path / "whole", [schedule()], module=start, max_epochs=3)
    first = _trainer("nanotrain", tmp_path / "first", [schedule()], max_steps=14)
    first.fit(copy.deepcopy(start), DataLoader(_data(24), batch_size=2))  # 2 steps into epoch 1
    first.save_checkpoint(tmp_path / "mid")
    recorder = StepRecorder()
    second = _trainer("nanotrain", tmp_path / "second", [schedule(), recorder], max_epochs=3)
    resumed = copy.deepcopy(start)
    second.fit(resumed, DataLoader(_data(24), batch_size=2), ckpt_path=tmp_path / "mid")
    assert recorder.seen == [(1, 16, 3), (2, 22, 2)]
    _same_weights(whole, resumed)


class WithBackbone(Regression):
    """A backbone (with BatchNorm) and a head; Adam with a StepLR schedule over the trainable
    parameters, as Lightning's BackboneFinetuning documents it."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.BatchNorm1d(6))
        self.lin = nn.Linear(6, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.lin(self.backbone(x)), y)

    def configure_optimizers(self):
        trainable = [p for p in self.parameters() if p.requires_grad]
        opt = torch.optim.Adam(trainable, lr=0.01)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


class GroupRecorder(pl.Callback):
    """Records each param group's lr and parameter count at each epoch's end."""

    def __init__(self) -> None:
        self.seen: list = []

    def on_train_epoch_end(self, trainer, pl_module):
        groups = trainer.optimizers[0].param_groups
        self.seen.append([(g["lr"], len(g["params"])) for g in groups])


@pytest.mark.parametrize("clip", [None, 0.5])
def test_backbone_finetuning_unfreezes_as_lightning(tmp_path, clip):
    from lightning.pytorch.callbacks import BackboneFinetuning

    finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.1)
    module = WithBackbone()
    runs = []
    for kind in ("lightning", "nanotrain"):
        recorder = GroupRecorder()
        pl.seed_everything(0, verbose=False)
        callbacks = [copy.deepcopy(finetuning), recorder]
        trainer = _trainer(kind, tmp_path, callbacks, max_epochs=3, gradient_clip_val=clip)
        fitted = copy.deepcopy(module)
        trainer.fit(fitted, DataLoader(_data(24), batch_size=4))
        runs.append((fitted, recorder.seen))
    (lightning_module, lightning_groups), (nanotrain_module, nanotrain_groups) = runs
    assert len(lightning_groups[-1]) == 2, "Lightning's run did not add the backbone's group"
    assert nanotrain_groups == lightning_groups
    _same_weights(lightning_module, nanotrain_module)
    assert not torch.equal(lightning_module.backbone[0].weight, module.backbone[0].weight)


def test_backbone_finetuning_is_refused_where_it_cannot_give_lightnings_result(tmp_path):
    from lightning.pytorch.callbacks import BackboneFinetuning

    def fit(**args):
        callback = BackboneFinetuning(unfreeze_backbone_at_epoch=1)
        ckpt_path = args.pop("ckpt_path", None)
        trainer = _trainer("nanotrain", tmp_path, [callback], **args)
        trainer.fit(WithBackbone(), DataLoader(_data(24), batch_size=4), ckpt_path=ckpt_path)
        return trainer

    with pytest.raises(ValueError, match="BackboneFinetuning cannot run here.*master weights"):
        fit(max_epochs=1, precision="bf16-true")
    fit(max_epochs=2).save_checkpoint(tmp_path / "two")
    with pytest.raises(ValueError, match="BackboneFinetuning cannot run here: resuming"):
        fit(max_epochs=3, ckpt_path=tmp_path / "two")
