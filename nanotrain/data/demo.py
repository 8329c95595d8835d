"""The demo corpus: the Python standard library's own source, which every install ships.

Real text (code, docstrings, comments) with no download, so examples and tests train on
something meaningful offline. The selection is a fixed, sorted list of ``.py`` files under
``sysconfig.get_paths()["stdlib"]`` (test suites and third-party ``site-packages`` excluded),
filled greedily up to ``max_bytes``; the same Python install always gives the same files.
"""

from __future__ import annotations

import os
import shutil
import sysconfig
from pathlib import Path

from .metadata import read_metadata
from .prepare import build_in_temp, commit_directory, source_digest
from .tokenizers import load_tokenizer

DEFAULT_DEMO_BYTES = 4_000_000
# Folders whose files are test data, third-party code or deliberately odd encodings.
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_sources(root: Path) -> list[tuple[str, Path]]:
    """(relative posix path, path) of every stdlib ``.py`` file, sorted by relative path."""
    found = []
    # os.walk with pruning: a site-packages folder under the stdlib (torch and friends) holds
    # far more files than the stdlib itself and must not even be listed.
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _EXCLUDED_DIRS and not d.startswith(".")]
        for name in files:
            if name.endswith(".py"):
                path = Path(folder, name)
                found.append((path.relative_to(root).as_posix(), path))
    return sorted(found)


def demo_corpus_files(max_bytes: int = DEFAULT_DEMO_BYTES) -> list[Path]:
    """The demo corpus: sorted stdlib ``.py`` files whose sizes add up to at most ``max_bytes``.

    Files are taken in sorted relative-path order; one that would overflow the budget is
    skipped and smaller later ones still fill it, so small budgets give small corpora. Files
    that are not valid UTF-8 are skipped. The stdlib holds about 12 MB of such source.

    Raises:
        ValueError: ``max_bytes`` < 1, or no stdlib source file fits (e.g. a zipped stdlib).
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    root = _stdlib_dir()
    chosen, used = [], 0
    for _, path in _stdlib_sources(root):
        size = path.stat().st_size
        if 0 < size <= max_bytes - used and _is_utf8(path):
            chosen.append(path)
            used += size
        if used == max_bytes:
            break
    if not chosen:
        raise ValueError(
            f"no standard-library source file under '{root}' fits in max_bytes={max_bytes}; "
            "raise max_bytes or pass your own text with data_path"
        )
    return chosen


def _is_utf8(path: Path) -> bool:
    try:
        path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def default_cache_dir() -> Path:
    """``$NANOTRAIN_CACHE`` if set, else ``~/.cache/nanotrain``."""
    return Path(os.environ.get("NANOTRAIN_CACHE", "~/.cache/nanotrain")).expanduser()


def _matches(out_dir: Path, tokenizer_desc: dict, files: list[Path], val_fraction: float) -> bool:
    try:
        meta = read_metadata(out_dir)
    except ValueError:
        return False
    return (
        meta["tokenizer"] == tokenizer_desc
        and meta.get("settings", {}).get("val_fraction") == val_fraction
        and meta.get("source_sha256") == source_digest(files)
    )


def prepare_demo(
    out_dir: str | os.PathLike[str],
    tokenizer: str = "byte",
    max_bytes: int = DEFAULT_DEMO_BYTES,
    val_fraction: float = 0.05,
) -> Path:
    """Prepare the demo corpus into ``out_dir``, or reuse it if it is already there.

    A prepared corpus in ``out_dir`` is reused when it was made from the same files (same
    bytes), tokenizer and ``val_fraction``; otherwise it is prepared again. Safe when several
    processes call it at once: each writes a private temporary folder and renames it into
    place; the first rename wins, the others discard their copy.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ValueError: see `demo_corpus_files` and `prepare`.
    """
    out = Path(out_dir).expanduser().resolve()
    files = demo_corpus_files(max_bytes)
    tok = load_tokenizer(tokenizer)
    if _matches(out, tok.describe(), files, val_fraction):
        return out
    settings = {
        "text_field": "text",
        "shard_tokens": 2**24,
        "val_fraction": float(val_fraction),
        "split_chunk_chars": 2**16,
    }
    tmp_dir = build_in_temp([str(path) for path in files], out, tok, settings)
    if _matches(out, tok.describe(), files, val_fraction):
        # A concurrent call committed the same corpus while we were writing ours.
        shutil.rmtree(tmp_dir, ignore_errors=True)
    else:
        # Replaces a stale cache; if another process commits at the same instant, one of
        # the two identical copies wins the rename.
        commit_directory(tmp_dir, out, replace=True)
    return out
