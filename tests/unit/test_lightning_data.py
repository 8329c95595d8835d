"""Data as a Lightning user gives it: the DataLoader's batch size and sampler, the module's own
dataloaders, `seed_everything` and `accumulate_grad_batches` mean under `nanotrain.Trainer`
what they mean under `lightning.Trainer` (compared on the same module and data), and what
cannot be honoured exactly is refused before any step."""

from __future__ import annotations

import copy
import os
import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.demos import SequenceSampler
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    SubsetRandomSampler,
    TensorDataset,
)

import nanotrain as nt
from nanotrain.callbacks.checkpoint import ModelCheckpoint
from nanotrain.data import ResumableDistributedSampler
from nanotrain.strategies.base import DataShard
from nanotrain.trainer.data_source import inspect_source
from nanotrain.trainer.loaders import rebatch


def dataset(n: int = 64) -> TensorDataset:
    """(x [n, 4], y [n, 1], index [n]): the index tells which samples a step read."""
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g),
                         torch.arange(n))  # fmt: skip


class Tiny(pl.LightningModule):
    """A two-layer regressor recording the sample indices of every microbatch it trains on."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(dropout), nn.Linear(8, 1))
        self.seen: list[list[int]] = []
        self.accumulate: list[int] = []
        self.num_val_batches: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.seen.append(index.tolist())
        self.accumulate.append(self.trainer.accumulate_grad_batches)
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("val_loss", F.mse_loss(self.net(x), y))

    def on_validation_epoch_end(self):
        self.num_val_batches = list(self.trainer.num_val_batches)

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class OwnData(Tiny):
    """Tiny with its own train/val dataloaders, as every `lightning.pytorch.demos` module."""

    def train_dataloader(self):
        return DataLoader(dataset(32), batch_size=4)

    def val_dataloader(self):
        return DataLoader(dataset(16), batch_size=8)


def fresh(cls=Tiny, **kwargs) -> Tiny:
    torch.manual_seed(0)
    return cls(**kwargs)


def lightning_fit(module, *data, **settings) -> pl.Trainer:
    settings = {"max_epochs": 1, "num_sanity_val_steps": 0, **settings}
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", devices=1, **settings)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, *data)
    return trainer


def nt_trainer(tmp_path, **settings) -> nt.Trainer:
    defaults = dict(strategy=nt.SingleDeviceStrategy("cpu"), default_root_dir=str(tmp_path),
                    logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_monitors=False, max_epochs=1)  # fmt: skip
    defaults.update(settings)
    return nt.Trainer(**defaults)


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_dataloaders_batch_size_and_order_give_lightnings_run(tmp_path, accumulate):
    loader = lambda: DataLoader(dataset(), batch_size=8, shuffle=False)  # noqa: E731
    lit_module, nt_module = fresh(), fresh()
    lit = lightning_fit(lit_module, loader(), accumulate_grad_batches=accumulate)
    ours = nt_trainer(tmp_path, accumulate_grad_batches=accumulate)
    ours.fit(nt_module, loader())  # Lightning's positional order: fit(model, train_loader)
    assert ours.global_step == lit.global_step == 8 // accumulate
    assert nt_module.seen == lit_module.seen == [list(range(i, i + 8)) for i in range(0, 64, 8)]
    assert nt_module.accumulate == lit_module.accumulate == [accumulate] * 8
    assert ours.settings.micro_batch_size == 8 and ours.settings.global_batch_size == 8 * accumulate
    assert ours.settings.shuffle is False
    assert_same_weights(nt_module, lit_module)


def test_module_defined_dataloaders_are_used_as_in_lightning(tmp_path):
    lit_module, nt_module = fresh(OwnData), fresh(OwnData)
    lit = lightning_fit(lit_module, max_epochs=2)
    ours = nt_trainer(tmp_path, max_epochs=2)
    ours.fit(nt_module)
    assert ours.global_step == lit.global_step == 16
    assert nt_module.seen == lit_module.seen
    assert nt_module.num_val_batches == lit_module.num_val_batches == [2]
    torch.testing.assert_close(
        ours.callback_metrics["val_loss"], lit.callback_metrics["val_loss"], rtol=1e-6, atol=0
    )
    assert_same_weights(nt_module, lit_module)
    assert list(ours.validate(nt_module)[0]) == ["val_loss"]


class Boring(BoringModel):
    def on_train_start(self):
        self.counts = (self.trainer.num_training_batches, list(self.trainer.num_val_batches))


def test_boring_model_trains_on_its_own_dataloaders(tmp_path):
    model = Boring()
    trainer = nt_trainer(tmp_path, max_epochs=None, max_steps=3)
    trainer.fit(model)
    # BoringModel's DataLoader(RandomDataset(32, 64)) has DataLoader's default batch_size 1
    assert trainer.global_step == 3 and model.counts == (64, [64])
    assert trainer.settings.micro_batch_size == 1
    assert trainer.test(model) == [{}]
    predictions = trainer.predict(model)
    assert len(predictions) == 64 and predictions[0].shape == (1, 2)


def test_evaluation_loaders_keep_their_batch_size(tmp_path):
    module = fresh()
    val = DataLoader(dataset(48), batch_size=16)
    lit = lightning_fit(copy.deepcopy(module), DataLoader(dataset(), batch_size=8), val)
    ours = nt_trainer(tmp_path)
    ours.fit(module, DataLoader(dataset(), batch_size=8), val)
    assert module.num_val_batches == [3] and lit.num_val_batches == [3]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lit_pred = lit.predict(module, DataLoader(dataset(40), batch_size=16))
    pred = ours.predict(module, DataLoader(dataset(40), batch_size=16))
    assert [p.shape[0] for p in pred] == [p.shape[0] for p in lit_pred] == [16, 16, 8]
    for ours_batch, theirs in zip(pred, lit_pred, strict=True):
        torch.testing.assert_close(ours_batch, theirs)


def test_a_shuffled_dataloader_reads_distributed_samplers_order(tmp_path):
    module = fresh()
    trainer = nt_trainer(tmp_path, seed=5)
    trainer.fit(module, DataLoader(dataset(), batch_size=8, shuffle=True))
    order = list(DistributedSampler(dataset(), num_replicas=1, rank=0, shuffle=True, seed=5))
    assert [i for batch in module.seen for i in batch] == order
    assert trainer.settings.shuffle is True


@pytest.mark.parametrize("replicas, micro, accumulate", [(2, 4, 1), (2, 2, 3), (4, 2, 2)])
def test_each_replica_reads_its_distributed_sampler_share(replicas, micro, accumulate):
    data = dataset(96)
    total = micro * replicas * accumulate
    for epoch in (0, 1):
        for rank in range(replicas):
            ours = ResumableDistributedSampler(len(data), total, rank, replicas, seed=3)
            theirs = DistributedSampler(data, num_replicas=replicas, rank=rank, seed=3)
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)


def test_a_checkpoint_of_the_former_order_resumes_in_it():
    # before the order was DistributedSampler's, it was numpy's; such a state keeps it
    sampler = ResumableDistributedSampler(40, 8, seed=2)
    state = sampler.state_dict()
    del state["permutation"]
    state["epoch"] = 1
    resumed = ResumableDistributedSampler(40, 8, seed=2)
    resumed.load_state_dict(state)
    assert list(resumed) == np.random.default_rng([2, 1]).permutation(40).tolist()


def test_seed_everything_decides_the_run_unless_the_trainer_has_a_seed(tmp_path):
    original = fresh(dropout=0.5)

    def run(global_seed: int | None, **settings) -> Tiny:
        if global_seed is not None:
            pl.seed_everything(global_seed, verbose=False)
        module = copy.deepcopy(original)
        trainer = nt_trainer(tmp_path, max_epochs=None, max_steps=3, **settings)
        trainer.fit(module, DataLoader(dataset(), batch_size=8, shuffle=True))
        assert os.environ.get("PL_GLOBAL_SEED") == (
            None if global_seed is None else str(global_seed)
        )
        return module, trainer.settings.seed

    one, seed = run(1)
    again, _ = run(1)
    two, _ = run(2)
    assert seed == 1 and one.seen == again.seen and one.seen != two.seen
    assert_same_weights(one, again)
    assert any(
        not torch.equal(p, q) for p, q in zip(one.parameters(), two.parameters(), strict=True)
    )
    explicit_1, seed = run(1, seed=7)
    explicit_2, _ = run(2, seed=7)
    assert seed == 7 and explicit_1.seen == explicit_2.seen
    assert_same_weights(explicit_1, explicit_2)


def test_a_trainers_seed_does_not_leak_into_a_later_fit(tmp_path):
    original = fresh(dropout=0.5)

    def run(**settings) -> Tiny:
        module = copy.deepcopy(original)
        torch.manual_seed(0)  # dropout draws from the global RNG, which fit leaves unseeded
        trainer = nt_trainer(tmp_path, max_epochs=None, max_steps=3, **settings)
        trainer.fit(module, DataLoader(dataset(), batch_size=8, shuffle=True))
        return module

    default = run()
    run(seed=7)
    assert "PL_GLOBAL_SEED" not in os.environ  # seed_everything(7) inside fit was undone
    later = run()
    assert later.seen == default.seen
    assert_same_weights(later, default)


def test_a_resume_keeps_the_data_orders_seed(tmp_path):
    original = fresh()

    def run(root, steps: int, global_seed: int, **kwargs) -> Tiny:
        pl.seed_everything(global_seed, verbose=False)
        module = copy.deepcopy(original)
        trainer = nt_trainer(root, max_epochs=None, max_steps=steps,
                             callbacks=[ModelCheckpoint(every_n_steps=2)])  # fmt: skip
        trainer.fit(module, DataLoader(dataset(), batch_size=8, shuffle=True), **kwargs)
        return module

    straight = run(tmp_path / "straight", 6, 1)
    run(tmp_path / "split", 3, 1)
    with pytest.raises(ValueError, match="seed=1, this one 2.*seed_everything"):
        run(tmp_path / "split", 6, 2, ckpt_path="last")
    resumed = run(tmp_path / "split", 6, 1, ckpt_path="last")
    assert resumed.seen == straight.seen[3:]  # from the checkpoint saved at the end, step 3
    assert_same_weights(resumed, straight)


def test_conflicting_settings_are_refused_before_any_step(tmp_path):
    module = fresh()
    loader = DataLoader(dataset(), batch_size=8)
    cases = [
        (dict(micro_batch_size=4), "batch_size=8 but the Trainer has micro_batch_size=4"),
        (dict(accumulate_grad_batches=2, global_batch_size=32),
         "accumulate_grad_batches=2 means global_batch_size=16 .* global_batch_size=32"),
        (dict(shuffle=True), r"Trainer\(shuffle=True\) contradicts .* SequentialSampler"),
    ]  # fmt: skip
    for settings, message in cases:
        with pytest.raises(ValueError, match=message):
            nt_trainer(tmp_path, **settings).fit(module, loader)
    with pytest.raises(ValueError, match="batch_size=None"):
        nt_trainer(tmp_path).fit(module, DataLoader(dataset(), batch_size=None))
    mine = DistributedSampler(dataset(), num_replicas=2, rank=1)
    with pytest.raises(ValueError, match="num_replicas=2, rank=1.*replica 0 of 1"):
        nt_trainer(tmp_path).fit(module, DataLoader(dataset(), batch_size=8, sampler=mine))
    with pytest.raises(ValueError, match="accumulate_grad_batches must be a positive integer"):
        nt_trainer(tmp_path, accumulate_grad_batches=0)
    assert module.seen == []  # no step ran


def test_a_custom_batch_sampler_is_read_as_lightning_reads_it(tmp_path):
    data = dataset(32)
    loader = lambda: DataLoader(data, batch_sampler=SequenceSampler(data, batch_size=4))  # noqa: E731
    lit_module, nt_module = fresh(), fresh()
    lightning_fit(lit_module, loader(), max_epochs=2)
    trainer = nt_trainer(tmp_path, max_epochs=2)
    trainer.fit(nt_module, loader())
    assert nt_module.seen == lit_module.seen and len(nt_module.seen) == 16
    assert nt_module.seen[1] == [1, 9, 17, 25]
    assert_same_weights(nt_module, lit_module)
    with pytest.raises(ValueError, match="batch_size=4 but the Trainer has micro_batch_size=8"):
        nt_trainer(tmp_path, micro_batch_size=8).fit(fresh(), loader())
    with pytest.raises(ValueError, match="batch_sampler SequenceSampler cannot be shared out"):
        source = inspect_source(loader(), "training")
        rebatch(source, micro_batch_size=4, global_batch_size=8, shard=DataShard(0, 2),
                shuffle=False, seed=0)  # fmt: skip


def test_a_custom_sampler_is_lightnings_order_and_resumes_exactly(tmp_path):
    def loader():
        sampler = SubsetRandomSampler(range(0, 32, 2), generator=torch.Generator().manual_seed(4))
        return DataLoader(dataset(32), batch_size=4, sampler=sampler)

    lit_module = fresh()
    lightning_fit(lit_module, loader(), max_epochs=3)

    def run(root, steps: int, **kwargs) -> Tiny:
        module = fresh()
        trainer = nt_trainer(root, max_epochs=3, max_steps=steps,
                             callbacks=[ModelCheckpoint(every_n_steps=3)])  # fmt: skip
        trainer.fit(module, loader(), **kwargs)
        return module

    straight = run(tmp_path / "straight", 12)
    assert straight.seen == lit_module.seen and len(straight.seen) == 12  # 3 epochs of 4
    assert_same_weights(straight, lit_module)
    run(tmp_path / "split", 6)  # stops in the middle of the second epoch
    resumed = run(tmp_path / "split", 12, ckpt_path="last")
    assert resumed.seen == straight.seen[6:]
    assert_same_weights(resumed, straight)


def test_samples_that_do_not_fill_a_global_batch_are_named(tmp_path):
    with pytest.warns(UserWarning, match="leaves 4 samples per epoch .* global batch of 8"):
        nt_trainer(tmp_path).fit(fresh(), DataLoader(dataset(60), batch_size=8))
    # with drop_last Lightning leaves them out too: the same run, and nothing to say
    lit_module, nt_module = fresh(), fresh()
    lit = lightning_fit(lit_module, DataLoader(dataset(60), batch_size=8, drop_last=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = nt_trainer(tmp_path)
        ours.fit(nt_module, DataLoader(dataset(60), batch_size=8, drop_last=True))
    assert ours.global_step == lit.global_step == 7
    assert_same_weights(nt_module, lit_module)


def test_token_data_module_batches_agree_with_the_trainers_micro_batch():
    from nanotrain.data import TokenDataModule

    assert TokenDataModule().loader_batch_size == 8  # alone, or under lightning.Trainer
    told = TokenDataModule()
    told.trainer = nt.Trainer(max_steps=1, micro_batch_size=4)
    assert told.loader_batch_size == 4
    own = TokenDataModule(micro_batch_size=2)
    own.trainer = told.trainer
    assert own.loader_batch_size == 2  # and fit then names both sizes (see above)
