"""Bad input to `prepare`: the error names the file and where it broke, and nothing is left
behind: no output folder, no temporary sibling, an earlier corpus in `out_dir` untouched."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest

from nanotrain.data import prepare, read_metadata

ROWS = [f"document {i} " + "words " * 20 for i in range(500)]


def write_parquet(path: Path, texts: list[str]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"url": ["u"] * len(texts), "text": texts}), path, row_group_size=100)
    return path


def jsonl(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()


def assert_nothing_left(tmp_path: Path, out: Path) -> None:
    assert not out.exists()
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(".")]


def test_corrupt_parquet_row_group_names_file_and_row(tmp_path):
    import pyarrow.parquet as pq

    path = write_parquet(tmp_path / "c.parquet", ROWS)
    column = pq.ParquetFile(path).metadata.row_group(2).column(1)
    start = column.dictionary_page_offset or column.data_page_offset
    raw = bytearray(path.read_bytes())
    raw[start : start + column.total_compressed_size] = b"\xab" * column.total_compressed_size
    path.write_bytes(bytes(raw))
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"c.parquet' is corrupt: reading broke at row 200 "):
        prepare([str(path)], out, num_workers=2)
    assert_nothing_left(tmp_path, out)


def test_truncated_parquet_is_named(tmp_path):
    path = write_parquet(tmp_path / "c.parquet", ROWS)
    path.write_bytes(path.read_bytes()[:3000])
    with pytest.raises(ValueError, match=r"c.parquet' is not a readable Parquet file"):
        prepare([str(path)], tmp_path / "out")
    assert_nothing_left(tmp_path, tmp_path / "out")


def test_missing_parquet_column_names_the_columns_present(tmp_path):
    path = write_parquet(tmp_path / "c.parquet", ROWS[:3])
    with pytest.raises(
        ValueError, match=r"has no column 'content'; its columns are \['url', 'text'\]"
    ):
        prepare([str(path)], tmp_path / "out", text_field="content")


def test_missing_json_field_names_line_and_fields_present(tmp_path):
    path = tmp_path / "d.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"text": "ok"}\n{"content": "x", "id": 1}\n'))
    with pytest.raises(
        ValueError,
        match=r"d.jsonl.gz:2 has no string field 'text' \(its fields: \['content', 'id'\]\)",
    ):
        prepare([str(path)], tmp_path / "out")


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_truncated_compressed_file_names_file_line_and_byte(tmp_path, suffix):
    import zstandard

    rng = random.Random(0)  # text that does not compress to one block: zstd decodes whole blocks
    rows = ["".join(rng.choice("abcdefgh ") for _ in range(200)) for _ in range(3000)]
    data = jsonl(rows)
    packed = (
        gzip.compress(data) if suffix.endswith("gz") else zstandard.ZstdCompressor().compress(data)
    )
    path = tmp_path / f"c{suffix}"
    path.write_bytes(packed[: len(packed) // 2])
    # an earlier corpus in out_dir stays as it was
    out = prepare(["earlier text"], tmp_path / "out", val_fraction=0)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ValueError) as caught:
        prepare([str(path)], out, shard_tokens=1000)
    message = str(caught.value)
    assert f"'{path}' is truncated or corrupt" in message
    assert f"compressed byte {len(packed) // 2}" in message
    line = int(message.split("stream broke in line ")[1].split(" ")[0])
    text_byte = int(message.split("at text byte ")[1].split(",")[0])
    assert 1 < line < len(rows)  # it broke part way, where the text ends
    assert data[:text_byte].count(b"\n") == line - 1  # the text byte lies in that line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert read_metadata(out)["num_documents"] == 1
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_error_inside_a_worker_leaves_nothing_behind(tmp_path):
    class Broken:
        """A tokenizer whose encode fails on one document, as a real one can."""

        name, vocab_size, eos_id = "broken", 257, 256

        def encode(self, text):
            if "poison" in text:
                raise RuntimeError("cannot encode")
            return list(text.encode())

        def decode(self, ids):
            return ""

        def describe(self):
            return {"kind": "broken"}

    with pytest.raises(RuntimeError, match="cannot encode"):
        prepare(["fine", "poison", "fine"], tmp_path / "out", tokenizer=Broken(), num_workers=2)
    assert_nothing_left(tmp_path, tmp_path / "out")
