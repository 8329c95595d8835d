"""Lightning habits of issue 53 (round two, continued) run side by side under
`lightning.Trainer` and `nanotrain.Trainer` with the same seed and data: a stage with
`ckpt_path="last"` and no checkpoint, a module copied or pickled in the middle of a stage
whose steps have no `batch_idx`, the logger rows, learning-rate monitor and progress bar of
manual optimization with two optimizers, a skip request during an LBFGS step."""

from __future__ import annotations

import copy
import csv
import io
import pickle
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

import nanotrain as nt
from tests.nested_approx import nested_approx
from tests.unit.test_lightning_manual import TinyGAN, data
from tests.unit.test_lightning_round2_a import (
    Data,
    Evaluated,
    NoBatchIdx,
    Regression,
    WithLBFGS,
    _both,
    _data,
    _same_weights,
    _trainer,
)

NO_LAST = r'\.{stage}\(ckpt_path="last"\) is set, but there is no last checkpoint available'


def test_a_stage_with_ckpt_path_last_and_no_checkpoint_warns_and_uses_the_weights(tmp_path):
    results = {}

    def run(trainer, module):
        found = {}
        for stage in ("validate", "test", "predict"):
            with pytest.warns(UserWarning, match=NO_LAST.format(stage=stage)):
                kwargs = {} if stage == "predict" else {"verbose": False}
                found[stage] = getattr(trainer, stage)(module, Data(), ckpt_path="last", **kwargs)
        with pytest.warns(UserWarning, match=NO_LAST.format(stage="fit")):
            trainer.fit(module, Data(), ckpt_path="last")
        results[type(trainer).__module__.split(".")[0]] = found

    _both(Evaluated(), tmp_path, run=run)  # each stage on the module's own weights
    for stage in ("validate", "test"):
        assert results["nanotrain"][stage] == nested_approx(results["lightning"][stage], abs=1e-6)
    assert torch.allclose(
        torch.cat(results["nanotrain"]["predict"]), torch.cat(results["lightning"]["predict"]),
        atol=1e-6,
    )  # fmt: skip


class CopiesItself(NoBatchIdx):
    """Steps without `batch_idx`; at each batch's end a deep copy with zeroed weights and a
    pickled round trip of the module run `training_step` on the batch (as an averaging or
    EMA callback would copy the module mid-stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.copied: list[tuple[float, float, float]] = []

    def on_train_batch_end(self, outputs, batch, batch_idx):
        clone = copy.deepcopy(self)
        with torch.no_grad():
            for p in clone.parameters():
                p.zero_()
        unpickled = pickle.loads(pickle.dumps(self))
        self.copied.append(
            (
                float(clone.training_step(batch)),
                float(unpickled.training_step(batch)),
                float(self.training_step(batch)),
            )
        )


def test_a_module_copied_or_pickled_mid_stage_runs_its_own_steps_as_under_lightning(tmp_path):
    reference, ours = _both(CopiesItself(), tmp_path)
    assert len(ours.copied) == len(reference.copied) == 4
    assert ours.copied == nested_approx(reference.copied, abs=1e-6)
    _, y = Data().train_dataloader().dataset.tensors
    assert ours.copied[0][0] == pytest.approx(float(F.mse_loss(torch.zeros_like(y[:8]), y[:8])))
    assert "training_step" not in vars(ours)


def _gan_rows(kind: str, tmp_path, stream: io.StringIO) -> list[dict[str, str]]:
    """Fit TinyGAN (two optimizers, 4 batches an epoch) for 2 epochs with a CSVLogger and
    each Trainer's LearningRateMonitor, logging every 2 batches; return the CSV rows."""
    torch.manual_seed(0)
    logger = CSVLogger(str(tmp_path / kind), name="csv", version=0)
    common = dict(
        logger=logger, enable_checkpointing=False, max_epochs=2, log_every_n_steps=2,
        default_root_dir=str(tmp_path / kind),
    )  # fmt: skip
    if kind == "lightning":
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, enable_model_summary=False, num_sanity_val_steps=0,
            enable_progress_bar=False, callbacks=[pl.callbacks.LearningRateMonitor()], **common,
        )  # fmt: skip
    else:
        callbacks = [nt.callbacks.LearningRateMonitor(), nt.callbacks.ProgressBar("plain", stream)]
        trainer = nt.Trainer(enable_monitors=False, callbacks=callbacks, **common)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(TinyGAN(), DataLoader(data(), batch_size=8))
    assert trainer.global_step == 16  # two optimizer steps a batch, as Lightning counts them
    with open(logger.log_dir + "/metrics.csv") as f:
        return list(csv.DictReader(f))


def _series(rows: list[dict[str, str]], key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]


def test_two_optimizers_in_manual_mode_log_and_show_progress_as_lightning(tmp_path):
    stream = io.StringIO()
    reference = _gan_rows("lightning", tmp_path, io.StringIO())
    ours = _gan_rows("nanotrain", tmp_path, stream)
    # Lightning's rows count batches in manual optimization, every 2 batches
    assert _series(ours, "g_loss") == nested_approx(_series(reference, "g_loss"), abs=1e-6)
    for ours_key, lightning_key in (("lr/Adam/group0", "lr-Adam"), ("lr/SGD/group0", "lr-SGD")):
        assert _series(ours, ours_key) == nested_approx(_series(reference, lightning_key))
    # manual schedulers step by epoch: Lightning logs their rates at each epoch's start
    assert [int(r["step"]) for r in reference if r.get("lr-Adam")] == [0, 4]
    lines = stream.getvalue().splitlines()
    steps = [line.split(" | ")[0] for line in lines if line.startswith("step ")]
    assert steps[-1].startswith("step 16/16") and len(steps) == 4  # every 2 batches, no overshoot


class LBFGSSkipsBatch1(WithLBFGS):
    """LBFGS whose update of batch 1 is left out, the Lightning way: `optimizer_step` runs
    the closure (forward and backward) but not the optimizer's step."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        if batch_idx == 1:
            optimizer_closure()
        else:
            optimizer.step(closure=optimizer_closure)


class SkipBatch1(nt.Callback):
    """Asks nanotrain to skip the update of batch 1 (as the NaN guard does for a bad step)."""

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if trainer.state.steps_in_epoch == 1:
            trainer.request_skip_step()


def test_a_skip_request_leaves_an_lbfgs_step_out_as_lightnings_skipped_step(tmp_path):
    runs = []
    for kind, module_class, callbacks in (
        ("lightning", LBFGSSkipsBatch1, []),
        ("nanotrain", WithLBFGS, [SkipBatch1()]),
    ):
        torch.manual_seed(0)
        module = module_class()
        trainer = _trainer(kind, tmp_path, callbacks=callbacks, max_epochs=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, DataLoader(_data(), batch_size=8))
        runs.append(module)
    reference, ours = runs
    assert len(ours.losses) == len(reference.losses)  # batch 1: one forward, no line search
    assert ours.losses == pytest.approx(reference.losses, rel=1e-6)
    _same_weights(reference, ours)


class WithStepLR(Regression):
    """Regression with an epoch scheduler, which SWA swaps for its SWALR."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.5)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


def test_stochastic_weight_averaging_runs_as_under_lightning(tmp_path):
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    rates = {}

    class RecordRates(pl.Callback):
        def on_train_epoch_end(self, trainer, module):
            rates.setdefault(type(trainer).__module__.split(".")[0], []).append(
                trainer.optimizers[0].param_groups[0]["lr"]
            )

    def callbacks():
        swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2, annealing_epochs=2)
        return [swa, RecordRates()]

    reference, ours = _both(WithStepLR(), tmp_path, callbacks=callbacks, max_epochs=5, max_steps=-1)
    _same_weights(reference, ours)  # the average of epochs 2..4 copied into the module
    assert rates["nanotrain"] == pytest.approx(rates["lightning"])
    # StepLR halves the rate in epoch 0; from epoch 1 (swa_epoch_start - 1) SWALR anneals it
    # to swa_lrs over 2 epochs (StepLR would give 0.0125 after epoch 1)
    assert rates["lightning"] == pytest.approx([0.025, 0.0175, 0.01, 0.01, 0.01])


def test_stochastic_weight_averaging_is_refused_with_batchnorm(tmp_path):
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    class WithNorm(Regression):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.BatchNorm1d(4)

    trainer = _trainer(
        "nanotrain", tmp_path, callbacks=[StochasticWeightAveraging(swa_lrs=0.01)], max_epochs=2
    )
    with pytest.raises(ValueError, match="BatchNorm.*torch.optim.swa_utils.update_bn"):
        trainer.fit(WithNorm(), DataLoader(_data(), batch_size=8))


def test_a_manual_gan_checkpoint_resumes_across_the_two_trainers(tmp_path):
    """A Lightning .ckpt of a GAN after one epoch (8 optimizer steps, 4 batches), written by
    either Trainer and resumed by the other, ends where lightning.Trainer's two epochs do."""

    def lightning_trainer(**args):
        return pl.Trainer(
            accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            default_root_dir=str(tmp_path), **args,
        )  # fmt: skip

    def nanotrain_trainer(**args):
        return nt.Trainer(
            logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_monitors=False, default_root_dir=str(tmp_path / "nt"), **args,
        )  # fmt: skip

    def loader():
        return DataLoader(data(), batch_size=8)

    torch.manual_seed(0)
    start = TinyGAN()
    whole = copy.deepcopy(start)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lightning_trainer(max_epochs=2).fit(whole, loader())
        for writer, reader, name in (
            (nanotrain_trainer, lightning_trainer, "nt.ckpt"),
            (lightning_trainer, nanotrain_trainer, "pl.ckpt"),
        ):
            first = writer(max_epochs=1)
            first.fit(copy.deepcopy(start), loader())
            first.save_checkpoint(str(tmp_path / name))
            resumed, second = copy.deepcopy(start), reader(max_epochs=2)
            second.fit(resumed, loader(), ckpt_path=str(tmp_path / name))
            assert second.global_step == 16, name
            _same_weights(whole, resumed)
