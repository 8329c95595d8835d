"""`TokenDataModule`: prepared token shards (or the built-in demo corpus) as a LightningDataModule."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader, Dataset

from .blend import BlendedDataset, PartsValidationDataset, merged_metadata, parse_blend
from .dataset import TokenShardDataset, check_vocab
from .demo import DEFAULT_DEMO_BYTES, default_cache_dir, prepare_demo
from .metadata import read_metadata
from .tokenizers import Tokenizer, load_tokenizer


class TokenDataModule(pl.LightningDataModule):
    """Next-token windows of a prepared corpus for the nanotrain Trainer or `lightning.Trainer`.

    Batches are ``{"input_ids": LongTensor[B, seq_len], "labels": LongTensor[B, seq_len]}``
    (labels are the inputs shifted by one token; see `TokenShardDataset`).

    Both Trainers read the loaders with their batch size; the nanotrain Trainer reads them in
    a `ResumableDistributedSampler`'s order (training windows shuffled unless
    ``shuffle=False``, validation in order).

    A blend (``data_path={"corpus/a": 0.7, "corpus/b": 0.3}``) serves each corpus's training
    windows at its weight (`BlendedDataset`: weights normalised, a fixed index, so order,
    sharding and resume are those of one map-style dataset); validation reads every part's
    validation windows once, each micro batch from one part, and ``LanguageModelModule`` logs
    ``val/loss`` over all of them and ``val/loss/<name>`` for each part (``part_names``).

    Args:
        data_path: a folder written by `nanotrain prepare`, or a blend ``{folder: weight}``
            of such folders (prepared with the same tokenizer); None uses the demo corpus
            (the Python standard library's source), prepared once into
            ``$NANOTRAIN_CACHE/demo-<tokenizer>-<demo_max_bytes>`` (default cache
            ``~/.cache/nanotrain``).
        tokenizer: ``"byte"`` or a ``tokenizer.json`` path, for the demo corpus. A prepared
            ``data_path`` carries its own tokenizer in its metadata, which wins.
        seq_len: tokens per example.
        micro_batch_size: batch size of the returned DataLoaders; None: the nanotrain
            Trainer's ``micro_batch_size`` when it is given one, else 8.
        num_workers: DataLoader worker processes.
        shuffle: shuffle the training windows every epoch (the training DataLoader's
            ``shuffle``, which the nanotrain Trainer follows).
        demo_max_bytes: size of the demo corpus in bytes of source text.

    Raises:
        ValueError: an argument out of range (at construction); a missing or unprepared
            ``data_path`` (in `prepare_data`/`setup`, with a hint to run `nanotrain prepare`);
            a split shorter than one example (in `setup`); a blend with a weight that is not
            positive, or of corpora prepared with different tokenizers.
    """

    def __init__(
        self,
        data_path: str | dict[str, float] | None = None,
        tokenizer: str = "byte",
        seq_len: int = 128,
        micro_batch_size: int | None = None,
        num_workers: int = 0,
        demo_max_bytes: int = DEFAULT_DEMO_BYTES,
        shuffle: bool = True,
    ) -> None:
        super().__init__()
        for name, value, low in (
            ("seq_len", seq_len, 1),
            ("num_workers", num_workers, 0),
            ("demo_max_bytes", demo_max_bytes, 1),
        ):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if micro_batch_size is not None and (
            not isinstance(micro_batch_size, int) or micro_batch_size < 1
        ):
            raise ValueError(
                f"micro_batch_size must be an int >= 1 or None, got {micro_batch_size!r}"
            )
        self.save_hyperparameters()
        self.data_path = data_path
        # [(name, folder, normalised weight)] of a blend; None for one corpus
        self.blend = parse_blend(data_path) if isinstance(data_path, Mapping) else None
        self._part_metadata: list[dict[str, Any]] = []
        self.part_names: list[str] = []  # the validation parts, in `val_dataset` order
        self._val_parts: list[TokenShardDataset] = []
        self.tokenizer_spec = tokenizer
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.num_workers, self.demo_max_bytes = num_workers, demo_max_bytes
        self.shuffle = bool(shuffle)
        self._metadata: dict[str, Any] | None = None
        self._tokenizer: Tokenizer | None = None
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None

    # -- where the data lives ------------------------------------------------------------------
    def _demo_dir(self) -> Path:
        name = load_tokenizer(self.tokenizer_spec).name
        return default_cache_dir() / f"demo-{name}-{self.demo_max_bytes}"

    @property
    def path(self) -> Path:
        """The prepared folder this module reads (the demo cache folder when no data_path; a
        blend's first corpus)."""
        if self.blend is not None:
            return self.blend[0][1]
        if self.data_path is None:
            return self._demo_dir()
        return Path(os.fspath(self.data_path)).expanduser()

    def _ensure_prepared(self) -> dict[str, Any]:
        if self.data_path is None:
            # Idempotent and safe under races, so every rank may call it: the ranks that
            # come after local rank 0's `prepare_data` find the cache and return at once.
            prepare_demo(self.path, self.tokenizer_spec, self.demo_max_bytes)
        if self.blend is None:
            self._metadata = read_metadata(self.path)
            return self._metadata
        self._part_metadata = [read_metadata(path) for _, path, _ in self.blend]
        names = [name for name, _, _ in self.blend]
        self._metadata = merged_metadata(self._part_metadata, names)
        return self._metadata

    @property
    def metadata(self) -> dict[str, Any]:
        """The corpus's ``metadata.json`` (prepares the demo corpus on first use)."""
        return self._metadata if self._metadata is not None else self._ensure_prepared()

    @property
    def loader_batch_size(self) -> int:
        """The batch size of the loaders: ``micro_batch_size``, else the nanotrain Trainer's
        ``micro_batch_size`` when it was given one (so that the two agree), else 8."""
        if self.micro_batch_size is not None:
            return self.micro_batch_size
        requested = getattr(getattr(self, "trainer", None), "requested_settings", None)
        return getattr(requested, "micro_batch_size", None) or 8

    # -- LightningDataModule hooks -------------------------------------------------------------
    def prepare_data(self) -> None:
        """Prepare the demo corpus if needed, or check that ``data_path`` is prepared data."""
        self._ensure_prepared()

    def setup(self, stage: str | None = None) -> None:
        """Open the splits ``stage`` needs: train (and val) for "fit", val for "validate".

        A val split with no tokens at all (``val_fraction=0``) leaves ``val_dataset`` None.
        """
        meta = self._ensure_prepared()
        if self.blend is not None:
            self._setup_blend(stage)
            return
        if stage in (None, "fit"):
            self.train_dataset = TokenShardDataset(meta, "train", self.seq_len)
        if stage in (None, "fit", "validate") and meta["splits"]["val"]["tokens"] > 0:
            self.val_dataset = TokenShardDataset(meta, "val", self.seq_len)

    def _setup_blend(self, stage: str | None) -> None:
        assert self.blend is not None
        if stage in (None, "fit"):
            parts = [TokenShardDataset(m, "train", self.seq_len) for m in self._part_metadata]
            self.train_dataset = BlendedDataset(parts, [w for _, _, w in self.blend])
        if stage in (None, "fit", "validate"):
            # a part without validation tokens has no val/loss/<name>
            with_val = [
                (name, meta)
                for (name, _, _), meta in zip(self.blend, self._part_metadata, strict=True)
                if meta["splits"]["val"]["tokens"] > 0
            ]
            self.part_names = [name for name, _ in with_val]
            self._val_parts = [TokenShardDataset(m, "val", self.seq_len) for _, m in with_val]
            self.val_dataset = PartsValidationDataset(self._val_parts) if with_val else None

    def _data_parallel_size(self) -> int:
        """Replicas that share the validation batches: the nanotrain Trainer's data-parallel
        size, `lightning.Trainer`'s world size, 1 without a Trainer."""
        trainer = getattr(self, "trainer", None)
        strategy = getattr(trainer, "strategy", None)
        if callable(getattr(strategy, "data_shard", None)):
            return int(strategy.data_shard().count)
        return int(getattr(trainer, "world_size", 1) or 1)

    def train_dataloader(self) -> DataLoader:
        """Training windows (shuffled unless ``shuffle=False``), `loader_batch_size` per batch,
        last partial one dropped."""
        if self.train_dataset is None:
            self.setup("fit")
        return DataLoader(
            self.train_dataset,
            batch_size=self.loader_batch_size,
            shuffle=self.shuffle,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader | None:
        """Validation windows in order; None when the corpus has no validation tokens."""
        if self.val_dataset is None:
            self.setup("validate")
        if self.val_dataset is None:
            return None
        if self.blend is not None:
            # each micro batch from one part (see PartsValidationDataset), for any layout
            pad_to = self.loader_batch_size * self._data_parallel_size()
            self.val_dataset = PartsValidationDataset(self._val_parts, pad_to)
        return DataLoader(
            self.val_dataset,
            batch_size=self.loader_batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    # -- what the model needs to know ----------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer the corpus was prepared with (rebuilt from its metadata)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.metadata["tokenizer"])
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the corpus's tokenizer (every token id is below it)."""
        return int(self.metadata["vocab_size"])

    @property
    def bytes_per_token(self) -> float:
        """UTF-8 bytes of text per token in the val split (train if val is empty).

        Validation bits per byte = loss in nats / ln 2 / bytes_per_token.
        """
        return float(self.metadata["bytes_per_token"])

    def validate_vocab(self, model_vocab_size: int) -> None:
        """Raise ValueError if the corpus holds a token id >= ``model_vocab_size``."""
        check_vocab(self.metadata, model_vocab_size)
