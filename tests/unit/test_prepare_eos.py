"""`prepare(eos_token=...)`: a tokenizer whose end-of-text token nanotrain does not know."""

from __future__ import annotations

import numpy as np
import pytest

from nanotrain.data import prepare
from nanotrain.data.metadata import read_metadata
from tests.integration.test_cli_errors import DEEPSEEK_EOS, deepseek_style_tokenizer


def test_eos_token_is_used_and_recorded(tmp_path):
    tokenizer = deepseek_style_tokenizer(tmp_path)
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world\n" * 50)
    with pytest.raises(ValueError, match="no end-of-text token"):
        prepare([corpus], tmp_path / "a", tokenizer=str(tokenizer))
    out = prepare([corpus], tmp_path / "b", tokenizer=str(tokenizer.parent), eos_token=DEEPSEEK_EOS)
    meta = read_metadata(out)
    assert meta["tokenizer"]["eos_token"] == DEEPSEEK_EOS
    from tokenizers import Tokenizer

    assert meta["eos_id"] == Tokenizer.from_file(str(tokenizer)).token_to_id(DEEPSEEK_EOS)
    with pytest.raises(ValueError, match="eos_token applies to a tokenizer.json only"):
        prepare([corpus], tmp_path / "c", eos_token=DEEPSEEK_EOS)


def test_literal_end_of_text_inside_a_document_stays_text(tmp_path):
    from nanotrain.data import train_bpe

    tok = train_bpe(["plain words and more words " * 20], 270, tmp_path / "tok.json")
    docs = ["before <|endoftext|> after", "<|endoftext|>"]
    out = prepare(docs, tmp_path / "o", tokenizer=str(tmp_path / "tok.json"), val_fraction=0)
    meta = read_metadata(out)
    stream = np.fromfile(out / meta["splits"]["train"]["shards"][0]["file"], meta["dtype"])
    assert meta["eos_id"] == tok.eos_id and meta["num_documents"] == 2
    # one EOS per document, at its end; the literal text decodes back
    ends = np.flatnonzero(stream == tok.eos_id).tolist()
    assert len(ends) == 2 and ends[-1] == len(stream) - 1
    first = stream[: ends[0]].tolist()
    assert tok.decode(first) == docs[0]
    assert len(first) > len("before  after")  # the marker is spelled out in byte tokens


def test_a_pickled_tokenizer_still_reads_the_marker_as_text(tmp_path):
    """Workers started with spawn get a pickled tokenizer; it must encode the same."""
    import pickle

    from nanotrain.data import train_bpe

    tok = train_bpe(["plain words and more words " * 20], 270, tmp_path / "tok.json")
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode("a <|endoftext|> b") == tok.encode("a <|endoftext|> b")
    assert tok.eos_id not in clone.encode("a <|endoftext|> b")
