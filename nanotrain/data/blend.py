"""Blends: several prepared corpora served at given weights, as Megatron's ``--data-path 0.7 A
0.3 B`` (weights normalised, a fixed per-sample index), as one map-style dataset.

`BlendedDataset` is map-style and deterministic (item ``i`` is always the same window), so the
Trainer's `ResumableDistributedSampler` shuffles, shards and resumes it exactly as any other
dataset: the same global batches under every layout, and a resumed run reads what an
uninterrupted one would have.

`PartsValidationDataset` holds every part's validation windows once, each tagged with its
part, and padded so that no micro batch mixes parts: the validation step can then report each
part's loss (``val/loss/<name>``) from the batch's own loss, in every layout (also under
pipeline parallelism, where only the batch's global loss exists).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset


def parse_blend(data_path: Mapping[str, Any]) -> list[tuple[str, Path, float]]:
    """``[(name, path, weight)]`` of a blend given as ``{path: weight}``, weights normalised to
    sum to 1, in the order given. A part's name is its folder's name (the path as given where
    two folders share a name); it names its ``val/loss/<name>`` metric.

    Raises:
        ValueError: an empty blend, a weight that is not a positive finite number, or a path
            given twice.
    """
    if not data_path:
        raise ValueError("a blend needs at least one corpus: data_path={'corpus/a': 0.7, ...}")
    parts: list[tuple[str, Path, float]] = []
    for key, weight in data_path.items():
        ok = isinstance(weight, int | float) and not isinstance(weight, bool)
        if not ok or not math.isfinite(weight) or weight <= 0:
            raise ValueError(
                f"the blend's weight for '{key}' must be a positive number, got {weight!r}; "
                "give data_path as {path: weight}, e.g. {'corpus/a': 0.7, 'corpus/b': 0.3}"
            )
        parts.append((str(key), Path(os.fspath(key)).expanduser(), float(weight)))
    resolved = [p.resolve() for _, p, _ in parts]
    if len(set(resolved)) != len(resolved):
        raise ValueError(f"the blend names a corpus twice: {list(data_path)}; list each once")
    total = sum(w for _, _, w in parts)
    names = [p.name or key for key, p, _ in parts]
    unique = len(set(names)) == len(names)
    return [
        (name if unique else key, path, w / total)
        for name, (key, path, w) in zip(names, parts, strict=True)
    ]


def blend_counts(weights: Sequence[float], num_samples: int) -> np.ndarray:
    """Samples each part gets of ``num_samples``: ``floor(w_k · N)``, the remainder going one
    each to the parts with the largest fractional shares (ties to the earlier part)."""
    ideal = np.asarray(weights, dtype=np.float64) * num_samples
    counts = np.floor(ideal).astype(np.int64)
    left = num_samples - int(counts.sum())
    order = np.argsort(-(ideal - counts), kind="stable")
    counts[order[:left]] += 1
    return counts


def blend_index(counts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(part, sample) of every blend position, each shape ``(sum(counts),)``.

    Part ``k``'s ``j``-th sample sits at the ideal time ``(j + 0.5) / counts[k]`` of the epoch;
    positions follow these times (ties to the earlier part), so every stretch of the blend
    holds each part at close to its weight, as Megatron's error-minimising blending index.
    """
    times = [(np.arange(c, dtype=np.float64) + 0.5) / c for c in counts]
    parts = [np.full(c, k, dtype=np.int64) for k, c in enumerate(counts)]
    samples = [np.arange(c, dtype=np.int64) for c in counts]
    order = np.lexsort((np.concatenate(parts), np.concatenate(times)))
    return np.concatenate(parts)[order], np.concatenate(samples)[order]


class BlendedDataset(Dataset):
    """Map-style blend of datasets at given weights: item ``i`` is sample ``s`` of part ``k``
    for a fixed (part, sample) index (`blend_index`).

    One pass holds ``num_samples`` items (default: all parts' items together), part ``k``
    giving ``round(w_k · num_samples)`` of them (`blend_counts`). A part with fewer items than
    its share is repeated in order (upsampled); one with more is read at evenly spaced items,
    so its whole length is covered.

    Args:
        parts: map-style datasets of the same item structure.
        weights: one positive weight per part (normalised here).
        num_samples: items of the blend, >= 1 (default: ``sum(len(part))``).

    Raises:
        ValueError: as many weights as parts, positive; an empty part.
    """

    def __init__(
        self,
        parts: Sequence[Dataset],
        weights: Sequence[float],
        num_samples: int | None = None,
    ) -> None:
        if len(parts) != len(weights) or not parts or min(weights) <= 0:
            raise ValueError(
                f"need one positive weight per part; got {len(parts)} parts, weights {weights}"
            )
        lengths = [len(p) for p in parts]
        if min(lengths) == 0:
            raise ValueError(f"a blend's part is empty (lengths {lengths})")
        total = float(sum(weights))
        self.parts = list(parts)
        self.weights = [w / total for w in weights]
        self.num_samples = sum(lengths) if num_samples is None else int(num_samples)
        self.counts = blend_counts(self.weights, self.num_samples)
        self.part_of, sample = blend_index(self.counts)
        # the part's item of each position: evenly spaced when it has more than it gives,
        # cycled in order when fewer
        length = np.asarray(lengths, dtype=np.int64)[self.part_of]
        count = self.counts[self.part_of]
        spread = sample * length // np.maximum(count, 1)
        self.item_of = np.where(count <= length, spread, sample % length)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> Any:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} blended samples")
        return self.parts[int(self.part_of[index])][int(self.item_of[index])]


class PartsValidationDataset(Dataset):
    """Every part's items once, each dict item with ``"part"`` (its part's index, a 0-dim
    LongTensor) added; each part padded with label-free copies of its last item (``labels``
    all -100) to whole blocks of ``pad_to`` items, the blocks of all parts spread evenly over
    the set (`blend_index` over the parts' block counts), so that a prefix of it (a
    ``limit_val_batches``) holds every part in proportion to its size.

    With ``pad_to = micro_batch_size × data-parallel size``, every micro batch of the Trainer's
    validation order (each rank reading positions ``r, r + n, ...``, ``micro_batch_size`` at a
    time) lies in one block, so it holds one part only; the padding adds no token to any mean.

    Args:
        parts: map-style datasets of dicts with ``"input_ids"`` and ``"labels"``.
        pad_to: the block size, >= 1.
    """

    def __init__(self, parts: Sequence[Dataset], pad_to: int = 1) -> None:
        if pad_to < 1:
            raise ValueError(f"pad_to must be >= 1, got {pad_to}")
        self.parts, self.pad_to = list(parts), pad_to
        self.lengths = [len(p) for p in parts]
        blocks = [-(-n // pad_to) for n in self.lengths]
        self.block_part, self.block_index = blend_index(blocks)

    def __len__(self) -> int:
        return len(self.block_part) * self.pad_to

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} validation samples")
        block, offset = divmod(index, self.pad_to)
        k = int(self.block_part[block])
        local = int(self.block_index[block]) * self.pad_to + offset
        item = dict(self.parts[k][min(local, self.lengths[k] - 1)])
        if local >= self.lengths[k]:  # padding: a real window's shape, no label
            item["labels"] = torch.full_like(item["labels"], -100)
        item["part"] = torch.tensor(k, dtype=torch.long)
        return item


def merged_metadata(metas: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """One metadata dict for a blend of prepared corpora: the first part's, with the largest
    ``max_token_id`` of all and ``bytes_per_token`` of all validation tokens together.

    Raises:
        ValueError: the parts were prepared with different tokenizers.
    """
    first = metas[0]
    for meta, name in zip(metas[1:], names[1:], strict=True):
        if meta["tokenizer"] != first["tokenizer"] or meta["vocab_size"] != first["vocab_size"]:
            raise ValueError(
                f"the blend's parts were prepared with different tokenizers: '{names[0]}' with "
                f"{first['tokenizer']!r}, '{name}' with {meta['tokenizer']!r}; prepare every "
                "corpus with the same --tokenizer"
            )
    merged = dict(first)
    merged["max_token_id"] = max(int(m["max_token_id"]) for m in metas)
    tokens = [
        int(m["splits"]["val"]["tokens"]) or int(m["splits"]["train"]["tokens"]) for m in metas
    ]
    text_bytes = sum(float(m["bytes_per_token"]) * t for m, t in zip(metas, tokens, strict=True))
    merged["bytes_per_token"] = text_bytes / max(sum(tokens), 1)
    return merged
