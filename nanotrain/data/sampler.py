"""`ResumableDistributedSampler`: the sample order, identical for 1 or N data-parallel shards.

Per epoch, a permutation ``perm`` of ``range(dataset_len)`` is drawn from ``(seed, epoch)``
(identity without shuffle) and cut into global batches of ``G = global_batch_size``; the last
incomplete one is dropped. Global batch ``s`` is ``perm[s*G:(s+1)*G]``, and shard ``r`` of ``n``
reads the entries of that window at offsets ``r, r+n, r+2n, ...``. So the union over shards of
one optimizer step's samples is exactly the single-process global batch, whatever ``n`` is.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


class ResumableDistributedSampler(torch.utils.data.Sampler[int]):
    """Yields this data-parallel shard's sample indices and remembers how far it got.

    ``position`` counts the samples this shard has consumed in the current epoch; the
    Trainer reports them with `advance` after each optimizer step. `iter()` starts after them,
    so a sampler rebuilt from `state_dict` continues with exactly the next sample. The state is
    the same on every shard and can be loaded with a different ``shard_count`` (the consumed
    global batches are kept), as long as the global batch size stays the same.

    Args:
        dataset_len: number of samples in the dataset.
        global_batch_size: samples per optimizer step over all shards (``G``).
        shard_index: this shard's index ``r`` in ``[0, shard_count)``.
        shard_count: number of data-parallel shards ``n``; must divide ``G``.
        shuffle: draw a fresh permutation per epoch; otherwise use ``range(dataset_len)``.
        seed: seed of the permutation, >= 0; epoch ``e`` uses ``(seed, e)``.

    Raises:
        ValueError: ``G`` not divisible by ``n``, ``dataset_len < G``, or an argument out of
            range.
    """

    def __init__(
        self,
        dataset_len: int,
        global_batch_size: int,
        shard_index: int = 0,
        shard_count: int = 1,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        if global_batch_size < 1 or shard_count < 1 or seed < 0:
            raise ValueError(
                f"need global_batch_size >= 1, shard_count >= 1 and seed >= 0; got "
                f"{global_batch_size}, {shard_count}, {seed}"
            )
        if not 0 <= shard_index < shard_count:
            raise ValueError(f"shard_index must be in [0, {shard_count}), got {shard_index}")
        if global_batch_size % shard_count:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by the "
                f"{shard_count} data-parallel shards; choose a multiple of {shard_count}"
            )
        if dataset_len < global_batch_size:
            raise ValueError(
                f"dataset has {dataset_len} samples, fewer than one global batch of "
                f"{global_batch_size}; use a smaller global batch (or seq_len) or more data"
            )
        self.dataset_len, self.global_batch_size = dataset_len, global_batch_size
        self.shard_index, self.shard_count = shard_index, shard_count
        self.shuffle, self.seed = shuffle, seed
        self.epoch = 0
        self.position = 0

    @property
    def num_steps(self) -> int:
        """Optimizer steps (full global batches) per epoch."""
        return self.dataset_len // self.global_batch_size

    @property
    def shard_batch_size(self) -> int:
        """Samples this shard reads per optimizer step (``G / n``)."""
        return self.global_batch_size // self.shard_count

    def epoch_indices(self, epoch: int | None = None) -> np.ndarray:
        """This shard's indices of a whole epoch (default: the current one), shape ``(len,)``."""
        epoch = self.epoch if epoch is None else epoch
        if self.shuffle:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.dataset_len)
        else:
            perm = np.arange(self.dataset_len)
        used = perm[: self.num_steps * self.global_batch_size]
        # (num_steps, G) → columns r, r+n, ... → (num_steps, G/n), read row by row.
        return used.reshape(self.num_steps, self.global_batch_size)[
            :, self.shard_index :: self.shard_count
        ].reshape(-1)

    def __iter__(self) -> Iterator[int]:
        """This shard's remaining indices of the current epoch, after ``position``."""
        return iter(self.epoch_indices()[self.position :].tolist())

    def __len__(self) -> int:
        """Indices this shard yields in a full epoch."""
        return self.num_steps * self.shard_batch_size

    def set_epoch(self, epoch: int) -> None:
        """Switch to ``epoch`` and rewind to its first sample."""
        self.epoch = int(epoch)
        self.position = 0

    def advance(self, num_samples: int) -> None:
        """Record that this shard consumed ``num_samples`` more samples of the current epoch.

        Raises:
            ValueError: negative, or past the end of the epoch.
        """
        if num_samples < 0 or self.position + num_samples > len(self):
            raise ValueError(
                f"cannot advance by {num_samples} from position {self.position}: the epoch "
                f"has {len(self)} samples on this shard; call set_epoch() for the next epoch"
            )
        self.position += int(num_samples)

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "position", "consumed_global", ...}``; the same on every shard."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "consumed_global": self.position * self.shard_count,
            "shard_count": self.shard_count,
            "dataset_len": self.dataset_len,
            "global_batch_size": self.global_batch_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the epoch and position; the next `iter()` yields the next unseen sample.

        Raises:
            ValueError: the saved order (dataset_len, global_batch_size, shuffle, seed)
                differs from this sampler's, or the consumed samples do not split evenly
                over this sampler's shards.
        """
        for key in ("dataset_len", "global_batch_size", "shuffle", "seed"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume: the checkpoint's sampler has {key}={state[key]!r}, this "
                    f"one {getattr(self, key)!r}; the sample order would differ. Use the same "
                    "data, seq_len, global batch size and seed"
                )
        consumed = state.get("consumed_global")
        if consumed is None:
            consumed = int(state["position"]) * int(state.get("shard_count", self.shard_count))
        if consumed % self.shard_count:
            raise ValueError(
                f"cannot resume: {consumed} consumed samples do not split over "
                f"{self.shard_count} shards; resume at an optimizer-step boundary"
            )
        position = consumed // self.shard_count
        if position > len(self):
            raise ValueError(f"saved position {position} is past the epoch's end {len(self)}")
        self.epoch, self.position = int(state["epoch"]), position


def validation_sample_count(limit: int | float | None, dataset_len: int, global_batch: int) -> int:
    """How many validation samples (the first ones, in order) a validation run reads.

    None: all of them; a float in (0, 1]: that fraction of the set (rounded down, at least
    one sample); an int n (or a float above 1, taken as an int): n global batches of
    ``global_batch`` samples, at most the whole set; 0: none. The count depends only on the
    data and the global batch, never on how many processes read it.
    """
    if limit is None:
        return dataset_len
    if isinstance(limit, float) and limit <= 1.0:
        return max(1, int(dataset_len * limit)) if limit > 0 else 0
    return min(int(limit) * global_batch, dataset_len)


class ValidationBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Batches of one data-parallel shard's validation samples; every shard yields the same
    number of batches.

    The first ``num_samples`` samples (in order) are dealt to ``shard_count`` shards like
    cards (shard ``r`` reads ``r, r + n, r + 2n, ...``), so their union is the same set for
    any ``n``, none dropped, and read ``batch_size`` at a time (the last batch may be
    smaller). A shard with fewer batches than the others then yields padding batches
    (copies of sample 0, ``batch_size`` of them) until every shard has yielded
    `num_batches`: under expert parallelism a forward is a collective that every rank must
    enter. The batches from index `num_real_batches` on are padding: the validation loop
    runs them without recording anything.

    Args:
        num_samples: samples of the validation run (see `validation_sample_count`), >= 1.
        batch_size: samples per batch (the micro batch size), >= 1.
        shard_index, shard_count: this shard ``r`` and the number ``n`` of shards.

    Raises:
        ValueError: for an argument out of range.
    """

    def __init__(
        self, num_samples: int, batch_size: int, shard_index: int = 0, shard_count: int = 1
    ) -> None:
        if num_samples < 1 or batch_size < 1 or not 0 <= shard_index < shard_count:
            raise ValueError(
                f"need num_samples >= 1, batch_size >= 1 and 0 <= shard_index < shard_count; "
                f"got {num_samples}, {batch_size}, {shard_index}, {shard_count}"
            )
        self.indices = list(range(shard_index, num_samples, shard_count))
        self.batch_size = batch_size
        self.num_real_batches = -(-len(self.indices) // batch_size)
        most = -(-num_samples // shard_count)  # shard 0 holds the most samples
        self.num_batches = -(-most // batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        b = self.batch_size
        for start in range(0, len(self.indices), b):
            yield self.indices[start : start + b]
        for _ in range(self.num_batches - self.num_real_batches):
            yield [0] * b

    def __len__(self) -> int:
        return self.num_batches
