"""How the `nanotrain` command reports a user's mistake: one line on global rank 0, exit code 2.

A wrong flag, a bad value or a setting the Trainer refuses is not a bug of nanotrain, so the
command prints only the message (`nanotrain: error: ...`) instead of a traceback, once per job
(global rank 0; other ranks exit quietly with the same code). Pass `--debug` or set
`NANOTRAIN_DEBUG=1` to get the full traceback instead.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Callable

DEBUG_FLAG = "--debug"
DEBUG_ENV = "NANOTRAIN_DEBUG"
USER_ERROR_EXIT_CODE = 2
NON_ZERO_RANK_GRACE_S = 2.0
# what a user's mistake raises: bad values, wrong types, missing files, bad flags
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, argparse.ArgumentError)
# jsonargparse explanations around the real message; never the message itself
_NOISE = re.compile(
    r"^(Expected a <class 'NoneType'>|Does not validate against any of the Union subtypes|"
    r"Subtypes:|Errors:|Given value|Parser key|Expected a path but|Problem with given class_path"
    r"|Validation failed|Not a valid subclass)"
)


def debug_requested(argv: list[str]) -> bool:
    """Whether `--debug` is among the arguments or NANOTRAIN_DEBUG is set (not "0"/"")."""
    return DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0", "false")


def is_rank_zero() -> bool:
    """Global rank 0 as torchrun (RANK) or SLURM (SLURM_PROCID) numbers processes."""
    for name in ("RANK", "SLURM_PROCID"):
        if name in os.environ:
            return os.environ[name] == "0"
    return True


def _root(exc: BaseException) -> BaseException:
    """The innermost user error an exception was raised from (jsonargparse wraps the
    ValueError of a class's __init__ in its own error)."""
    seen = {id(exc)}
    while exc.__cause__ is not None and id(exc.__cause__) not in seen:
        if not isinstance(exc.__cause__, USER_ERRORS):
            break
        exc = exc.__cause__
        seen.add(id(exc))
    return exc


def one_line(exc: BaseException) -> str:
    """The message of `exc` on one line, without jsonargparse's explanations of how the
    value failed each alternative type."""
    exc = _root(exc)
    text = str(exc)
    lines = [ln.strip().lstrip("- ").strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln]
    useful = [ln for ln in lines if not _NOISE.match(ln)]
    if useful and len(useful) < len(lines):  # a jsonargparse report: keep its first finding
        return useful[0]
    return " ".join(lines) or type(exc).__name__


def run_reporting_user_errors(main: Callable[[list[str]], int], argv: list[str]) -> int:
    """Run `main(argv)` (without `--debug`); a user error becomes one line on stderr of global
    rank 0 and exit code 2, unless debugging was requested (then it propagates)."""
    debug = debug_requested(argv)
    argv = [a for a in argv if a != DEBUG_FLAG]
    try:
        return main(argv)
    except USER_ERRORS as exc:
        if debug:
            raise
        if is_rank_zero():
            print(
                f"nanotrain: error: {one_line(exc)}  (--debug or {DEBUG_ENV}=1 for the traceback)",
                file=sys.stderr,
                flush=True,
            )
        else:
            # torchrun stops every worker once one exits with an error: give rank 0, which
            # hit the same error, a moment to print it before this rank's exit ends the job
            time.sleep(NON_ZERO_RANK_GRACE_S)
        return USER_ERROR_EXIT_CODE
