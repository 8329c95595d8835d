"""Why a run ended, in a file a wrapper script can read (`exit.json`).

torchrun exits 1 whenever a worker exits non-zero, whatever the worker's own code was (75
"preempted, resume me", 3 "stopped on NaN", 2 "user error"), so a SLURM script cannot tell a
preemption from a crash by `$?`. `nanotrain fit` therefore writes its outcome as JSON:

    {"reason": "preempted", "exit_code": 75, "message": "...", "step": 120, "rank": 0, ...}

`reason` is one of `REASONS`: "running" (written at start: a record still saying "running"
after the job ended means a process was killed without a word, e.g. by the OOM killer),
"finished", "preempted" (checkpointed; resume with `--ckpt_path last`), "nonfinite" (NaNGuard
stopped the run), "user_error" (one line on stderr says what to fix) or "crashed".

Where: `$NANOTRAIN_EXIT_FILE` when set (the stable path a wrapper script names, see
docs/checkpointing.md), and `exit.json` in the run directory once it exists; when neither
applies (an error before the run directory was made, without the variable), beside the
`--config` file as `<config>.exit.json`. Files are replaced atomically (temporary file, then
rename), so a reader never sees half a record.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from nanotrain.runtime.exit_codes import EXIT_NONFINITE, EXIT_OK, EXIT_PREEMPTED

__all__ = [
    "EXIT_FILE_ENV",
    "REASONS",
    "ExitRecorder",
    "USER_ERROR_EXIT_CODE",
    "reason_of_exit_code",
    "read_exit_record",
]

EXIT_FILE_ENV = "NANOTRAIN_EXIT_FILE"
USER_ERROR_EXIT_CODE = 2
CRASH_EXIT_CODE = 1
#: reason -> the exit code a process ends with for it (None: not an ending)
REASONS: dict[str, int | None] = {
    "running": None,
    "finished": EXIT_OK,
    "preempted": EXIT_PREEMPTED,
    "nonfinite": EXIT_NONFINITE,
    "user_error": USER_ERROR_EXIT_CODE,
    "crashed": CRASH_EXIT_CODE,
}


def reason_of_exit_code(code: int) -> str:
    """The reason a run that returned normally with `code` (`trainer.exit_code`) ended."""
    for reason, value in REASONS.items():
        if value == code and reason not in ("running", "crashed"):
            return reason
    return "crashed"


def read_exit_record(path: str | Path) -> dict[str, Any] | None:
    """The record at `path`, or None when there is none (or it cannot be read)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _write_atomically(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


class ExitRecorder:
    """Writes the outcome of one `nanotrain` command (see the module docstring).

    Args:
        config_path: the `--config` file, where the record goes when no run directory was
            made and `$NANOTRAIN_EXIT_FILE` is not set (None: nowhere then).
        rank: this process's global rank (RANK / SLURM_PROCID; 0 without a launcher).
    """

    def __init__(self, config_path: str | None = None, rank: int = 0) -> None:
        self.config_path = config_path
        self.rank = rank
        #: set by the command once it has a Trainer: its run directory holds exit.json
        self.trainer: Any = None
        #: whether this command records its outcome (`start` was called: fit and validate)
        self.active = False

    def start(self) -> None:
        """Record "running" (global rank 0): this command's outcome is recorded from now on.
        A record still saying "running" after the job ended means a process was killed."""
        self.active = True
        if self.rank == 0:
            self.write("running")

    def _run_dir(self) -> Path | None:
        run_dir = getattr(self.trainer, "run_dir", None)
        return Path(run_dir) if run_dir is not None and Path(run_dir).is_dir() else None

    def paths(self, ending: bool = True) -> list[Path]:
        """Where this process writes its record: `$NANOTRAIN_EXIT_FILE`, and the run
        directory's exit.json once it exists; for an `ending` without either, beside the
        `--config` file."""
        paths = []
        if os.environ.get(EXIT_FILE_ENV):
            paths.append(Path(os.environ[EXIT_FILE_ENV]))
        run_dir = self._run_dir()
        if run_dir is not None:
            paths.append(run_dir / "exit.json")
        elif ending and not paths and self.config_path:
            paths.append(Path(f"{self.config_path}.exit.json"))
        return paths

    def write(self, reason: str, message: str | None = None, only_over_running: bool = False):
        """Write `reason` (a key of `REASONS`) with `message` to every path. With
        `only_over_running`, a path whose record already names an ending is left alone (a
        rank that only saw its peers go away must not hide the reason one of them wrote).
        Failing to write (a read-only folder, a full disk) never hides the run's own error.
        Nothing is written before `start`."""
        if not self.active:
            return
        if reason not in REASONS:
            raise ValueError(f"unknown exit reason {reason!r}; one of {sorted(REASONS)}")
        trainer = self.trainer
        record = {
            "reason": reason,
            "exit_code": REASONS[reason],
            "message": message,
            "rank": self.rank,
            "step": getattr(trainer, "global_step", None),
            "run_dir": str(self._run_dir()) if self._run_dir() else None,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "time": time.time(),
        }
        for path in self.paths(ending=reason != "running"):
            if only_over_running:
                existing = read_exit_record(path)
                if existing is not None and existing.get("reason") != "running":
                    continue
            try:
                _write_atomically(path, record)
            except OSError:
                pass


def main(argv: list[str] | None = None) -> int:
    """`python -m nanotrain.runtime.exit_record FILE`: print the reason FILE records ("none"
    when there is no record), for wrapper scripts: see docs/checkpointing.md, SLURM."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m nanotrain.runtime.exit_record EXIT_JSON", file=sys.stderr)
        return 2
    record = read_exit_record(args[0])
    print(record.get("reason", "none") if record else "none")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
