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
        default_root_dir=str(tmp_path / kind), callbacks=callbacks or [], **args,
    )  # fmt: skip
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
