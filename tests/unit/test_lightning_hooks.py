"""Lightning's optimization hooks run under `nanotrain.Trainer` with Lightning's arguments and
cadence, and a module that uses them ends with `lightning.Trainer`'s weights: freezing a
layer by zeroing its gradients in `on_after_backward`, an LR warm-up in `optimizer_step`, a
custom `configure_gradient_clipping`, `lr_scheduler_step`, `optimizer_zero_grad`."""

from __future__ import annotations

import copy
import warnings
from collections import Counter

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nanotrain as nt
from nanotrain.testing import blobs

HOOKS = (
    "on_before_backward",
    "on_after_backward",
    "on_before_zero_grad",
    "optimizer_zero_grad",
    "on_before_optimizer_step",
    "configure_gradient_clipping",
    "optimizer_step",
    "lr_scheduler_step",
)


def data(n: int = 48, batch_size: int = 8) -> DataLoader:
    x, y = blobs(n)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


class HookedClassifier(pl.LightningModule):
    """Uses every optimization hook the way Lightning's docs do."""

    def __init__(self, lr: float = 0.2, warmup: int = 3) -> None:
        super().__init__()
        self.lr, self.warmup = lr, warmup
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        self.calls: Counter[str] = Counter()
        self.losses_before_backward: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def on_before_backward(self, loss):
        self.calls["on_before_backward"] += 1
        self.losses_before_backward.append(float(loss))

    def on_after_backward(self):
        self.calls["on_after_backward"] += 1
        for p in self.net[0].parameters():  # "freeze" the first layer
            p.grad.zero_()

    def on_before_zero_grad(self, optimizer):
        self.calls["on_before_zero_grad"] += 1

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        self.calls["optimizer_zero_grad"] += 1
        optimizer.zero_grad()

    def on_before_optimizer_step(self, optimizer):
        self.calls["on_before_optimizer_step"] += 1

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ):
        self.calls["configure_gradient_clipping"] += 1
        self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="value")

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        self.calls["optimizer_step"] += 1
        # Lightning's documented LR warm-up
        if self.trainer.global_step < self.warmup:
            scale = (self.trainer.global_step + 1) / self.warmup
            for group in optimizer.param_groups:
                group["lr"] = scale * self.lr
        optimizer.step(closure=optimizer_closure)

    def lr_scheduler_step(self, scheduler, metric):
        self.calls["lr_scheduler_step"] += 1
        scheduler.step()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def fit_both(accumulate: int = 1) -> tuple[HookedClassifier, HookedClassifier]:
    torch.manual_seed(0)
    original = HookedClassifier()
    lit_module, nt_module = copy.deepcopy(original), copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(
            max_epochs=1,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            accumulate_grad_batches=accumulate,
        ).fit(lit_module, data())
    nt.Trainer(
        strategy=nt.SingleDeviceStrategy("cpu"),
        max_epochs=1,
        micro_batch_size=8,
        global_batch_size=8 * accumulate,
        shuffle=False,
        loggers=[],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_monitors=False,
    ).fit(nt_module, train_dataloaders=data())
    return lit_module, nt_module


@pytest.mark.parametrize("accumulate", [1, 2])
def test_optimization_hooks_are_called_as_lightning_calls_them(accumulate):
    lit_module, nt_module = fit_both(accumulate)
    steps = 6 // accumulate  # 6 batches of 8
    # per batch (microbatch): backward hooks; per optimizer step: the others
    assert lit_module.calls["on_before_backward"] == nt_module.calls["on_before_backward"]
    assert nt_module.calls["on_after_backward"] == steps * accumulate
    for hook in HOOKS[2:]:
        assert nt_module.calls[hook] == lit_module.calls[hook] == steps, hook
    assert nt_module.losses_before_backward == pytest.approx(
        lit_module.losses_before_backward, rel=1e-5
    )


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_module_using_the_hooks_ends_with_lightnings_weights(accumulate):
    lit_module, nt_module = fit_both(accumulate)
    torch.manual_seed(0)
    untouched = HookedClassifier()
    for (name, ours), theirs in zip(
        nt_module.state_dict().items(), lit_module.state_dict().values(), strict=True
    ):
        assert torch.allclose(ours, theirs, atol=1e-6), name
    # the layer "frozen" in on_after_backward did not train
    assert torch.equal(nt_module.net[0].weight, untouched.net[0].weight)
    assert not torch.equal(nt_module.net[2].weight, untouched.net[2].weight)


def test_backward_hooks_where_a_layout_cannot_run_them_are_refused_before_any_update():
    class Frozen(HookedClassifier):
        def optimizer_step(self, *args, **kwargs):
            raise AssertionError("no update may run")

    trainer = nt.Trainer(
        strategy=nt.MegatronStrategy(zero_stage=2),
        max_steps=1,
        micro_batch_size=8,
        shuffle=False,
        loggers=[],
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    with pytest.raises(ValueError, match="on_before_backward / on_after_backward cannot run"):
        trainer.fit(Frozen(), train_dataloaders=data())


def test_clip_gradients_contradicting_the_trainer_is_refused_as_in_lightning():
    class Contradicts(HookedClassifier):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, algorithm=None):
            self.clip_gradients(optimizer, gradient_clip_val=0.3)

    trainer = nt.Trainer(
        max_steps=1, micro_batch_size=8, gradient_clip_val=1.0, loggers=[],
        enable_checkpointing=False, enable_progress_bar=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"gradient_clip_val=1.0\) and clip_gradients"):
        trainer.fit(Contradicts(), train_dataloaders=data())


class _Steps(nt.Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        self.steps += 1


def _refused(module, callbacks=(), match=""):
    steps = _Steps()
    trainer = nt.Trainer(
        max_steps=2, micro_batch_size=8, loggers=[], enable_checkpointing=False,
        enable_progress_bar=False, callbacks=[*callbacks, steps],
    )  # fmt: skip
    with pytest.raises(ValueError, match=match):
        trainer.fit(module, train_dataloaders=data())
    return steps.steps


@pytest.mark.parametrize(
    "hook, match",
    [
        ("transfer_batch_to_device", "the strategy moves each batch to its device"),
        ("backward", "nanotrain runs backward itself"),
        ("on_validation_model_eval", "switches the model between train and eval mode"),
        ("configure_callbacks", r"pass the callbacks to Trainer\(callbacks=\[...\]\)"),
    ],
)
def test_a_lightning_hook_the_trainer_would_not_call_is_refused_at_fit_start(hook, match):
    module = type("Overrides", (HookedClassifier,), {hook: lambda self, *a, **k: None})()
    assert _refused(module, match=f"Overrides.{hook} is a Lightning hook .*{match}") == 0


def test_a_sanity_check_hook_of_a_callback_is_refused():
    class Sanity(nt.Callback):
        def on_sanity_check_start(self, trainer, module):
            pass

    steps = _refused(HookedClassifier(), [Sanity()], "Sanity.on_sanity_check_start .* no sanity")
    assert steps == 0


def test_returning_minus_one_from_on_train_batch_start_is_refused():
    class SkipsEpoch(HookedClassifier):
        def on_train_batch_start(self, batch, batch_idx):
            return -1

    assert _refused(SkipsEpoch(), match="returned -1.*should_stop = True") == 0
