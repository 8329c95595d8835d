"""The on-disk format of a prepared corpus: ``metadata.json`` next to raw token shards.

`prepare` writes it, `TokenShardDataset` and the demo cache read it. See docs/data.md for
every field.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

METADATA_FILE = "metadata.json"
FORMAT_NAME = "nanotrain.tokens"
FORMAT_VERSION = 1
SPLITS = ("train", "val")

_HINT = "run `nanotrain prepare --inputs ... --out DIR` first"


def shard_dtype_name(vocab_size: int) -> str:
    """``"uint16"`` when every id of a ``vocab_size`` vocabulary fits 16 bits, else ``"uint32"``."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def metadata_path(path: str | os.PathLike[str]) -> Path:
    """The ``metadata.json`` of a prepared directory (or the file itself if given)."""
    path = Path(path).expanduser()
    return path if path.name == METADATA_FILE else path / METADATA_FILE


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check the ``metadata.json`` of a prepared corpus.

    Args:
        path: the prepared directory or its ``metadata.json``.

    Returns:
        The metadata dict, with ``"root"`` set to the directory holding the shards.

    Raises:
        ValueError: the path does not exist, holds no metadata, or the metadata is corrupt
            or of another format; the message says to run `nanotrain prepare`.
    """
    meta_file = metadata_path(path)
    if not Path(path).expanduser().exists():
        raise ValueError(f"data path '{path}' does not exist; {_HINT}")
    if not meta_file.is_file():
        raise ValueError(f"'{path}' holds no {METADATA_FILE}, so it is not prepared data; {_HINT}")
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"'{meta_file}' is corrupt ({err}); {_HINT} again") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise ValueError(f"'{meta_file}' is not nanotrain token metadata; {_HINT}")
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"'{meta_file}' has format version {meta.get('version')}, this nanotrain reads "
            f"version {FORMAT_VERSION}; {_HINT} again"
        )
    required = ("tokenizer", "vocab_size", "dtype", "max_token_id", "splits")
    missing = [key for key in required if key not in meta]
    if missing or any(split not in meta["splits"] for split in SPLITS):
        raise ValueError(f"'{meta_file}' is corrupt (missing {missing or 'splits'}); {_HINT} again")
    meta["root"] = str(meta_file.parent)
    return meta


def write_metadata(directory: Path, meta: dict[str, Any]) -> None:
    """Write ``meta`` as ``directory/metadata.json`` (sorted keys, so output is deterministic)."""
    text = json.dumps(meta, indent=2, sort_keys=True) + "\n"
    (directory / METADATA_FILE).write_text(text, encoding="utf-8")
