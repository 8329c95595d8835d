"""The run's own folders and files, when they cannot be written: a user error, in one line.

A read-only mount, a folder without write permission, a file where the run directory should
be, a full disk: nothing nanotrain can fix, and nothing a traceback helps with. The Trainer and
the checkpoint callback turn the `OSError` of their first write into a `RunFilesError` naming
the path, the cause and the setting that picks another place, before any step runs.
"""

from __future__ import annotations

import errno
from pathlib import Path

__all__ = ["RunFilesError", "run_files_error"]

_CAUSES = {
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EROFS: "the file system is read-only",
    errno.ENOSPC: "no space is left on the device",
    errno.EDQUOT: "the disk quota is used up",
    errno.ENOTDIR: "a file is in the way of a folder",
    errno.EEXIST: "a file is in the way of a folder",
    errno.EISDIR: "a folder is in the way of a file",
}


class RunFilesError(OSError):
    """The run directory or the checkpoint folder cannot be written (see the module docstring);
    the `nanotrain` command reports it in one line with exit code 2."""


def run_files_error(exc: OSError, path: str | Path, what: str, setting: str) -> RunFilesError:
    """A `RunFilesError` for `exc`, raised while writing `what` (e.g. "the run directory") at
    `path`; `setting` names what picks another place (e.g. "--trainer.default_root_dir")."""
    cause = _CAUSES.get(exc.errno or -1, exc.strerror or str(exc))
    where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(path) else ""
    fix = (
        "free some space" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "pick a writable place"
    )
    return RunFilesError(f"cannot write {what} {path}: {cause}{where}; {fix}, e.g. with {setting}")
