"""Sequence parallelism keeps its shards: a gathered input is saved as this rank's shard.

Under sequence parallelism the input of a tensor-parallel block (attention's q/k/v, MLA's
latents before their up-projections, an MLP's gate/up) is all-gathered along the sequence, and
the column-parallel layers reading it save the whole gathered sequence for their weight
gradients: tp times what the rank holds. Megatron-LM saves the shard and all-gathers it again in
backward (Korthikanti et al. 2022, section 4.2.2). `RegatheredInput` does the same with the
saved-tensor hooks of `nanotrain.parallel.saved_rebuild` around the block: a saved tensor that
is the gathered input, a view of it, or a cast of one (`cast_in_region`, under autocast) is
packed as a marker; unpacking all-gathers the shard once for all of the block's layers (cached
until each marker was unpacked) and rebuilds the view or cast, bitwise what was saved.
"""

from __future__ import annotations

import contextlib

from torch import Tensor
from torch.distributed import ProcessGroup

from nanotrain.parallel.collectives import all_gather_along_dim, group_size
from nanotrain.parallel.saved_rebuild import RebuiltSaves, cast_in_region

__all__ = ["RegatheredInput", "cast_in_region", "saved_as_shard"]


class RegatheredInput(RebuiltSaves):
    """Saved-tensor hooks for one gathered input (a context manager).

    Args:
        full: the gathered input [B, T, ...] the block's layers read.
        shard: this rank's part [B, T / tp, ...] it was gathered from.
        group: the tensor-parallel group; dim: the sequence dim.
    """

    def __init__(self, full: Tensor, shard: Tensor, group: ProcessGroup | None, dim: int) -> None:
        super().__init__()
        self._full_in, self._shard, self._group, self._dim = full, shard, group, dim

    def __enter__(self) -> RegatheredInput:
        if group_size(self._group) > 1:
            super().__enter__()
            group, dim = self._group, self._dim
            self.track(
                self._full_in, lambda shard: all_gather_along_dim(shard, dim, group), self._shard
            )
        self._full_in = self._shard = None  # the recipe holds the shard
        return self


def saved_as_shard(
    full: Tensor, shard: Tensor, group: ProcessGroup | None, sequence_parallel: bool, dim: int = 1
) -> contextlib.AbstractContextManager:
    """`RegatheredInput(full, shard, group, dim)` under sequence parallelism over 2 or more
    ranks; else a context that does nothing."""
    if not sequence_parallel or group_size(group) == 1:
        return contextlib.nullcontext()
    return RegatheredInput(full, shard, group, dim)
