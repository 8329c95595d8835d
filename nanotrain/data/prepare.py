"""`prepare`: text files, folders, globs and JSONL → memory-mappable token shards.

Output layout (see docs/data.md)::

    out_dir/
      metadata.json          tokenizer, dtype, splits with their shard files and counts
      train-00000.bin ...    raw little-endian uint16/uint32 token ids (numpy ``tofile``)
      val-00000.bin ...

Documents are tokenized in a fixed order (inputs in the order given, folders and globs
expanded in sorted order), each followed by the tokenizer's EOS id, so the output is
byte-for-byte deterministic.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .metadata import FORMAT_NAME, FORMAT_VERSION, METADATA_FILE, shard_dtype_name, write_metadata
from .tokenizers import Tokenizer, load_tokenizer

_GLOB_CHARS = set("*?[")


def _expand_folder(folder: Path) -> list[Path]:
    # Hidden files and folders (.git, .DS_Store) are never corpus text.
    files = []
    for path in sorted(folder.rglob("*")):
        rel_parts = path.relative_to(folder).parts
        if path.is_file() and not any(part.startswith(".") for part in rel_parts):
            files.append(path)
    return files


def resolve_inputs(inputs: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Expand files, folders (recursively, sorted, hidden entries skipped) and glob patterns.

    Returns:
        The files in a deterministic order, each once.

    Raises:
        ValueError: ``inputs`` is empty, or an entry matches no file.
    """
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if not inputs:
        raise ValueError("no inputs given; pass files, folders or glob patterns of text")
    files: list[Path] = []
    for spec in inputs:
        path = Path(spec).expanduser()
        if path.is_file():
            matched = [path]
        elif path.is_dir():
            matched = _expand_folder(path)
        elif _GLOB_CHARS & set(str(spec)):
            matched = []
            for hit in sorted(glob.glob(os.path.expanduser(str(spec)), recursive=True)):
                hit_path = Path(hit)
                matched += _expand_folder(hit_path) if hit_path.is_dir() else [hit_path]
        else:
            matched = []
        if not matched:
            raise ValueError(f"no files matched '{spec}'; pass a file, folder or glob")
        files += matched
    unique: dict[Path, Path] = {}
    for path in files:
        unique.setdefault(path.resolve(), path)
    return list(unique.values())


def _decode(raw: bytes, path: Path) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"'{path}' is not UTF-8 text ({err.reason} at byte {err.start}); pass only text "
            "files, e.g. a glob like 'dir/**/*.txt'"
        ) from err


def _iter_documents(files: Sequence[Path], text_field: str, digest: Any) -> Iterator[str]:
    """Yield the documents of ``files``: a whole file, or one per non-blank JSONL line."""
    for path in files:
        raw = path.read_bytes()
        digest.update(len(raw).to_bytes(8, "little") + raw)
        text = _decode(raw, path)
        if path.suffix != ".jsonl":
            yield text
            continue
        for line_no, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no} is not valid JSON ({err.msg})") from err
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise ValueError(
                    f"{path}:{line_no} has no string field '{text_field}'; pass "
                    "text_field=<the field that holds the text>"
                )
            yield record[text_field]


def source_digest(files: Sequence[Path]) -> str:
    """sha256 over the raw bytes of ``files`` in order (what `prepare` records as its source)."""
    digest = hashlib.sha256()
    for path in files:
        raw = path.read_bytes()
        digest.update(len(raw).to_bytes(8, "little") + raw)
    return digest.hexdigest()


def _chunks(text: str, chunk_chars: int) -> Iterator[str]:
    """Cut a long document after line breaks into pieces of about ``chunk_chars`` characters."""
    start = 0
    while len(text) - start > chunk_chars:
        cut = text.find("\n", start + chunk_chars)
        if cut < 0:
            break
        yield text[start : cut + 1]
        start = cut + 1
    if start < len(text) or start == 0:
        yield text[start:]


class _ShardWriter:
    """Buffers one split's tokens and writes them as ``{split}-NNNNN.bin`` files."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.out_dir, self.split, self.dtype, self.shard_tokens = (
            out_dir,
            split,
            dtype,
            shard_tokens,
        )
        self.buffer: list[np.ndarray] = []
        self.buffered = 0
        self.shards: list[dict[str, Any]] = []
        self.tokens = self.bytes = self.chunks = 0

    def add(self, ids: np.ndarray, num_bytes: int) -> None:
        self.buffer.append(ids)
        self.buffered += len(ids)
        self.tokens += len(ids)
        self.bytes += num_bytes
        self.chunks += 1
        while self.buffered >= self.shard_tokens:
            self._flush(self.shard_tokens)

    def _flush(self, count: int) -> None:
        data = np.concatenate(self.buffer) if self.buffer else np.empty(0, self.dtype)
        name = f"{self.split}-{len(self.shards):05d}.bin"
        data[:count].astype(self.dtype).tofile(self.out_dir / name)
        self.shards.append({"file": name, "tokens": int(count)})
        rest = data[count:]
        self.buffer, self.buffered = ([rest] if len(rest) else []), len(rest)

    def finish(self) -> dict[str, Any]:
        if self.buffered:
            self._flush(self.buffered)
        return {
            "tokens": self.tokens,
            "bytes": self.bytes,
            "chunks": self.chunks,
            "shards": self.shards,
        }


def _write_shards(
    tmp_dir: Path, files: list[Path], tok: Tokenizer, settings: dict[str, Any]
) -> dict[str, Any]:
    """Tokenize every document into train/val shard writers; return the metadata dict."""
    dtype = np.dtype(shard_dtype_name(tok.vocab_size))
    writers = {
        s: _ShardWriter(tmp_dir, s, dtype, settings["shard_tokens"]) for s in ("train", "val")
    }
    val_fraction = settings["val_fraction"]
    digest = hashlib.sha256()
    num_documents = total_bytes = max_id = 0
    for text in _iter_documents(files, settings["text_field"], digest):
        if not text:
            continue
        num_documents += 1
        pieces = list(_chunks(text, settings["split_chunk_chars"]))
        for index, piece in enumerate(pieces):
            ids = np.asarray(tok.encode(piece), dtype=np.int64)
            if index == len(pieces) - 1:
                ids = np.append(ids, tok.eos_id)
            num_bytes = len(piece.encode("utf-8"))
            # Error diffusion on bytes: a chunk goes to val when that keeps val's share of
            # all bytes closest to val_fraction, which spreads val evenly over the corpus.
            total_bytes += num_bytes
            to_val = writers["val"].bytes + num_bytes / 2 <= val_fraction * total_bytes
            writers["val" if to_val else "train"].add(ids, num_bytes)
            max_id = max(max_id, int(ids.max()))
    if max_id >= tok.vocab_size:
        raise ValueError(f"tokenizer produced id {max_id} >= its vocab_size {tok.vocab_size}")
    splits = {name: writer.finish() for name, writer in writers.items()}
    total_tokens = splits["train"]["tokens"] + splits["val"]["tokens"]
    if total_tokens == 0:
        raise ValueError(
            f"the inputs {settings['inputs']} hold no text (all documents are empty); "
            "pass files that contain text"
        )
    measured = splits["val"] if splits["val"]["tokens"] else splits["train"]
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "tokenizer": tok.describe(),
        "vocab_size": int(tok.vocab_size),
        "eos_id": int(tok.eos_id),
        "dtype": dtype.name,
        "num_files": len(files),
        "num_documents": num_documents,
        "total_tokens": total_tokens,
        "max_token_id": max_id,
        "bytes_per_token": measured["bytes"] / measured["tokens"],
        "source_sha256": digest.hexdigest(),
        "settings": settings,
        "splits": splits,
    }


def commit_directory(tmp_dir: Path, out_dir: Path, replace: bool = True) -> bool:
    """Move a finished ``tmp_dir`` to ``out_dir`` with an atomic rename.

    An empty folder at ``out_dir`` is taken over. An existing prepared corpus is replaced
    when ``replace`` is True, and kept (``tmp_dir`` deleted) when it is False, which is what
    concurrent writers of the same cache want.

    Returns:
        True if ``tmp_dir`` became ``out_dir``; False if a prepared corpus was kept there
        (for instance one another process committed at the same moment).

    Raises:
        ValueError: ``out_dir`` is a non-empty folder that is not a prepared corpus.
    """
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()
    elif out_dir.exists() and not (out_dir / METADATA_FILE).is_file():
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise ValueError(
            f"'{out_dir}' exists and is not prepared data; pass an empty or new output folder"
        )
    elif out_dir.exists() and replace:
        trash = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
        try:
            out_dir.rename(trash)
        except FileNotFoundError:
            pass  # another process moved it first; our own rename below decides
        else:
            shutil.rmtree(trash, ignore_errors=True)
    try:
        # rename(2) of a directory onto an existing non-empty one fails, so exactly one
        # of several racing writers wins.
        tmp_dir.rename(out_dir)
    except OSError:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        return False
    return True


def build_in_temp(
    inputs: Sequence[str | os.PathLike[str]],
    out_dir: Path,
    tokenizer: str | Tokenizer,
    settings: dict[str, Any],
) -> Path:
    """Prepare ``inputs`` into a fresh hidden sibling folder of ``out_dir`` and return it.

    The sibling lives on the same filesystem, so `commit_directory` can rename it atomically.
    ``settings`` holds the keyword arguments of `prepare` other than inputs/out_dir/tokenizer.
    """
    if settings["shard_tokens"] < 1:
        raise ValueError(f"shard_tokens must be >= 1, got {settings['shard_tokens']}")
    if not 0.0 <= settings["val_fraction"] < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {settings['val_fraction']}")
    if settings["split_chunk_chars"] < 1:
        raise ValueError(f"split_chunk_chars must be >= 1, got {settings['split_chunk_chars']}")
    files = resolve_inputs(inputs)
    tok = load_tokenizer(tokenizer)
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / METADATA_FILE).is_file():
        # Checked before tokenizing so the user does not wait for a run that cannot commit.
        raise ValueError(
            f"'{out_dir}' exists and is not prepared data; pass an empty or new output folder"
        )
    given = [inputs] if isinstance(inputs, (str, os.PathLike)) else inputs
    settings = {"inputs": [str(spec) for spec in given], **settings}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp_dir.mkdir()
    try:
        meta = _write_shards(tmp_dir, files, tok, settings)
        write_metadata(tmp_dir, meta)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return tmp_dir


def prepare(
    inputs: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    tokenizer: str = "byte",
    text_field: str = "text",
    shard_tokens: int = 2**24,
    val_fraction: float = 0.05,
    split_chunk_chars: int = 2**16,
    eos_token: str | None = None,
) -> Path:
    """Tokenize text into memory-mappable token shards plus ``metadata.json``.

    Args:
        inputs: files, folders (read recursively) and glob patterns (``**`` allowed). A
            ``.jsonl`` file holds one JSON object per line, the text in ``text_field``; any
            other file is one UTF-8 document.
        out_dir: output folder; created, or replaced if it already holds prepared data.
        tokenizer: ``"byte"``, the path of a ``tokenizer.json`` (or of a folder holding one),
            or a tokenizer object (`nanotrain.data.HFTokenizer` ...).
        text_field: the JSONL field holding the text.
        shard_tokens: tokens per shard file (the last shard of a split may be shorter).
        val_fraction: share of the text's bytes that goes to the validation split, in [0, 1).
        split_chunk_chars: documents longer than this are cut after a line break into chunks
            of about this many characters; chunks (not whole documents) are assigned to
            train or val, so even a single large file gets a validation part.
        eos_token: the token string appended after every document (a ``tokenizer.json``
            path only), e.g. ``"<｜end▁of▁sentence｜>"`` for DeepSeek's tokenizer; default:
            the first known end-of-text token the vocabulary holds.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ValueError: an input matches nothing, a file is not UTF-8, a JSONL line lacks
            ``text_field``, the result is empty, an argument is out of range, or ``out_dir``
            is a non-empty folder that is not prepared data.
    """
    settings = {
        "text_field": text_field,
        "shard_tokens": int(shard_tokens),
        "val_fraction": float(val_fraction),
        "split_chunk_chars": int(split_chunk_chars),
    }
    out = Path(out_dir).expanduser().resolve()
    if eos_token is not None:
        tokenizer = _with_eos(tokenizer, eos_token)
    tmp_dir = build_in_temp(inputs, out, tokenizer, settings)
    commit_directory(tmp_dir, out)
    return out


def _with_eos(tokenizer: Any, eos_token: str) -> Tokenizer:
    """An `HFTokenizer` of the path `tokenizer` with `eos_token` as its end-of-text token.

    Raises:
        ValueError: `tokenizer` is not the path of a tokenizer.json (the byte tokenizer's EOS
            is fixed), or the vocabulary lacks `eos_token`.
    """
    from nanotrain.data.tokenizers import HFTokenizer

    if not isinstance(tokenizer, (str, os.PathLike)) or str(tokenizer) == "byte":
        raise ValueError(
            "eos_token applies to a tokenizer.json only (the byte tokenizer's EOS is fixed); "
            "pass tokenizer=<path of tokenizer.json> with it, or drop eos_token"
        )
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"unknown tokenizer '{tokenizer}': no tokenizer.json at {path}")
    return HFTokenizer(path, eos_token=eos_token)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m nanotrain.data.prepare --inputs A B --out DIR``."""
    parser = argparse.ArgumentParser(description="Tokenize text into nanotrain token shards.")
    parser.add_argument("--inputs", nargs="+", required=True, help="files, folders or globs")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--tokenizer", default="byte", help="'byte' or a tokenizer.json path")
    parser.add_argument("--text-field", default="text", help="JSONL field holding the text")
    parser.add_argument("--shard-tokens", type=int, default=2**24)
    parser.add_argument("--val-fraction", type=float, default=0.05)
    args = parser.parse_args(argv)
    out = prepare(
        args.inputs, args.out, args.tokenizer, args.text_field, args.shard_tokens, args.val_fraction
    )
    meta = json.loads((out / METADATA_FILE).read_text(encoding="utf-8"))
    print(format_summary(meta, out))
    return 0


def format_summary(meta: dict[str, Any], out: Path) -> str:
    """One line describing a prepared corpus, for the CLI."""
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    return (
        f"prepared {meta['num_documents']} documents from {meta['num_files']} files into "
        f"'{out}': {train['tokens']:,} train + {val['tokens']:,} val tokens "
        f"({meta['dtype']}, vocab {meta['vocab_size']}, {meta['bytes_per_token']:.3f} bytes/token)"
    )


if __name__ == "__main__":
    raise SystemExit(main())
