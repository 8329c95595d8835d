"""Lightning habits around the optimizer step (scheduler cadence, what the hooks read, Trainer
arguments given as Lightning takes them) give lightning.Trainer's result under
nanotrain.Trainer: the same module and data run under both, and their weights and records
are compared."""

from __future__ import annotations

import copy
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nanotrain as nt
from tests.nested_approx import nested_approx


def _data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(123)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]))


class Regression(pl.LightningModule):
    """Linear regression with SGD and an optional LR scheduler config."""

    def __init__(self, scheduler: dict | None = None) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.scheduler = scheduler
        self.seen_in_scheduler_step: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.lin(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05)
        if self.scheduler is None:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, **self.scheduler}}

    def lr_scheduler_step(self, scheduler, metric):
        self.seen_in_scheduler_step.append(self.global_step)
        scheduler.step()


def _both(module: pl.LightningModule, tmp_path, val: bool = False, **trainer_args):
    """Fit a copy of `module` under each Trainer with the same arguments (and, with `val`, a
    validation set of 16 samples); return both."""
    runs = []
    for kind in ("lightning", "nanotrain"):
        copy_of = copy.deepcopy(module)
        pl.seed_everything(0, verbose=False)
        common = dict(
            logger=False, enable_checkpointing=False, enable_progress_bar=False,
            default_root_dir=str(tmp_path / kind), **trainer_args,
        )  # fmt: skip
        if kind == "lightning":
            trainer = pl.Trainer(
                accelerator="cpu", devices=1, enable_model_summary=False,
                num_sanity_val_steps=0, **common,
            )  # fmt: skip
        else:
            trainer = nt.Trainer(enable_monitors=False, **common)
        validation = DataLoader(_data(16), batch_size=8) if val else None
        trainer.fit(copy_of, DataLoader(_data(), batch_size=8), validation)
        runs.append(copy_of)
    return runs


def _fit_nanotrain(module: pl.LightningModule, tmp_path, **trainer_args) -> nt.Trainer:
    """Fit `module` for 2 steps (unless told otherwise) under nanotrain.Trainer alone."""
    trainer = nt.Trainer(
        **{"max_steps": 2, **trainer_args}, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(module, DataLoader(_data(), batch_size=8))
    return trainer


def _trainer(kind: str, tmp_path, **args):
    """A lightning.Trainer or a nanotrain.Trainer (no checkpointing or progress bar unless
    asked), writing under `tmp_path / kind`."""
    common = {
        "enable_checkpointing": False, "enable_progress_bar": False,
        "default_root_dir": str(tmp_path / kind), **args,
    }  # fmt: skip
    if kind == "lightning":
        return pl.Trainer(accelerator="cpu", devices=1, **common)
    return nt.Trainer(**common)


def _same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "scheduler,trainer_args",
    [
        ({"interval": "epoch", "frequency": 2}, {"max_epochs": 3}),
        ({"interval": "step", "frequency": 3}, {"max_epochs": 2}),  # counts batches per epoch
        ({"interval": "step", "frequency": 3}, {"max_epochs": 2, "accumulate_grad_batches": 2}),
    ],
)
def test_a_scheduler_steps_at_lightnings_frequency(tmp_path, scheduler, trainer_args):
    lightning_run, nanotrain_run = _both(Regression(scheduler), tmp_path, **trainer_args)
    assert nanotrain_run.seen_in_scheduler_step == lightning_run.seen_in_scheduler_step
    _same_weights(lightning_run, nanotrain_run)


def test_lr_scheduler_step_reads_the_step_count_that_includes_its_update(tmp_path):
    lightning_run, nanotrain_run = _both(Regression({"interval": "step"}), tmp_path, max_steps=4)
    assert lightning_run.seen_in_scheduler_step == [1, 2, 3, 4]
    assert nanotrain_run.seen_in_scheduler_step == [1, 2, 3, 4]


def _torch_determinism() -> tuple[bool, bool]:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )


@pytest.mark.parametrize("mode", [None, True, "warn", False])
def test_deterministic_sets_torch_as_lightning_does(tmp_path, mode):
    before = _torch_determinism()
    seen = {}
    try:
        for kind in ("lightning", "nanotrain"):
            torch.use_deterministic_algorithms(True)  # a user's own setting, before the Trainer
            if kind == "lightning":
                pl.Trainer(accelerator="cpu", devices=1, deterministic=mode, logger=False)
            else:
                _fit_nanotrain(Regression(), tmp_path, deterministic=mode, max_steps=1)
            seen[kind] = _torch_determinism()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    assert seen["nanotrain"] == seen["lightning"]


def test_an_unknown_deterministic_mode_is_refused():
    with pytest.raises(ValueError, match="deterministic must be True, False, 'warn' or None"):
        nt.Trainer(deterministic="always", max_steps=1)


def test_the_logging_cadence_defaults_to_lightnings():
    lightning_default = pl.Trainer(logger=False, enable_progress_bar=False).log_every_n_steps
    assert nt.Trainer(max_steps=1).log_every_n_steps == lightning_default


class ListOfOneDict(Regression):
    """`configure_optimizers` returning Lightning's list of one config dict."""

    def configure_optimizers(self):
        return [super().configure_optimizers()]


def test_a_list_of_one_optimizer_dict_trains_as_under_lightning(tmp_path):
    lightning_run, nanotrain_run = _both(
        ListOfOneDict({"interval": "step", "frequency": 2}), tmp_path, max_epochs=1
    )
    assert nanotrain_run.seen_in_scheduler_step == lightning_run.seen_in_scheduler_step != []
    _same_weights(lightning_run, nanotrain_run)


def test_a_list_holding_something_else_names_it():
    from nanotrain.strategies.optimizers import parse_optimizer_config

    with pytest.raises(ValueError, match="its list held a str"):
        parse_optimizer_config(["adam"])


class SeesDtypes(Regression):
    """Records the dtypes of the batch `training_step` gets (a float input, an int tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[tuple[torch.dtype, torch.dtype]] = []

    def training_step(self, batch, batch_idx):
        x, y, ids = batch
        self.dtypes.append((x.dtype, ids.dtype))
        return F.mse_loss(self.lin(x).float(), y.float())


def test_bf16_true_casts_the_floating_inputs_as_lightning_does(tmp_path):
    seen = {}
    for kind in ("lightning", "nanotrain"):
        module, x = SeesDtypes(), torch.randn(16, 4)
        data = DataLoader(TensorDataset(x, x.sum(-1, keepdim=True), torch.arange(16)), batch_size=8)
        common = dict(
            precision="bf16-true", max_steps=2, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, default_root_dir=str(tmp_path / kind),
        )  # fmt: skip
        if kind == "lightning":
            pl.Trainer(accelerator="cpu", devices=1, **common).fit(module, data)
        else:
            nt.Trainer(**common).fit(module, data)
        seen[kind] = module.dtypes
    assert seen["nanotrain"] == seen["lightning"] == [(torch.bfloat16, torch.int64)] * 2


def test_fp16_mixed_on_the_cpu_says_lightning_would_switch_to_bf16(tmp_path):
    with pytest.warns(UserWarning, match="lightning.Trainer would switch to 'bf16-mixed'"):
        _fit_nanotrain(Regression(), tmp_path, precision="16-mixed", max_steps=1)


class EpochEnds(Regression):
    """Records each `on_train_epoch_end` (epoch, step) and the epoch-mean loss it sees;
    sets `should_stop` at `stop_at` steps."""

    def __init__(self, stop_at: int | None = None) -> None:
        super().__init__()
        self.stop_at, self.ends = stop_at, []

    def training_step(self, batch, batch_idx):
        if self.global_step == self.stop_at:
            self.trainer.should_stop = True
        x, y = batch
        loss = F.mse_loss(self.lin(x), y)
        self.log("epoch_loss", loss, on_step=False, on_epoch=True)
        return loss

    def on_train_epoch_end(self):
        mean = float(self.trainer.callback_metrics["epoch_loss"])
        self.ends.append((self.current_epoch, self.global_step, round(mean, 6)))

    def on_train_end(self):
        self.ends.append(("end", self.current_epoch))  # the cut epoch counts as done


@pytest.mark.parametrize("stop_at,trainer_args", [(None, {"max_steps": 3}), (2, {"max_epochs": 3})])
def test_an_epoch_stopped_midway_still_ends_as_under_lightning(tmp_path, stop_at, trainer_args):
    lightning_run, nanotrain_run = _both(EpochEnds(stop_at), tmp_path, **trainer_args)
    assert len(lightning_run.ends) == 2
    assert nanotrain_run.ends == lightning_run.ends
    _same_weights(lightning_run, nanotrain_run)


class HookCounts(Regression):
    """Counts `on_before_optimizer_step` and `configure_gradient_clipping` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = {"before": 0, "clip": 0}

    def on_before_optimizer_step(self, optimizer):
        self.counts["before"] += 1

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ):
        self.counts["clip"] += 1
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)


class UpdatesEveryOtherStep(HookCounts):
    """Runs the closure on every batch but steps the optimizer on even ones only."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        if batch_idx % 2 == 0:
            optimizer.step(closure=optimizer_closure)
        else:
            optimizer_closure()


def test_an_optimizer_step_that_skips_updates_trains_as_under_lightning(tmp_path):
    lightning_run, nanotrain_run = _both(UpdatesEveryOtherStep(), tmp_path, max_epochs=1)
    # on_before_optimizer_step and clipping run inside optimizer.step(closure), as Lightning's
    assert nanotrain_run.counts == lightning_run.counts == {"before": 4, "clip": 4}
    _same_weights(lightning_run, nanotrain_run)


class NeverRunsTheClosure(Regression):
    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        pass


def test_an_optimizer_step_that_never_runs_the_closure_is_refused_as_lightning(tmp_path):
    with pytest.raises(RuntimeError, match="did not call the optimizer closure"):
        _fit_nanotrain(NeverRunsTheClosure(), tmp_path)


class Validated(Regression):
    """Records the step of every validation run."""

    def __init__(self) -> None:
        super().__init__()
        self.validated_at: list[int] = []

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.lin(x), y))

    def on_validation_end(self):
        self.validated_at.append(self.global_step)


@pytest.mark.parametrize("fraction", [0.5, 0.3, 1.0])
def test_a_float_val_check_interval_is_a_fraction_of_the_epoch_as_in_lightning(tmp_path, fraction):
    lightning_run, nanotrain_run = _both(
        Validated(), tmp_path, val=True, max_epochs=2, val_check_interval=fraction
    )
    # nanotrain validates once more at the end of fit when the last step was not validated
    assert nanotrain_run.validated_at[: len(lightning_run.validated_at)] == (
        lightning_run.validated_at
    )
    assert set(nanotrain_run.validated_at[len(lightning_run.validated_at) :]) <= {16}
    _same_weights(lightning_run, nanotrain_run)


def test_lightnings_spellings_of_no_limit_and_no_clipping_are_taken(tmp_path):
    lightning_run, nanotrain_run = _both(
        Regression(), tmp_path, max_epochs=-1, max_steps=5, gradient_clip_val=0
    )
    _same_weights(lightning_run, nanotrain_run)


@pytest.mark.parametrize(
    "args,message",
    [
        ({"val_check_interval": 1.5}, "a float is a fraction of the training epoch"),
        ({"val_check_interval": 0.5, "check_val_every_n_epoch": None}, "needs check_val"),
    ],
)
def test_a_fraction_val_check_interval_out_of_lightnings_range_is_refused(args, message):
    with pytest.raises(ValueError, match=message):
        nt.Trainer(max_steps=1, **args)


class ReturnsNone(Regression):
    def training_step(self, batch, batch_idx):
        return None


def test_a_training_step_returning_none_is_refused_with_the_reason(tmp_path):
    with pytest.raises(TypeError, match="returned None: Lightning skips such a batch"):
        _fit_nanotrain(ReturnsNone(), tmp_path)


def _lr_rows(path) -> list[tuple[int, float]]:
    """(step, lr) of every row of a CSVLogger's metrics.csv that has a learning rate."""
    import csv

    with open(path) as f:
        rows = list(csv.DictReader(f))
    key = next(k for k in rows[0] if k.startswith("lr"))
    return [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]


@pytest.mark.parametrize("interval", ["epoch", "step"])
def test_the_lr_monitor_takes_lightnings_logging_interval(tmp_path, interval):
    from lightning.pytorch.loggers import CSVLogger

    from nanotrain.callbacks import LearningRateMonitor

    rows = {}
    for kind in ("lightning", "nanotrain"):
        logger = CSVLogger(str(tmp_path / kind), name="", version="")
        common = dict(
            max_epochs=2, logger=logger, enable_checkpointing=False, enable_progress_bar=False,
            default_root_dir=str(tmp_path / kind), log_every_n_steps=4,
        )  # fmt: skip
        if kind == "lightning":
            monitor = pl.callbacks.LearningRateMonitor(interval)  # positional, as Lightning's
            trainer = pl.Trainer(
                accelerator="cpu", devices=1, callbacks=[monitor], enable_model_summary=False,
                **common,
            )  # fmt: skip
        else:
            monitor = LearningRateMonitor(interval)
            trainer = nt.Trainer(enable_monitors=False, callbacks=[monitor], **common)
        trainer.fit(Regression({"interval": "step"}), DataLoader(_data(), batch_size=8))
        rows[kind] = _lr_rows(tmp_path / kind / "metrics.csv")
    assert rows["nanotrain"] == nested_approx(rows["lightning"])


def test_the_lr_monitor_refuses_an_unknown_logging_interval():
    from nanotrain.callbacks import LearningRateMonitor

    with pytest.raises(ValueError, match="logging_interval must be None, 'step' or 'epoch'"):
        LearningRateMonitor(logging_interval="batch")


class Data(pl.LightningDataModule):
    """Records its setup / teardown calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []  # Lightning passes a str enum: equal to "fit"

    def setup(self, stage: str) -> None:
        self.calls.append(("setup", stage))

    def teardown(self, stage: str) -> None:
        self.calls.append(("teardown", stage))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(), batch_size=8)


def test_the_datamodule_is_torn_down_and_its_instance_loaders_read_as_lightning(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    seen = {}
    for kind in ("lightning", "nanotrain"):
        data = Data()
        logger = TensorBoardLogger(str(tmp_path / kind), name="tb", version=0)
        trainer = _trainer(kind, tmp_path, max_steps=2, logger=logger)
        trainer.fit(Regression(), datamodule=data)
        from_datasets = pl.LightningDataModule.from_datasets(_data(), batch_size=8)
        trainer.fit(Regression(), datamodule=from_datasets)  # loaders set on the instance
        seen[kind] = (data.calls, trainer.log_dir.replace(str(tmp_path / kind), "<root>"))
    assert seen["nanotrain"] == seen["lightning"]
    assert seen["nanotrain"][1] == "<root>/tb/version_0"  # the logger's folder, as a str
    assert seen["nanotrain"][0] == [("setup", "fit"), ("teardown", "fit")]


class LogsEpochEnds(Regression):
    def __init__(self) -> None:
        super().__init__()
        self.epoch_ends = 0

    def on_train_epoch_end(self):
        self.epoch_ends += 1


def test_a_second_fit_that_trains_nothing_ends_no_epoch_and_keeps_no_metrics(tmp_path):
    seen = {}
    for kind in ("lightning", "nanotrain"):
        module = LogsEpochEnds()
        trainer = _trainer(kind, tmp_path, max_steps=5, logger=False)
        for _ in range(2):
            trainer.fit(module, DataLoader(_data(), batch_size=8))
        seen[kind] = (module.epoch_ends, dict(trainer.callback_metrics), trainer.global_step)
    assert seen["nanotrain"] == seen["lightning"] == (1, {}, 5)


class StatefulData(Data):
    """A datamodule with state, as Lightning saves it in checkpoints."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: dict | None = None

    def state_dict(self) -> dict:
        return {"epochs_seen": 1}

    def load_state_dict(self, state_dict: dict) -> None:
        self.loaded = state_dict


class RenamesOnLoad(Regression):
    """Key surgery in `on_load_checkpoint`, as Lightning users do it: the saved bias is
    replaced by zeros before the weights load."""

    def on_load_checkpoint(self, checkpoint):
        self.seen = (checkpoint["epoch"], checkpoint["global_step"])
        checkpoint["state_dict"]["lin.bias"] = torch.zeros(1)


def test_checkpoints_carry_lightnings_names_and_the_datamodule_state(tmp_path):
    from nanotrain.callbacks import ModelCheckpoint

    saver = ModelCheckpoint(dirpath=tmp_path / "mine")  # a custom folder: "last" looks there
    trainer = nt.Trainer(
        max_steps=3, logger=False, enable_progress_bar=False, callbacks=[saver],
        default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(Regression(), datamodule=StatefulData())
    resumed, data = RenamesOnLoad(), StatefulData()
    again = nt.Trainer(
        max_steps=4, logger=False, enable_progress_bar=False,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "mine")], default_root_dir=str(tmp_path),
    )  # fmt: skip
    again.fit(resumed, datamodule=data, ckpt_path="last")
    assert data.loaded == {"epochs_seen": 1}
    assert resumed.seen == (0, 3)
    loaded = type(resumed).load_from_checkpoint(saver.last_model_path)  # the adopted class
    assert float(loaded.lin.bias) == 0.0 and loaded.seen == (0, 3)


def test_fits_final_validation_does_not_move_the_best_checkpoint_or_early_stopping(tmp_path):
    from nanotrain.callbacks import EarlyStopping, ModelCheckpoint

    seen = {}
    for kind in ("lightning", "nanotrain"):
        own = pl.callbacks if kind == "lightning" else None
        saver = (own.ModelCheckpoint if own else ModelCheckpoint)(
            dirpath=tmp_path / kind / "ckpt", monitor="val_loss", filename="{epoch}-{step}"
        )
        stopper = (own.EarlyStopping if own else EarlyStopping)("val_loss", patience=5)
        common = dict(
            max_epochs=3, val_check_interval=5, check_val_every_n_epoch=None, logger=False,
            enable_progress_bar=False, callbacks=[saver, stopper],
            default_root_dir=str(tmp_path / kind),
        )  # fmt: skip
        if kind == "lightning":
            trainer = pl.Trainer(accelerator="cpu", devices=1, num_sanity_val_steps=0, **common)
        else:
            trainer = nt.Trainer(enable_monitors=False, **common)
        module = Validated()
        torch.manual_seed(0)
        module.lin.reset_parameters()
        trainer.fit(module, DataLoader(_data(), batch_size=8), DataLoader(_data(16), batch_size=8))
        seen[kind] = (
            module.validated_at,
            Path(saver.best_model_path).name.removesuffix(".ckpt"),
            float(saver.best_model_score),
            float(stopper.best_score),
        )
    # nanotrain validates once more at step 24 (the end of fit); nothing is ranked by it
    assert seen["nanotrain"][0] == seen["lightning"][0] + [24]
    assert seen["nanotrain"][1:] == pytest.approx(seen["lightning"][1:])


class FrozenBackbone(Regression):
    """A BatchNorm + Dropout backbone the user froze and put in eval mode before fit."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.BatchNorm1d(4), nn.Dropout(0.5))
        self.backbone.eval().requires_grad_(False)
        self.modes: list[bool] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.modes.append(self.backbone.training)
        return F.mse_loss(self.lin(self.backbone(x)), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.lin(self.backbone(x)), y))


def test_a_submodule_left_in_eval_mode_stays_so_through_fit_and_validation(tmp_path):
    lightning_run, nanotrain_run = _both(FrozenBackbone(), tmp_path, val=True, max_epochs=2)
    assert nanotrain_run.modes == lightning_run.modes == [False] * 16
    _same_weights(lightning_run, nanotrain_run)  # the BatchNorm's running statistics included


class TransfersInTheDatamodule(Data):
    def on_before_batch_transfer(self, batch, dataloader_idx):
        return batch


def test_a_datamodules_batch_transfer_hook_is_refused_at_the_start(tmp_path):
    with pytest.raises(ValueError, match="on_before_batch_transfer is a Lightning hook"):
        _trainer("nanotrain", tmp_path, max_steps=1).fit(
            Regression(), datamodule=TransfersInTheDatamodule()
        )


class WithExampleInput(Regression):
    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = torch.zeros(2, 4)

    def forward(self, x):
        return self.lin(x)

    def on_fit_start(self):
        self.trainer.strategy.barrier("fit-start")  # Lightning's signature: a name


def test_the_summary_of_a_module_with_an_example_input_and_a_named_barrier(tmp_path, capsys):
    _trainer("nanotrain", tmp_path, max_steps=1, enable_model_summary=True).fit(
        WithExampleInput(), DataLoader(_data(), batch_size=8)
    )
    assert "[2, 4]" in capsys.readouterr().out  # the In sizes column, as Lightning prints it


class LogsToTheBar(Validated):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("bar_loss", loss, prog_bar=True)
        return loss


def test_loggers_bar_metrics_and_the_default_best_checkpoint_are_lightnings(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    seen, original = {}, LogsToTheBar()
    for kind in ("lightning", "nanotrain"):
        logger = CSVLogger(str(tmp_path / kind), name="", version="")
        trainer = _trainer(
            kind, tmp_path, max_epochs=2, logger=logger, log_every_n_steps=1,
            enable_checkpointing=True,  # the Trainer's default ModelCheckpoint
        )  # fmt: skip
        before = list(trainer.loggers)
        module = copy.deepcopy(original)
        trainer.fit(module, DataLoader(_data(), batch_size=8))
        bar = sorted(trainer.progress_bar_metrics)
        best = trainer.validate(module, DataLoader(_data(16), batch_size=8), ckpt_path="best")
        seen[kind] = (
            before == [logger] and trainer.logger is logger,  # yours, outside fit too
            bar,
            trainer.global_step,
            best,
        )
    assert seen["nanotrain"][:3] == seen["lightning"][:3] == (True, ["bar_loss"], 16)
    # ckpt_path="best" of the default ModelCheckpoint: the trained state, as Lightning's
    assert seen["nanotrain"][3][0]["val_loss"] == pytest.approx(seen["lightning"][3][0]["val_loss"])
