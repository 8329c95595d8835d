"""`prepare` and `TokenShardDataset`: token counts, shard format, windows, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from nanotrain.data import TokenShardDataset, prepare, read_metadata, train_bpe

EOS = 256  # the byte tokenizer's end-of-document id


def byte_ids(text: str) -> list[int]:
    """The byte tokenizer's encoding of one document, computed independently of it."""
    return list(text.encode("utf-8")) + [EOS]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def split_stream(out: Path, split: str) -> np.ndarray:
    """A split's tokens read straight from its shard files, in the order metadata lists them."""
    meta = json.loads((out / "metadata.json").read_text())
    files = [out / shard["file"] for shard in meta["splits"][split]["shards"]]
    parts = [np.fromfile(f, dtype=meta["dtype"]) for f in files]
    return np.concatenate(parts) if parts else np.empty(0, dtype=meta["dtype"])


@pytest.fixture
def corpus(tmp_path) -> Path:
    root = tmp_path / "corpus"
    write(root / "b.txt", "second file ✓\n")
    write(root / "a.txt", "first file\n")
    write(root / "sub" / "c.md", "nested — third\n")
    write(root / ".hidden" / "x.txt", "never read")
    write(root / ".notes.txt", "never read either")
    return root


def test_folder_is_read_recursively_sorted_and_hidden_files_skipped(corpus, tmp_path):
    out = prepare([str(corpus)], tmp_path / "out", val_fraction=0.0)
    expected = byte_ids("first file\n") + byte_ids("second file ✓\n") + byte_ids("nested — third\n")
    assert split_stream(out, "train").tolist() == expected
    meta = read_metadata(out)
    assert meta["total_tokens"] == len(expected) and meta["num_documents"] == 3
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 257
    assert meta["max_token_id"] == EOS and meta["splits"]["val"]["tokens"] == 0


def test_files_and_globs_are_read_in_the_order_given(corpus, tmp_path):
    out = prepare(
        [str(corpus / "sub" / "c.md"), str(corpus / "*.txt")], tmp_path / "o", val_fraction=0
    )
    expected = byte_ids("nested — third\n") + byte_ids("first file\n") + byte_ids("second file ✓\n")
    assert split_stream(out, "train").tolist() == expected


def test_recursive_glob_and_duplicates_counted_once(corpus, tmp_path):
    out = prepare(
        [str(corpus / "**" / "*.md"), str(corpus / "sub")], tmp_path / "o", val_fraction=0
    )
    assert split_stream(out, "train").tolist() == byte_ids("nested — third\n")


def test_jsonl_yields_one_document_per_line_from_text_field(tmp_path):
    rows = [{"body": "alpha"}, {"body": "béta", "id": 2}, {"body": ""}]
    path = write(tmp_path / "d.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    out = prepare([str(path)], tmp_path / "o", text_field="body", val_fraction=0)
    assert split_stream(out, "train").tolist() == byte_ids("alpha") + byte_ids("béta")
    assert read_metadata(out)["num_documents"] == 2


def test_jsonl_without_the_field_names_line_and_field(tmp_path):
    path = write(tmp_path / "d.jsonl", '{"text": "ok"}\n{"content": "x"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2 has no string field 'text'"):
        prepare([str(path)], tmp_path / "o")


def test_bpe_tokenizer_counts_match_encoding_the_texts(tmp_path):
    texts = ["def f(x):\n    return x * 2\n" * 30, "print('hello world')\n" * 40]
    tok = train_bpe(texts, vocab_size=290, out_path=tmp_path / "tok.json")
    paths = [str(write(tmp_path / f"in{i}.py", t)) for i, t in enumerate(texts)]
    out = prepare(paths, tmp_path / "o", tokenizer=str(tmp_path / "tok.json"), val_fraction=0)
    expected = tok.encode(texts[0]) + [tok.eos_id] + tok.encode(texts[1]) + [tok.eos_id]
    assert split_stream(out, "train").tolist() == expected
    meta = read_metadata(out)
    assert meta["tokenizer"]["kind"] == "hf" and meta["vocab_size"] == tok.vocab_size
    assert meta["max_token_id"] == max(expected)


def test_shards_split_at_shard_tokens_and_sum_to_the_total(corpus, tmp_path):
    out = prepare([str(corpus)], tmp_path / "o", shard_tokens=10, val_fraction=0)
    shards = read_metadata(out)["splits"]["train"]["shards"]
    counts = [s["tokens"] for s in shards]
    total = sum(len(byte_ids(t)) for t in ("first file\n", "second file ✓\n", "nested — third\n"))
    assert sum(counts) == total and all(c == 10 for c in counts[:-1]) and 0 < counts[-1] <= 10
    for shard in shards:  # raw uint16, no header
        assert (out / shard["file"]).stat().st_size == 2 * shard["tokens"]


def test_validation_split_takes_about_val_fraction_of_whole_documents(tmp_path):
    docs = [f"document number {i:02d} " * 5 for i in range(40)]
    paths = [str(write(tmp_path / "in" / f"{i:02d}.txt", d)) for i, d in enumerate(docs)]
    out = prepare(paths, tmp_path / "o", val_fraction=0.25)
    train, val = split_stream(out, "train"), split_stream(out, "val")

    def documents(stream: np.ndarray) -> list[str]:
        cut = np.flatnonzero(stream == EOS)
        pieces = np.split(stream, cut + 1)[:-1]
        return [bytes(p[:-1].tolist()).decode() for p in pieces]

    train_docs, val_docs = documents(train), documents(val)
    assert sorted(train_docs + val_docs) == sorted(docs)
    assert 9 <= len(val_docs) <= 11  # 25% of 40 equal-sized documents, give or take one
    meta = read_metadata(out)
    assert meta["splits"]["val"]["tokens"] == len(val)
    assert meta["bytes_per_token"] == pytest.approx(
        sum(len(d) for d in val_docs) / len(val)  # ASCII: chars == bytes; EOS has no text
    )


def test_long_single_document_is_chunked_so_val_is_not_empty(tmp_path):
    text = "".join(f"line {i}\n" for i in range(2000))
    path = write(tmp_path / "big.txt", text)
    out = prepare([str(path)], tmp_path / "o", val_fraction=0.1, split_chunk_chars=500)
    train, val = split_stream(out, "train"), split_stream(out, "val")
    assert len(train) + len(val) == len(byte_ids(text))
    assert 0.05 < len(val) / (len(train) + len(val)) < 0.15
    assert int((train == EOS).sum() + (val == EOS).sum()) == 1  # still one document


def test_output_is_deterministic(corpus, tmp_path):
    first = prepare([str(corpus)], tmp_path / "one", shard_tokens=8, val_fraction=0.3)
    second = prepare([str(corpus)], tmp_path / "two", shard_tokens=8, val_fraction=0.3)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes()


def test_prepare_replaces_an_earlier_prepared_output(corpus, tmp_path):
    prepare([str(corpus)], tmp_path / "o", val_fraction=0)
    out = prepare([str(corpus / "a.txt")], tmp_path / "o", val_fraction=0)
    assert split_stream(out, "train").tolist() == byte_ids("first file\n")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp leftovers


@pytest.mark.parametrize("spec", ["missing.txt", "*.nothing", "nodir/**/*.txt"])
def test_input_that_matches_nothing_is_a_clear_error(tmp_path, spec):
    with pytest.raises(ValueError, match=r"no files matched '.*'; pass a file, folder or glob"):
        prepare([str(tmp_path / spec)], tmp_path / "o")


def test_empty_corpus_is_a_clear_error(tmp_path):
    write(tmp_path / "in" / "empty.txt", "")
    with pytest.raises(ValueError, match="hold no text"):
        prepare([str(tmp_path / "in")], tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_non_utf8_file_and_foreign_output_folder_are_rejected(corpus, tmp_path):
    (tmp_path / "bin.dat").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="is not UTF-8 text"):
        prepare([str(tmp_path / "bin.dat")], tmp_path / "o")
    write(tmp_path / "mine" / "keep.txt", "precious")
    with pytest.raises(ValueError, match="exists and is not prepared data"):
        prepare([str(corpus)], tmp_path / "mine")
    assert (tmp_path / "mine" / "keep.txt").read_text() == "precious"


# -- TokenShardDataset --------------------------------------------------------------------------


@pytest.fixture
def shards(tmp_path) -> Path:
    text = "".join(chr(ord("a") + i % 26) for i in range(200))
    # 7-token shards, so windows cross shard boundaries.
    return prepare(
        [str(write(tmp_path / "t.txt", text))], tmp_path / "o", shard_tokens=7, val_fraction=0
    )


def test_windows_are_slices_of_the_token_stream_and_labels_are_shifted(shards):
    stream = torch.tensor(split_stream(shards, "train").astype(np.int64))
    ds = TokenShardDataset(shards, "train", seq_len=16)
    assert len(ds) == (len(stream) - 1) // 16 == 12
    for i in range(len(ds)):
        item = ds[i]
        assert item["input_ids"].dtype == torch.long and item["input_ids"].shape == (16,)
        assert torch.equal(item["input_ids"], stream[i * 16 : i * 16 + 16])
        assert torch.equal(item["labels"], stream[i * 16 + 1 : i * 16 + 17])
    assert torch.equal(ds[-1]["labels"], ds[len(ds) - 1]["labels"])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_dataset_pickles_without_its_memory_maps(shards):
    import pickle

    ds = TokenShardDataset(shards, "train", seq_len=8)
    first = ds[3]
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._mmaps is None
    assert torch.equal(clone[3]["labels"], first["labels"])


def test_dataset_errors_point_to_prepare(tmp_path, shards):
    with pytest.raises(ValueError, match="does not exist; run `nanotrain prepare"):
        TokenShardDataset(tmp_path / "nope", "train", 8)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no metadata.json.*nanotrain prepare"):
        TokenShardDataset(tmp_path / "empty", "train", 8)
    (shards / "train-00001.bin").unlink()
    with pytest.raises(ValueError, match="train-00001.bin' is missing"):
        TokenShardDataset(shards, "train", 8)
    (shards / "metadata.json").write_text("{ truncated")
    with pytest.raises(ValueError, match="is corrupt.*nanotrain prepare"):
        TokenShardDataset(shards, "train", 8)


def test_split_shorter_than_one_window_names_the_numbers(shards):
    with pytest.raises(
        ValueError, match=r"dataset 'train' has 201 tokens, fewer than seq_len\+1=202"
    ):
        TokenShardDataset(shards, "train", seq_len=201)
    with pytest.raises(ValueError, match=r"dataset 'val' has 0 tokens"):
        TokenShardDataset(shards, "val", seq_len=4)


def test_validate_vocab_names_both_numbers(shards):
    ds = TokenShardDataset(shards, "train", seq_len=8)
    ds.validate_vocab(257)  # EOS 256 is the largest id: fits exactly
    with pytest.raises(ValueError, match="token id 256 .* model's vocab_size is 200"):
        ds.validate_vocab(200)
