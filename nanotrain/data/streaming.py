"""Training on a stream: an `IterableDataset` (your own, or a `datasets` streaming dataset) read
as one sequence of samples, cut into global batches shared out over the data-parallel
replicas, resumable where the dataset can say where it is.

The order, for ``G = global_batch_size`` and ``n`` data-parallel replicas: global batch ``s``
is samples ``s·G .. s·G + G - 1`` of the stream, and replica ``r`` trains on the entries at
offsets ``r, r + n, r + 2n, ...`` of it (`ResumableDistributedSampler`'s split of an unshuffled
dataset), so every optimizer step sees the same samples under every layout, and no sample is
read by two replicas. Each replica iterates the whole stream and keeps its share: the stream
needs no idea of ranks, and the position is the same number on every replica.

An epoch ends when the stream runs out; its last, incomplete global batch is left out, and the
next epoch iterates the dataset again (as `lightning.Trainer` does).
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

from torch.utils.data import IterableDataset

# a stream's length is unknown: an epoch "holds" this many samples until the stream runs out
UNKNOWN_LENGTH = sys.maxsize // 4


def can_resume(dataset: Any) -> bool:
    """Whether `dataset` can save and restore its position (``state_dict``/``load_state_dict``,
    as `datasets.IterableDataset` and torchdata's ``Stateful`` datasets have)."""
    return callable(getattr(dataset, "state_dict", None)) and callable(
        getattr(dataset, "load_state_dict", None)
    )


def check_stream_settings(val_check_interval: int | float | None) -> None:
    """Refuse what needs the epoch's length, which a stream does not know in advance.

    Raises:
        ValueError: a fractional ``val_check_interval`` (as `lightning.Trainer` refuses it
            for an `IterableDataset`).
    """
    if type(val_check_interval) is float:
        raise ValueError(
            f"val_check_interval={val_check_interval} is a fraction of an epoch, whose length "
            "a stream (IterableDataset) does not know; use an int (every that many optimizer "
            "steps) or None (at each epoch's end, when the stream runs out)"
        )


class StreamSampler:
    """Where the Trainer is in a stream: the epoch and the global samples consumed in it, and
    (for a checkpoint) the dataset's own position.

    The Trainer treats it as its training sampler: `set_epoch`, `advance` after each optimizer
    step, `state_dict` / `load_state_dict` for checkpoints; `StreamLoader` reads the stream.

    Args:
        dataset: the `IterableDataset`.
        global_batch_size: samples per optimizer step over all replicas (``G``).
        shard_index, shard_count: this replica ``r`` and the number ``n`` of replicas; ``n``
            divides ``G``.

    Raises:
        ValueError: ``G`` not divisible by ``n``; a `datasets` dataset already split with
            ``split_dataset_by_node`` (nanotrain shares the stream out itself).
    """

    def __init__(
        self, dataset: IterableDataset, global_batch_size: int, shard_index: int, shard_count: int
    ) -> None:
        if global_batch_size % shard_count:
            raise ValueError(
                f"global_batch_size={global_batch_size} does not split over {shard_count} "
                "data-parallel replicas"
            )
        if getattr(dataset, "_distributed", None) is not None:  # datasets' split_dataset_by_node
            raise ValueError(
                "the training dataset was split with datasets.distributed.split_dataset_by_node; "
                "nanotrain shares a stream out over the data-parallel replicas itself (the same "
                "global batches under every layout): pass the dataset before splitting"
            )
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.shard_index, self.shard_count = shard_index, shard_count
        self.epoch = 0
        self.consumed_global = 0  # samples of the current epoch, over all replicas
        self.resumable = can_resume(dataset)
        self._loaded_state = False  # the dataset continues from a loaded position

    @property
    def position(self) -> int:
        """Samples this replica consumed in the current epoch."""
        return self.consumed_global // self.shard_count

    def __len__(self) -> int:
        """Unknown before the stream runs out: `UNKNOWN_LENGTH`."""
        return UNKNOWN_LENGTH

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from the stream's beginning."""
        self.epoch, self.consumed_global = int(epoch), 0
        if self._loaded_state and hasattr(self.dataset, "_starting_state_dict"):
            # `datasets` keeps a loaded position for every later iteration; a new epoch
            # starts from the beginning
            self.dataset._starting_state_dict = None
        self._loaded_state = False

    def advance(self, num_samples: int) -> None:
        """Record that this replica consumed ``num_samples`` more samples (the others as many)."""
        self.consumed_global += int(num_samples) * self.shard_count

    def state_dict(self) -> dict[str, Any]:
        """``{"kind": "stream", "epoch", "consumed_global", "global_batch_size", "dataset",
        "dataset_state"}``, the same on every replica; ``dataset_state`` is the dataset's own
        `state_dict()` at this step boundary (None where it has none)."""
        state = self.dataset.state_dict() if self.resumable else None
        return {
            "kind": "stream",
            "epoch": self.epoch,
            "consumed_global": self.consumed_global,
            "global_batch_size": self.global_batch_size,
            "dataset": type(self.dataset).__name__,
            "dataset_state": copy.deepcopy(state),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` was saved: the dataset's `load_state_dict` gets its saved
        position, so the next iteration yields the sample after the last one trained on.

        Raises:
            ValueError: the checkpoint read a map-style dataset; or it was saved mid-stream and
                the dataset cannot restore a position (no ``state_dict``/``load_state_dict``),
                so an exact resume is impossible.
        """
        if state.get("kind") != "stream":
            raise ValueError(
                "cannot resume: the checkpoint read a map-style dataset, this run an "
                "IterableDataset; train with the same data"
            )
        consumed = int(state["consumed_global"])
        if consumed and state.get("dataset_state") is None:
            raise ValueError(
                f"cannot resume exactly: the checkpoint stopped {consumed} samples into epoch "
                f"{state['epoch']} of the stream {state['dataset']}, which has no "
                "state_dict()/load_state_dict() to return to that point. Give the dataset "
                "both methods (e.g. count the samples it yielded, and skip that many on load; "
                "`datasets` streaming datasets have them), or start a new run from the "
                "checkpoint's weights (YourModule.load_from_checkpoint(path), fit without "
                "ckpt_path)"
            )
        if state.get("dataset_state") is not None:
            if not self.resumable:
                raise ValueError(
                    f"cannot resume: the checkpoint holds the position of a stream with "
                    f"state_dict(), this run's {type(self.dataset).__name__} has no "
                    "load_state_dict(); train with the same data"
                )
            self.dataset.load_state_dict(copy.deepcopy(state["dataset_state"]))
            self._loaded_state = True
        self.epoch, self.consumed_global = int(state["epoch"]), consumed


class StreamLoader:
    """This replica's micro batches of a stream (see the module docstring for the order).

    Iterating continues the dataset from where it is (its start, or a loaded position): each
    optimizer step reads one whole global batch of ``G`` samples, then yields this replica's
    ``G / n`` of them, ``micro_batch_size`` at a time, collated with ``collate_fn``. Nothing is
    read ahead, so at a step boundary the dataset has read exactly the samples trained on.

    Args:
        sampler: the stream's `StreamSampler`.
        micro_batch_size: samples per micro batch; divides ``G / n``.
        collate_fn: turns a list of samples into a batch (the DataLoader's).

    Raises:
        ValueError: (when iterated) a stream that does not fill one global batch.
    """

    def __init__(self, sampler: StreamSampler, micro_batch_size: int, collate_fn: Callable):
        self.sampler, self.micro_batch_size, self.collate_fn = sampler, micro_batch_size, collate_fn
        self.dataset = sampler.dataset
        self.draws_global_seed = False  # no workers: iterating draws no seed

    def __iter__(self) -> Iterator[Any]:
        s = self.sampler
        size, r, n = s.global_batch_size, s.shard_index, s.shard_count
        samples = iter(s.dataset)
        from_start = s.consumed_global == 0 and not s._loaded_state
        while True:
            window = list(islice(samples, size))
            if len(window) < size:
                if from_start:
                    raise ValueError(
                        f"the training stream {type(s.dataset).__name__} ended after "
                        f"{len(window)} samples, fewer than one global batch of {size}; "
                        "use more data or a smaller global batch"
                    )
                if window and r == 0:
                    warnings.warn(
                        f"the training stream ended {len(window)} samples into a global batch "
                        f"of {size}; nanotrain leaves them out of the epoch, where "
                        "lightning.Trainer would train them in a last, smaller step",
                        UserWarning,
                        stacklevel=2,
                    )
                return  # the stream ran out: the epoch ends, the partial batch left out
            from_start = False
            mine = window[r::n]
            for start in range(0, len(mine), self.micro_batch_size):
                yield self.collate_fn(mine[start : start + self.micro_batch_size])
