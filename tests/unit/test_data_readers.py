"""`prepare` reads the formats corpora ship in: each gives the source's documents, token for
token (byte tokenizer: a document's tokens are its UTF-8 bytes, then EOS 256)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from nanotrain.data import prepare, read_metadata

EOS = 256
# Unicode, a blank-looking document, one long enough to be cut into chunks, and empty
# documents, which every format skips.
DOCS = [
    "first document ✓\nwith two lines\n",
    "",
    "second — naïve café",
    "   ",
    "".join(f"line {i}\n" for i in range(300)),
    "",
    "last one <|endoftext|> stays text",
]
NON_EMPTY = [doc for doc in DOCS if doc]


def byte_ids(docs: list[str]) -> list[int]:
    """The byte tokenizer's stream of ``docs``, computed independently of nanotrain."""
    return [token for doc in docs for token in [*doc.encode("utf-8"), EOS]]


def train_stream(out: Path) -> list[int]:
    meta = json.loads((out / "metadata.json").read_text())
    shards = meta["splits"]["train"]["shards"]
    return np.concatenate([np.fromfile(out / s["file"], meta["dtype"]) for s in shards]).tolist()


def jsonl_bytes(docs: list[str]) -> bytes:
    return "".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)).encode()


def write_parquet(path: Path, docs: list[str], **kwargs) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": list(range(len(docs))), "text": docs})
    pq.write_table(table, path, row_group_size=2, **kwargs)  # several row groups per file
    return path


def make_parquet_file(root: Path) -> Path:
    return write_parquet(root / "c.parquet", DOCS)


def make_parquet_folder(root: Path) -> Path:
    # shards named so that sorted order is the document order
    for index, start in enumerate(range(0, len(DOCS), 3)):
        write_parquet(root / "shards" / f"part-{index:03d}.parquet", DOCS[start : start + 3])
    return root / "shards"


def make_parquet_glob(root: Path) -> str:
    return str(make_parquet_folder(root) / "part-*.parquet")


def make_jsonl(root: Path) -> Path:
    (root / "c.jsonl").write_bytes(jsonl_bytes(DOCS))
    return root / "c.jsonl"


def make_json_lines(root: Path) -> Path:
    (root / "c.json").write_bytes(jsonl_bytes(DOCS))
    return root / "c.json"


def make_jsonl_gz(root: Path) -> Path:
    (root / "c.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(DOCS)))
    return root / "c.jsonl.gz"


def make_jsonl_zst(root: Path) -> Path:
    import zstandard

    # two frames, as concatenated or parallel-compressed files hold
    data = jsonl_bytes(DOCS)
    compress = zstandard.ZstdCompressor().compress
    (root / "c.jsonl.zst").write_bytes(compress(data[:40]) + compress(data[40:]))
    return root / "c.jsonl.zst"


def make_txt_folder(root: Path) -> Path:
    for index, doc in enumerate(DOCS):
        (root / "texts").mkdir(exist_ok=True)
        (root / "texts" / f"{index:02d}.txt").write_text(doc, encoding="utf-8")
    return root / "texts"


MAKERS = {
    "parquet file": make_parquet_file,
    "parquet folder": make_parquet_folder,
    "parquet glob": make_parquet_glob,
    "jsonl": make_jsonl,
    "json lines": make_json_lines,
    "jsonl.gz": make_jsonl_gz,
    "jsonl.zst": make_jsonl_zst,
    "txt folder": make_txt_folder,
}


@pytest.mark.parametrize("kind", list(MAKERS))
def test_each_format_prepares_its_documents_token_for_token(tmp_path, kind):
    source = MAKERS[kind](tmp_path)
    out = prepare([str(source)], tmp_path / "out", val_fraction=0, split_chunk_chars=500)
    assert train_stream(out) == byte_ids(NON_EMPTY)
    meta = read_metadata(out)
    assert meta["num_documents"] == len(NON_EMPTY)
    assert meta["total_tokens"] == len(byte_ids(NON_EMPTY))


def test_mixed_formats_are_read_in_the_order_given(tmp_path):
    parquet = write_parquet(tmp_path / "a.parquet", ["from parquet"])
    gz = tmp_path / "b.jsonl.gz"
    gz.write_bytes(gzip.compress(jsonl_bytes(["from gzip"])))
    txt = tmp_path / "c.txt"
    txt.write_text("from text")
    out = prepare([txt, gz, parquet], tmp_path / "out", val_fraction=0, num_workers=2)
    assert train_stream(out) == byte_ids(["from text", "from gzip", "from parquet"])
    assert read_metadata(out)["num_files"] == 3


def test_python_list_and_generator_of_strings(tmp_path):
    out = prepare(list(DOCS), tmp_path / "a", val_fraction=0)
    assert train_stream(out) == byte_ids(NON_EMPTY)
    out = prepare((doc for doc in DOCS), tmp_path / "b", val_fraction=0)
    assert train_stream(out) == byte_ids(NON_EMPTY)
    meta = read_metadata(out)
    assert meta["num_documents"] == len(NON_EMPTY) and meta["num_files"] == 0
    out = prepare(["hello", "world"], tmp_path / "c", val_fraction=0)  # words, not file names
    assert train_stream(out) == byte_ids(["hello", "world"])


def test_list_that_looks_like_paths_still_means_paths(tmp_path):
    with pytest.raises(ValueError, match=r"no files matched '.*missing.txt'"):
        prepare([str(tmp_path / "missing.txt")], tmp_path / "o")
    with pytest.raises(TypeError, match="input item 1 is a int"):
        prepare(iter(["text", 3]), tmp_path / "o")


@pytest.fixture(scope="module")
def hf_dataset():
    datasets = pytest.importorskip("datasets")
    return datasets.Dataset.from_dict({"id": list(range(len(DOCS))), "text": DOCS})


def test_datasets_objects_and_save_to_disk_folder(tmp_path, hf_dataset):
    expected = byte_ids(NON_EMPTY)
    assert train_stream(prepare(hf_dataset, tmp_path / "a", val_fraction=0)) == expected
    iterable = hf_dataset.to_iterable_dataset()
    assert train_stream(prepare(iterable, tmp_path / "b", val_fraction=0)) == expected
    hf_dataset.save_to_disk(str(tmp_path / "saved"))
    out = prepare([str(tmp_path / "saved")], tmp_path / "c", val_fraction=0)
    assert train_stream(out) == expected
    assert read_metadata(out)["num_documents"] == len(NON_EMPTY)
    with pytest.raises(ValueError, match=r"has no column 'body'; its columns are \['id', 'text'\]"):
        prepare(hf_dataset, tmp_path / "d", text_field="body")


def test_datasets_dict_folder_names_its_splits(tmp_path, hf_dataset):
    import datasets

    datasets.DatasetDict({"train": hf_dataset}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"DatasetDict with splits \['train'\]; pass one split"):
        prepare([str(tmp_path / "dd")], tmp_path / "o")


def test_datasets_folder_without_the_library_names_it(tmp_path, monkeypatch):
    folder = tmp_path / "saved"
    folder.mkdir()
    (folder / "state.json").write_text("{}")
    (folder / "dataset_info.json").write_text("{}")
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # import fails
    with pytest.raises(ValueError, match=r"needs the `datasets` library: pip install datasets"):
        prepare([str(folder)], tmp_path / "o")


@pytest.mark.parametrize("name", ["data.bin", "data.gz", "archive.zip", "table.arrow"])
def test_file_in_no_known_format_is_refused_with_the_formats(tmp_path, name):
    (tmp_path / name).write_bytes(b"\x00\x01 whatever")
    with pytest.raises(ValueError, match=rf"'{tmp_path / name}' is in no known format.*\.parquet"):
        prepare([str(tmp_path / name)], tmp_path / "o")


def test_binary_file_with_a_text_like_name_names_the_byte(tmp_path):
    (tmp_path / "notes.txt").write_bytes(b"fine text " * 10 + b"\xff\xfe")
    with pytest.raises(ValueError, match=r"notes.txt' is not UTF-8 text .* at byte 100\).*\.jsonl"):
        prepare([str(tmp_path / "notes.txt")], tmp_path / "o")


def test_json_array_file_says_json_lines_are_expected(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps([{"text": "a"}, {"text": "b"}], indent=1))
    with pytest.raises(ValueError, match=r"c.json:1 is not valid JSON .*one object per line"):
        prepare([str(tmp_path / "c.json")], tmp_path / "o")
