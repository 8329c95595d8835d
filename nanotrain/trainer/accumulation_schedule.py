"""Gradient accumulation that changes by epoch, as Lightning's `GradientAccumulationScheduler`
does it: the callback sets `trainer.accumulate_grad_batches` in `on_train_epoch_start`, and
the epoch's optimizer steps take that many microbatches.

nanotrain reads each optimizer step's samples as one global batch of
``accumulate × micro × data-parallel size`` samples (rank r reading columns r, r + n, ...: the
samples Lightning's DistributedSampler gives rank r for that step), so a new factor is a new
global batch for the sampler from the epoch's first sample on. The epochs are Lightning's
only where every factor's global batch divides the dataset (Lightning steps on a shorter
last window, nanotrain would leave it out): other data is refused at fit start.
"""

from __future__ import annotations

from typing import Any

from nanotrain.trainer.loaders import limited_steps


def _schedulers(trainer: Any) -> list[Any]:
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    return [cb for cb in trainer.callbacks if isinstance(cb, GradientAccumulationScheduler)]


def check_accumulation_schedule(trainer: Any) -> None:
    """At fit start, once the loaders are built: raise ValueError when a
    `GradientAccumulationScheduler` among the callbacks asks for a factor this run cannot give
    with Lightning's result (see the module docstring); nothing without one."""
    from nanotrain.data.sampler import ResumableDistributedSampler

    for scheduler in _schedulers(trainer):
        factors = sorted(set(scheduler.scheduling.values()))
        sampler, s = trainer._train_sampler, trainer.settings
        why = None
        if not isinstance(sampler, ResumableDistributedSampler):
            why = (
                "the training data is read through its own sampler or batch sampler, or as a "
                "stream (IterableDataset); pass a map-style Dataset or a plain DataLoader"
            )
        elif s.limit_train_batches is not None:
            why = "limit_train_batches is set; drop it"
        else:
            shard_count = trainer.strategy.data_shard().count
            for factor in factors:
                trainer.strategy.check_step_microbatches(factor)
                total = factor * s.micro_batch_size * shard_count
                if sampler.dataset_len % total:
                    why = (
                        f"the {sampler.dataset_len} training samples do not fill whole steps of "
                        f"{factor} batches of {s.micro_batch_size} on {shard_count} "
                        f"process(es) ({total} samples), where lightning.Trainer would step on "
                        "a shorter last window; use a dataset whose size is a multiple of "
                        f"{total}"
                    )
                    break
        if why is not None:
            raise ValueError(
                f"GradientAccumulationScheduler(scheduling={scheduler.scheduling}) cannot give "
                f"lightning.Trainer's result here: {why}"
            )


def set_accumulation(trainer: Any, factor: int) -> None:
    """`trainer.accumulate_grad_batches = factor`: this epoch's optimizer steps take `factor`
    microbatches each (a global batch of ``factor × micro × data-parallel size`` samples).

    Raises:
        ValueError: a factor below 1, or a change outside `on_train_epoch_start` of an
            epoch's start (or of the resumed epoch, to the factor it was saved with).
    """
    if not isinstance(factor, int) or factor < 1:
        raise ValueError(f"accumulate_grad_batches must be an int >= 1, got {factor!r}")
    if factor == trainer.num_microbatches:
        return
    resumed, trainer._resumed_accumulation = getattr(trainer, "_resumed_accumulation", None), None
    in_hook = trainer.is_fitting and trainer._current_fx == "on_train_epoch_start"
    # at an epoch's start, or at the resumed epoch's (mid-epoch) with its checkpoint's factor
    if not in_hook or (trainer.state.steps_in_epoch != 0 and factor != resumed):
        raise ValueError(
            "trainer.accumulate_grad_batches can change only in on_train_epoch_start, before "
            "the epoch's first step (as GradientAccumulationScheduler changes it); set "
            "Trainer(accumulate_grad_batches=...) for one value over the run"
        )
    s, sampler = trainer.settings, trainer._train_sampler
    total = factor * s.micro_batch_size * trainer.strategy.data_shard().count
    s.global_batch_size, s.accumulate_grad_batches = total, factor
    sampler.global_batch_size = total
    trainer.state.steps_per_epoch = limited_steps(s.limit_train_batches, sampler.num_steps, factor)


def load_sampler_state(trainer: Any, data_state: dict[str, Any]) -> None:
    """Load the training sampler's checkpointed `data_state`. Under a
    `GradientAccumulationScheduler` the checkpoint may hold another global batch (the factor
    of the epoch it was written in): its position loads under that global batch, and the
    callback's `on_train_epoch_start` of the resumed epoch sets the factor again (as
    Lightning, which saves no factor, `on_train_start` still sees the Trainer's own)."""
    sampler = trainer._train_sampler
    saved = data_state.get("global_batch_size")
    own = getattr(sampler, "global_batch_size", None)
    if saved is None or own is None or saved == own or not _schedulers(trainer):
        sampler.load_state_dict(data_state)
        return
    sampler.global_batch_size = int(saved)
    try:
        sampler.load_state_dict(data_state)
    finally:
        sampler.global_batch_size = own
    s = trainer.settings
    trainer._resumed_accumulation = int(saved) // (
        s.micro_batch_size * trainer.strategy.data_shard().count
    )
