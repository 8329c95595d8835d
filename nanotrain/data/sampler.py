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
