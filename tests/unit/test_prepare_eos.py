"""`prepare(eos_token=...)`: a tokenizer whose end-of-text token nanotrain does not know."""

from __future__ import annotations

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
