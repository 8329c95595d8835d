"""The parallel layout a checkpoint records, so a load can tell whether it must reshard."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanotrain.strategies.base import Strategy


def sharded_layout(strategy: Strategy) -> dict[str, Any] | None:
    """The parallel layout of a strategy that shards the model, or None when every rank holds
    the whole model (then rank 0 writes one copy for all)."""
    mesh = strategy.mesh
    if mesh is None:
        return None
    return {
        "strategy": type(strategy).__name__,
        "world_size": strategy.world_size,
        **{axis: int(getattr(mesh, f"{axis}_size", 1)) for axis in ("tp", "pp", "ep", "dp")},
        "zero_stage": int(getattr(strategy, "zero_stage", 0)),
    }
