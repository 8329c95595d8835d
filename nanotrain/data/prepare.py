"""`prepare`: corpora in the formats they ship in → memory-mappable token shards.

Output layout (see docs/data.md)::

    out_dir/
      metadata.json          tokenizer, dtype, splits with their shard files and counts
      train-00000.bin ...    raw little-endian uint16/uint32 token ids (numpy ``tofile``)
      val-00000.bin ...

Sources are read in a fixed order (inputs in the order given, folders and globs expanded in
sorted order) by the streaming readers of `nanotrain.data.readers`; documents are cut into
chunks, tokenized by worker processes (`tokenize_pool`), each document followed by the
tokenizer's EOS id, and written as they come (`shard_writer`), so the output is
byte-for-byte the same for every number of workers and memory does not grow with the input.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from .metadata import FORMAT_NAME, FORMAT_VERSION, METADATA_FILE, shard_dtype_name, write_metadata
from .readers import Source, open_sources
from .readers.sources import resolve_paths
from .shard_writer import ShardWriter, ValidationSplit, chunk_pieces
from .tokenize_pool import batch_chunks, tokenize_in_order
from .tokenizers import Tokenizer, load_tokenizer


def resolve_inputs(inputs: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Expand files, folders (recursively, sorted, hidden entries skipped) and glob patterns.

    Returns:
        The files (and `datasets` folders) in a deterministic order, each once.

    Raises:
        ValueError: ``inputs`` is empty, or an entry matches no file.
    """
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    return resolve_paths(inputs)


def _update_digest(digest: Any, path: Path) -> None:
    """Feed a file's (or a folder's files') length and bytes to ``digest``, block by block."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        digest.update(file.stat().st_size.to_bytes(8, "little"))
        with open(file, "rb") as handle:
            while block := handle.read(1 << 20):
                digest.update(block)


def source_digest(files: Sequence[Path]) -> str:
    """sha256 over the raw bytes of ``files`` in order (what `prepare` records as its source)."""
    digest = hashlib.sha256()
    for path in files:
        _update_digest(digest, path)
    return digest.hexdigest()


class Progress:
    """A one-line progress display: documents, tokens, tokens/s; redrawn at most twice a second.

    Args:
        stream: where to draw (stderr by default); None draws nothing.
    """

    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream
        self.start = self.last = time.perf_counter()
        self.documents = self.tokens = 0

    def line(self) -> str:
        """The current state as text."""
        seconds = max(time.perf_counter() - self.start, 1e-9)
        return (
            f"prepare: {self.documents:,} documents, {self.tokens:,} tokens, "
            f"{self.tokens / seconds:,.0f} tokens/s"
        )

    def update(self, documents: int, tokens: int) -> None:
        """Count ``documents`` more documents and ``tokens`` more tokens; redraw if due."""
        self.documents += documents
        self.tokens += tokens
        now = time.perf_counter()
        if self.stream is not None and now - self.last >= 0.5:
            self.last = now
            self.stream.write("\r" + self.line())
            self.stream.flush()

    def close(self) -> None:
        """Draw the final state and end the line."""
        if self.stream is not None:
            self.stream.write("\r" + self.line() + "\n")
            self.stream.flush()


def _pieces(sources: list[Source], digest: Any) -> Iterator[tuple[str, bool]]:
    """Every source's pieces in order; hashes each file (or, for Python inputs, the text)."""
    for source in sources:
        if source.path is not None:
            _update_digest(digest, source.path)
            yield from source.pieces()
        else:
            for text, ends in source.pieces():
                digest.update(text.encode("utf-8"))
                yield text, ends


def _write_shards(
    tmp_dir: Path,
    sources: list[Source],
    tok: Tokenizer,
    settings: dict[str, Any],
    num_workers: int,
    progress: Progress,
) -> dict[str, Any]:
    """Tokenize every document into train/val shard writers; return the metadata dict."""
    dtype = np.dtype(shard_dtype_name(tok.vocab_size))
    writers = {
        s: ShardWriter(tmp_dir, s, dtype, settings["shard_tokens"]) for s in ("train", "val")
    }
    split = ValidationSplit(settings["val_fraction"])
    digest = hashlib.sha256()
    num_documents = max_id = 0
    chunks = chunk_pieces(_pieces(sources, digest), settings["split_chunk_chars"])
    batches = batch_chunks(chunks)
    results = tokenize_in_order(batches, tok, dtype, num_workers)
    try:
        for result in results:
            ends = np.cumsum(result.token_counts)
            for index, num_bytes in enumerate(result.byte_counts.tolist()):
                ids = result.ids[ends[index] - result.token_counts[index] : ends[index]]
                writers[split.assign(num_bytes)].add(ids, num_bytes)
            num_documents += result.documents
            max_id = max(max_id, result.max_id)
            progress.update(result.documents, len(result.ids))
    finally:
        results.close()
    progress.close()
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
        "num_files": sum(source.path is not None for source in sources),
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


def _settings_inputs(inputs: Any, sources: list[Source]) -> list[str]:
    """How the metadata names the inputs (JSON): path specs as given, Python objects by kind."""
    if isinstance(inputs, (str, os.PathLike)):
        return [str(inputs)]
    if isinstance(inputs, (list, tuple)) and sources and sources[0].path is not None:
        return [str(item) for item in inputs]
    return [source.name for source in sources]


def default_num_workers() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(len(os.sched_getaffinity(0)), 1)
    return os.cpu_count() or 1


def build_in_temp(
    inputs: Any,
    out_dir: Path,
    tokenizer: str | Tokenizer,
    settings: dict[str, Any],
    num_workers: int = 1,
    progress: TextIO | None = None,
) -> Path:
    """Prepare ``inputs`` into a fresh hidden sibling folder of ``out_dir`` and return it.

    The sibling lives on the same filesystem, so `commit_directory` can rename it atomically.
    ``settings`` holds the keyword arguments of `prepare` that shape the output (text_field,
    shard_tokens, val_fraction, split_chunk_chars). On any error the sibling is removed.
    """
    if settings["shard_tokens"] < 1:
        raise ValueError(f"shard_tokens must be >= 1, got {settings['shard_tokens']}")
    if not 0.0 <= settings["val_fraction"] < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {settings['val_fraction']}")
    if settings["split_chunk_chars"] < 1:
        raise ValueError(f"split_chunk_chars must be >= 1, got {settings['split_chunk_chars']}")
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    sources = open_sources(inputs, settings["text_field"])
    tok = load_tokenizer(tokenizer)
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / METADATA_FILE).is_file():
        # Checked before tokenizing so the user does not wait for a run that cannot commit.
        raise ValueError(
            f"'{out_dir}' exists and is not prepared data; pass an empty or new output folder"
        )
    settings = {"inputs": _settings_inputs(inputs, sources), **settings}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp_dir.mkdir()
    try:
        meta = _write_shards(tmp_dir, sources, tok, settings, num_workers, Progress(progress))
        write_metadata(tmp_dir, meta)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return tmp_dir


def prepare(
    inputs: Any,
    out_dir: str | os.PathLike[str],
    tokenizer: str | Tokenizer = "byte",
    text_field: str = "text",
    shard_tokens: int = 2**24,
    val_fraction: float = 0.05,
    split_chunk_chars: int = 2**16,
    eos_token: str | None = None,
    num_workers: int | None = None,
    progress: bool | None = None,
) -> Path:
    """Tokenize a corpus into memory-mappable token shards plus ``metadata.json``.

    Args:
        inputs: files, folders (read recursively) and glob patterns (``**`` allowed), in the
            formats of `nanotrain.data.readers.FORMATS` (Parquet, JSON lines plain / .gz /
            .zst, text, a `datasets` save_to_disk folder); or an iterable of str (each a
            document); or a `datasets.Dataset` / `IterableDataset`.
        out_dir: output folder; created, or replaced if it already holds prepared data.
        tokenizer: ``"byte"``, the path of a ``tokenizer.json`` (or of a folder holding one),
            or a tokenizer object (`nanotrain.data.HFTokenizer` ...).
        text_field: the JSON field / Parquet or `datasets` column holding the text.
        shard_tokens: tokens per shard file (the last shard of a split may be shorter).
        val_fraction: share of the text's bytes that goes to the validation split, in [0, 1).
            Chunks are picked without looking at their own length (see
            `shard_writer.ValidationSplit`), so validation is not biased to short documents.
        split_chunk_chars: documents longer than this are cut after a line break into chunks
            of about this many characters; chunks (not whole documents) are assigned to
            train or val, so even a single large file gets a validation part.
        eos_token: the token string appended after every document (a ``tokenizer.json``
            path only), e.g. ``"<｜end▁of▁sentence｜>"`` for DeepSeek's tokenizer; default:
            the first known end-of-text token the vocabulary holds.
        num_workers: tokenizer processes (1: tokenize in this process); None: the CPUs
            this process may use. The output is byte-identical
            for every value.
        progress: draw documents, tokens and tokens/s on stderr; None: when stderr is a
            terminal.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ValueError: an input matches nothing or is in no known format, a file is corrupt or
            truncated (named, with the row, line or byte), the text field is missing (the
            fields present are named), the result is empty, an argument is out of range, or
            ``out_dir`` is a non-empty folder that is not prepared data. Nothing is left
            behind: the output is renamed into place only after everything was written.
        TypeError: ``inputs`` is of an unsupported type.
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
    workers = default_num_workers() if num_workers is None else int(num_workers)
    show = sys.stderr.isatty() if progress is None else progress
    tmp_dir = build_in_temp(inputs, out, tokenizer, settings, workers, sys.stderr if show else None)
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


def format_summary(meta: dict[str, Any], out: Path) -> str:
    """One line describing a prepared corpus, for the CLI."""
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    return (
        f"prepared {meta['num_documents']} documents from {meta['num_files']} files into "
        f"'{out}': {train['tokens']:,} train + {val['tokens']:,} val tokens "
        f"({meta['dtype']}, vocab {meta['vocab_size']}, {meta['bytes_per_token']:.3f} bytes/token)"
    )
