"""Find and end the processes a test run started, so that Ctrl-C stops everything.

A run's processes form a tree: pytest, its xdist workers, the ranks `run_world` forks, torchrun
agents and their workers (which torchrun starts in sessions of their own, out of reach of a
terminal's Ctrl-C). tests/conftest.py makes the controlling pytest a *child subreaper*
(Linux): a process whose parent dies is re-parented to it instead of to init, so every process
the run started stays a descendant of pytest until it ends, and `kill_descendants` reaches it.
Elsewhere these functions find nothing and do nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["become_subreaper", "children", "descendants", "kill_descendants", "die_with_parent"]

_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Make this process adopt its orphaned descendants (Linux); False where unsupported."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent(parent_pid: int) -> None:
    """In a child: be killed (SIGKILL) when the thread that started it dies; exit now if the
    parent `parent_pid` is already gone (it may die between the fork and this call)."""
    if _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) and os.getppid() != parent_pid:
        os._exit(1)


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process visible in /proc (empty without /proc)."""
    parents = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return parents
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after it
        fields = stat[stat.rfind(b")") + 2 :].split()
        if fields[0] != b"Z":  # a zombie has ended already; only its parent's wait is due
            parents[int(name)] = int(fields[1])
    return parents


def children() -> list[int]:
    """Live direct children of this process."""
    me = os.getpid()
    return [pid for pid, parent in _parents().items() if parent == me]


def descendants(pid: int | None = None) -> list[int]:
    """Live (non-zombie) descendants of `pid` (default: this process), children first."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found, frontier = [], [root]
    while frontier:
        frontier = [c for p in frontier for c in children.get(p, [])]
        found += frontier
    return found


def kill_descendants(sig: int = signal.SIGKILL, spare: list[int] = ()) -> list[int]:
    """Send `sig` to every descendant of this process but those in `spare` (repeated until
    none is left, for those started meanwhile) and reap those that are its children; returns
    the pids signalled."""
    signalled: list[int] = []
    for _ in range(5):
        pids = [pid for pid in descendants() if pid not in spare]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        signalled += pids
        if sig != signal.SIGKILL:
            break
        _reap(pids)
    return signalled


def _reap(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:  # not our child: its own parent reaps it
            pass
