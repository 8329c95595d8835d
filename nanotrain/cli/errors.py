"""How the `nanotrain` command reports a user's mistake: one line, once per job, exit code 2.

A wrong flag, a bad value, a missing or unwritable file (a full disk included) or a setting
the Trainer refuses is not a bug of nanotrain, so the command prints only the message
(`nanotrain: error: ...`) instead of a traceback. Pass `--debug` or set `NANOTRAIN_DEBUG=1` to
get every rank's full traceback instead.

An exception that passed through your own code (your module, callbacks, datamodule, dataset:
any frame outside nanotrain, the standard library and installed packages) is a bug to find
in that code: as under Lightning it keeps its traceback, down to your frame, and the command
exits 1, whatever its type.

Under torchrun, once per job:
- an error found before the process group exists (parsing, configuration) is the same on
  every rank: global rank 0 prints it;
- an error found later may be found by one rank only (its data, its shard): the first rank
  to report it through the job's store prints it, the others stay quiet;
- a rank whose collective fails because another rank left the job (gloo's "Connection closed
  by peer", NCCL's "remote process exited") prints nothing and exits 1: the rank that left
  printed its own reason. Its exit record (`nanotrain.runtime.exit_record`) is kept.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import sysconfig
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from nanotrain.runtime.exit_record import (
    CRASH_EXIT_CODE,
    USER_ERROR_EXIT_CODE,
    ExitRecorder,
    reason_of_exit_code,
)
from nanotrain.runtime.run_files import RunFilesError

DEBUG_FLAG = "--debug"
DEBUG_ENV = "NANOTRAIN_DEBUG"
NON_ZERO_RANK_GRACE_S = 2.0
# what a user's mistake raises: bad values, wrong types, missing or unwritable files, bad flags
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, RunFilesError, argparse.ArgumentError)
# jsonargparse explanations around the real message; never the message itself
_NOISE = re.compile(
    r"^(Expected a <class 'NoneType'>|Does not validate against any of the Union subtypes|"
    r"Subtypes:|Errors:|Given value|Parser key|Expected a path but|Problem with given class_path"
    r"|Validation failed|Not a valid subclass)"
)
# what a collective raises when another rank of the job has exited
_PEER_GONE = re.compile(
    r"Connection closed by peer|Connection reset by peer|remote process exited|Broken pipe"
    r"|failed to recv, got 0 bytes|Connection refused"
)
_PACKAGE = str(Path(__file__).resolve().parents[1])
# where the standard library and installed packages live: code there is not the user's
_LIBRARIES = tuple(
    {os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib", "purelib",
                                                          "platlib")}
)  # fmt: skip


def debug_requested(argv: list[str]) -> bool:
    """Whether `--debug` is among the arguments or NANOTRAIN_DEBUG is set (not "0"/"")."""
    return DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0", "false")


def global_rank() -> int:
    """This process's global rank as torchrun (RANK) or SLURM (SLURM_PROCID) number it."""
    for name in ("RANK", "SLURM_PROCID"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


def is_rank_zero() -> bool:
    """Global rank 0 as torchrun (RANK) or SLURM (SLURM_PROCID) numbers processes."""
    return global_rank() == 0


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from (`__cause__`), outermost first."""
    chain, seen = [exc], {id(exc)}
    while exc.__cause__ is not None and id(exc.__cause__) not in seen:
        exc = exc.__cause__
        chain.append(exc)
        seen.add(id(exc))
    return chain


def _raised_by_nanotrain(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(_PACKAGE)


def _is_user_file(filename: str) -> bool:
    """Whether code at `filename` is the user's: not nanotrain, the standard library, an
    installed package or generated code ("<string>", "<frozen ...>")."""
    if filename.startswith("<"):
        return False
    path = os.path.realpath(filename)
    return not path.startswith(_PACKAGE) and not path.startswith(_LIBRARIES)


def raised_in_user_code(exc: BaseException) -> bool:
    """Whether the error the one line would report (`_root`) passed through a frame of the
    user's own code: a bug there, or a call from there that nanotrain refused, which keeps its
    traceback (see the module docstring)."""
    tb = _root(exc).__traceback__
    while tb is not None:
        if _is_user_file(tb.tb_frame.f_code.co_filename):
            return True
        tb = tb.tb_next
    return False


def _root(exc: BaseException) -> BaseException:
    """The exception whose message the one line shows: the outermost user error nanotrain
    raised itself (its message names the file or setting; a library's error beneath it, e.g.
    JSON's "Invalid control character", does not), else the innermost user error of the chain
    (jsonargparse wraps the ValueError of a class's __init__ in its own error)."""
    users = [e for e in _chain(exc) if isinstance(e, USER_ERRORS)]
    ours = [e for e in users if _raised_by_nanotrain(e)]
    if ours:
        return ours[0]
    chain = _chain(exc)
    inner = exc
    for e in chain[1:]:
        if not isinstance(e, USER_ERRORS):
            break
        inner = e
    return inner


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


def peer_gone(exc: BaseException) -> bool:
    """Whether `exc` says that another rank of the job has exited (its collective lost the
    connection), rather than what went wrong on this rank."""
    for e in [*_chain(exc), exc.__context__]:
        if isinstance(e, RuntimeError | OSError) and _PEER_GONE.search(str(e)):
            return True
    return False


def _first_to_report() -> bool | None:
    """Whether this rank is the first of the job to report a user error (None: no way to
    agree). Asked through torchrun's agent store, which outlives the workers' process group
    (the Trainer has already torn the group down when the error reaches the command), else
    through the default group's store while it exists."""
    try:
        import torch.distributed as dist  # noqa: PLC0415 - only once an error happened

        key = f"nanotrain/user_error_reported/{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=timedelta(seconds=10),
            )
            return store.add(key, 1) == 1
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return dist.distributed_c10d._get_default_store().add(key, 1) == 1
    except Exception:  # noqa: BLE001 - a store that is gone cannot agree either
        return None
    return None


def _print_error(message: str) -> None:
    print(
        f"nanotrain: error: {message}  (--debug or {DEBUG_ENV}=1 for the traceback)",
        file=sys.stderr,
        flush=True,
    )


def _config_path(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def run_reporting_user_errors(main: Callable[..., int], argv: list[str]) -> int:
    """Run `main(argv, recorder)` (without `--debug`) and record its outcome; a user error
    becomes one line on stderr, once per job, and exit code 2, unless debugging was requested
    (then it propagates on every rank). See the module docstring."""
    debug = debug_requested(argv)
    argv = [a for a in argv if a != DEBUG_FLAG]
    recorder = ExitRecorder(_config_path(argv), global_rank())
    try:
        code = main(argv, recorder)
    except USER_ERRORS as exc:
        if raised_in_user_code(exc):  # a bug in the user's code: its traceback, exit 1
            recorder.write("crashed", f"{type(exc).__name__}: {exc}".splitlines()[0][:500])
            raise
        recorder.write("user_error", one_line(exc))
        if debug:
            raise
        first = _first_to_report()
        if first or (first is None and is_rank_zero()):
            _print_error(one_line(exc))
        else:
            # torchrun stops every worker once one exits with an error: give the rank that
            # prints the error a moment to do so before this rank's exit ends the job
            time.sleep(NON_ZERO_RANK_GRACE_S)
        return USER_ERROR_EXIT_CODE
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        if peer_gone(exc) and not debug:
            recorder.write("crashed", "another rank left the job first", only_over_running=True)
            return CRASH_EXIT_CODE
        recorder.write("crashed", f"{type(exc).__name__}: {exc}".splitlines()[0][:500])
        raise
    # every rank ends the same way and says so: the first to exit may be the only one that
    # gets to (torchrun stops the others once one worker has exited with a non-zero code)
    recorder.write(reason_of_exit_code(code))
    return code
