"""Name the collective and the process group when a collective times out.

A rank that is alive but never joins a collective (stuck in I/O, a deadlocked data loader, a
debugger) makes its peers wait until the process group's timeout (`timeout_s` of
`DDPStrategy` / `MegatronStrategy`). gloo then raises "Timed out waiting 2000ms for recv
operation", which names neither the collective nor the group. `explain_timeout` finds both in
the traceback (the innermost `torch.distributed` collective and its `group` argument) and
names the group by its role in the strategy's mesh (tp, pp, dp, ep, ...).
"""

from __future__ import annotations

import types
from typing import Any

import torch.distributed as dist

__all__ = ["CollectiveTimeoutError", "explain_timeout"]

_TIMEOUT_MARKERS = ("Timed out", "timed out", "Timeout", "timeout")
_C10D_FILE = "distributed_c10d.py"


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within the process group's timeout: some rank of the
    group is alive but never joined it."""


def explain_timeout(exc: BaseException, strategy: Any) -> CollectiveTimeoutError | None:
    """A `CollectiveTimeoutError` naming the collective and group `exc` timed out in, or None
    when `exc` is no collective timeout."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, CollectiveTimeoutError):
        return None
    if not any(marker in str(exc) for marker in _TIMEOUT_MARKERS):
        return None
    frame = _innermost_collective(exc.__traceback__)
    if frame is None:
        return None
    collective = frame.f_code.co_name
    group = frame.f_locals.get("group")
    where = _describe_group(group, strategy)
    timeout = getattr(strategy, "timeout_s", None)
    after = f" after {timeout:g} s (the strategy's timeout_s)" if timeout else ""
    return CollectiveTimeoutError(
        f"collective {collective} over {where} timed out{after}: another rank of that group is "
        "alive but never joined it (stalled in I/O, data loading or a hang), or runs different "
        f"code. Check the other ranks' logs and stacks (e.g. py-spy dump). Cause: {exc}"
    )


def _innermost_collective(tb: types.TracebackType | None) -> types.FrameType | None:
    found = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(_C10D_FILE):
            name = tb.tb_frame.f_code.co_name
            if not name.startswith("_"):
                found = tb.tb_frame
        tb = tb.tb_next
    return found


def _describe_group(group: Any, strategy: Any) -> str:
    if group is None or group is dist.group.WORLD:
        try:
            size = dist.get_world_size()
        except (RuntimeError, ValueError):
            size = "?"
        return f"the default process group (all {size} ranks)"
    try:
        ranks = dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError):
        ranks = "?"
    mesh = getattr(strategy, "_mesh", None)
    for axis in ("tp", "pp", "dp", "ep", "expert_dp", "mp"):
        if mesh is not None and getattr(mesh, "_groups", {}).get(axis) is group:
            return f"process group {axis} (ranks {ranks})"
    return f"a process group of ranks {ranks}"
