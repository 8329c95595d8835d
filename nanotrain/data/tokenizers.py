"""Tokenizers: a tiny protocol, a byte tokenizer, a wrapper around Hugging Face `tokenizers`,
and local byte-level BPE training (no download).

Every tokenizer can describe itself as a small JSON-able dict (`describe()`), which `prepare`
stores in `metadata.json` so a prepared corpus always knows how to decode its own tokens.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

# The end-of-document token that `train_bpe` reserves; also the first name HFTokenizer looks for.
BPE_EOS_TOKEN = "<|endoftext|>"
# Names of end-of-text tokens used by common tokenizer.json files, tried in order.
_KNOWN_EOS_TOKENS = (BPE_EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


@runtime_checkable
class Tokenizer(Protocol):
    """What nanotrain needs from a tokenizer.

    Attributes:
        name: short human-readable name (``"byte"``, ``"bpe-1a2b3c4d"``).
        vocab_size: number of distinct ids; every id is in ``[0, vocab_size)``.
        eos_id: the id `prepare` appends after every document.
    """

    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]:
        """Text → token ids (no EOS appended)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Token ids → text (EOS and other special ids are dropped)."""
        ...

    def describe(self) -> dict[str, Any]:
        """A JSON-able dict from which `load_tokenizer` rebuilds this tokenizer."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are the bytes, id 256 is EOS, so ``vocab_size == 257``.

    Needs no training and no files, round-trips every string exactly, and makes
    bits-per-byte trivially comparable with the loss. Decoding drops EOS and replaces
    invalid UTF-8 (e.g. a window cut in the middle of a character) with U+FFFD.
    """

    name = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as ints in ``[0, 256)``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Return the text of byte ids; ids >= 256 (EOS) are skipped.

        Raises:
            ValueError: an id is negative or >= ``vocab_size``.
        """
        ids = [int(i) for i in ids]
        bad = [i for i in ids if i < 0 or i >= self.vocab_size]
        if bad:
            raise ValueError(
                f"token id {bad[0]} is outside the byte vocabulary [0, {self.vocab_size}); "
                "were these ids made by another tokenizer?"
            )
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def describe(self) -> dict[str, Any]:
        """``{"kind": "byte"}``."""
        return {"kind": "byte"}

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=257, eos_id=256)"


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class HFTokenizer:
    """A `tokenizer.json` file (Hugging Face `tokenizers` format) behind the `Tokenizer` protocol.

    Args:
        path: path to a ``tokenizer.json`` file.
        eos_token: the token string to use as EOS; by default the first of
            ``<|endoftext|>``, ``</s>``, ``<eos>``, ``<|end_of_text|>``, ``[SEP]`` present.

    Raises:
        ValueError: the file does not exist, cannot be parsed, or has no EOS token.
    """

    def __init__(self, path: str | os.PathLike[str], eos_token: str | None = None) -> None:
        from tokenizers import Tokenizer as _HFTok

        self.path = Path(path).expanduser().resolve()
        if not self.path.is_file():
            raise ValueError(
                f"tokenizer file '{path}' does not exist; pass 'byte' or the path of a "
                "tokenizer.json (train one with nanotrain.data.train_bpe)"
            )
        try:
            self._tok = _HFTok.from_file(str(self.path))
        except Exception as err:  # tokenizers raises a bare Exception on parse errors
            raise ValueError(f"cannot read tokenizer '{path}': {err}") from err
        # Text is text: a literal "<|endoftext|>" inside a document encodes as its characters,
        # never as the special id, so only `prepare` decides where documents end.
        self._tok.encode_special_tokens = True
        self.sha256 = _file_sha256(self.path)
        self.name = f"bpe-{self.sha256[:8]}"
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        candidates = (eos_token,) if eos_token is not None else _KNOWN_EOS_TOKENS
        for token in candidates:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                self.eos_token, self.eos_id = token, int(token_id)
                break
        else:
            raise ValueError(
                f"tokenizer '{path}' has no end-of-text token among {list(candidates)}; "
                "pass eos_token=<its EOS token string>"
            )

    def __setstate__(self, state: dict[str, Any]) -> None:
        # the library's pickle does not keep encode_special_tokens (a spawned worker's copy)
        self.__dict__.update(state)
        self._tok.encode_special_tokens = True

    def encode(self, text: str) -> list[int]:
        """Return the ids of ``text`` without special tokens (no BOS/EOS added); special-token
        strings inside ``text`` (``<|endoftext|>``) are encoded as ordinary text."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text, in one call into the `tokenizers` library."""
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets nanotrain never reads
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        encodings = encode(texts, add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        """Return the text of ``ids``, skipping special tokens such as EOS."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def describe(self) -> dict[str, Any]:
        """``{"kind": "hf", "path": ..., "sha256": ..., "eos_token": ...}``."""
        return {
            "kind": "hf",
            "path": str(self.path),
            "sha256": self.sha256,
            "eos_token": self.eos_token,
        }

    def __repr__(self) -> str:
        return f"HFTokenizer('{self.path}', vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def load_tokenizer(spec: str | os.PathLike[str] | dict[str, Any] | Tokenizer) -> Tokenizer:
    """Build a tokenizer from ``"byte"``, a path to a ``tokenizer.json``, or a `describe()` dict.

    A tokenizer object is returned unchanged.

    Raises:
        ValueError: unknown spec, missing file, or (for a dict) a file whose content changed
            since the description was written (sha256 mismatch).
    """
    if isinstance(spec, (ByteTokenizer, HFTokenizer)):
        return spec
    if isinstance(spec, dict):
        kind = spec.get("kind")
        if kind == "byte":
            return ByteTokenizer()
        if kind == "hf":
            tok = HFTokenizer(spec["path"], eos_token=spec.get("eos_token"))
            if spec.get("sha256") and spec["sha256"] != tok.sha256:
                raise ValueError(
                    f"tokenizer file '{spec['path']}' changed since the data was prepared "
                    "(sha256 differs); restore it or prepare the data again"
                )
            return tok
        raise ValueError(f"unknown tokenizer kind {kind!r}; expected 'byte' or 'hf'")
    if isinstance(spec, Tokenizer):
        return spec
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(f"tokenizer spec must be 'byte' or a path, got {type(spec).__name__}")
    if str(spec) == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(
            f"unknown tokenizer '{spec}': pass 'byte' or the path of an existing tokenizer.json"
        )
    return HFTokenizer(path)


def _names_a_file(item: str) -> bool:
    """Whether a str item of `train_bpe` is a file name rather than text: one short line
    without spaces that names an existing file, or that looks like a path (a separator or a
    suffix such as .txt)."""
    if len(item) > 4096 or "\n" in item or not item.strip():
        return False
    try:
        if Path(item).expanduser().is_file():
            return True
    except OSError:  # e.g. a name too long for the file system: text
        return False
    if " " in item.strip():
        return False
    if os.sep in item or Path(item).suffix[1:].isalnum() and len(Path(item).suffix) <= 6:
        raise ValueError(
            f"train_bpe got {item!r}, which looks like a file name, but no such file exists; "
            "pass the paths of existing files (str or pathlib.Path), or texts"
        )
    return False


def _iter_texts(texts_or_files: Iterable[str | os.PathLike[str]]) -> Iterator[str]:
    for item in texts_or_files:
        if isinstance(item, os.PathLike):
            yield Path(item).read_text(encoding="utf-8")
        elif isinstance(item, str) and _names_a_file(item):
            # tokenizers' own habit, train(files=[...]): a file name means the file
            yield Path(item).expanduser().read_text(encoding="utf-8")
        elif isinstance(item, str):
            yield item
        else:
            raise TypeError(
                f"train_bpe expects strings (texts) or pathlib.Path objects (files), "
                f"got {type(item).__name__}"
            )


def train_bpe(
    texts_or_files: Iterable[str | os.PathLike[str]],
    vocab_size: int,
    out_path: str | os.PathLike[str],
) -> HFTokenizer:
    """Train a byte-level BPE tokenizer locally and save it as a ``tokenizer.json``.

    The vocabulary holds the 256 byte symbols, the EOS token ``<|endoftext|>`` and up to
    ``vocab_size - 257`` merges; a corpus too small to yield that many merges gives a smaller
    vocabulary. Any text can be encoded (byte fallback), and decode(encode(t)) == t.

    Args:
        texts_or_files: texts, or UTF-8 files to read: ``pathlib.Path`` items, and ``str``
            items that name an existing file (as `tokenizers`' ``train(files=[...])``); a
            ``str`` that looks like a file name of a missing file is an error.
        vocab_size: wanted vocabulary size, at least 258 (bytes + EOS + one merge).
        out_path: where to write ``tokenizer.json`` (parent folders are created).

    Returns:
        The trained tokenizer, loaded from ``out_path``.

    Warns:
        UserWarning: the corpus cannot reach ``vocab_size`` (the size reached is named).

    Raises:
        ValueError: ``vocab_size`` below 258, or a missing file named by a str item.
        TypeError: an item is neither str nor Path.
    """
    from tokenizers import Tokenizer as _HFTok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 258:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for byte-level BPE: 256 bytes + EOS + at "
            "least one merge need 258; use tokenizer='byte' for a pure byte vocabulary"
        )
    tok = _HFTok(models.BPE())
    # add_prefix_space=False keeps decode(encode(t)) == t for every t.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS_TOKEN],
        # All 256 byte symbols up front, so unseen bytes still encode.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_iter_texts(texts_or_files), trainer=trainer)
    out = Path(out_path).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    reached = tok.get_vocab_size()
    if reached < vocab_size:
        warnings.warn(
            f"train_bpe: the corpus yielded a vocabulary of {reached} tokens, fewer than the "
            f"{vocab_size} asked for (it has too few distinct byte pairs to merge); train on "
            "more text for a larger vocabulary",
            stacklevel=2,
        )
    return HFTokenizer(out)
