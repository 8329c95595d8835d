"""Lightning `.ckpt` files: read one to resume, validate, test or predict from (what
`lightning.Trainer` and its ModelCheckpoint write), and write one that `lightning.Trainer`
resumes and a plain `LightningModule.load_from_checkpoint` reads.

A `.ckpt` is one `torch.save` file of plain values: "state_dict" (the module's whole weights),
"optimizer_states" and "lr_schedulers" (one state dict per optimizer / scheduler), "epoch",
"global_step", "loops" (the loops' progress), "callbacks", "hyper_parameters". nanotrain
reads it with `weights_only=True` only: a file that needs unpickling code is refused with the
reason (`files.read_torch`).

What maps: weights, optimizer and scheduler states, `global_step`, the epoch and the steps
done in it. As under lightning.Trainer (whose DataLoader keeps no position), a checkpoint
saved mid-epoch runs the epoch's remaining steps on the data from the epoch's start. Lightning's callback states (other keys, other classes) and RNG states are not
restored: a resumed run starts its callbacks afresh.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nanotrain.checkpoint import files
from nanotrain.checkpoint.layout import sharded_layout

if TYPE_CHECKING:
    from nanotrain.trainer import Trainer

#: the suffix nanotrain takes as a Lightning checkpoint file
LIGHTNING_SUFFIX = ".ckpt"


def is_lightning_file(path: Path) -> bool:
    """Whether `path` is a single checkpoint file (Lightning's format), not a nanotrain
    checkpoint directory or its `last` pointer file."""
    return path.is_file() and path.suffix == LIGHTNING_SUFFIX


def read_lightning(path: Path) -> dict[str, Any]:
    """The contents of a Lightning `.ckpt`, on the CPU, read with `weights_only=True`.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a Lightning checkpoint (no "state_dict"), a damaged file, or
            `files.UnsafeCheckpointError`: it holds pickled objects that would run code (e.g.
            hyperparameters that are arbitrary classes); re-save it with plain values.
    """
    checkpoint = files.read_torch(path)
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ValueError(
            f"{path} is not a Lightning checkpoint (no 'state_dict'); pass a .ckpt written by "
            "lightning.Trainer or a nanotrain checkpoint directory"
        )
    return checkpoint


def _one_or_list(states: list[Any], key: str) -> dict[str, Any] | None:
    """One optimizer's (scheduler's) state as itself; several as nanotrain's
    `OptimizerList` / `SchedulerList` state."""
    if not states:
        return None
    return states[0] if len(states) == 1 else {key: list(states)}


def restore_lightning(trainer: Trainer, checkpoint: dict[str, Any], weights_only: bool) -> None:
    """Load a Lightning checkpoint into `trainer` as Lightning restores it: the module's
    `on_load_checkpoint` (and callbacks') first, on the checkpoint itself, then the weights;
    unless `weights_only`, the optimizer and scheduler states, the step and the position in
    the data.

    Raises:
        ValueError: the layout cannot take whole weights (sharded strategies), the checkpoint
            holds another number of optimizers, or its position does not fit this data.
    """
    strategy = trainer.strategy
    if sharded_layout(strategy) is not None:
        raise ValueError(
            f"a Lightning checkpoint holds whole weights and optimizer states, which "
            f"{type(strategy).__name__}'s sharded layout does not load; load it under "
            "SingleDeviceStrategy or DDPStrategy and save a nanotrain checkpoint "
            "(trainer.save_checkpoint(dir)), which any layout resumes"
        )
    trainer._call("on_load_checkpoint", checkpoint)
    strategy.load_model_state_dict(checkpoint["state_dict"])
    if weights_only:
        return
    setup = strategy.optimizer_setup
    optimizer = _one_or_list(checkpoint.get("optimizer_states", []), "optimizers")
    if optimizer is not None and setup is not None:
        strategy.load_optimizer_state_dict(optimizer)
    scheduler = _one_or_list(checkpoint.get("lr_schedulers", []), "schedulers")
    if scheduler is not None and setup is not None and setup.scheduler is not None:
        setup.scheduler.scheduler.load_state_dict(scheduler)
    _restore_position(trainer, checkpoint)


def _batches_that_stepped(checkpoint: dict[str, Any], default: int) -> int:
    """Lightning's count of training batches (`fit_loop.epoch_loop._batches_that_stepped`)."""
    loop = checkpoint.get("loops", {}).get("fit_loop", {})
    return int(loop.get("epoch_loop.state_dict", {}).get("_batches_that_stepped", default))


def _restore_position(trainer: Trainer, checkpoint: dict[str, Any]) -> None:
    """The TrainState a Lightning checkpoint stands for: `global_step` steps done; at an
    epoch's end (where Lightning's ModelCheckpoint saves by default) the next epoch starts,
    else the epoch's remaining steps run, reading its data from the start (as Lightning)."""
    st, s = trainer.state, trainer.settings
    step = int(checkpoint.get("global_step", 0))
    epoch = int(checkpoint.get("epoch", 0))
    per_epoch = st.steps_per_epoch
    # manual optimization: an epoch is its batches, global_step the optimizer steps (a GAN
    # takes two a batch); Lightning keeps the batches in _batches_that_stepped
    manual = getattr(trainer, "_manual", False)
    batches = _batches_that_stepped(checkpoint, step) if manual else step
    done = batches - epoch * per_epoch
    if done == per_epoch:  # saved at the epoch's end: the next one starts
        epoch, done = epoch + 1, 0
    if not 0 <= done < per_epoch:
        raise ValueError(
            f"the Lightning checkpoint is at global_step={step}, epoch={epoch}, which does not "
            f"fit this data's {per_epoch} optimizer steps per epoch; resume it with the data "
            "and batch size it was trained with"
        )
    samples = batches * s.global_batch_size
    st.load_state_dict(
        {"global_step": step, "epoch": epoch, "steps_in_epoch": done,
         "consumed_samples": samples, "consumed_tokens": 0,
         "batches_stepped": batches if manual else 0}
    )  # fmt: skip
    sampler = trainer._train_sampler
    if sampler is not None and done:
        # as lightning.Trainer, whose DataLoader keeps no position: the epoch's remaining
        # steps read its data from the start
        sampler.set_epoch(epoch)


def lightning_checkpoint(trainer: Trainer) -> dict[str, Any]:
    """The running fit as a Lightning checkpoint dict: what `lightning.Trainer` resumes
    (weights, optimizer and scheduler states, epoch, global_step and its loops' progress)
    and `LightningModule.load_from_checkpoint` reads (weights and hyperparameters).

    Raises:
        ValueError: a strategy that shards the model (MegatronStrategy).
    """
    import lightning.pytorch as pl

    module, strategy, st = trainer.module, trainer.strategy, trainer.state
    if sharded_layout(strategy) is not None:
        raise ValueError(
            f"a Lightning checkpoint holds whole weights and optimizer states; "
            f"{type(strategy).__name__} keeps them in shards: save a nanotrain checkpoint "
            "directory, and write the .ckpt from it under SingleDeviceStrategy or DDPStrategy"
        )
    setup = strategy.optimizer_setup
    optimizers = trainer.optimizers
    schedulers = [c.scheduler for c in trainer.lr_scheduler_configs]
    state = {k: strategy.full_tensor(k, v) for k, v in strategy.model_state_dict().items()}
    at_epoch_end = st.steps_in_epoch == 0 or st.steps_in_epoch == st.steps_per_epoch
    epoch = st.epoch - 1 if st.steps_in_epoch == 0 and st.epoch > 0 else st.epoch
    checkpoint: dict[str, Any] = {
        "epoch": epoch,
        "global_step": st.global_step,
        "pytorch-lightning_version": pl.__version__,
        "state_dict": {k: v.detach().cpu() for k, v in state.items()},
        "loops": _loops(trainer, epoch, at_epoch_end),
        "callbacks": {},
        "optimizer_states": [o.state_dict() for o in optimizers] if setup else [],
        "lr_schedulers": [sch.state_dict() for sch in schedulers],
    }
    hparams = dict(getattr(module, "hparams", {}) or {})
    if hparams:
        checkpoint["hparams_name"] = "kwargs"
        checkpoint["hyper_parameters"] = hparams
    return checkpoint


def _counts(n: int, *names: str) -> dict[str, int]:
    return dict.fromkeys(names, n)


def _progress(current: int, total: int, *names: str) -> dict[str, dict[str, int]]:
    return {"current": _counts(current, *names), "total": _counts(total, *names)}


def _loops(trainer: Trainer, epoch: int, at_epoch_end: bool) -> dict[str, Any]:
    """Lightning's "loops" entry for this position (the keys of Lightning 2.x's fit loop):
    the epoch and batch progress and the optimizer-step count that `lightning.Trainer`
    reads `global_step` from (the manual one in manual optimization)."""
    st = trainer.state
    per_step = trainer.num_microbatches
    done = (st.steps_per_epoch if at_epoch_end else st.steps_in_epoch) * per_step
    manual = not getattr(trainer.module, "automatic_optimization", True)
    batches = st.batches_stepped if manual else st.global_step * per_step
    four = ("ready", "started", "processed", "completed")
    steps = _progress(st.global_step, st.global_step, "ready", "completed")
    none = _progress(0, 0, "ready", "completed")
    started = epoch + 1  # Lightning counts the epoch under way (or just ended) as started
    epochs = {"ready": started, "started": started, "processed": epoch + at_epoch_end,
              "completed": epoch}  # fmt: skip
    return {
        "fit_loop": {
            "state_dict": {},
            "epoch_loop.state_dict": {"_batches_that_stepped": batches},
            "epoch_loop.batch_progress": {
                **_progress(done, batches, *four),
                "is_last_batch": at_epoch_end,
            },
            "epoch_loop.scheduler_progress": none,
            "epoch_loop.automatic_optimization.state_dict": {},
            "epoch_loop.automatic_optimization.optim_progress": {
                "optimizer": {
                    "step": none if manual else steps,
                    "zero_grad": _progress(
                        0 if manual else st.global_step,
                        0 if manual else st.global_step,
                        "ready",
                        "started",
                        "completed",
                    ),  # fmt: skip
                }
            },
            "epoch_loop.manual_optimization.state_dict": {},
            "epoch_loop.manual_optimization.optim_step_progress": steps if manual else none,
            "epoch_loop.val_loop.state_dict": {},
            "epoch_loop.val_loop.batch_progress": {
                **_progress(0, 0, *four),
                "is_last_batch": False,
            },
            "epoch_progress": {"current": dict(epochs), "total": dict(epochs)},
        }
    }


def save_lightning(trainer: Trainer, path: Path) -> Path:
    """Write `lightning_checkpoint(trainer)` to `path` (global rank 0 writes; call on every
    rank), atomically (a temporary file, then renamed). Returns `path`."""
    checkpoint = lightning_checkpoint(trainer)
    if trainer.is_global_zero:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        torch.save(checkpoint, partial)
        os.replace(partial, path)
    trainer.strategy.barrier()
    return path
