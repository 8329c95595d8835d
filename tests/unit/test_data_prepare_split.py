"""The validation split: its share of the bytes is `val_fraction`, and its documents are as
long as training's (the split picks them without looking at their length)."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import numpy as np

from nanotrain.data import prepare

EOS = 256


def split_documents(out: Path, split: str) -> list[bytes]:
    meta = json.loads((out / "metadata.json").read_text())
    shards = meta["splits"][split]["shards"]
    stream = np.concatenate([np.fromfile(out / s["file"], meta["dtype"]) for s in shards])
    cuts = np.flatnonzero(stream == EOS)
    return [bytes(piece[:-1].tolist()) for piece in np.split(stream, cuts + 1)[:-1]]


def test_validation_holds_val_fraction_of_bytes_and_typical_lengths(tmp_path):
    rng = random.Random(0)
    # heavy-tailed lengths, as web text: median ~400 bytes, some documents 10x that
    docs = ["x" * max(1, int(rng.lognormvariate(6.0, 1.0))) for _ in range(3000)]
    out = prepare(docs, tmp_path / "o", val_fraction=0.1, split_chunk_chars=1 << 20)
    train, val = split_documents(out, "train"), split_documents(out, "val")
    assert len(train) + len(val) == len(docs)
    val_bytes, train_bytes = sum(map(len, val)), sum(map(len, train))
    assert abs(val_bytes / (val_bytes + train_bytes) - 0.1) < 0.005
    train_median = statistics.median(map(len, train))
    val_median = statistics.median(map(len, val))
    assert abs(val_median / train_median - 1) < 0.15, (val_median, train_median)
    assert abs(len(val) / len(docs) - 0.1) < 0.02  # ~10% of documents too
