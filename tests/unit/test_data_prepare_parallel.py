"""`prepare(num_workers=N)`: the same bytes for every N, and a progress line."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest

from nanotrain.data import prepare, read_metadata, tokenize_pool, train_bpe


def corpus(root: Path) -> list[str]:
    """Mixed formats, documents of varied length (some cut into chunks), many batches."""
    rng = random.Random(1)
    words = ["the", "quick", "brown", "fox", "naïve", "—", "42", "jumps\n"]

    def doc() -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(1, 400)))

    root.mkdir()
    (root / "a.jsonl.gz").write_bytes(
        gzip.compress("".join(json.dumps({"text": doc()}) + "\n" for _ in range(60)).encode())
    )
    (root / "b.txt").write_text(doc() * 20, encoding="utf-8")
    (root / "c.jsonl").write_text("".join(json.dumps({"text": doc()}) + "\n" for _ in range(60)))
    return [doc() for _ in range(40)]  # for train_bpe


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_output_is_byte_identical_for_every_number_of_workers(tmp_path, monkeypatch, tokenizer):
    texts = corpus(tmp_path / "in")
    if tokenizer == "bpe":
        tokenizer = str(tmp_path / "tok.json")
        train_bpe(texts, vocab_size=280, out_path=tokenizer)
    # small batches, so each worker count splits the work differently
    monkeypatch.setattr(tokenize_pool, "BATCH_CHARS", 700)
    outputs = {}
    for workers in (1, 2, 3):
        out = prepare(
            [str(tmp_path / "in")],
            tmp_path / f"w{workers}",
            tokenizer=tokenizer,
            shard_tokens=997,
            val_fraction=0.2,
            split_chunk_chars=300,
            num_workers=workers,
        )
        outputs[workers] = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    assert len(outputs[1]) > 5  # several shards per split
    assert outputs[2] == outputs[1] and outputs[3] == outputs[1]


def test_progress_line_counts_documents_tokens_and_speed(tmp_path, capsys):
    out = prepare(["one", "two words", "three"], tmp_path / "o", progress=True, num_workers=2)
    err = capsys.readouterr().err
    final = err.rstrip("\n").split("\r")[-1]
    tokens = read_metadata(out)["total_tokens"]
    assert tokens == len("one") + len("two words") + len("three") + 3
    assert final.startswith(f"prepare: 3 documents, {tokens} tokens, ")
    assert final.endswith(" tokens/s")
    prepare(["one"], tmp_path / "p", progress=False)
    assert capsys.readouterr().err == ""


def test_num_workers_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="num_workers must be >= 1, got 0"):
        prepare(["text"], tmp_path / "o", num_workers=0)


def test_cli_takes_num_workers_and_says_what_val_fraction_means(tmp_path, capsys):
    from nanotrain.cli.commands import run_prepare

    with pytest.raises(SystemExit):
        run_prepare(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "share of the text's bytes held out for validation" in help_text
    assert "tokenizer processes (default: the CPU count)" in help_text
    (tmp_path / "c.jsonl").write_text('{"text": "from the cli"}\n')
    args = ["--inputs", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "o")]
    run_prepare([*args, "--num_workers", "2", "--progress", "false", "--val_fraction", "0"])
    assert "prepared 1 documents from 1 files" in capsys.readouterr().out
    assert read_metadata(tmp_path / "o")["total_tokens"] == len("from the cli") + 1
