"""What the Trainer reads of a user's DataLoader (or bare Dataset), and the batch sizes and
order that follow from it, as under `lightning.Trainer`: the loader's ``batch_size`` is the
micro batch unless the Trainer sets one (they must agree), its sampler decides the order
(`nanotrain.trainer.loaders` builds the Trainer's loaders from a `DataSource`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

__all__ = [
    "KEPT_SETTINGS",
    "DataSource",
    "inspect_source",
    "resolve_global_batch",
    "resolve_micro_batch",
    "resolve_shuffle",
    "warn_if_shuffled",
]

# DataLoader settings kept as the user gave them (the sampler, batch size and generator are
# the Trainer's: see `rebatch`)
KEPT_SETTINGS = (
    "collate_fn",
    "num_workers",
    "pin_memory",
    "worker_init_fn",
    "timeout",
    "prefetch_factor",
    "persistent_workers",
    "multiprocessing_context",
    "pin_memory_device",
)


@dataclass
class DataSource:
    """What the Trainer reads of a DataLoader or a bare Dataset.

    Attributes:
        dataset: the map-style dataset, or (training only) an `IterableDataset`.
        what: "training", "validation", "test" or "predict" (for messages).
        extra: the DataLoader settings kept (`KEPT_SETTINGS`).
        batch_size: the DataLoader's batch size (None: a bare Dataset, or a batch sampler
            without a ``batch_size``).
        drop_last: the DataLoader's (its batch sampler's) ``drop_last``.
        shuffle: what its sampler says (None: a bare Dataset or a custom sampler).
        seed: a `DistributedSampler`'s own seed (None otherwise).
        distributed: the user's `DistributedSampler`, if any.
        batch_sampler: the batch sampler to read as it yields batches, when the DataLoader has
            a custom ``batch_sampler`` or a ``sampler`` other than torch's sequential, random
            (without replacement, over the whole set) and distributed ones; else None.
        stream: the dataset is an `IterableDataset` (read by `nanotrain.data.streaming`).
    """

    dataset: Dataset
    what: str
    extra: dict[str, Any] = field(default_factory=dict)
    batch_size: int | None = None
    drop_last: bool = False
    shuffle: bool | None = None
    seed: int | None = None
    distributed: DistributedSampler | None = None
    draws_global_seed: bool = False
    batch_sampler: Any = None
    stream: bool = False

    @property
    def custom_name(self) -> str:
        """The class name of the custom sampler (for messages)."""
        inner = getattr(self.batch_sampler, "sampler", None)
        if type(self.batch_sampler) is BatchSampler and inner is not None:
            return f"sampler {type(inner).__name__}"
        return f"batch_sampler {type(self.batch_sampler).__name__}"


def inspect_source(source: DataLoader | Dataset, what: str) -> DataSource:
    """Read what a DataLoader (or a bare Dataset) says about batches and order.

    Raises:
        TypeError: an iterable-style dataset for anything but training, or something that
            is not a dataset.
        ValueError: several DataLoaders (a list, tuple or dict of them), an empty dataset,
            or a DataLoader with ``batch_size=None`` (no batching).
    """
    _refuse_several_loaders(source, what)
    if isinstance(source, DataLoader):
        dataset = source.dataset
    else:
        dataset = source
    if isinstance(dataset, IterableDataset):
        return _stream_source(source, dataset, what)
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise TypeError(
            "nanotrain needs a map-style dataset (with __len__ and __getitem__) so that it can "
            "shard it across processes and resume at the exact next sample; got "
            f"{type(dataset).__name__} as the {what} data"
        )
    if len(dataset) == 0:
        raise ValueError(f"the dataset {type(dataset).__name__} is empty; check the data path")
    if not isinstance(source, DataLoader):
        return DataSource(dataset, what)
    data = DataSource(dataset, what, extra={name: getattr(source, name) for name in KEPT_SETTINGS})
    data.draws_global_seed = source.generator is None
    batches = source.batch_sampler
    if batches is None:
        raise ValueError(
            f"the {what} DataLoader has batch_size=None (no automatic batching); nanotrain "
            "batches the samples itself: give the DataLoader a batch_size"
        )
    size = getattr(batches, "batch_size", None)
    data.batch_size = size if type(size) is int else None
    data.drop_last = bool(getattr(batches, "drop_last", False))
    sampler = batches.sampler if type(batches) is BatchSampler else None
    if type(sampler) is SequentialSampler:
        data.shuffle = False
    elif type(sampler) is RandomSampler and _plain_permutation(sampler):
        data.shuffle = True
    elif type(sampler) is DistributedSampler:
        data.shuffle, data.seed, data.distributed = sampler.shuffle, sampler.seed, sampler
        data.drop_last = data.drop_last or sampler.drop_last
    else:
        data.batch_sampler = batches
    return data


def _stream_source(source: Any, dataset: IterableDataset, what: str) -> DataSource:
    """A training `IterableDataset` (bare or in a DataLoader without workers)."""
    if what != "training":
        raise TypeError(
            f"the {what} data is an IterableDataset ({type(dataset).__name__}); nanotrain reads "
            f"{what} data as a map-style dataset (__len__ and __getitem__), so that every "
            "sample is read once under any layout: pass e.g. a list of its samples, or a "
            "datasets.Dataset (not streaming)"
        )
    data = DataSource(dataset, what, stream=True, shuffle=False)
    if not isinstance(source, DataLoader):
        return data
    if source.num_workers:
        raise ValueError(
            f"the training DataLoader reads the IterableDataset {type(dataset).__name__} with "
            f"num_workers={source.num_workers}; nanotrain reads a stream in the training "
            "process (each replica its share, in an order it can resume): use num_workers=0"
        )
    if source.batch_size is None:
        raise ValueError(
            "the training DataLoader has batch_size=None (no automatic batching); nanotrain "
            "batches the samples itself: give the DataLoader a batch_size"
        )
    data.batch_size, data.drop_last = source.batch_size, source.drop_last
    data.extra = {"collate_fn": source.collate_fn}
    return data


def _refuse_several_loaders(source: Any, what: str) -> None:
    """Lightning runs a list of DataLoaders one after the other (`dataloader_idx`); nanotrain
    reads one."""
    items = source.values() if isinstance(source, dict) else source
    if isinstance(source, list | tuple | dict) and any(isinstance(i, DataLoader) for i in items):
        raise ValueError(
            f"got {len(source)} {what} DataLoaders; nanotrain reads one {what} DataLoader: "
            "pass one (join the datasets with torch.utils.data.ConcatDataset, or run one "
            "validate / test / predict call per DataLoader)"
        )


def _plain_permutation(sampler: RandomSampler) -> bool:
    """A RandomSampler that draws one permutation of the whole set (shuffle=True)."""
    return not sampler.replacement and sampler._num_samples is None


def resolve_micro_batch(requested: int | None, data: DataSource, default: int | None) -> int:
    """The micro batch size that reads `data`: the Trainer's `requested` one, else the
    DataLoader's batch_size, else `default` (e.g. the training micro batch for a bare
    validation Dataset), else 1.

    Raises:
        ValueError: the Trainer's micro_batch_size and the DataLoader's batch_size differ, or
            a micro_batch_size is set for a batch sampler that has no batch size.
    """
    if requested is None:
        return data.batch_size or default or 1
    if data.batch_size is not None and data.batch_size != requested:
        raise ValueError(
            f"the {data.what} DataLoader has batch_size={data.batch_size} but the Trainer has "
            f"micro_batch_size={requested}; they say the same thing and must agree: drop "
            f"micro_batch_size (the DataLoader's batch_size is then the micro batch) or build "
            f"the DataLoader with batch_size={requested}"
        )
    if data.batch_sampler is not None and data.batch_size is None:
        raise ValueError(
            f"the {data.what} DataLoader's {data.custom_name} makes its own batches, which "
            f"micro_batch_size={requested} cannot resize; drop micro_batch_size"
        )
    return requested


def resolve_global_batch(requested: Any, micro: int, dp: int) -> tuple[int, int]:
    """(global_batch_size, accumulate_grad_batches) from the Trainer's settings as given:
    ``accumulate_grad_batches × micro × dp`` (Lightning's meaning), the given
    global_batch_size, or ``micro × dp`` (no accumulation).

    Raises:
        ValueError: accumulate_grad_batches and global_batch_size disagree, or the global
            batch is not a multiple of micro × dp.
    """
    per_step = micro * dp
    accumulate, total = requested.accumulate_grad_batches, requested.global_batch_size
    if accumulate is not None:
        implied = accumulate * per_step
        if total is not None and total != implied:
            raise ValueError(
                f"accumulate_grad_batches={accumulate} means global_batch_size={implied} "
                f"(accumulate_grad_batches × micro batch {micro} × data-parallel size {dp}), but "
                f"global_batch_size={total} was given; set only one of them"
            )
        return implied, accumulate
    if total is None:
        return per_step, 1
    if total % per_step:
        raise ValueError(
            f"global_batch_size={total} is not divisible by micro_batch_size={micro} × "
            f"data-parallel size {dp}; pick a global batch that is a multiple of {per_step}"
        )
    return total, total // per_step


def resolve_shuffle(requested: bool | None, data: DataSource) -> bool | None:
    """Whether the training data is shuffled: the DataLoader's sampler decides, and a Trainer
    `shuffle` of True/False must agree with it; a bare Dataset follows the Trainer (None:
    shuffled). None for a custom sampler or batch sampler (it keeps its own order).

    Raises:
        ValueError: the Trainer's shuffle contradicts the DataLoader's sampler, or is set for
            a custom sampler.
    """
    if data.stream:
        if requested:
            raise ValueError(
                "Trainer(shuffle=True) cannot shuffle the training IterableDataset: a stream "
                "is read in its own order; shuffle in the dataset (e.g. datasets' "
                ".shuffle(seed=..., buffer_size=...)) and drop the Trainer's shuffle"
            )
        return False
    if data.batch_sampler is not None:
        if requested is not None:
            raise ValueError(
                f"Trainer(shuffle={requested}) cannot reorder the training DataLoader's "
                f"{data.custom_name}, which decides the order itself; drop the Trainer's "
                "shuffle"
            )
        return None
    if data.shuffle is None:  # a bare Dataset
        return True if requested is None else requested
    if requested is not None and requested != data.shuffle:
        if data.distributed is not None:
            sampler = f"DistributedSampler(shuffle={data.shuffle})"
        elif data.shuffle:
            sampler = "RandomSampler (shuffle=True)"
        else:
            sampler = "SequentialSampler (shuffle=False)"
        raise ValueError(
            f"Trainer(shuffle={requested}) contradicts the training DataLoader's {sampler}; "
            f"the DataLoader decides the order: drop the Trainer's shuffle, or build the "
            f"DataLoader with shuffle={requested}"
        )
    return data.shuffle


def warn_if_shuffled(data: DataSource) -> None:
    """Evaluation data is read in order: say so when its DataLoader asks for shuffling."""
    if data.shuffle:
        warnings.warn(
            f"the {data.what} DataLoader shuffles (shuffle=True), but nanotrain reads "
            f"{data.what} data in order, every sample once; build it with shuffle=False to "
            "silence this",
            UserWarning,
            stacklevel=5,
        )
