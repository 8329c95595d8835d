"""Tokenizers: byte round trip, local BPE training, loading by spec, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanotrain.data import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer, train_bpe

TEXTS = ["héllo wörld ✓ — emoji 🚀", "", "line one\nline two\r\n\ttabbed", "a" * 50]

# A tiny corpus with enough repetition for many merges.
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "def sub(a, b):\n    return a - b\n",
    "the quick brown fox jumps over the lazy dog. " * 20,
    "import numpy as np\nimport torch\n" * 10,
]


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bpe") / "tok" / "tokenizer.json"
    train_bpe(CORPUS, vocab_size=300, out_path=path)
    return path


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trips_and_ids_are_utf8_bytes(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_tokenizer_has_eos_256_and_decode_drops_it():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    assert tok.decode([104, 105, 256, 33]) == "hi!"
    assert isinstance(tok, Tokenizer)


def test_byte_tokenizer_rejects_out_of_range_ids():
    with pytest.raises(ValueError, match="token id 300 is outside the byte vocabulary"):
        ByteTokenizer().decode([1, 300])


def test_train_bpe_has_asked_vocab_size_and_round_trips(bpe_path):
    tok = HFTokenizer(bpe_path)
    assert tok.vocab_size == 300
    for text in CORPUS + TEXTS:
        assert tok.decode(tok.encode(text)) == text
    # Merges learned: the repeated sentence costs far fewer tokens than bytes.
    assert len(tok.encode(CORPUS[2])) < len(CORPUS[2].encode()) / 3


def test_train_bpe_reserves_eos_and_reads_files(tmp_path):
    text_file = tmp_path / "corpus.txt"
    text_file.write_text("\n".join(CORPUS))
    tok = train_bpe([text_file], vocab_size=280, out_path=tmp_path / "t.json")
    assert tok.eos_token == "<|endoftext|>"
    assert tok.decode([tok.eos_id]) == ""  # special tokens are skipped when decoding
    assert json.loads((tmp_path / "t.json").read_text())["model"]["type"] == "BPE"


def test_train_bpe_rejects_too_small_vocab(tmp_path):
    with pytest.raises(ValueError, match="vocab_size=257 is too small"):
        train_bpe(CORPUS, vocab_size=257, out_path=tmp_path / "t.json")


def test_load_tokenizer_by_name_path_folder_and_description(bpe_path):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    by_path = load_tokenizer(str(bpe_path))
    by_folder = load_tokenizer(bpe_path.parent)
    rebuilt = load_tokenizer(by_path.describe())
    sample = "return a + b"
    assert by_path.encode(sample) == by_folder.encode(sample) == rebuilt.encode(sample)
    assert load_tokenizer(ByteTokenizer().describe()).vocab_size == 257


def test_load_tokenizer_unknown_spec_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match="pass 'byte' or the path of an existing tokenizer.json"):
        load_tokenizer(str(tmp_path / "missing.json"))
    with pytest.raises(TypeError, match="tokenizer spec must be"):
        load_tokenizer(42)


def test_description_detects_a_changed_tokenizer_file(tmp_path):
    path = tmp_path / "t.json"
    description = train_bpe(CORPUS, vocab_size=270, out_path=path).describe()
    train_bpe(CORPUS[:2], vocab_size=262, out_path=path)  # overwrite with another tokenizer
    with pytest.raises(ValueError, match="changed since the data was prepared"):
        load_tokenizer(description)


def test_hf_tokenizer_rejects_a_file_that_is_not_a_tokenizer(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read tokenizer"):
        HFTokenizer(bad)


def test_a_str_naming_a_file_trains_on_the_file_and_a_missing_one_is_an_error(
    tmp_path, monkeypatch
):
    # tokenizers' own habit, train(files=["a.py"]): a file name means the file, not its text
    text_file = tmp_path / "a.py"
    text_file.write_text("def f(x):\n    return x + 1\n" * 200)
    monkeypatch.chdir(tmp_path)
    by_name = train_bpe(["a.py"], vocab_size=280, out_path=tmp_path / "n.json")
    by_path = train_bpe([text_file], vocab_size=280, out_path=tmp_path / "p.json")
    assert by_name.encode("return x + 1") == by_path.encode("return x + 1")
    with pytest.raises(ValueError, match="'b.py', which looks like a file name, but no such file"):
        train_bpe(["b.py"], vocab_size=280, out_path=tmp_path / "m.json")
    # text that merely has spaces or several lines stays text
    train_bpe(["hello world. " * 20], vocab_size=270, out_path=tmp_path / "t.json")


def test_a_vocabulary_the_corpus_cannot_reach_warns_with_the_size_reached(tmp_path):
    with pytest.warns(UserWarning, match=r"vocabulary of \d+ tokens, fewer than the 5000 asked"):
        tok = train_bpe(["aaaa bbbb"], vocab_size=5000, out_path=tmp_path / "t.json")
    assert tok.vocab_size < 5000
