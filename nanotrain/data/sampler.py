"""`ResumableDistributedSampler`: the sample order, identical for 1 or N data-parallel shards.

Per epoch, a permutation ``perm`` of ``range(dataset_len)`` is drawn from ``seed + epoch``
(identity without shuffle) and cut into global batches of ``G = global_batch_size``; the last
incomplete one is dropped. Global batch ``s`` is ``perm[s*G:(s+1)*G]``, and shard ``r`` of ``n``
reads the entries of that window at offsets ``r, r+n, r+2n, ...``. So the union over shards of
one optimizer step's samples is exactly the single-process global batch, whatever ``n`` is.

This is `torch.utils.data.DistributedSampler`'s order for the same seed (the permutation
``torch.randperm(dataset_len)`` of a generator seeded ``seed + epoch``, rank ``r`` reading
positions ``r, r+n, ...``), which Lightning puts under every DataLoader under DDP: with
``G = micro_batch_size × n × accumulation`` the microbatches of every rank are Lightning's
whenever the dataset splits into whole global batches.

`ResumableBatchList` keeps a DataLoader's own batch sampler (a custom ``batch_sampler`` or
``sampler``) on one data-parallel shard: the batches it yields, in its order, resumable.
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
        seed: seed of the permutation, >= 0; epoch ``e`` uses ``seed + e`` (as
            `DistributedSampler`).

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
        # "torch": DistributedSampler's permutation. "numpy": the one of nanotrain before it
        # matched DistributedSampler, kept so that a checkpoint written then resumes exactly.
        self.permutation = "torch"

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
        if self.shuffle and self.permutation == "numpy":
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.dataset_len)
        elif self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            perm = torch.randperm(self.dataset_len, generator=generator).numpy()
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
            "permutation": self.permutation,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the epoch and position; the next `iter()` yields the next unseen sample.

        Raises:
            ValueError: the saved order (dataset_len, global_batch_size, shuffle, seed)
                differs from this sampler's, or the consumed samples do not split evenly
                over this sampler's shards.
        """
        if "batches" in state or state.get("kind") == "stream":
            what = (
                "a stream (IterableDataset)"
                if "kind" in state
                else ("the batches of the DataLoader's own batch_sampler (or sampler)")
            )
            raise ValueError(
                f"cannot resume: the checkpoint read {what}, this run a plain shuffled or "
                "sequential order; train with the same DataLoader"
            )
        for key in ("dataset_len", "global_batch_size", "shuffle", "seed"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume: the checkpoint's sampler has {key}={state[key]!r}, this "
                    f"one {getattr(self, key)!r}; the sample order would differ. Use the same "
                    "data, seq_len, global batch size and seed (Trainer(seed=...), or "
                    "lightning.seed_everything(...) before fit)"
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
        # a state without the key was written before the order became DistributedSampler's
        self.permutation = state.get("permutation", "numpy")


class ResumableBatchList(torch.utils.data.Sampler[list[int]]):
    """The batches of a DataLoader's own batch sampler, in its order, remembering how far it got
    (one data-parallel shard only).

    `set_epoch(e)` calls ``set_epoch(e)`` on the batch sampler and on its ``sampler`` where they
    have one (as Lightning does at each epoch), then draws the epoch's batches from it once and
    keeps them; `iter()` yields the kept batches after ``position``. The state holds the
    epoch's batches and the states of the samplers' ``generator`` attributes, so a sampler
    rebuilt from `state_dict` yields exactly the batches the interrupted run would have read,
    and later epochs draw as they would have: exact for batch samplers whose order depends on
    the epoch, on the global RNGs (restored with the checkpoint) or on a ``generator``
    attribute, which covers torch's samplers.

    Args:
        batch_sampler: the DataLoader's ``batch_sampler``: an iterable of index lists with
            ``__len__``.
        batch_size: the micro batch size the Trainer counts samples in (see `advance`).

    Raises:
        TypeError: a batch sampler without ``__len__`` (the epoch's length must be known
            before it is drawn).
    """

    def __init__(self, batch_sampler: Any, batch_size: int) -> None:
        try:
            self.num_batches = len(batch_sampler)
        except TypeError:
            raise TypeError(
                f"the DataLoader's batch sampler {type(batch_sampler).__name__} has no __len__; "
                "nanotrain needs the number of batches of an epoch before it starts: give it a "
                "__len__, or pass a plain DataLoader (batch_size=..., shuffle=...)"
            ) from None
        self.batch_sampler, self.batch_size = batch_sampler, batch_size
        self.epoch = 0
        self.position = 0  # batches consumed in the current epoch
        self.batches: list[list[int]] | None = None

    def _parts(self) -> list[Any]:
        parts = [self.batch_sampler]
        inner = getattr(self.batch_sampler, "sampler", None)
        if inner is not None and inner is not self.batch_sampler:
            parts.append(inner)
        return parts

    def _generators(self) -> list[torch.Generator]:
        gens = [getattr(part, "generator", None) for part in self._parts()]
        return [g for g in gens if isinstance(g, torch.Generator)]

    def set_epoch(self, epoch: int) -> None:
        """Switch to ``epoch``, rewind to its first batch and draw its batches.

        Raises:
            ValueError: the batch sampler yielded another number of batches than its len().
        """
        self.epoch, self.position = int(epoch), 0
        for part in self._parts():
            if callable(getattr(part, "set_epoch", None)):
                part.set_epoch(self.epoch)
        self.batches = [[int(i) for i in batch] for batch in self.batch_sampler]
        if len(self.batches) != self.num_batches:
            raise ValueError(
                f"the batch sampler {type(self.batch_sampler).__name__} yielded "
                f"{len(self.batches)} batches in epoch {self.epoch} but its len() is "
                f"{self.num_batches}; make __len__ return the number of batches it yields"
            )

    def __iter__(self) -> Iterator[list[int]]:
        """The current epoch's remaining batches, after ``position``."""
        if self.batches is None:
            self.set_epoch(self.epoch)
        return iter(self.batches[self.position :])

    def __len__(self) -> int:
        """Batches in a full epoch."""
        return self.num_batches

    def advance(self, num_samples: int) -> None:
        """Record that ``num_samples`` more samples (``batch_size`` per batch, as the Trainer
        counts them) of the current epoch were consumed.

        Raises:
            ValueError: not whole batches, or past the end of the epoch.
        """
        batches, rest = divmod(int(num_samples), self.batch_size)
        if rest or batches < 0 or self.position + batches > self.num_batches:
            raise ValueError(
                f"cannot advance by {num_samples} samples ({self.batch_size} per batch) from "
                f"batch {self.position} of {self.num_batches}; call set_epoch() for the next "
                "epoch"
            )
        self.position += batches

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "position", "batches", "num_batches", "generators"}``."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "batches": self.batches,
            "num_batches": self.num_batches,
            "generators": [g.get_state() for g in self._generators()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the epoch, its batches, the position and the samplers' generators.

        Raises:
            ValueError: the state is not of a `ResumableBatchList`, or of one with another
                number of batches or generators.
        """
        if "batches" not in state:
            raise ValueError(
                "cannot resume: the checkpoint read a plain shuffled or sequential order, this "
                "run the batches of the DataLoader's own batch_sampler (or sampler); train with "
                "the same DataLoader"
            )
        generators = self._generators()
        if state["num_batches"] != self.num_batches or len(state["generators"]) != len(generators):
            raise ValueError(
                f"cannot resume: the checkpoint's batch sampler had {state['num_batches']} "
                f"batches per epoch, this one {self.num_batches}; the batches would differ. "
                "Use the same data and DataLoader"
            )
        for generator, saved in zip(generators, state["generators"], strict=True):
            generator.set_state(saved)
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.batches = state["batches"]


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
