"""JSON lines (``.jsonl``, or ``.json`` holding JSON lines), plain, gzip or zstd compressed,
read line by line from a decompressing stream."""

from __future__ import annotations

import gzip
import io
import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO


def _open_binary(path: Path, compression: str | None, raw: IO[bytes]) -> IO[bytes]:
    if compression == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if compression == "zstd":
        return _ZstdStream(raw)
    return raw


class _ZstdStream(io.RawIOBase):
    """Decompressed bytes of a zstd file, frame after frame, that raises EOFError when the file
    ends inside a frame (zstandard's own stream reader ends quietly there)."""

    def __init__(self, raw: IO[bytes]) -> None:
        import zstandard

        self._zstd, self._raw = zstandard, raw
        self._decomp = zstandard.ZstdDecompressor().decompressobj()
        self._pending = b""
        self._in_frame = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # noqa: ANN001 (a writable bytes-like object)
        while not self._pending:
            # small compressed steps: a step can inflate many times over, all at once
            chunk = self._raw.read(1 << 14)
            if not chunk:
                if self._in_frame:
                    raise EOFError("the file ends inside a zstd frame")
                return 0
            while chunk:
                self._in_frame = True
                self._pending += self._decomp.decompress(chunk)
                if not self._decomp.eof:
                    break
                # a frame ended: the next one (if any) starts in unused_data
                chunk, self._in_frame = self._decomp.unused_data, False
                self._decomp = self._zstd.ZstdDecompressor().decompressobj()
        size = min(len(buffer), len(self._pending))
        buffer[:size] = self._pending[:size]
        self._pending = self._pending[size:]
        return size


class _Counted(io.RawIOBase):
    """Passes a decompressed stream through, counting its bytes and line breaks, so an error
    can say where the text broke (reading is buffered ahead of the lines handed out)."""

    def __init__(self, inner: IO[bytes]) -> None:
        self.inner = inner
        self.bytes = 0
        self.newlines = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # noqa: ANN001 (a writable bytes-like object)
        # read1: at most one step of the decompressor, so the bytes it produced before a
        # failure are counted instead of being lost inside one large read
        read = getattr(self.inner, "read1", self.inner.read)
        data = read(min(len(buffer), 1 << 16))
        size = len(data)
        buffer[:size] = data
        self.bytes += size
        self.newlines += data.count(b"\n")
        return size


def read_jsonl(
    path: Path, text_field: str, compression: str | None = None
) -> Iterator[tuple[str, bool]]:
    """Yield the ``text_field`` of each non-blank line of ``path`` as one whole document.

    Args:
        path: the file.
        text_field: the key of each JSON object that holds the text.
        compression: None, ``"gzip"`` or ``"zstd"``.

    Raises:
        ValueError: a line is not JSON or lacks a string ``text_field`` (file:line, the keys
            present), a ``.json`` file holds one JSON array instead of lines, or the compressed
            stream is truncated/corrupt (file, line, and compressed byte offset reached).
    """
    with open(path, "rb") as raw:
        counted = _Counted(_open_binary(path, compression, raw))
        stream = io.BufferedReader(counted, 1 << 20)
        line_no = 0
        while True:
            try:
                line = stream.readline()
            except (EOFError, OSError, zlib.error) as err:
                raise _broken(path, compression, counted, raw.tell(), err) from err
            except Exception as err:  # zstandard.ZstdError has no common base to name here
                if type(err).__module__.startswith("zstandard"):
                    raise _broken(path, compression, counted, raw.tell(), err) from err
                raise
            if not line:
                return
            line_no += 1
            if not line.strip():
                continue
            yield _document(path, line_no, line, text_field), True


def _broken(
    path: Path, compression: str | None, counted: _Counted, offset: int, err: Exception
) -> ValueError:
    return ValueError(
        f"'{path}' is truncated or corrupt: the {compression} stream broke in line "
        f"{counted.newlines + 1} (at text byte {counted.bytes}, compressed byte {offset}: "
        f"{err}); download or copy the file again"
    )


def _document(path: Path, line_no: int, line: bytes, text_field: str) -> str:
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        hint = ""
        if line_no == 1 and line.lstrip().startswith((b"[", b"{")) and path.suffix == ".json":
            hint = " (a .json file is read as JSON lines: one object per line)"
        raise ValueError(f"{path}:{line_no} is not valid JSON ({err}){hint}") from err
    if isinstance(record, dict) and isinstance(record.get(text_field), str):
        return record[text_field]
    if isinstance(record, dict):
        keys = sorted(record)
        raise ValueError(
            f"{path}:{line_no} has no string field '{text_field}' (its fields: {keys}); pass "
            "text_field=<the field that holds the text>"
        )
    raise ValueError(
        f"{path}:{line_no} holds a JSON {type(record).__name__}, not an object with a "
        f"'{text_field}' field; JSON lines hold one object per line"
    )
