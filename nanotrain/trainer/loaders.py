"""The Trainer's data loaders: a user's DataLoader read as given (its batch size, its sampler's
order) in a resumable order shared out over the data-parallel shards.

What a DataLoader decides, as under `lightning.Trainer`:

- its ``batch_size`` is the micro batch (unless the Trainer sets ``micro_batch_size``, which
  must then agree);
- its sampler the order: a ``SequentialSampler`` (``shuffle=False``) reads in order, a
  ``RandomSampler`` (``shuffle=True``) a permutation per epoch seeded with the run's seed, a
  ``DistributedSampler`` its own ``shuffle`` and ``seed``; each in `DistributedSampler`'s order
  and split (`ResumableDistributedSampler`);
- any other sampler or batch sampler is read batch for batch as it yields them
  (`ResumableBatchList`), on one data-parallel shard only;
- ``collate_fn`` and the worker settings are kept.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    Sampler,
    default_collate,
)

from nanotrain.strategies.base import DataShard
from nanotrain.trainer.data_source import (
    DataSource,
    inspect_source,
    resolve_global_batch,
    resolve_micro_batch,
    resolve_shuffle,
    warn_if_shuffled,
)


def build_loaders(
    trainer: Any, stage: str, train_source: Any, val_source: Any
) -> tuple[DataLoader | None, Any, DataLoader | None]:
    """(train loader, train sampler, val loader) of `trainer` for `stage` ("fit" or
    "validate"), with the stage's micro_batch_size, global_batch_size,
    accumulate_grad_batches and shuffle resolved into `trainer.settings` (from the settings
    as given, `trainer.requested_settings`).

    Sources, as in Lightning: the dataloaders passed, else the datamodule's
    `train_dataloader()` / `val_dataloader()` where it defines them, else the module's.
    Validation reads the same samples under any layout (`validation_loader`); it is skipped
    when `limit_val_batches` is 0, there is no validation data, or `drop_last` leaves no
    batch. Sets `trainer._num_val_batches` (Lightning's `num_val_batches`, which stays after
    the stage).

    Raises:
        ValueError: `fit` without training data, a batch setting that contradicts the
            DataLoader, a custom sampler under data parallelism (and what `rebatch` raises).
    """
    settings, requested = trainer.settings, trainer.requested_settings
    shard = trainer.strategy.data_shard()
    module, datamodule = trainer.module, trainer.datamodule
    train_loader = train_sampler = val_loader = None
    micro = None
    if stage == "fit":
        source = data_source(train_source, datamodule, module, "train_dataloader")
        if source is None:
            raise ValueError(
                "fit needs training data: pass train_dataloaders or a datamodule, or define "
                f"train_dataloader() on {type(module).__name__}"
            )
        data = inspect_source(source, "training")
        micro = resolve_micro_batch(requested.micro_batch_size, data, None)
        total, accumulate = resolve_global_batch(requested, micro, shard.count)
        shuffle = resolve_shuffle(requested.shuffle, data)
        if settings.overfit_batches and shuffle:  # as Lightning: in order, with its warning
            warnings.warn(
                "You requested to overfit but enabled train dataloader shuffling. We are "
                "turning off the train dataloader shuffling for you.",
                UserWarning,
                stacklevel=3,
            )
            shuffle = False
        settings.micro_batch_size, settings.global_batch_size = micro, total
        settings.accumulate_grad_batches, settings.shuffle = accumulate, shuffle
        train_loader, train_sampler = rebatch(
            data,
            micro_batch_size=micro,
            global_batch_size=total,
            shard=shard,
            shuffle=bool(shuffle),
            seed=settings.seed if data.seed is None else data.seed,
            rank=trainer.strategy.global_rank,
        )
        if data.stream:
            from nanotrain.data.streaming import check_stream_settings

            check_stream_settings(settings.val_check_interval)
        else:
            _warn_if_samples_left(trainer, data, train_sampler, accumulate)
    source = data_source(val_source, datamodule, module, "val_dataloader")
    if source is not None and (stage == "validate" or settings.limit_val_batches != 0):
        data = inspect_source(source, "validation")
        batch = resolve_micro_batch(requested.micro_batch_size, data, micro)
        if stage == "validate":  # no training data: the validation batch sets the numbers
            total, accumulate = resolve_global_batch(requested, batch, shard.count)
            settings.micro_batch_size, settings.global_batch_size = batch, total
            settings.accumulate_grad_batches = accumulate
        if settings.limit_val_batches != 0:
            val_loader = validation_loader(data, settings, shard, batch)
    # Lightning's `num_val_batches`, which outlives the stage
    trainer._num_val_batches = [] if val_loader is None else [val_loader.num_batches]
    if val_loader is not None and not val_loader.num_batches:
        val_loader = None  # drop_last leaves no batch: no validation, as Lightning
    return train_loader, train_sampler, val_loader


def data_source(given: Any, datamodule: Any, module: Any, hook: str) -> Any:
    """The data of `hook` (e.g. "train_dataloader"), as Lightning picks it: `given` (the
    dataloaders passed to fit/validate/test/predict), else the datamodule's hook where it
    defines one, else the module's; None when none has data."""
    import lightning.pytorch as pl

    if given is not None:
        return given
    for owner, base in ((datamodule, pl.LightningDataModule), (module, pl.LightningModule)):
        if owner is not None and _overrides(owner, hook, base):
            source = getattr(owner, hook)()
            if source is not None:
                return source
    return None


def rebatch(
    data: DataSource,
    *,
    micro_batch_size: int,
    global_batch_size: int,
    shard: DataShard,
    shuffle: bool,
    seed: int,
    rank: int = 0,
) -> tuple[DataLoader, Any]:
    """Return (loader, sampler): the data's dataset, collate function and worker settings,
    read `micro_batch_size` at a time in the order of a `ResumableDistributedSampler`, or,
    for a custom sampler or batch sampler, its own batches (`ResumableBatchList`); an
    `IterableDataset` as a stream (`StreamLoader`, `StreamSampler`).

    Raises:
        ValueError: a dataset smaller than a global batch, a DistributedSampler made for
            another rank or number of replicas, or a custom sampler under data parallelism.
    """
    from nanotrain.data.sampler import ResumableBatchList, ResumableDistributedSampler

    if data.stream:  # an IterableDataset: `nanotrain.data.streaming` reads it
        from nanotrain.data.streaming import StreamLoader, StreamSampler

        stream = StreamSampler(data.dataset, global_batch_size, shard.index, shard.count)
        collate = data.extra.get("collate_fn") or default_collate
        return StreamLoader(stream, micro_batch_size, collate), stream
    extra = dict(data.extra)
    if os.environ.get("PL_SEED_WORKERS") == "1" and extra.get("worker_init_fn") is None:
        # as Lightning after seed_everything(workers=True): workers seed themselves from it
        from lightning.fabric.utilities.seed import pl_worker_init_function

        extra["worker_init_fn"] = functools.partial(pl_worker_init_function, rank=rank)
    # A generator of its own: otherwise every iter(loader) draws the workers' base seed from
    # the global torch RNG, so re-creating the iterator (on resume, or for each validation)
    # would shift the dropout masks of the following steps and break an exact resume.
    generator = torch.Generator().manual_seed(seed)
    if data.batch_sampler is not None:
        _refuse_custom_under_dp(data, shard)
        sampler = ResumableBatchList(data.batch_sampler, micro_batch_size)
        loader = DataLoader(data.dataset, batch_sampler=sampler, generator=generator, **extra)
        return lightning_rng_parity(loader, data), sampler
    _check_distributed_sampler(data, shard)
    sampler = ResumableDistributedSampler(
        len(data.dataset),
        global_batch_size=global_batch_size,
        shard_index=shard.index,
        shard_count=shard.count,
        shuffle=shuffle,
        seed=seed,
    )
    loader = DataLoader(
        data.dataset,
        batch_size=micro_batch_size,
        sampler=sampler,
        drop_last=True,
        generator=generator,
        **extra,
    )
    return lightning_rng_parity(loader, data), sampler


def _refuse_custom_under_dp(data: DataSource, shard: DataShard) -> None:
    if shard.count > 1:
        raise ValueError(
            f"the {data.what} DataLoader's {data.custom_name} cannot be shared out over "
            f"{shard.count} data-parallel replicas exactly and resumably; pass a plain "
            "DataLoader (batch_size=..., shuffle=True/False) and nanotrain splits each global "
            "batch over the replicas as DistributedSampler does, or train on one replica"
        )


def _check_distributed_sampler(data: DataSource, shard: DataShard) -> None:
    sampler = data.distributed
    if sampler is not None and (sampler.num_replicas, sampler.rank) != (shard.count, shard.index):
        raise ValueError(
            f"the {data.what} DataLoader's DistributedSampler has num_replicas="
            f"{sampler.num_replicas}, rank={sampler.rank}, but this process is data-parallel "
            f"replica {shard.index} of {shard.count}; pass a DataLoader without a "
            "DistributedSampler (shuffle=True/False): nanotrain shares it out itself"
        )


def _warn_if_samples_left(trainer: Any, data: DataSource, sampler: Any, accumulate: int) -> None:
    """Warn (global rank 0) when an epoch ends with samples that do not fill a whole global
    batch and the run will reach the end of an epoch: Lightning trains them as a smaller last
    batch (or a step of fewer microbatches), nanotrain leaves them out."""
    from nanotrain.data.sampler import ResumableBatchList

    s = trainer.settings
    if isinstance(sampler, ResumableBatchList):
        left, steps = sampler.num_batches % accumulate, sampler.num_batches // accumulate
        lightning_same = left == 0
        what = f"{left} batches per epoch that do not fill a step of {accumulate} batches"
        fix = "use an accumulate_grad_batches that divides the batches of an epoch"
    else:
        total = len(data.dataset)
        left, steps = total % s.global_batch_size, sampler.num_steps
        dp = sampler.shard_count
        # with drop_last, Lightning drops each rank's incomplete batch itself; what nanotrain
        # leaves out then is exactly that when whole steps of full batches remain
        lightning_same = left == 0 or (
            data.drop_last
            and total % dp == 0
            and (total // dp // s.micro_batch_size) % accumulate == 0
        )
        what = f"{left} samples per epoch that do not fill a global batch of {s.global_batch_size}"
        fix = (
            "use a dataset whose size is a multiple of the global batch, or "
            "DataLoader(drop_last=True) without gradient accumulation"
        )
    reaches_epoch_end = s.max_steps is None or s.max_steps > steps
    if lightning_same or not reaches_epoch_end or not trainer.is_global_zero:
        return
    warnings.warn(
        f"the training data leaves {what} ({steps} optimizer steps per epoch); nanotrain "
        "leaves them out of each epoch, where lightning.Trainer would train them in a last, "
        f"smaller step. To make the runs the same, {fix}",
        UserWarning,
        stacklevel=5,
    )


class FixedBatches(Sampler[list[int]]):
    """Given batches, in order: a custom batch sampler's batches of one evaluation run. All
    are real (`num_real_batches`: no padding batches)."""

    def __init__(self, batches: list[list[int]]) -> None:
        self.batches = batches
        self.num_real_batches = len(batches)

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def validation_loader(
    source: DataSource | DataLoader | Dataset,
    settings: Any,
    shard: DataShard,
    batch_size: int | None = None,
) -> DataLoader:
    """The validation loader of this data-parallel shard: the batches Lightning runs per rank
    (`limit_val_batches` and `drop_last` applied to whole global batches of
    `global_batch_size` samples: an int n = the first n, a fraction f = int(f × their
    number); in one process without accumulation, Lightning's own batches), as the first
    samples of the set dealt over the shards, `batch_size` (default: the micro batch) at a
    time; every shard yields the same number of batches (padding batches from
    `loader.batch_sampler.num_real_batches` on; see `ValidationBatchSampler`). A custom
    sampler or batch sampler is read as it yields its batches (one shard only),
    `limit_val_batches` of them. `loader.num_batches` is Lightning's `num_val_batches` entry.

    Raises:
        TypeError, ValueError: as `inspect_source`; a custom sampler under data parallelism;
            a fractional `limit_val_batches` that leaves no batch.
    """
    from nanotrain.data.sampler import ValidationBatchSampler

    data = source if isinstance(source, DataSource) else inspect_source(source, "validation")
    warn_if_shuffled(data)
    batch_size = batch_size or settings.micro_batch_size
    # its own generator, as in `rebatch`: iterating must not draw from the global RNG
    generator = torch.Generator().manual_seed(settings.seed)
    if data.batch_sampler is not None:
        _refuse_custom_under_dp(data, shard)
        batches = [list(b) for b in data.batch_sampler]
        batches = batches[: val_batch_limit(settings.limit_val_batches, len(batches))]
        sampler: Sampler = FixedBatches(batches)
        num_batches = len(batches)
    else:
        # limits and drop_last count whole global batches (in one process without
        # accumulation: Lightning's own batches), so that every layout reads the same samples
        length, per_step = len(data.dataset), settings.global_batch_size
        whole = length // per_step if data.drop_last else math.ceil(length / per_step)
        count = min(val_batch_limit(settings.limit_val_batches, whole) * per_step, length)
        # dealt over the ranks as Lightning's DistributedSampler deals them, a micro batch at
        # a time: each rank's number of batches is Lightning's `num_val_batches` entry
        num_batches = math.ceil(math.ceil(count / shard.count) / batch_size)
        sampler = ValidationBatchSampler(max(count, 1), batch_size, shard.index, shard.count)
    loader = DataLoader(data.dataset, batch_sampler=sampler, generator=generator, **data.extra)
    loader.num_batches = num_batches
    return lightning_rng_parity(loader, data)


def evaluation_loader(trainer: Any, source: Any, what: str, ordered: Any) -> DataLoader:
    """The test / predict loader of this shard: `source`'s batch size (the Trainer's
    micro_batch_size must agree with it; a bare Dataset: the Trainer's micro batch, or that
    of its last fit, else 1), every sample once in order (but a `drop_last` DataLoader's
    partial last batch, of the whole set), built by `ordered(
    length, batch_size, shard)` (a batch sampler); a custom sampler or batch sampler is read
    as it yields its batches (one shard only).

    Raises:
        TypeError, ValueError: as `inspect_source` and `resolve_micro_batch`; a custom
            sampler under data parallelism.
    """
    data = inspect_source(source, what)
    warn_if_shuffled(data)
    shard = trainer.strategy.data_shard()
    dev_run = int(trainer.settings.fast_dev_run)  # as Lightning: n batches of a dev run
    if data.batch_sampler is not None:
        _refuse_custom_under_dp(data, shard)
        custom = [list(b) for b in data.batch_sampler]
        batches: Sampler = FixedBatches(custom[:dev_run] if dev_run else custom)
    else:
        # a bare Dataset: the micro batch of the last fit, if any
        default = trainer.settings.micro_batch_size
        batch = resolve_micro_batch(trainer.requested_settings.micro_batch_size, data, default)
        length = len(data.dataset)
        if data.drop_last:  # as Lightning in one process: the partial last batch left out
            length = length // batch * batch  # (of the whole set: the same under any layout)
        if dev_run:  # the first n batches of each rank: of the set, n × batch × replicas
            length = min(length, dev_run * batch * shard.count)
        batches = ordered(length, batch, shard)
    generator = torch.Generator().manual_seed(trainer.settings.seed)
    loader = DataLoader(data.dataset, batch_sampler=batches, generator=generator, **data.extra)
    return lightning_rng_parity(loader, data)


def lightning_rng_parity(loader: DataLoader, data: DataSource) -> DataLoader:
    """Mark `loader` to draw from the global torch RNG once per pass, as the user's DataLoader
    would have under Lightning (`draw_as_lightning`)."""
    loader.draws_global_seed = data.draws_global_seed
    return loader


def draw_as_lightning(loader: DataLoader | None) -> None:
    """One draw from the global torch RNG where the user's DataLoader had no `generator`.

    Every `iter()` of such a DataLoader draws its workers' base seed from the global RNG, so
    under lightning.Trainer each pass over it (a training epoch, a validation, a test) moves
    the RNG that dropout and data drawn later read. nanotrain's own loaders carry a generator
    (an exact resume re-creates iterators mid-epoch), so the Trainer makes the same draw at the
    start of each pass itself: the RNG streams, and so the runs, stay Lightning's. The loader's
    own generator is set to draw the same number when the pass's iterator is made, so its
    workers get Lightning's base seed (and, after `seed_everything(n, workers=True)`,
    Lightning's `pl_worker_init_function` seeds them from it): random augmentation in workers
    draws Lightning's numbers. Call it right before `iter(loader)`.
    """
    if loader is not None and getattr(loader, "draws_global_seed", False):
        loader.generator.set_state(torch.get_rng_state())
        torch.empty((), dtype=torch.int64).random_()


def _overrides(obj: Any, name: str, base: type) -> bool:
    """Whether `obj` defines hook `name` itself, on its class or on the instance (as
    `LightningDataModule.from_datasets` does), not `base`'s default."""
    if not callable(getattr(obj, name, None)):
        return False
    own = name in getattr(obj, "__dict__", {})
    return own or getattr(type(obj), name, None) is not getattr(base, name, None)


def val_batch_limit(limit: int | float | None, available: int) -> int:
    """Batches to run of `available`, as Lightning's `limit_val_batches` says: all (None),
    ``int(limit × available)`` (a float), or a count (an int), at most `available`.

    Raises:
        ValueError: a float `limit` that leaves no batch of several (Lightning's error).
    """
    if limit is None:
        return available
    if isinstance(limit, float):
        batches = int(available * limit)
        if batches == 0 and limit > 0 and available > 0:
            raise ValueError(
                f"limit_val_batches={limit} of {available} validation batches is less than one "
                f"batch; use at least limit_val_batches={1 / available} (or an int count)"
            )
        return batches
    return min(int(limit), available)


def limited_steps(limit: int | float | None, steps: int, microbatches: int) -> int:
    """Optimizer steps of one training epoch under Lightning's `limit_train_batches`: of the
    epoch's `steps` × `microbatches` batches (per process, as Lightning counts them) all
    (None), the first ``int(limit × batches)`` (a float) or the first `limit` (an int).

    Raises:
        ValueError: a limit of 0 batches, or one that is not a whole number of optimizer
            steps (Lightning would train the rest in a last, smaller step).
    """
    if limit is None:
        return steps
    available = steps * microbatches
    batches = int(available * limit) if isinstance(limit, float) else min(int(limit), available)
    if batches == 0:
        raise ValueError(
            f"limit_train_batches={limit!r} leaves no training batch of {available}; "
            f"use at least limit_train_batches={1 / max(available, 1)} or an int >= 1"
        )
    if batches % microbatches and batches < available:
        raise ValueError(
            f"limit_train_batches={limit!r} gives {batches} batches per epoch, not a whole "
            f"number of optimizer steps of accumulate_grad_batches={microbatches} batches "
            "(lightning.Trainer would step on the rest too); pass a limit of a multiple of "
            f"{microbatches} batches"
        )
    return batches // microbatches
