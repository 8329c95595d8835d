"""The parallel layout a checkpoint records, so a load can tell whether it must reshard."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanotrain.strategies.base import Strategy


def sharded_layout(strategy: Strategy) -> dict[str, Any] | None:
    """The parallel layout of a strategy that shards the model, or None when every rank holds
    the whole model (then rank 0 writes one copy for all).

    ``dp`` is the mesh's replica count (data x context parallel ranks) and ``cp`` how many of
    them split each sequence, so a cp=2 checkpoint differs from a plain dp=2 one (the ranks'
    RNG states belong to other data ranks) and is loaded through the reshard path with its
    note. Checkpoints written before ``cp`` was recorded read as cp=1 (`saved_layout`)."""
    mesh = strategy.mesh
    if mesh is None:
        return None
    return {
        "strategy": type(strategy).__name__,
        "world_size": strategy.world_size,
        **{axis: int(getattr(mesh, f"{axis}_size", 1)) for axis in ("tp", "pp", "ep", "dp", "cp")},
        "zero_stage": int(getattr(strategy, "zero_stage", 0)),
    }


def saved_layout(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The layout a checkpoint's ``meta.json`` records, as `sharded_layout` writes it today
    (``cp`` = 1 where it predates the field), or None for a replicated checkpoint."""
    layout = meta.get("layout")
    return None if layout is None else {"cp": 1, **layout}
