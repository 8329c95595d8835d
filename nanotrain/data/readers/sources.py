"""What `prepare` was given → `Source` objects in reading order, each with its reader.

Inputs: file paths, folders (read recursively, sorted, hidden entries skipped; a `datasets`
``save_to_disk`` folder is one source), glob patterns (``**`` allowed), an iterable of
strings (each a document), or a `datasets.Dataset` / `IterableDataset`.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .hf_datasets import is_datasets_folder, is_datasets_object, load_folder, read_dataset
from .jsonl import read_jsonl
from .parquet import read_parquet
from .text import read_text_file

# Name -> what selects it; the order of the error message's list.
FORMATS = {
    "parquet": ".parquet (a file, a folder of shards or a glob)",
    "jsonl": ".jsonl / .json holding JSON lines",
    "jsonl.gz": ".jsonl.gz / .json.gz",
    "jsonl.zst": ".jsonl.zst / .json.zst",
    "text": "any other UTF-8 file, e.g. .txt (one document per file)",
    "datasets": "a folder written by datasets' save_to_disk",
}
FORMATS_HINT = "nanotrain reads: " + "; ".join(FORMATS.values())

_GLOB_CHARS = set("*?[")
# Binary or compressed suffixes that are never one UTF-8 document: refused up front, by name.
_REFUSED_SUFFIXES = {
    ".gz",
    ".zst",
    ".zstd",
    ".bz2",
    ".xz",
    ".lz4",
    ".zip",
    ".tar",
    ".7z",
    ".arrow",
    ".feather",
    ".orc",
    ".avro",
    ".npy",
    ".npz",
    ".bin",
    ".pt",
    ".safetensors",
}


@dataclass
class Source:
    """One input to read.

    Attributes:
        name: what error messages and the metadata call it (a path, or ``<iterable>``).
        format: a key of `FORMATS`, or ``"strings"`` for a Python iterable.
        path: the file or folder, None for Python objects.
        pieces: callable returning an iterator of ``(text, ends_document)``.
    """

    name: str
    format: str
    path: Path | None
    pieces: Callable[[], Iterator[tuple[str, bool]]]


def file_format(path: Path) -> str:
    """The `FORMATS` key that reads ``path``, chosen by its name.

    Raises:
        ValueError: a compressed or binary file that no reader takes, named, with the formats.
    """
    name = path.name.lower()
    for stem, fmt in ((".jsonl", "jsonl"), (".json", "jsonl"), (".ndjson", "jsonl")):
        if name.endswith(stem):
            return fmt
        for tail, compressed in (
            (".gz", "jsonl.gz"),
            (".zst", "jsonl.zst"),
            (".zstd", "jsonl.zst"),
        ):
            if name.endswith(stem + tail):
                return compressed
    if name.endswith(".parquet"):
        return "parquet"
    if path.suffix.lower() in _REFUSED_SUFFIXES:
        raise ValueError(f"'{path}' is in no known format ({path.suffix}); {FORMATS_HINT}")
    return "text"


def _expand_folder(folder: Path) -> list[Path]:
    """Files (and datasets folders) under ``folder`` in sorted order; hidden entries skipped
    (.git, .DS_Store are never corpus text)."""
    if is_datasets_folder(folder):
        return [folder]
    found: list[Path] = []
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            found += _expand_folder(entry)
        elif entry.is_file():
            found.append(entry)
    return found


def resolve_paths(specs: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """Expand files, folders and glob patterns into files and datasets folders, each once.

    Raises:
        ValueError: ``specs`` is empty, or an entry matches nothing.
    """
    specs = list(specs)
    if not specs:
        raise ValueError("no inputs given; pass files, folders or glob patterns of text")
    found: list[Path] = []
    for spec in specs:
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
        found += matched
    unique: dict[Path, Path] = {}
    for path in found:
        unique.setdefault(path.resolve(), path)
    return list(unique.values())


def _path_source(path: Path, text_field: str) -> Source:
    if path.is_dir():
        return Source(
            str(path),
            "datasets",
            path,
            lambda: read_dataset(load_folder(path), text_field, f"'{path}'"),
        )
    fmt = file_format(path)
    if fmt == "parquet":
        read = lambda: read_parquet(path, text_field)  # noqa: E731
    elif fmt == "text":
        read = lambda: read_text_file(path, FORMATS_HINT)  # noqa: E731
    else:
        compression = {"jsonl": None, "jsonl.gz": "gzip", "jsonl.zst": "zstd"}[fmt]
        read = lambda: read_jsonl(path, text_field, compression)  # noqa: E731
    return Source(str(path), fmt, path, read)


def _looks_like_path(item: Any) -> bool:
    """Whether a str of a list names a file (exists, or has a glob, separator or suffix and no
    whitespace) rather than being a text to prepare."""
    if isinstance(item, os.PathLike):
        return True
    if not isinstance(item, str) or "\n" in item or len(item) > 4096 or not item.strip():
        return False
    try:
        if Path(item).expanduser().exists():
            return True
    except OSError:  # a name too long for the file system: text
        return False
    if any(ch.isspace() for ch in item):
        return False
    return bool(_GLOB_CHARS & set(item)) or os.sep in item or bool(Path(item).suffix)


def _strings(items: Iterable[Any]) -> Iterator[tuple[str, bool]]:
    for index, item in enumerate(items):
        if not isinstance(item, str):
            raise TypeError(
                f"input item {index} is a {type(item).__name__}; an iterable input must hold "
                "str documents (or pass paths, a datasets.Dataset or an IterableDataset)"
            )
        yield item, True


def open_sources(inputs: Any, text_field: str) -> list[Source]:
    """The sources of ``inputs`` in reading order.

    A str or PathLike is one path spec. A list or tuple is path specs when any item names an
    existing path or every item looks like one (a glob, a separator or a suffix, no
    whitespace), else texts. Any other iterable (a generator ...) is texts; a
    `datasets.Dataset`/`IterableDataset` is read from ``text_field``.

    Raises:
        ValueError: an input matches nothing, or a file is in no known format.
        TypeError: ``inputs`` is none of the above.
    """
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if is_datasets_object(inputs):
        name = f"<datasets.{type(inputs).__name__}>"
        return [Source(name, "datasets", None, lambda: read_dataset(inputs, text_field, name))]
    if isinstance(inputs, (list, tuple)):
        flags = [_looks_like_path(item) for item in inputs]
        if (
            not inputs
            or all(flags)
            or any(
                isinstance(item, (str, os.PathLike)) and Path(item).expanduser().exists()
                for item, flag in zip(inputs, flags, strict=True)
                if flag
            )
        ):
            paths = resolve_paths(inputs)
            return [_path_source(path, text_field) for path in paths]
        if not all(isinstance(item, str) for item in inputs):
            bad = next(item for item in inputs if not isinstance(item, str))
            raise TypeError(
                f"inputs mixes texts and a {type(bad).__name__}; pass paths, or texts (str) only"
            )
        return [Source("<list of str>", "strings", None, lambda: _strings(inputs))]
    if isinstance(inputs, Iterable) and not isinstance(inputs, (bytes, dict)):
        return [Source("<iterable of str>", "strings", None, lambda: _strings(inputs))]
    raise TypeError(
        f"inputs must be paths, globs, an iterable of str or a datasets.Dataset, got "
        f"{type(inputs).__name__}"
    )
