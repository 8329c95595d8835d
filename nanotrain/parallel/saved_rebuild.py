"""Saved tensors kept as a recipe: what forward would save for backward is rebuilt there.

Some tensors autograd saves are cheap to make again from others it keeps anyway: a gathered
sequence from this rank's shard (`nanotrain.parallel.sp_regather`), a norm's output from its
input, a SwiGLU product from its two factors (the light recomputation,
`nanotrain.models.recompute`). `RebuiltSaves` is a context manager of saved-tensor hooks in
which `track(t, rebuild, *inputs)` names such a tensor: a saved tensor on its storage (t, a
view of t) or a cast of one made through `cast` is packed as a small marker instead. The first
marker unpacked in backward runs `rebuild(*inputs)` once, without gradient and under the
autocast state t was made in, and every marker of the recipe is served from that result until
each has been unpacked (a later unpack rebuilds again).

Tracked tensors are held by the region until it closes, so their memory cannot be reused by
another tensor while saves are matched by storage. Inside a torch checkpoint region the hooks
stay off: what such a region saves is recomputed anyway. Saved-tensor hooks already active
(a user's, a memory counter's, an enclosing region) still see every tensor the region does
not replace, and the recipes' inputs once.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["PassedOn", "PerThreadRegions", "RebuiltSaves", "cast_in_region", "open_saved_hooks"]


class PerThreadRegions(threading.local):
    """Per thread: a stack of open regions (`regions`, innermost last). Made on each thread's
    first access, so code that reads them never creates them: a compiled forward would
    otherwise trace that creation, and its guard (no regions yet) fail on the next call,
    compiling the whole model a second time."""

    def __init__(self) -> None:
        self.regions: list[Any] = []


_local = PerThreadRegions()


def _regions() -> list[RebuiltSaves]:
    return _local.regions


def _geometry(t: Tensor) -> tuple[Any, ...]:
    return t.size(), t.stride(), t.storage_offset()


class _Recipe:
    """How tracked tensors are made again: `fn(*inputs)` (one tensor or a tuple), run under
    the autocast state they were made in, cached until every marker was unpacked."""

    __slots__ = ("autocast", "fn", "inputs", "packed_inputs", "pending", "result")

    def __init__(self, fn: Callable[..., Any], inputs: tuple[Tensor, ...], device: str) -> None:
        self.fn, self.inputs = fn, inputs
        self.autocast = (
            device,
            torch.get_autocast_dtype(device),
            torch.is_autocast_enabled(device),
        )
        self.packed_inputs: tuple[Any, ...] | None = None
        self.result: tuple[Tensor, ...] | None = None
        self.pending: set[int] = set()


class _Source:
    """A tracked tensor: its recipe, which of the recipe's outputs it is, and its geometry."""

    __slots__ = ("dtype", "geometry", "index", "recipe")

    def __init__(self, recipe: _Recipe, index: int, t: Tensor) -> None:
        self.recipe, self.index, self.geometry, self.dtype = recipe, index, _geometry(t), t.dtype


class _Marker:
    """What a saved tracked tensor is packed as: its source, its view of the source's storage
    (size, stride, storage offset), the dtype it was cast to (None: none) and its size."""

    __slots__ = ("dtype", "region", "size", "source", "view")

    def __init__(self, region: RebuiltSaves, source: _Source, view: tuple, dtype: Any, size: Any):
        self.region, self.source, self.view, self.dtype, self.size = (
            region,
            source,
            view,
            dtype,
            size,
        )


class PassedOn:
    """A saved tensor a region of saved-tensor hooks left to the enclosing hooks: what they
    packed it as (their unpack hook gets it back)."""

    __slots__ = ("packed",)

    def __init__(self, packed: Any) -> None:
        self.packed = packed


def open_saved_hooks(
    pack: Callable[[Tensor], Any], unpack: Callable[[Any], Tensor]
) -> tuple[Any, tuple[Any, Any] | None]:
    """Enter saved-tensor hooks `pack` / `unpack` for a region that replaces some saves,
    unless autograd does not record, torch.compile traces, or a torch checkpoint region
    encloses it (what that saves is recomputed anyway). Returns (the entered hooks, to exit
    at the region's end, or None where none were entered; the enclosing hooks or None)."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return None, None
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if outer is not None and _recomputing(outer[0]):
        return None, None
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
    hooks.__enter__()
    return hooks, outer


class RebuiltSaves:
    """Saved-tensor hooks that keep tracked tensors as recipes (a context manager).

    Use: ``with RebuiltSaves() as saves: y = saves.track(f(x), f, x); ... ops saving y ...``.
    Outside autograd recording, under torch.compile, or inside a checkpoint region the
    region installs nothing and `track` returns its tensor untouched.
    """

    def __init__(self) -> None:
        self._sources: dict[int, _Source] = {}
        self._shared: set[int] = set()  # storages tracked twice: left alone
        # a cast's storage -> (the cast, weakly; its source; the view cast; dtype; numel)
        self._casts: dict[int, tuple[Any, ...]] = {}
        self._held: list[Tensor] = []  # tracked tensors, alive while the region is open
        self._hooks: Any = None
        self._outer_hooks: tuple[Any, Any] | None = None

    @property
    def active(self) -> bool:
        """Whether the region's hooks are installed (it replaces saves)."""
        return self._hooks is not None

    # -- the region -----------------------------------------------------------------------
    def __enter__(self) -> RebuiltSaves:
        self._hooks, self._outer_hooks = open_saved_hooks(self._pack, self._unpack)
        if self._hooks is not None:
            _regions().append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._held.clear()  # the region keeps the recipes' inputs only
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None
            _regions().remove(self)

    def track(self, t: Tensor, rebuild: Callable[..., Tensor], *inputs: Tensor) -> Tensor:
        """Save `t` as `rebuild(*inputs)` (which must give t's values and strides); returns t."""
        self.track_all((t,), lambda *xs: (rebuild(*xs),), *inputs)
        return t

    def track_all(
        self, ts: Sequence[Tensor], rebuild: Callable[..., Sequence[Tensor]], *inputs: Tensor
    ) -> None:
        """Save each of `ts` as its output of `rebuild(*inputs)` (one run rebuilds them all)."""
        if self._hooks is None:
            return
        recipe = _Recipe(rebuild, tuple(x.detach() for x in inputs), ts[0].device.type)
        for i, t in enumerate(ts):
            if t.numel() == 0:
                continue
            storage = t.untyped_storage().data_ptr()
            if storage in self._sources or storage in self._shared:
                # two tracked tensors on one storage: which one a save is a view of cannot be
                # told apart, so neither is replaced
                self._sources.pop(storage, None)
                self._shared.add(storage)
                continue
            self._sources[storage] = _Source(recipe, i, t)
            self._held.append(t)

    def knows(self, x: Tensor) -> bool:
        """Whether `x` lies on a tracked tensor's storage (so a cast of it can be tracked)."""
        return self._hooks is not None and x.untyped_storage().data_ptr() in self._sources

    def cast(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        """`x.to(dtype)` for `x` on a tracked storage, saved as a recipe too."""
        out = x.to(dtype)
        source = self._sources.get(x.untyped_storage().data_ptr())
        if source is not None and out is not x:
            # by weak reference: once the cast is gone its memory may hold another tensor
            entry = (weakref.ref(out), source, _geometry(x), dtype, out.numel())
            self._casts[out.untyped_storage().data_ptr()] = entry
        return out

    # -- hooks ----------------------------------------------------------------------------
    def _pack(self, t: Tensor) -> Any:
        if t.numel() == 0:
            return self._pass_on(t)
        storage = t.untyped_storage().data_ptr()
        source = self._sources.get(storage)
        if source is not None and t.dtype == source.dtype:
            view, dtype = _geometry(t), None
        elif storage in self._casts and t.is_contiguous() and t.storage_offset() == 0:
            cast, source, view, dtype, numel = self._casts[storage]
            alive = cast()
            if alive is None or alive.untyped_storage().data_ptr() != storage:
                return self._pass_on(t)  # another tensor in a dead cast's memory
            if t.numel() != numel:  # a part of the cast: kept as it is
                return self._pass_on(t)
        else:
            return self._pass_on(t)
        recipe = source.recipe
        if self._outer_hooks is not None and recipe.packed_inputs is None:
            # the enclosing hooks keep what the recipe needs (an enclosing region may keep it
            # as a recipe of its own), once
            recipe.packed_inputs = tuple(self._outer_hooks[0](x) for x in recipe.inputs)
            recipe.inputs = ()
        marker = _Marker(self, source, view, dtype, t.size())
        recipe.pending.add(id(marker))
        return marker

    def _pass_on(self, t: Tensor) -> Any:
        """A tensor this region does not replace, through the enclosing hooks if any."""
        return t if self._outer_hooks is None else PassedOn(self._outer_hooks[0](t))

    def _unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, PassedOn):
            return self._outer_hooks[1](packed.packed)
        if not isinstance(packed, _Marker) or packed.region is not self:
            return packed
        source = packed.source
        recipe = source.recipe
        if recipe.result is None:
            recipe.result = tuple(self._rebuild(recipe))
        base = recipe.result[source.index]
        size, stride, offset = packed.view
        if base.stride() != source.geometry[1]:
            raise RuntimeError("a rebuilt saved tensor has other strides than the one saved")
        out = base.as_strided(size, stride, base.storage_offset() + offset - source.geometry[2])
        if packed.dtype is not None:
            out = out.to(packed.dtype)
        out = out.reshape(packed.size)
        recipe.pending.discard(id(packed))
        if not recipe.pending:  # every save has its tensor: a later unpack rebuilds again
            recipe.result = None
        return out

    def _rebuild(self, recipe: _Recipe) -> Sequence[Tensor]:
        inputs = recipe.inputs
        if recipe.packed_inputs is not None:
            inputs = tuple(self._outer_hooks[1](p) for p in recipe.packed_inputs)
        device, dtype, enabled = recipe.autocast
        with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            return recipe.fn(*inputs)


def _recomputing(pack_hook: Any) -> bool:
    """Whether `pack_hook` is one of torch's checkpoint hooks (a region that is recomputed)."""
    return getattr(pack_hook, "__module__", "") == "torch.utils.checkpoint"


def cast_in_region(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """`x` cast as autocast would cast a matmul's input (or to `dtype`), made through the
    innermost open `RebuiltSaves` that tracks x, so that the cast's saved copy is kept as a
    recipe too. `x` itself where no region tracks it, or (autocast's cast) where autocast is
    off, x is not fp32, or a torch-function mode (an fp8/fp4 emulation) handles the layer's
    inputs itself."""
    device, explicit = x.device.type, dtype
    if dtype is None:
        if x.dtype != torch.float32 or not torch.is_autocast_enabled(device):
            return x
        if torch._C._is_torch_function_mode_enabled():
            return x
        dtype = torch.get_autocast_dtype(device)
    for region in reversed(_regions()):
        if region.knows(x):
            return region.cast(x, dtype)
    return x if explicit is None or x.dtype == explicit else x.to(explicit)
