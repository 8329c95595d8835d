"""Lightning `.ckpt` files both ways: a checkpoint lightning.Trainer wrote resumes, tests and
loads under nanotrain as under lightning.Trainer, and the `.ckpt` nanotrain writes
(`trainer.save_checkpoint("x.ckpt")`) resumes under lightning.Trainer and loads with a plain
`LightningModule.load_from_checkpoint`; files that need unpickling code are refused."""

from __future__ import annotations

import copy
import pickle
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

import nanotrain as nt
from tests.unit.test_lightning_switches import Regression, _data


def _quiet(kind: str, tmp_path, **args):
    common = dict(logger=False, enable_progress_bar=False, default_root_dir=str(tmp_path / kind))
    if kind == "lightning":
        return pl.Trainer(accelerator="cpu", devices=1, enable_model_summary=False,
                          num_sanity_val_steps=0, **common, **args)  # fmt: skip
    return nt.Trainer(enable_monitors=False, **common, **args)


def _fit(kind, module, tmp_path, ckpt_path=None, **args):
    trainer = _quiet(kind, tmp_path, **args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def _same_weights(a, b) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def lightning_ckpts(tmp_path_factory):
    """A lightning.Trainer run of 3 epochs (8 steps each) with a .ckpt at every epoch's end,
    and one mid-epoch (step 12); returns (folder, module)."""
    root = tmp_path_factory.mktemp("pl")
    pl.seed_everything(0, verbose=False)
    module = Regression({"monitor": "val_loss"})  # a ReduceLROnPlateau, its state saved too
    saver = pl.callbacks.ModelCheckpoint(dirpath=root / "ck", save_top_k=-1, every_n_epochs=1)
    mid = pl.callbacks.ModelCheckpoint(dirpath=root / "mid", save_top_k=-1,
                                       every_n_train_steps=12)  # fmt: skip
    _fit("lightning", module, root, max_epochs=3, callbacks=[saver, mid])
    return root, module


@pytest.mark.parametrize("name", ["ck/epoch=0-step=8.ckpt", "mid/epoch=1-step=12.ckpt"])
def test_fit_resumes_a_lightning_ckpt_as_lightning_does(tmp_path, lightning_ckpts, name):
    root, _ = lightning_ckpts
    ckpt = root / name  # at an epoch's end, and mid-epoch (its data restarts, as Lightning's)
    runs = {}
    for kind in ("lightning", "nanotrain"):
        module = Regression({"monitor": "val_loss"})
        trainer = _fit(kind, module, tmp_path, ckpt_path=str(ckpt), max_epochs=3,
                       enable_checkpointing=False)  # fmt: skip
        runs[kind] = (module, trainer)
    (a, ta), (b, tb) = runs["lightning"], runs["nanotrain"]
    _same_weights(a, b)
    assert (tb.global_step, tb.current_epoch) == (ta.global_step, ta.current_epoch) == (24, 3)
    assert b.lrs == pytest.approx(a.lrs)
    assert b.first_samples == pytest.approx(a.first_samples)


def test_test_and_load_from_checkpoint_read_a_lightning_ckpt(tmp_path, lightning_ckpts):
    root, trained = lightning_ckpts
    ckpt = str(root / "ck" / "epoch=2-step=24.ckpt")
    data = DataLoader(_data(16, seed=9), batch_size=8)
    expected = _quiet("lightning", tmp_path).test(Regression(), data, ckpt_path=ckpt, verbose=False)
    got = _quiet("nanotrain", tmp_path).test(Regression(), data, ckpt_path=ckpt, verbose=False)
    assert got[0] == pytest.approx(expected[0], abs=1e-6)

    class Loaded(nt.NanoModule, Regression):
        pass

    _same_weights(trained, Loaded.load_from_checkpoint(ckpt))


def test_a_ckpt_that_needs_unpickling_code_is_refused_with_the_reason(tmp_path, lightning_ckpts):
    root, _ = lightning_ckpts
    checkpoint = torch.load(root / "ck" / "epoch=0-step=8.ckpt", weights_only=True)
    checkpoint["hyper_parameters"] = {"fn": pickle.loads}  # a callable: pickled by reference
    path = tmp_path / "unsafe.ckpt"
    torch.save(checkpoint, path)
    with pytest.raises(ValueError, match="pickled object .* could run code"):
        _fit("nanotrain", Regression(), tmp_path, ckpt_path=str(path), max_epochs=3)


def test_a_ckpt_nanotrain_writes_resumes_under_lightning_and_loads_plainly(tmp_path):
    # nanotrain trains 1 epoch and writes a .ckpt; lightning.Trainer resumes it for 2 more
    pl.seed_everything(0, verbose=False)
    start = Regression({"monitor": "val_loss"})
    whole = copy.deepcopy(start)
    trainer = _fit("nanotrain", start, tmp_path, max_epochs=1, enable_checkpointing=False)
    path = trainer.save_checkpoint(tmp_path / "nanotrain.ckpt")
    resumed = Regression({"monitor": "val_loss"})
    after = _fit("lightning", resumed, tmp_path, ckpt_path=str(path), max_epochs=3,
                 enable_checkpointing=False)  # fmt: skip
    reference = _fit("lightning", whole, tmp_path / "whole", max_epochs=3,
                     enable_checkpointing=False)  # fmt: skip
    _same_weights(whole, resumed)
    assert (after.global_step, after.current_epoch) == (reference.global_step, 3)
    assert resumed.lrs[-2:] == pytest.approx(whole.lrs[-2:])
    _same_weights(start, Regression.load_from_checkpoint(path, scheduler=None))
