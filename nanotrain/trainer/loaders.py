"""Re-batch a user's DataLoader into microbatches read in the Trainer's resumable order."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from nanotrain.strategies.base import DataShard


def rebatch(
    loader_or_dataset: DataLoader | Dataset,
    *,
    micro_batch_size: int,
    global_batch_size: int,
    shard: DataShard,
    shuffle: bool,
    seed: int,
) -> tuple[DataLoader, Any]:
    """Return (loader, sampler): the same dataset, collate function and worker settings, read
    `micro_batch_size` at a time in the order of a `ResumableDistributedSampler`.

    Raises:
        TypeError: for an `IterableDataset` (its position cannot be saved for an exact resume)
            or something that is neither a DataLoader nor a map-style Dataset.
        ValueError: for an empty dataset or one smaller than a global batch.
    """
    from nanotrain.data.sampler import ResumableDistributedSampler

    dataset, extra = _unwrap(loader_or_dataset)
    sampler = ResumableDistributedSampler(
        len(dataset),
        global_batch_size=global_batch_size,
        shard_index=shard.index,
        shard_count=shard.count,
        shuffle=shuffle,
        seed=seed,
    )
    # A generator of its own: otherwise every iter(loader) draws the workers' base seed from
    # the global torch RNG, so re-creating the iterator (on resume, or for each validation)
    # would shift the dropout masks of the following steps and break an exact resume.
    loader = DataLoader(
        dataset,
        batch_size=micro_batch_size,
        sampler=sampler,
        drop_last=True,
        generator=torch.Generator().manual_seed(seed),
        **extra,
    )
    return loader, sampler


def build_loaders(
    settings: Any, shard: DataShard, datamodule: Any, stage: str, train_source: Any, val_source: Any
) -> tuple[DataLoader | None, Any, DataLoader | None]:
    """(train loader, train sampler, val loader) for `stage` ("fit" or "validate").

    Sources default to the datamodule's `train_dataloader()` / `val_dataloader()`. Validation
    reads the same samples under any layout (`validation_loader`); it is skipped when
    `limit_val_batches` is 0 or there is no validation data.

    Raises:
        ValueError: `fit` without training data (and everything `rebatch` raises).
    """
    train_loader = train_sampler = val_loader = None
    if stage == "fit":
        if train_source is None and datamodule is not None:
            train_source = datamodule.train_dataloader()
        if train_source is None:
            raise ValueError("fit needs training data: pass a datamodule or train_dataloaders")
        train_loader, train_sampler = rebatch(
            train_source,
            micro_batch_size=settings.micro_batch_size,
            global_batch_size=settings.global_batch_size,
            shard=shard,
            shuffle=settings.shuffle,
            seed=settings.seed,
        )
    if val_source is None and datamodule is not None and _overrides(datamodule, "val_dataloader"):
        val_source = datamodule.val_dataloader()
    if val_source is not None and settings.limit_val_batches != 0:
        val_loader = validation_loader(val_source, settings, shard)
    return train_loader, train_sampler, val_loader


def validation_loader(source: DataLoader | Dataset, settings: Any, shard: DataShard) -> DataLoader:
    """The validation loader of this data-parallel shard: the first samples of the set
    (`limit_val_batches` counted in global batches of `global_batch_size`, or a fraction of
    the set: `validation_sample_count`) dealt over the shards, `micro_batch_size` at a time,
    none dropped; every shard yields the same number of batches (padding batches from
    `loader.batch_sampler.num_real_batches` on; see `ValidationBatchSampler`).

    Raises:
        TypeError, ValueError: as `rebatch`.
    """
    from nanotrain.data.sampler import ValidationBatchSampler, validation_sample_count

    dataset, extra = _unwrap(source)
    count = validation_sample_count(
        settings.limit_val_batches, len(dataset), settings.global_batch_size
    )
    sampler = ValidationBatchSampler(count, settings.micro_batch_size, shard.index, shard.count)
    # its own generator, as in `rebatch`: iterating must not draw from the global RNG
    generator = torch.Generator().manual_seed(settings.seed)
    return DataLoader(dataset, batch_sampler=sampler, generator=generator, **extra)


def _unwrap(loader_or_dataset: DataLoader | Dataset) -> tuple[Dataset, dict[str, Any]]:
    """(dataset, DataLoader settings to keep) of a DataLoader or map-style Dataset.

    Raises:
        TypeError: for an iterable-style dataset; ValueError: for an empty one.
    """
    if isinstance(loader_or_dataset, DataLoader):
        dataset = loader_or_dataset.dataset
        extra = dict(
            collate_fn=loader_or_dataset.collate_fn,
            num_workers=loader_or_dataset.num_workers,
            pin_memory=loader_or_dataset.pin_memory,
        )
    else:
        dataset, extra = loader_or_dataset, {}
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise TypeError(
            "nanotrain needs a map-style dataset (with __len__ and __getitem__) so that it can "
            "shard it across processes and resume at the exact next sample; got "
            f"{type(dataset).__name__}"
        )
    if len(dataset) == 0:
        raise ValueError(f"the dataset {type(dataset).__name__} is empty; check the data path")
    return dataset, extra


def _overrides(obj: Any, name: str) -> bool:
    """Whether a LightningDataModule subclass defines hook `name` itself."""
    import lightning.pytorch as pl

    return getattr(type(obj), name, None) is not getattr(pl.LightningDataModule, name, None)
