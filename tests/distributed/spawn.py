"""Run a function on a small gloo world of forked processes and collect each rank's result.

Used by every multi-process test::

    def check(rank, world_size, scale):
        ...  # torch.distributed is initialised (gloo) here
        return some_picklable_value

    results = run_world(check, 2, 3.0)  # [rank 0's value, rank 1's value]

Why fork: a forked rank is ready in well under 0.2 s, a spawned one takes seconds to re-import
torch. Fork's two known traps are handled here: every rank sets one intra-op thread before
touching torch (a forked child with a thread pool can deadlock), and garbage is collected
before ``destroy_process_group`` (a live DDP model can hang it). Ctrl-C stops a world at once:
the ranks ignore SIGINT (a terminal sends it to them as well), the parent's KeyboardInterrupt
kills them, and a rank whose parent dies is killed with it (Linux), so none outlives its test. The parent's objects are frozen
(``gc.freeze``) while the ranks fork, so a rank's garbage collector never walks or touches the
inherited heap: without it, a world spends about a quarter more CPU. Results travel back as
plain pickles over one pipe per rank (never through shared memory, which dies with the child).
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch._dynamo  # noqa: F401  (pre-imported once here: saves each forked rank ~1 s)
import torch.distributed as dist
import torch.nn.parallel.distributed  # noqa: F401  (same reason)

from tests.process_tree import die_with_parent

__all__ = ["RankError", "run_world"]


class RankError(AssertionError):
    """A rank raised, died or timed out; the message holds that rank's traceback."""


def _rendezvous_store(rank: int, world_size: int, port: Any, ready: Any, timeout: timedelta):
    """The world's TCPStore. Rank 0 serves it on a port the OS picks while binding (port 0) and
    publishes that port through the shared `port` value; the others wait for it and connect. A
    port chosen before the fork could be taken by anything else on the machine (another xdist
    worker's gloo connections use ephemeral ports) before rank 0 binds it: EADDRINUSE."""
    if rank == 0:
        store = dist.TCPStore(
            "127.0.0.1", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        port.value = store.port
        ready.set()
        return store
    if not ready.wait(timeout.total_seconds()):
        raise TimeoutError(f"rank 0 served no rendezvous store within {timeout}")
    return dist.TCPStore("127.0.0.1", port.value, world_size, is_master=False, timeout=timeout)


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    rendezvous: tuple[Any, Any],
    pg_timeout: float,
    conn: Connection,
    args: tuple,
    parent_pid: int,
) -> None:
    torch.set_num_threads(1)  # first, before any torch op in the forked child
    # Ctrl-C is the parent's to handle (it kills the world); a rank that raised
    # KeyboardInterrupt would start tearing down a process group its peers still use
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent_pid)  # a parent killed outright (xdist gives up on a worker)
    try:
        timeout = timedelta(seconds=pg_timeout)
        dist.init_process_group(
            "gloo",
            store=_rendezvous_store(rank, world_size, *rendezvous, timeout),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
        result = fn(rank, world_size, *args)
        payload = pickle.dumps(("ok", result))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        payload = pickle.dumps(("error", traceback.format_exc()))
    # Report before tearing down, so a hang in teardown can never hide the result.
    conn.send_bytes(payload)
    conn.close()
    gc.collect()  # free models before the group goes away (DDP hang, TESTING.md)
    if dist.is_initialized():
        dist.destroy_process_group()


def _kill_all(procs: list[mp.Process]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    pg_timeout: float = 20.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked gloo ranks.

    Each rank sets ``torch.set_num_threads(1)``, joins a gloo process group (localhost, a
    store on a port rank 0 binds, collective timeout ``pg_timeout`` seconds), calls ``fn``
    and sends its return value (must be picklable) back. The process group is destroyed
    after ``fn`` returns.

    Returns:
        The ranks' return values, indexed by rank.

    Raises:
        RankError: as soon as any rank raises (with that rank's traceback, and those of ranks
            failing within a second after it), dies without a result, or when ``timeout``
            seconds pass; every remaining rank is killed first.
    """
    ctx = mp.get_context("fork")
    rendezvous = (ctx.Value("i", 0), ctx.Event())  # rank 0's store port, and "it is set"
    procs, readers = [], {}
    # The children inherit every object of this process (torch, pytest, earlier tests): frozen,
    # their collector never walks them nor writes to their pages (a quarter of a world's CPU).
    gc.freeze()
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, rendezvous, pg_timeout, writer, args, os.getpid()),
                name=f"nanotrain-rank{rank}",
                daemon=True,  # if the test process itself dies, the ranks die with it
            )
            proc.start()
            writer.close()  # only the child writes; EOF on the reader means "child gone"
            procs.append(proc)
            readers[reader] = rank
    finally:
        gc.unfreeze()  # this process collects as before
    try:
        return _collect(procs, readers, world_size, timeout)
    finally:
        _kill_all(procs)
        for reader in readers:
            reader.close()


def _receive(procs: list[mp.Process], reader: Connection, rank: int) -> tuple[str, Any]:
    """One rank's ("ok", result) or ("error", message); a closed pipe means the rank died."""
    try:
        return pickle.loads(reader.recv_bytes())
    except EOFError:
        procs[rank].join(timeout=1)
        return "error", f"died without a result (exit code {procs[rank].exitcode})"


def _collect(
    procs: list[mp.Process], readers: dict[Connection, int], world_size: int, timeout: float
) -> list[Any]:
    results: dict[int, Any] = {}
    deadline = _now() + timeout
    pending = dict(readers)
    while pending:
        remaining = deadline - _now()
        if remaining <= 0:
            missing = sorted(pending.values())
            raise RankError(f"ranks {missing} of {world_size} gave no result within {timeout}s")
        for reader in wait(list(pending), timeout=remaining):
            rank = pending.pop(reader)
            status, value = _receive(procs, reader, rank)
            if status == "error":
                errors = [(rank, value), *_late_errors(procs, pending)]
                report = "\n".join(f"rank {r} of {world_size}: {msg}" for r, msg in errors)
                raise RankError(f"{len(errors)} rank(s) failed, first to report first:\n{report}")
            results[rank] = value
    # Let the ranks finish tearing down cleanly; run_world kills any that lingers.
    for proc in procs:
        proc.join(timeout=max(0.0, min(2.0, deadline - _now())))
    return [results[r] for r in range(world_size)]


def _late_errors(
    procs: list[mp.Process], pending: dict[Connection, int], grace: float = 1.0
) -> list[tuple[int, str]]:
    """Errors other ranks report within ``grace`` seconds of the first one.

    The rank that failed first is not always the first to report: its peers' collectives
    fail as soon as it dies, so a short grace collects the root cause as well.
    """
    errors, deadline = [], _now() + grace
    while pending and (remaining := deadline - _now()) > 0:
        ready = wait(list(pending), timeout=remaining)
        if not ready:
            break
        for reader in ready:
            rank = pending.pop(reader)
            status, value = _receive(procs, reader, rank)
            if status == "error":
                errors.append((rank, value))
    return errors


def _now() -> float:
    return time.monotonic()
