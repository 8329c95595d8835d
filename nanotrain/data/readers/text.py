"""A plain UTF-8 file as one document, read block by block."""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from pathlib import Path

# Bytes read per step: the whole file is never in memory at once.
BLOCK_BYTES = 1 << 18


def read_text_file(path: Path, formats_hint: str) -> Iterator[tuple[str, bool]]:
    """Yield the text of ``path`` in blocks; the last piece (possibly empty) ends the document.

    Raises:
        ValueError: the file is not UTF-8; names the file, the byte offset, and the formats
            nanotrain reads (``formats_hint``).
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as handle:
        while True:
            raw = handle.read(BLOCK_BYTES)
            final = not raw
            # bytes of a character cut by the previous block, which this decode completes
            held = len(decoder.getstate()[0])
            try:
                text = decoder.decode(raw, final=final)
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"'{path}' is not UTF-8 text ({err.reason} at byte "
                    f"{offset - held + err.start}) and is in no known format; "
                    f"{formats_hint}"
                ) from err
            offset += len(raw)
            if final:
                yield text, True
                return
            if text:
                yield text, False
