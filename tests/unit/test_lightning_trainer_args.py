"""Lightning's Trainer arguments and attributes on nanotrain.Trainer: accepted ones mean what
they mean in Lightning (read side by side from a lightning.Trainer), refused ones say why."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

import nanotrain as nt
from nanotrain.testing import BlobsData, Classifier

ARGS = dict(
    max_epochs=2, accelerator="cpu", devices=1, num_sanity_val_steps=0, gradient_clip_val=0.5,
    gradient_clip_algorithm="value", val_check_interval=None, check_val_every_n_epoch=1,
    log_every_n_steps=2, enable_progress_bar=False, enable_model_summary=False, logger=False,
)  # fmt: skip


class Recorder(pl.Callback):
    """Reads the Trainer attributes Lightning code reads, once in training and at the end."""

    def __init__(self) -> None:
        self.seen: dict = {}
        self.last_batch_flags: list[bool] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.last_batch_flags.append(trainer.is_last_batch)
        if self.seen:
            return
        self.seen = {
            "optimizers": [type(o).__name__ for o in trainer.optimizers],
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "schedulers": [
                (type(c.scheduler).__name__, c.interval, c.frequency)
                for c in trainer.lr_scheduler_configs
            ],
            "precision": trainer.precision,
            "model_is_module": trainer.model is module,
            "node_rank": trainer.node_rank,
            "local_rank": trainer.local_rank,
            "num_nodes": trainer.num_nodes,
            "num_devices": trainer.num_devices,
            "gradient_clip_val": trainer.gradient_clip_val,
            "gradient_clip_algorithm": str(trainer.gradient_clip_algorithm),
            "check_val_every_n_epoch": trainer.check_val_every_n_epoch,
            "log_every_n_steps": trainer.log_every_n_steps,
            "num_sanity_val_steps": trainer.num_sanity_val_steps,
            "evaluating": trainer.evaluating,
            "ckpt_path": trainer.ckpt_path,
            "accelerator": type(trainer.accelerator).__name__,
            "scaler": trainer.scaler,
            "sampler_kwargs": trainer.distributed_sampler_kwargs,
            "min_epochs": trainer.min_epochs,
            "min_steps": trainer.min_steps,
            "val_samples": len(trainer.val_dataloaders.dataset),
            "test_loaders": trainer.test_dataloaders,
            "sanity": trainer.num_sanity_val_batches,
        }


class FixedData(BoringModel):
    """BoringModel whose data is drawn at construction: nanotrain seeds each stage (Lightning
    does not), so data drawn inside `train_dataloader` would differ between the two."""

    def __init__(self) -> None:
        super().__init__()
        self.data = torch.randn(64, 32)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data)


class Scheduled(BoringModel):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _attributes(trainer_class, tmp_path, callbacks):
    rec = Recorder()
    trainer = trainer_class(default_root_dir=str(tmp_path), callbacks=[rec, *callbacks], **ARGS)
    torch.manual_seed(0)
    trainer.fit(Scheduled())
    return rec, trainer


def test_attributes_have_lightnings_values(tmp_path):
    lightning_rec, lt = _attributes(pl.Trainer, tmp_path / "pl", [])
    ours_rec, ours = _attributes(nt.Trainer, tmp_path / "nt", [])
    assert ours_rec.seen == lightning_rec.seen
    # BoringModel: 64 samples, batch 2 → the last of 32 batches of each epoch
    assert ours_rec.last_batch_flags == lightning_rec.last_batch_flags
    assert sum(ours_rec.last_batch_flags) == 2
    assert ours.default_root_dir == str(tmp_path / "nt")
    assert ours.interrupted is False and ours.received_sigterm is False
    assert set(ours.logged_metrics) and set(lt.logged_metrics) <= {"train_loss"} | set(
        ours.logged_metrics
    )


def test_callback_attributes(tmp_path):
    saver = nt.callbacks.ModelCheckpoint(monitor="val_loss")
    stopper = nt.callbacks.EarlyStopping(monitor="val_loss", patience=5)
    trainer = nt.Trainer(
        max_steps=4, default_root_dir=str(tmp_path), callbacks=[saver, stopper], loggers=[]
    )
    assert trainer.checkpoint_callback is saver and trainer.checkpoint_callbacks == [saver]
    assert trainer.early_stopping_callback is stopper
    assert trainer.early_stopping_callbacks == [stopper]
    assert isinstance(trainer.progress_bar_callback, nt.callbacks.ProgressBar)
    bare = nt.Trainer(max_steps=1, enable_checkpointing=False, enable_progress_bar=False)
    assert bare.checkpoint_callback is None and bare.progress_bar_callback is None


def test_resumed_run_names_its_checkpoint_and_interrupted_after_an_exception(tmp_path):
    def trainer(**kw):
        return nt.Trainer(
            default_root_dir=str(tmp_path), loggers=[], enable_progress_bar=False, **kw
        )

    first = trainer(max_steps=2)
    first.fit(Classifier(), BlobsData())
    assert first.ckpt_path is None
    again = trainer(max_steps=3)
    again.fit(Classifier(), BlobsData(), ckpt_path="last")
    assert again.ckpt_path.endswith("step-00000002")

    class Broken(Classifier):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("boom")

    broken = trainer(max_steps=1, enable_checkpointing=False)
    with pytest.raises(RuntimeError, match="boom"):
        broken.fit(Broken(), BlobsData())
    assert broken.interrupted is True


def test_clip_by_value_equals_lightning(tmp_path):
    """gradient_clip_algorithm="value" clamps like Lightning's: the same weights after 2 epochs."""
    weights = []
    for trainer_class in (pl.Trainer, nt.Trainer):
        torch.manual_seed(0)
        module = FixedData()
        trainer_class(default_root_dir=str(tmp_path), **ARGS).fit(module)
        weights.append(module.layer.weight.detach().clone())
    torch.testing.assert_close(weights[1], weights[0], rtol=0, atol=1e-6)


def test_launch_arguments_must_describe_the_launch(monkeypatch):
    with pytest.raises(
        ValueError, match="devices=2 but this job runs 1 process.*--nproc-per-node 2"
    ):
        nt.Trainer(max_steps=1, devices=2)
    with pytest.raises(ValueError, match=r"devices=\[0, 1\]: nanotrain does not pick devices"):
        nt.Trainer(max_steps=1, devices=[0, 1])
    with pytest.raises(ValueError, match="num_nodes=2 but this job runs on 1 node"):
        nt.Trainer(max_steps=1, num_nodes=2)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("GROUP_RANK", "1")
    nt.Trainer(max_steps=1, devices=4, num_nodes=2, strategy=nt.SingleDeviceStrategy("cpu"))
    trainer = nt.Trainer(max_steps=1, devices="4", strategy=nt.SingleDeviceStrategy("cpu"))
    assert (trainer.num_devices, trainer.num_nodes, trainer.node_rank) == (4, 2, 1)
    assert trainer.device_ids == [0, 1, 2, 3]


def test_accelerator_picks_the_device_of_a_named_strategy_and_must_agree_with_an_object(tmp_path):
    assert nt.Trainer(max_steps=1, accelerator="cpu").strategy.root_device.type == "cpu"
    trainer = nt.Trainer(max_steps=1, accelerator="gpu", strategy=nt.SingleDeviceStrategy("cpu"),
                         default_root_dir=str(tmp_path))  # fmt: skip
    with pytest.raises(
        ValueError, match="accelerator='gpu' but SingleDeviceStrategy trains on cpu"
    ):
        trainer.fit(Classifier(), BlobsData())


def test_model_summary_is_printed_when_asked(tmp_path, capsys):
    trainer = nt.Trainer(max_steps=1, enable_model_summary=True, default_root_dir=str(tmp_path),
                         loggers=[], enable_progress_bar=False, enable_checkpointing=False)  # fmt: skip
    trainer.fit(Classifier(), BlobsData())
    out = capsys.readouterr().out
    assert "Trainable params" in out and "Total params" in out


def test_validate_without_validation_step_is_refused_as_in_lightning(tmp_path):
    with pytest.raises(Exception, match="validation_step"):
        pl.Trainer(default_root_dir=str(tmp_path), logger=False).validate(
            _NoValidation(), dataloaders=BoringModel().val_dataloader()
        )
    with pytest.raises(ValueError, match="Trainer.validate needs _NoValidation.validation_step"):
        nt.Trainer(max_steps=1, default_root_dir=str(tmp_path)).validate(
            _NoValidation(), dataloaders=BoringModel().val_dataloader()
        )


class _NoValidation(BoringModel):
    validation_step = pl.LightningModule.validation_step


def test_the_modules_prepare_data_runs_as_in_lightning(tmp_path):
    """Lightning calls the module's prepare_data (after the datamodule's) before setup."""
    calls = []

    class Preparing(FixedData):
        def prepare_data(self):
            calls.append("prepare_data")

        def setup(self, stage):
            calls.append(("setup", stage == "fit"))

    for trainer_class in (pl.Trainer, nt.Trainer):
        trainer_class(default_root_dir=str(tmp_path), **{**ARGS, "max_epochs": 1}).fit(Preparing())
    assert calls == ["prepare_data", ("setup", True)] * 2


@pytest.mark.parametrize(("every", "per_epochs"), [(3, 1), (3, None), (None, 1), (4, 2)], ids=str)
def test_validation_runs_at_lightnings_steps(tmp_path, every, per_epochs):
    """An int val_check_interval counts within each selected epoch, or over the whole run
    without check_val_every_n_epoch, and replaces the epoch-end validation, as Lightning."""

    class Short(FixedData):
        def __init__(self) -> None:
            super().__init__()
            self.data = self.data[:8]  # 8 steps per epoch
            self.validated_at: list[int] = []

        def on_validation_start(self):
            self.validated_at.append(self.trainer.global_step)

    runs = []
    for trainer_class in (pl.Trainer, nt.Trainer):
        module = Short()
        args = {**ARGS, "max_epochs": 3, "val_check_interval": every,
                "check_val_every_n_epoch": per_epochs}  # fmt: skip
        if every is None:
            args.pop("val_check_interval")
        trainer_class(default_root_dir=str(tmp_path), **args).fit(module)
        runs.append(module.validated_at)
    lightning, ours = runs
    # nanotrain validates once more at the end of fit unless the last step just validated
    assert ours[: len(lightning)] == lightning
    assert ours[len(lightning) :] in ([], [24])


def test_clip_gradients_that_contradict_the_trainer_are_refused(tmp_path):
    """As Lightning: clip_gradients given a value or algorithm other than the Trainer's is an
    error, not a silent choice of one of them."""

    class Clipping(FixedData):
        clip = {}

        def configure_gradient_clipping(
            self, optimizer, gradient_clip_val, gradient_clip_algorithm
        ):
            self.clip_gradients(optimizer, **self.clip)

    for clip, match in (
        ({"gradient_clip_val": 0.1}, r"Trainer\(gradient_clip_val=0.5\) and clip_gradients"),
        ({"gradient_clip_algorithm": "norm"}, r"gradient_clip_algorithm='value'.*disagree"),
    ):
        module = Clipping()
        module.clip = clip
        for trainer_class in (pl.Trainer, nt.Trainer):  # Lightning refuses both too
            with pytest.raises(Exception, match="gradient_clip") as info:
                trainer_class(default_root_dir=str(tmp_path), **ARGS).fit(module)
            if trainer_class is nt.Trainer:
                assert info.type is ValueError and info.match(match)
