"""Lightning habits of issue 53 (round two) run side by side under `lightning.Trainer` and
`nanotrain.Trainer` with the same seed and data: gradient clipping after hooks that edit the
gradients, Lightning's call forms of fit/validate/test/predict, steps without `batch_idx`,
closure-requiring optimizers, the global RNG, and the metric dictionaries."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nanotrain as nt
from tests.nested_approx import nested_approx


def _data(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, 5 * x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 3)


class Regression(pl.LightningModule):
    """Linear regression with SGD; large targets, so a clip at 0.5 binds every step."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.lin(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _trainer(kind: str, tmp_path, callbacks: list | None = None, **args: Any):
    common = dict(
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        default_root_dir=str(tmp_path / kind), callbacks=callbacks or [],
    )  # fmt: skip
    common.update(args)
    if kind == "lightning":
        return pl.Trainer(
            accelerator="cpu", devices=1, enable_model_summary=False, num_sanity_val_steps=0,
            **common,
        )  # fmt: skip
    return nt.Trainer(enable_monitors=False, **common)


def _both(
    module: pl.LightningModule,
    tmp_path,
    callbacks: Callable[[], list] | None = None,
    run: Callable[[Any, pl.LightningModule], Any] | None = None,
    **args: Any,
) -> tuple[pl.LightningModule, pl.LightningModule]:
    """Fit a copy of `module` under each Trainer (4 steps of 8 samples unless `args` say
    otherwise; `run(trainer, module)` instead of a plain fit); return both modules."""
    args.setdefault("max_steps", 4)
    modules = []
    for kind in ("lightning", "nanotrain"):
        copy_of = copy.deepcopy(module)
        pl.seed_everything(0, verbose=False)
        trainer = _trainer(kind, tmp_path, callbacks() if callbacks else None, **args)
        if run is None:
            trainer.fit(copy_of, DataLoader(_data(), batch_size=8))
        else:
            run(trainer, copy_of)
        modules.append(copy_of)
    return modules[0], modules[1]


def _same_weights(a: nn.Module, b: nn.Module, atol: float = 1e-6) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.allclose(x, y, atol=atol), (name, x, y)


# -- 1. the clip measures the gradients as the hooks left them -----------------------------------
class ScalesInBeforeStep(Regression):
    """Scales the gradients by 0.1 in `on_before_optimizer_step` (a clip at 0.5 with the
    unscaled norm would shrink the update 10 times too much)."""

    def on_before_optimizer_step(self, optimizer):
        for p in self.parameters():
            p.grad.mul_(0.1)


class ScalesInConfigureClipping(Regression):
    """Scales the gradients by 3 before calling `clip_gradients` with Lightning's arguments,
    and records the arguments it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.given: list[tuple] = []

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ):
        self.given.append((gradient_clip_val, gradient_clip_algorithm))
        for p in self.parameters():
            p.grad.mul_(3.0)
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)


class HalvesGradients(pl.Callback):
    """A callback that edits the gradients in `on_before_optimizer_step`."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        for p in pl_module.parameters():
            p.grad.mul_(0.5)


@pytest.mark.parametrize("algorithm", [None, "value"])
def test_the_clip_uses_the_gradients_a_module_hook_left_as_lightning(tmp_path, algorithm):
    reference, ours = _both(
        ScalesInBeforeStep(), tmp_path, gradient_clip_val=0.5, gradient_clip_algorithm=algorithm
    )
    _same_weights(reference, ours)


def test_the_clip_uses_the_gradients_a_callback_left_as_lightning(tmp_path):
    reference, ours = _both(
        Regression(), tmp_path, callbacks=lambda: [HalvesGradients()], gradient_clip_val=0.5
    )
    _same_weights(reference, ours)


@pytest.mark.parametrize("algorithm", [None, "norm", "value"])
def test_configure_gradient_clipping_gets_lightnings_arguments(tmp_path, algorithm):
    reference, ours = _both(
        ScalesInConfigureClipping(), tmp_path, gradient_clip_val=0.5,
        gradient_clip_algorithm=algorithm,
    )  # fmt: skip
    assert ours.given == reference.given
    assert reference.given[0] == (0.5, algorithm)  # None when not set, as Lightning passes it
    _same_weights(reference, ours)


def test_configure_gradient_clipping_without_a_clip_value_gets_none(tmp_path):
    reference, ours = _both(ScalesInConfigureClipping(), tmp_path)
    assert ours.given == reference.given == [(None, None)] * 4
    _same_weights(reference, ours)


# -- 2. Lightning's call forms -------------------------------------------------------------------
class Evaluated(Regression):
    """Regression with validation, test and predict steps that log / return their values."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.lin(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self.lin(x), y))

    def predict_step(self, batch, batch_idx):
        return self.lin(batch[0])


class Data(pl.LightningDataModule):
    """The regression data for every stage, 8 at a time."""

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=8)

    def val_dataloader(self):
        return DataLoader(_data(16), batch_size=8)

    test_dataloader = predict_dataloader = val_dataloader


def _call_forms(trainer, module) -> dict[str, Any]:
    """Lightning's call forms after a fit given positionally: the stages without a module
    (the fitted one, ckpt_path "best"), a datamodule in the dataloaders' place, and
    `test(model, dm, "last")` (the string is ckpt_path)."""
    trainer.fit(module, DataLoader(_data(), batch_size=8), DataLoader(_data(16), batch_size=8))
    with pytest.warns(UserWarning, match="best"):
        tested = trainer.test(datamodule=Data(), verbose=False)
    with pytest.warns(UserWarning, match="best"):
        validated = trainer.validate(datamodule=Data(), verbose=False)
    with pytest.warns(UserWarning, match="best"):
        predicted = trainer.predict(datamodule=Data())
    return {
        "test": tested,
        "validate": validated,
        "predict": torch.cat(predicted),
        "test last": trainer.test(module, Data(), "last", False),
        "validate dm": trainer.validate(module, Data(), verbose=False),
        "predict dm": torch.cat(trainer.predict(module, Data())),
    }


def test_lightnings_call_forms_give_lightnings_results(tmp_path):
    results = {}

    def run(trainer, module):
        results[type(trainer).__module__.split(".")[0]] = _call_forms(trainer, module)

    _both(Evaluated(), tmp_path, run=run, enable_checkpointing=True)
    reference, ours = results["lightning"], results["nanotrain"]
    assert ours.keys() == reference.keys()
    for key, value in reference.items():
        if isinstance(value, torch.Tensor):
            assert torch.allclose(ours[key], value, atol=1e-6), key
        else:
            assert ours[key] == nested_approx(value, abs=1e-6), key


def test_fit_with_a_datamodule_in_the_dataloaders_place_as_lightning(tmp_path):
    reference, ours = _both(
        Evaluated(), tmp_path, run=lambda trainer, module: trainer.fit(module, Data())
    )
    _same_weights(reference, ours)


def test_a_datamodule_and_dataloaders_together_are_refused_as_lightning(tmp_path):
    trainer = _trainer("nanotrain", tmp_path, max_steps=1)
    with pytest.raises(
        ValueError, match="both train_dataloaders / val_dataloaders and a datamodule"
    ):
        trainer.fit(Evaluated(), DataLoader(_data(), batch_size=8), datamodule=Data())


def test_a_stage_without_a_model_before_any_fit_is_refused(tmp_path):
    trainer = _trainer("nanotrain", tmp_path, max_steps=1)
    with pytest.raises(TypeError, match=r"Trainer.test\(\) needs a LightningModule"):
        trainer.test(datamodule=Data())


def test_weights_only_false_is_refused_with_the_reason(tmp_path):
    trainer = _trainer("nanotrain", tmp_path, max_steps=1)
    with pytest.raises(ValueError, match="never does"):
        trainer.fit(Evaluated(), Data(), weights_only=False)


class NoBatchIdx(Regression):
    """Every step written without `batch_idx`, as Lightning allows."""

    def training_step(self, batch):
        x, y = batch
        return F.mse_loss(self.lin(x), y)

    def validation_step(self, batch):
        self.log("val_loss", F.mse_loss(self.lin(batch[0]), batch[1]))

    def test_step(self, batch):
        self.log("test_loss", F.mse_loss(self.lin(batch[0]), batch[1]))

    def predict_step(self, batch):
        return self.lin(batch[0])


def test_steps_without_batch_idx_run_as_under_lightning(tmp_path):
    results = {}

    def run(trainer, module):
        trainer.fit(module, Data())
        results[type(trainer).__module__.split(".")[0]] = (
            trainer.validate(module, Data(), verbose=False),
            trainer.test(module, Data(), verbose=False),
            torch.cat(trainer.predict(module, Data())),
        )

    reference, ours = _both(NoBatchIdx(), tmp_path, run=run)
    _same_weights(reference, ours)
    (val_ref, test_ref, pred_ref), (val, test, pred) = results["lightning"], results["nanotrain"]
    assert val == nested_approx(val_ref) and test == nested_approx(test_ref)
    assert torch.allclose(pred, pred_ref, atol=1e-6)
    assert "training_step" not in vars(ours)  # the instance's own steps are back after the stage


class WithLBFGS(Regression):
    """LBFGS, whose step calls the closure several times; logs every closure's loss."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=4)


def test_an_optimizer_that_needs_a_closure_trains_as_under_lightning(tmp_path):
    reference, ours = _both(WithLBFGS(), tmp_path, max_steps=3, gradient_clip_val=None)
    assert len(ours.losses) == len(reference.losses) > 3  # the closure ran several times a step
    assert ours.losses == pytest.approx(reference.losses, rel=1e-6)
    _same_weights(reference, ours)


def test_an_optimizer_that_needs_a_closure_is_refused_where_shards_would_change_it(tmp_path):
    trainer = nt.Trainer(
        strategy=nt.MegatronStrategy(), max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match="LBFGS.step needs a closure.*strategy='single'"):
        trainer.fit(WithLBFGS(), Data())


def test_tuner_lr_find_is_refused_naming_lightnings_tuner(tmp_path):
    from lightning.pytorch.tuner import Tuner

    trainer = _trainer("nanotrain", tmp_path, max_steps=4)
    with pytest.raises(ValueError, match=r"lr_find.*lightning.pytorch.tuner.Tuner\("):
        Tuner(trainer).lr_find(Regression(), DataLoader(_data(), batch_size=8))
    with pytest.raises(AttributeError, match=r"scale_batch_size.*lightning.pytorch.tuner.Tuner"):
        Tuner(trainer).scale_batch_size(Regression(), DataLoader(_data(), batch_size=8))
    assert not hasattr(trainer, "_accelerator_connector")  # hasattr still answers


# -- 3. the global RNG and worker seeds ----------------------------------------------------------
class DrawsItsData(Regression):
    """A module whose training data is drawn from the global RNG when the Trainer asks for it
    (a data-generating `train_dataloader`), and whose steps draw noise."""

    def train_dataloader(self):
        x = torch.randn(32, 4)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.lin(x + 0.1 * torch.randn_like(x)), y)


def test_the_global_rng_is_left_as_your_code_seeded_it(tmp_path, monkeypatch):
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    runs, after = [], []
    for kind in ("lightning", "nanotrain"):
        torch.manual_seed(5)  # the user's own seeding, without seed_everything
        module = DrawsItsData()
        _trainer(kind, tmp_path, max_steps=4).fit(module)
        runs.append(module)
        after.append(torch.rand(3))
    _same_weights(*runs)
    assert torch.equal(after[0], after[1])  # the RNG stream after fit is Lightning's too
    assert "PL_GLOBAL_SEED" not in __import__("os").environ


class NoisyData(torch.utils.data.Dataset):
    """Random augmentation drawn in the DataLoader's workers (torch, NumPy and `random`)."""

    def __init__(self) -> None:
        self.data = _data()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        import random

        import numpy as np

        x, y = self.data[i]
        noise = torch.rand(4) + float(np.random.rand()) + random.random()
        return x + 0.1 * noise, y


@pytest.mark.parametrize("workers", [True, False])
def test_workers_draw_lightnings_random_augmentation(tmp_path, monkeypatch, workers):
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    monkeypatch.delenv("PL_SEED_WORKERS", raising=False)
    runs = []
    for kind in ("lightning", "nanotrain"):
        pl.seed_everything(3, workers=workers, verbose=False)
        module = Regression()
        loader = DataLoader(NoisyData(), batch_size=8, num_workers=2)
        _trainer(kind, tmp_path, max_steps=8).fit(module, loader)  # two epochs: two draws
        runs.append(module)
    _same_weights(*runs)


# -- 7. the metric dictionaries ------------------------------------------------------------------
class LogsEveryKind(Regression):
    """Logs a step-only value, a step-and-epoch value, a progress-bar value and a value for
    callbacks only."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("step_only", loss * 2)
        self.log("both", loss * 3, on_step=True, on_epoch=True)
        self.log("bar", loss * 4, prog_bar=True)
        self.log("hidden", loss * 5, logger=False)
        return loss


#: what nanotrain's Trainer adds to `logged_metrics` / `callback_metrics` (documented)
NANOTRAIN_OWN = {"train/loss", "train/grad_norm", "trainer/consumed_samples"}


class MetricDicts(pl.Callback):
    """The three metric dictionaries at every step's end, each epoch's end and fit's end."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def _record(self, trainer, when) -> None:
        def plain(d):
            return {k: round(float(v), 5) for k, v in d.items() if k not in NANOTRAIN_OWN}

        self.seen.append((when, trainer.global_step, plain(trainer.logged_metrics),
                          plain(trainer.callback_metrics), plain(trainer.progress_bar_metrics)))  # fmt: skip

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._record(trainer, "batch end")

    def on_train_epoch_end(self, trainer, pl_module):
        self._record(trainer, "epoch end")

    def on_fit_end(self, trainer, pl_module):
        self._record(trainer, "fit end")


def test_the_metric_dictionaries_are_filled_every_step_as_lightning(tmp_path):
    recorders = []

    def callbacks():
        recorders.append(MetricDicts())
        return [recorders[-1]]

    _both(LogsEveryKind(), tmp_path, callbacks=callbacks, max_steps=6, log_every_n_steps=4)
    reference, ours = recorders
    assert "both_step" in reference.seen[0][2]  # Lightning writes the *_step keys every step
    assert ours.seen == reference.seen
