"""Lightning's built-in callbacks under nanotrain.Trainer: which run as they are, and for the
others the nanotrain counterpart (or what to do) named in the refusal.

Lightning's built-in callbacks read its Trainer's internals (`trainer.fit_loop`,
`trainer.predict_loop`, `trainer.strategy.optimizer_step`, ...), which the nanotrain Trainer
does not have. `LambdaCallback` only forwards hooks and runs as it is;
`BasePredictionWriter` reads `trainer.predict_loop`, which nanotrain's `predict` keeps as
Lightning's does (`nanotrain.trainer.predict_records`); `GradientAccumulationScheduler` sets
`trainer.accumulate_grad_batches` by epoch (`nanotrain.trainer.accumulation_schedule`);
`BaseFinetuning` and `BackboneFinetuning` edit `trainer.optimizers` (where they cannot give
Lightning's result they are refused at fit start, `nanotrain.trainer.finetuning_checks`);
`StochasticWeightAveraging` swaps `trainer.lr_scheduler_configs[0]` and averages the weights
per epoch (`nanotrain.trainer.swa_support`, which refuses what it cannot run at fit start).
Every other one is refused when the Trainer is built, with its counterpart. Each counterpart
named here exists (tests/unit/test_refusal_names.py reads every refusal message of the
codebase).
"""

from __future__ import annotations

from typing import Any

#: built-in Lightning callbacks that run unchanged (with the Trainer attributes they read)
RUNS_AS_IS = (
    "LambdaCallback",
    "BasePredictionWriter",
    "GradientAccumulationScheduler",
    "BaseFinetuning",
    "BackboneFinetuning",
    "StochasticWeightAveraging",
)

_PROGRESS = (
    "use nanotrain.callbacks.ProgressBar (added by default; Trainer(enable_progress_bar=False) "
    "drops it)"
)
_SUMMARY = "pass Trainer(enable_model_summary=True), which prints Lightning's summary at fit start"
_AVERAGING = (
    "use lightning.pytorch.callbacks.StochasticWeightAveraging (it runs under "
    "nanotrain.Trainer), or keep a torch.optim.swa_utils.AveragedModel in your module and "
    "update it in on_train_batch_end"
)

#: Lightning's built-in callback class -> the nanotrain counterpart, or what to do instead
COUNTERPARTS: dict[str, str] = {
    "ModelCheckpoint": "use nanotrain.callbacks.ModelCheckpoint (Lightning's arguments)",
    "Checkpoint": "use nanotrain.callbacks.ModelCheckpoint (Lightning's arguments)",
    "OnExceptionCheckpoint": "use nanotrain.callbacks.ModelCheckpoint(save_on_exception=True)",
    "EarlyStopping": "use nanotrain.callbacks.EarlyStopping (Lightning's arguments)",
    "LearningRateMonitor": "use nanotrain.callbacks.LearningRateMonitor (Lightning's arguments)",
    "Timer": "use nanotrain.callbacks.Timer (Lightning's arguments), or Trainer(max_time=...)",
    "ThroughputMonitor": "use nanotrain.callbacks.ThroughputMonitor (added by default)",
    "DeviceStatsMonitor": (
        "use nanotrain.callbacks.MemoryMonitor (device memory) and "
        "nanotrain.callbacks.ThroughputMonitor"
    ),
    "SpikeDetection": "use nanotrain.callbacks.NaNGuard (added by default) for non-finite losses",
    "ProgressBar": _PROGRESS,
    "TQDMProgressBar": _PROGRESS,
    "RichProgressBar": _PROGRESS,
    "ModelSummary": _SUMMARY,
    "RichModelSummary": _SUMMARY,
    "WeightAveraging": _AVERAGING,
    "EMAWeightAveraging": _AVERAGING,
    "BatchSizeFinder": "no nanotrain counterpart: pass the batch size (docs/planning.md sizes runs)",
    "LearningRateFinder": "no nanotrain counterpart: pass the learning rate",
    "ModelPruning": (
        "no nanotrain counterpart: prune with torch.nn.utils.prune in your module's hooks"
    ),
}


def lightning_builtin(cb: Any) -> type | None:
    """The Lightning built-in callback class `cb` is or derives from (None for nanotrain
    callbacks, your own `lightning.pytorch.Callback` subclasses and those that run as is)."""
    import lightning.pytorch as pl

    if not isinstance(cb, pl.Callback):
        return None
    for cls in type(cb).__mro__:
        root = cls.__module__.split(".")[0]
        if root in ("lightning", "pytorch_lightning") and cls is not pl.Callback:
            return None if cls.__name__ in RUNS_AS_IS else cls
    return None


def builtin_refusal(cls: type) -> TypeError:
    """The TypeError for Lightning's built-in callback `cls`: its name and the counterpart."""
    instead = COUNTERPARTS.get(
        cls.__name__,
        "no nanotrain counterpart: write the behaviour as your own lightning.pytorch.Callback "
        "subclass (its hooks are called with Lightning's arguments)",
    )
    return TypeError(
        f"got Lightning's {cls.__name__}, which reads lightning.Trainer's internals and does "
        f"not run under nanotrain.Trainer: {instead}"
    )
