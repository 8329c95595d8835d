"""`TokenShardDataset`: fixed-length training windows over memory-mapped token shards."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from .metadata import SPLITS, read_metadata

_HINT = "run `nanotrain prepare` first"


def check_vocab(metadata: dict[str, Any], model_vocab_size: int) -> None:
    """Raise ValueError if a corpus (its metadata) holds a token id >= ``model_vocab_size``."""
    max_id = int(metadata["max_token_id"])
    if max_id >= model_vocab_size:
        raise ValueError(
            f"the data holds token id {max_id} (tokenizer vocab_size "
            f"{metadata['vocab_size']}) but the model's vocab_size is {model_vocab_size}; set "
            f"the model's vocab_size to at least {max_id + 1} or prepare the data with a "
            "matching tokenizer"
        )


class TokenShardDataset(Dataset):
    """Map-style dataset of next-token-prediction windows over one split of a prepared corpus.

    The split's shards are read as one token stream ``t``. Item ``i`` is the window
    ``t[i*seq_len : i*seq_len + seq_len + 1]``: ``input_ids`` are its first ``seq_len``
    tokens and ``labels`` its last ``seq_len`` (the inputs shifted by one). Windows do not
    overlap in their inputs, so no token is a label twice in an epoch;
    there are ``(num_tokens - 1) // seq_len`` of them and a tail shorter than a window is unused.
    Windows may span shard files and document boundaries (documents are separated by EOS).

    Shards are opened with ``np.memmap`` lazily on first access and never pickled, so the
    dataset can be handed to forked or spawned DataLoader workers cheaply.

    Args:
        path_or_metadata: a prepared folder, its ``metadata.json``, or the dict returned by
            `read_metadata` (must carry ``"root"``).
        split: ``"train"`` or ``"val"``.
        seq_len: tokens per training example, >= 1.

    Raises:
        ValueError: missing path or corrupt/missing metadata or shard files; unknown split;
            a split with fewer than ``seq_len + 1`` tokens.
    """

    def __init__(
        self,
        path_or_metadata: str | os.PathLike[str] | dict[str, Any],
        split: str = "train",
        seq_len: int = 128,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        if isinstance(path_or_metadata, dict):
            self.metadata = path_or_metadata
        else:
            self.metadata = read_metadata(path_or_metadata)
        self.root = Path(self.metadata["root"])
        self.split, self.seq_len = split, seq_len
        self.dtype = np.dtype(self.metadata["dtype"])
        shards = self.metadata["splits"][split]["shards"]
        self._files = [self.root / shard["file"] for shard in shards]
        counts = [int(shard["tokens"]) for shard in shards]
        self._check_files(counts)
        # offsets[k] = index of shard k's first token in the split's stream.
        self._offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.num_tokens = int(self._offsets[-1])
        if self.num_tokens < seq_len + 1:
            raise ValueError(
                f"dataset '{split}' has {self.num_tokens} tokens, fewer than "
                f"seq_len+1={seq_len + 1} needed for one example; use a smaller seq_len, more "
                "text, or (for 'val') a larger val_fraction when preparing"
            )
        self._mmaps: list[np.memmap] | None = None

    def _check_files(self, counts: list[int]) -> None:
        for file, count in zip(self._files, counts, strict=True):
            if not file.is_file():
                raise ValueError(f"shard '{file}' is missing; {_HINT} again")
            if file.stat().st_size != count * self.dtype.itemsize:
                raise ValueError(
                    f"shard '{file}' has {file.stat().st_size} bytes, metadata says "
                    f"{count} {self.dtype.name} tokens; the data is corrupt, {_HINT} again"
                )

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the tokenizer the corpus was prepared with."""
        return int(self.metadata["vocab_size"])

    def validate_vocab(self, model_vocab_size: int) -> None:
        """Check that every token id in the corpus is a valid row of the model's embedding.

        Raises:
            ValueError: the corpus's largest token id is >= ``model_vocab_size``.
        """
        check_vocab(self.metadata, model_vocab_size)

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.seq_len

    def _open(self) -> list[np.memmap]:
        if self._mmaps is None:
            self._mmaps = [np.memmap(f, dtype=self.dtype, mode="r") for f in self._files]
        return self._mmaps

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the split's stream as int64, across shard boundaries."""
        mmaps = self._open()
        first = int(np.searchsorted(self._offsets, start, side="right")) - 1
        parts, pos, shard = [], start, first
        while pos < stop:
            local = pos - int(self._offsets[shard])
            take = min(stop, int(self._offsets[shard + 1])) - pos
            parts.append(mmaps[shard][local : local + take])
            pos += take
            shard += 1
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """``{"input_ids": LongTensor[seq_len], "labels": LongTensor[seq_len]}``."""
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} examples")
        start = index * self.seq_len
        window = torch.from_numpy(self.tokens(start, start + self.seq_len + 1))  # (seq_len+1,)
        return {"input_ids": window[:-1], "labels": window[1:]}

    def __getstate__(self) -> dict[str, Any]:
        # Memory maps are per process; workers reopen them on first access.
        state = self.__dict__.copy()
        state["_mmaps"] = None
        return state

    def __repr__(self) -> str:
        return (
            f"TokenShardDataset('{self.root}', split='{self.split}', seq_len={self.seq_len}, "
            f"tokens={self.num_tokens}, examples={len(self)})"
        )
