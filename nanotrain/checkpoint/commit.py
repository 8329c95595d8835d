"""Atomic commit of a checkpoint directory and the `last` pointer next to it.

A save writes into `<name>.tmp-<random>/`; only when every rank has finished does rank 0 write
`meta.json`, rename the directory to `<name>/` and then rewrite `last`. A process killed at any
moment therefore leaves either the old state (`last` → the previous checkpoint, plus an ignored
`.tmp-*` directory) or the new one, never a half-written checkpoint under a final name.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path

from nanotrain.checkpoint.files import META_FILE, fsync_path

LAST_POINTER = "last"
TMP_MARKER = ".tmp-"
# Temporary directories of asynchronous saves still being written in this process: a commit's
# cleanup of stale temporaries must leave them alone.
IN_PROGRESS: set[Path] = set()


def temporary_dir(final: Path) -> Path:
    """Create and return a fresh `<final>.tmp-<random>` directory next to `final`."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f"{final.name}{TMP_MARKER}{secrets.token_hex(4)}"
    tmp.mkdir()
    return tmp


def commit(tmp: Path, final: Path) -> None:
    """Rename the finished directory `tmp` to `final`, durably, then point `last` at it.

    `tmp` must already hold `meta.json`. An existing `final` (a second save at the same step)
    is first moved aside under a temporary name and deleted after the new one is in place.
    """
    assert (tmp / META_FILE).is_file(), "meta.json is written before the commit"
    fsync_path(tmp)
    displaced = None
    if final.exists():
        displaced = final.parent / f"{final.name}{TMP_MARKER}old-{secrets.token_hex(4)}"
        os.replace(final, displaced)
    os.replace(tmp, final)
    fsync_path(final.parent)
    write_last_pointer(final)
    if displaced is not None:
        shutil.rmtree(displaced, ignore_errors=True)


def write_last_pointer(ckpt_dir: Path) -> None:
    """Atomically make `<parent>/last` hold the name of `ckpt_dir`."""
    pointer = ckpt_dir.parent / LAST_POINTER
    tmp = ckpt_dir.parent / f"{LAST_POINTER}{TMP_MARKER}{secrets.token_hex(4)}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(ckpt_dir.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, pointer)
    fsync_path(ckpt_dir.parent)


def read_last_pointer(checkpoints_dir: Path) -> Path | None:
    """The checkpoint `<checkpoints_dir>/last` names, or None when there is no pointer."""
    pointer = checkpoints_dir / LAST_POINTER
    if not pointer.is_file():
        return None
    name = pointer.read_text(encoding="utf-8").strip()
    if not name or "/" in name or os.sep in name or name in (".", ".."):
        raise ValueError(
            f"{pointer} is corrupt (holds {name!r}, not a checkpoint name); delete it and pass "
            "an explicit checkpoint path"
        )
    return checkpoints_dir / name


def complete_checkpoints(checkpoints_dir: Path) -> list[Path]:
    """Committed checkpoints in `checkpoints_dir` (directories with `meta.json`, no `.tmp-`),
    oldest first by modification time of their `meta.json`."""
    if not checkpoints_dir.is_dir():
        return []
    found = [
        p
        for p in checkpoints_dir.iterdir()
        if p.is_dir() and TMP_MARKER not in p.name and (p / META_FILE).is_file()
    ]
    return sorted(found, key=lambda p: ((p / META_FILE).stat().st_mtime_ns, p.name))


def remove_stale_temporaries(checkpoints_dir: Path) -> list[Path]:
    """Delete `.tmp-*` leftovers of saves that were killed; return what was removed.

    Call only between saves (after a commit): a running save's own temporary would go too.
    """
    removed = []
    for path in checkpoints_dir.iterdir():
        if TMP_MARKER not in path.name or path in IN_PROGRESS:
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def check_writable(folder: Path) -> None:
    """Check, without leaving anything behind, that checkpoints can be written to `folder`.

    The folder may not exist yet (it is created at the first save): then its nearest existing
    ancestor must be a writable directory. An existing folder is probed by creating and
    removing a temporary file in it (permission bits alone do not tell, e.g. for root on a
    read-only mount).

    Raises:
        ValueError: an ancestor of `folder` (or `folder` itself) is not a directory.
        PermissionError: the folder (or the ancestor it would be created in) is not writable.
    """
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(
            f"checkpoints cannot be saved to {folder}: {existing} is a file, not a directory; "
            "choose another checkpoint folder (ModelCheckpoint(dirpath=...) or default_root_dir)"
        )
    try:
        if existing == folder:
            with tempfile.TemporaryFile(dir=folder, prefix=f"write-test{TMP_MARKER}"):
                pass
        elif not os.access(existing, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied", str(existing))
    except OSError as exc:
        raise PermissionError(
            f"checkpoints cannot be saved to {folder}: {existing} is not writable "
            f"({exc.strerror or exc}); fix its permissions or choose another folder"
        ) from exc
