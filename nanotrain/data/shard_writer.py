"""The write side of `prepare`: long documents cut into chunks, chunks assigned to train or
validation, and each split's tokens streamed into fixed-size ``{split}-NNNNN.bin`` files."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np


def chunk_pieces(
    pieces: Iterable[tuple[str, bool]], chunk_chars: int
) -> Iterator[tuple[str, bool]]:
    """Regroup ``(text, ends_document)`` pieces into chunks of about ``chunk_chars`` characters.

    A document longer than ``chunk_chars`` is cut after the first line break at or beyond
    ``chunk_chars`` characters; where no line break comes within ``2 * chunk_chars``
    characters it is cut there, so memory stays bounded on a file without line breaks. The
    result does not depend on how the reader cut its pieces. Empty documents are dropped.

    Yields:
        ``(chunk, ends_document)``; the chunks of one document concatenate to it.
    """
    buffer = ""
    for text, ends_document in pieces:
        buffer = buffer + text if buffer else text
        start = 0  # slice the buffer once per piece, not once per chunk
        while len(buffer) - start > chunk_chars:
            cut = buffer.find("\n", start + chunk_chars, start + 2 * chunk_chars)
            if cut < 0:
                if len(buffer) - start < 2 * chunk_chars:
                    break  # the line break may come in the next piece
                cut = start + 2 * chunk_chars - 1
            if cut + 1 == len(buffer):
                break  # nothing after the cut (yet): decided with the next piece or the end
            yield buffer[start : cut + 1], False
            start = cut + 1
        buffer = buffer[start:]
        if ends_document:
            if buffer:
                yield buffer, True
            buffer = ""


class ValidationSplit:
    """Decides, chunk after chunk, whether a chunk goes to validation.

    A chunk goes to validation when validation's share of the bytes *before* it is below
    ``val_fraction``. The decision never looks at the chunk's own length, so validation's
    chunk lengths are distributed like training's (no preference for short documents), and
    its share of the bytes stays within one chunk of ``val_fraction``. Deterministic: it
    depends only on the order and sizes of the chunks.
    """

    def __init__(self, val_fraction: float) -> None:
        self.val_fraction = val_fraction
        self.val_bytes = 0
        self.total_bytes = 0

    def assign(self, num_bytes: int) -> str:
        """``"val"`` or ``"train"`` for the next chunk of ``num_bytes`` UTF-8 bytes."""
        to_val = self.val_bytes < self.val_fraction * self.total_bytes
        self.total_bytes += num_bytes
        if to_val:
            self.val_bytes += num_bytes
        return "val" if to_val else "train"


class ShardWriter:
    """Streams one split's tokens into ``{split}-NNNNN.bin`` files of ``shard_tokens`` tokens.

    Tokens go to disk as they come (raw little-endian ``dtype``, numpy ``tofile`` layout), so
    memory does not grow with the corpus. Call `finish` to close the last shard.
    """

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.out_dir, self.split, self.dtype = out_dir, split, dtype
        self.shard_tokens = shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.tokens = self.bytes = self.chunks = 0
        self._file: IO[bytes] | None = None
        self._in_shard = 0

    def add(self, ids: np.ndarray, num_bytes: int) -> None:
        """Append one chunk: ``ids`` (1-D, already ``dtype``) of ``num_bytes`` bytes of text."""
        self.tokens += len(ids)
        self.bytes += num_bytes
        self.chunks += 1
        while len(ids):
            if self._file is None:
                name = f"{self.split}-{len(self.shards):05d}.bin"
                self._file = open(self.out_dir / name, "wb", buffering=1 << 20)  # noqa: SIM115
                self.shards.append({"file": name, "tokens": 0})
                self._in_shard = 0
            take = min(len(ids), self.shard_tokens - self._in_shard)
            self._file.write(ids[:take].tobytes())
            self._in_shard += take
            self.shards[-1]["tokens"] = self._in_shard
            ids = ids[take:]
            if self._in_shard == self.shard_tokens:
                self._close()

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def finish(self) -> dict[str, Any]:
        """Close the open shard; return the split's metadata (tokens, bytes, chunks, shards)."""
        self._close()
        return {
            "tokens": self.tokens,
            "bytes": self.bytes,
            "chunks": self.chunks,
            "shards": self.shards,
        }
