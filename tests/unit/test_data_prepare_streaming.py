"""`prepare` streams: its peak memory does not grow with the size of the input file.

Measured with tracemalloc (Python objects and numpy buffers of this process), which counts
allocations, not time, so the figure does not depend on load. The input grows 4x (by 3 MB);
a reader that held the file, its documents or its tokens would grow by megabytes."""

from __future__ import annotations

import json
import random
import tracemalloc
from pathlib import Path

import pytest

from nanotrain.data import prepare

MB = 1 << 20


def documents(total_bytes: int) -> list[str]:
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "naïve", "café", "x" * 12, "\n"]
    docs, size = [], 0
    while size < total_bytes:
        doc = " ".join(rng.choice(words) for _ in range(rng.randint(50, 600)))
        docs.append(doc)
        size += len(doc.encode())
    return docs


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


def write_jsonl_zst(path: Path, docs: list[str]) -> Path:
    import zstandard

    raw = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
    path.write_bytes(zstandard.ZstdCompressor().compress(raw))
    return path


def write_parquet(path: Path, docs: list[str]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": docs}), path, row_group_size=500)
    return path


def write_one_text_file(path: Path, docs: list[str]) -> Path:
    path.write_text("\n".join(docs), encoding="utf-8")  # one big document
    return path


WRITERS = {
    "jsonl": (write_jsonl, "c.jsonl"),
    "jsonl.zst": (write_jsonl_zst, "c.jsonl.zst"),
    "parquet": (write_parquet, "c.parquet"),
    "one text file": (write_one_text_file, "c.txt"),
}


def peak_bytes(path: Path, out: Path, num_workers: int) -> int:
    tracemalloc.start()
    try:
        prepare([str(path)], out, num_workers=num_workers, shard_tokens=MB, progress=False)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(("kind", "num_workers"), [(k, 1) for k in WRITERS] + [("jsonl", 2)])
def test_peak_memory_is_flat_in_the_input_size(tmp_path, kind, num_workers):
    write, name = WRITERS[kind]
    peaks = {}
    for scale in (1, 4):
        folder = tmp_path / f"x{scale}"
        folder.mkdir()
        source = write(folder / name, documents(scale * MB))
        peaks[scale] = peak_bytes(source, folder / "out", num_workers)
    grown = peaks[4] - peaks[1]
    # 3 MB more input; allow 10% of that for noise (the old reader grew ~6 bytes per byte)
    assert grown < 0.3 * MB, f"peak grew by {grown / MB:.2f} MB: {peaks}"
    assert peaks[4] < 24 * MB, f"peak {peaks[4] / MB:.1f} MB"
