"""Sequence parallelism keeps its shards: a gathered input is saved as this rank's shard.

Under sequence parallelism the input of a tensor-parallel block (attention's q/k/v, MLA's
latents before their up-projections, an MLP's gate/up) is all-gathered along the sequence, and
the column-parallel layers reading it save the whole gathered sequence for their weight
gradients: tp times what the rank holds. Megatron-LM saves the shard and all-gathers it again in
backward (Korthikanti et al. 2022, section 4.2.2). `RegatheredInput` does the same with
`torch.autograd.graph.saved_tensors_hooks` around the block: a saved tensor that is the
gathered input, a view of it, or a cast of one (`cast`, under autocast) is packed as a marker;
unpacking all-gathers the shard once for all of the block's layers (cached until each marker
was unpacked) and rebuilds the view or cast, bitwise what was saved.

Inside a recomputed region (torch's checkpoint hooks) the region does nothing: what it saves
is recomputed anyway. Other saved-tensor hooks already active (a user's, a memory counter's)
still see everything: the shard, once, and every tensor the region does not replace go
through them.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from nanotrain.parallel.collectives import all_gather_along_dim, group_size

__all__ = ["RegatheredInput", "cast_in_region", "saved_as_shard"]

_local = threading.local()


class RegatheredInput:
    """Saved-tensor hooks for one gathered input (a context manager).

    Args:
        full: the gathered input [B, T, ...] the block's layers read.
        shard: this rank's part [B, T / tp, ...] it was gathered from.
        group: the tensor-parallel group; dim: the sequence dim.
    """

    def __init__(self, full: Tensor, shard: Tensor, group: ProcessGroup | None, dim: int) -> None:
        self._full_in, self._storage = full, -1
        self._shard, self._group, self._dim = shard, group, dim
        # a cast's storage -> (the cast, weakly; its source view; dtype; numel)
        self._casts: dict[int, tuple[Any, ...]] = {}
        self._full: Tensor | None = None
        self._pending: set[int] = set()
        self._hooks: Any = None  # the saved-tensor hooks while the region is open
        self._enclosing: RegatheredInput | None = None  # the region this one opened in
        self._outer_hooks: tuple[Any, Any] | None = None  # hooks active before this region
        self._packed_shard: Any = None

    # -- the region -----------------------------------------------------------------------
    def __enter__(self) -> RegatheredInput:
        if torch.compiler.is_compiling():  # a compiled graph decides what it saves
            return self
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if outer is not None and _recomputing(outer[0]):
            return self
        if group_size(self._group) > 1 and torch.is_grad_enabled():
            self._storage = self._full_in.untyped_storage().data_ptr()
            self._shard = self._shard.detach()
            self._outer_hooks = outer
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()
            self._enclosing, _local.region = getattr(_local, "region", None), self
        return self

    def __exit__(self, *exc: object) -> None:
        self._full_in = None  # the region holds the shard only
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks, _local.region = None, self._enclosing

    def cast(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        """`x.to(dtype)` for `x` the gathered input or a view of it, saved as the shard too."""
        out = x.to(dtype)
        if x.untyped_storage().data_ptr() == self._storage:
            geometry = (x.size(), x.stride(), x.storage_offset())
            # by weak reference: once the cast is gone its memory may hold another tensor
            entry = (weakref.ref(out), geometry, dtype, out.numel())
            self._casts[out.untyped_storage().data_ptr()] = entry
        return out

    # -- hooks ----------------------------------------------------------------------------
    def _pack(self, t: Tensor) -> Any:
        storage = t.untyped_storage().data_ptr()
        if storage == self._storage:
            source, dtype = (t.size(), t.stride(), t.storage_offset()), None
        elif storage in self._casts and t.is_contiguous() and t.storage_offset() == 0:
            cast, source, dtype, numel = self._casts[storage]
            alive = cast()
            if alive is None or alive.untyped_storage().data_ptr() != storage:
                return self._pass_on(t)  # another tensor in a dead cast's memory
            if t.numel() != numel:  # a part of the cast: kept as it is
                return self._pass_on(t)
        else:
            return self._pass_on(t)
        if self._outer_hooks is not None and self._packed_shard is None:
            self._packed_shard = self._outer_hooks[0](self._shard)  # the outer hooks see it
        marker = _Marker(self, source, dtype, t.size())
        self._pending.add(id(marker))
        return marker

    def _pass_on(self, t: Tensor) -> Any:
        """A tensor this region does not replace, through the outer hooks if any."""
        return t if self._outer_hooks is None else _Passed(self._outer_hooks[0](t))

    def _unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, _Passed):
            return self._outer_hooks[1](packed.packed)
        if not isinstance(packed, _Marker) or packed.region is not self:
            return packed
        full = self._full
        if full is None:
            shard = self._shard
            if self._outer_hooks is not None:
                shard = self._outer_hooks[1](self._packed_shard)
            full = all_gather_along_dim(shard, self._dim, self._group)
            self._full = full
        size, stride, offset = packed.source
        out = full.as_strided(size, stride, offset)
        if packed.dtype is not None:
            out = out.to(packed.dtype)
        out = out.reshape(packed.size)
        self._pending.discard(id(packed))
        if not self._pending:  # every layer has its input: the next unpack gathers again
            self._full = None
        return out


def _recomputing(pack_hook: Any) -> bool:
    """Whether `pack_hook` is one of torch's checkpoint hooks (a region that is recomputed)."""
    return getattr(pack_hook, "__module__", "") == "torch.utils.checkpoint"


class _Passed:
    """A saved tensor this region left to the outer hooks: what they packed it as."""

    __slots__ = ("packed",)

    def __init__(self, packed: Any) -> None:
        self.packed = packed


class _Marker:
    """What a saved gathered input is packed as: its region, its view of the gathered input
    (size, stride, storage offset), the dtype it was cast to (None: none) and its size."""

    __slots__ = ("dtype", "region", "size", "source")

    def __init__(self, region: RegatheredInput, source: tuple, dtype: Any, size: Any) -> None:
        self.region, self.source, self.dtype, self.size = region, source, dtype, size


def cast_in_region(x: Tensor) -> Tensor:
    """The input of a column-parallel layer as autocast would cast it, made through the active
    `RegatheredInput` so that its saved copy is kept as the shard; `x` itself where no region
    is active, autocast is off, x is not fp32, or a torch-function mode (an fp8/fp4 emulation)
    handles the layer's inputs itself."""
    region = getattr(_local, "region", None)
    device = x.device.type
    if region is None or x.dtype != torch.float32 or not torch.is_autocast_enabled(device):
        return x
    if torch._C._is_torch_function_mode_enabled():
        return x
    return region.cast(x, torch.get_autocast_dtype(device))


def saved_as_shard(
    full: Tensor, shard: Tensor, group: ProcessGroup | None, sequence_parallel: bool, dim: int = 1
) -> contextlib.AbstractContextManager:
    """`RegatheredInput(full, shard, group, dim)` under sequence parallelism over 2 or more
    ranks; else a context that does nothing."""
    if not sequence_parallel or group_size(group) == 1:
        return contextlib.nullcontext()
    return RegatheredInput(full, shard, group, dim)
