"""How the ranks of a save or a load agree on what happened, so that none of them hangs.

A save or a load can fail on one rank only (its file is corrupt, its disk is full). Every
rank therefore runs its part inside `attempt`, and then all ranks exchange what happened
(`exchange`): one collective that doubles as the barrier, after which every rank knows about
every failure and raises the same error, naming the rank and its cause.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nanotrain.checkpoint.files import UnsafeCheckpointError
from nanotrain.runtime.run_files import RunFilesError

if TYPE_CHECKING:
    from nanotrain.strategies.base import Strategy

# Error types a peer re-raises under the failing rank's own type (others become RuntimeError).
_KNOWN_ERRORS: dict[str, type[Exception]] = {
    "FileNotFoundError": FileNotFoundError,
    "UnsafeCheckpointError": UnsafeCheckpointError,
    "ValueError": ValueError,
    "TypeError": TypeError,
    "OSError": OSError,
    "RunFilesError": RunFilesError,
}


def attempt(fn: Any) -> tuple[Any, Exception | None]:
    """Run `fn`; return (result, None) or (None, the exception) so that a failing rank can
    still take part in the collective that tells the others."""
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - re-raised on every rank by raise_first_failure
        return None, exc


def describe(error: BaseException | None) -> str | None:
    """ "Type: message" of `error` (None for None)."""
    return None if error is None else f"{type(error).__name__}: {error}"


def exchange(strategy: Strategy, obj: Any) -> list[Any]:
    """Every rank's `obj` (a small picklable value), in rank order, on every rank; `[obj]` on
    one process. Over the whole world: under a sharded layout every rank has files of its own."""
    if not (dist.is_available() and dist.is_initialized()) or strategy.world_size == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def raise_first_failure(strategy: Strategy, error: Exception | None, what: str) -> None:
    """Collective: raise on every rank if `error` is set on any rank, else return.

    The rank that failed re-raises its own exception; the others raise the same type (for
    the types in `_KNOWN_ERRORS`, RuntimeError otherwise) with "<what> failed on rank r: ...".
    """
    reports = exchange(strategy, None if error is None else (type(error).__name__, str(error)))
    failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    if not failed:
        return
    if error is not None:
        raise error
    rank, (kind, message) = failed[0]
    raise _KNOWN_ERRORS.get(kind, RuntimeError)(f"{what} failed on rank {rank}: {message}")


def agree_no_error(strategy: Strategy, error: Exception | None, what: str) -> None:
    """Collective: raise RuntimeError on every rank if `error` is set on any rank.

    A max-reduce of "did I fail" doubles as the barrier: every rank learns of a failure
    anywhere instead of hanging at a barrier the failed rank never reaches.
    """
    flag = torch.tensor(0.0 if error is None else 1.0, device=strategy.root_device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if float(flag) > 0:
        detail = describe(error) or "it failed on another rank (see that rank's error)"
        raise RuntimeError(f"{what} failed: {detail}") from error
