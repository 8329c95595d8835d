"""Routed experts' saved activations kept in fp8 for backward (DeepSeek-V3 report, section
3.3.3: the experts' GEMM inputs and the SwiGLU's inputs are cached in fp8 with 1 x 128 tile
scales, so light recomputation fits at the paper's scale).

`Fp8Saves` is a context manager of saved-tensor hooks. Inside it, `keep_in_fp8(t)` names a
tensor: whatever autograd saves for backward that lies on t's storage (t, a view of t) is
packed as e4m3 values with one fp32 scale per 1 x 128 tile of its rows
(`nanotrain.parallel.fp8_wire.pack_fp8_rows`: H + 4 * ceil(H / 128) bytes per row of H values)
and unpacked to its dtype when backward reads it. Forward computes with the exact values; only
backward reads the rounded ones (e4m3: 3 mantissa bits, a relative error of at most 2**-4 per
element), so the loss of the step is unchanged and its gradients move by that rounding.

A tensor saved twice (the rows both the gate and the up projection read) is packed once.
Tensors the region was not told about (weights, the gate weights, the SwiGLU's outputs) go
to the enclosing hooks as they are. Inside a torch checkpoint region the hooks stay off: what
such a region saves is recomputed from exact values anyway. Under torch.compile they stay off
too (`LanguageModelModule` refuses the combination).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from nanotrain.parallel.fp8_wire import fp8_row_bytes, pack_fp8_rows, unpack_fp8_rows
from nanotrain.parallel.saved_rebuild import PassedOn, PerThreadRegions, open_saved_hooks

__all__ = [
    "Fp8Saves",
    "check_flag",
    "check_fp8_expert_activations",
    "fp8_saved_bytes",
    "keep_in_fp8",
    "keep_in_fp8_like",
]


_local = PerThreadRegions()  # the open `Fp8Saves` regions


def _regions() -> list[Fp8Saves]:
    return _local.regions


def fp8_saved_bytes(rows: int, width: int) -> int:
    """Bytes `rows` rows of `width` values take when kept in fp8: the e4m3 values and one
    fp32 scale per 1 x 128 tile of each row (the fp8 wire's rows)."""
    return rows * fp8_row_bytes(width)


def check_flag(name: str, value: Any) -> None:
    """Raise TypeError unless `value` is a bool (an on/off option called `name`)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def check_fp8_expert_activations(enabled: Any, compiled: Any) -> None:
    """Raise for an `enabled` that is not a bool, or one that is on with torch.compile on
    (`compiled`), under which saved-tensor hooks do not run: the fp8 saves would silently
    not happen, and the gradients would differ from an uncompiled run's."""
    check_flag("fp8_expert_activations", enabled)
    if enabled and compiled:
        raise ValueError(
            "fp8_expert_activations keeps saved tensors in fp8 through saved-tensor hooks, "
            "which torch.compile does not run; turn off compile_layers / compile_model, or "
            "fp8_expert_activations"
        )


def keep_in_fp8(t: Tensor) -> Tensor:
    """Name `t` to the innermost open `Fp8Saves` (its saves are then packed in fp8); returns
    t. Nothing happens where no region is open or active."""
    regions = _regions()
    if regions:
        regions[-1].keep(t)
    return t


def keep_in_fp8_like(source: Tensor, t: Tensor) -> Tensor:
    """Name `t` to the innermost open `Fp8Saves` when `source` lies on a storage it was told
    about (a copy made of a named tensor, e.g. the quantized input an fp8 emulation saves
    instead of the rows); returns t."""
    regions = _regions()
    if regions and regions[-1].knows(source):
        regions[-1].keep(t)
    return t


class _Packed:
    """A saved tensor as fp8 rows: the packed rows (or what the enclosing hooks made of
    them), the shape and dtype to unpack to."""

    __slots__ = ("dtype", "rows", "shape")

    def __init__(self, rows: Any, shape: torch.Size, dtype: torch.dtype) -> None:
        self.rows, self.shape, self.dtype = rows, shape, dtype


class Fp8Saves:
    """Saved-tensor hooks that keep the named tensors' saves in fp8 (a context manager).

    Use: ``with Fp8Saves(enabled) as saves: saves.keep(x); ... ops saving x ...`` (or
    `keep_in_fp8` from code that does not hold the region). With `enabled` false, outside
    autograd recording, under torch.compile, or inside a checkpoint region the region
    installs nothing and `keep` does nothing.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        # named storages -> the tensor (held, so that its memory is not reused by another
        # tensor while saves are matched by storage)
        self._named: dict[int, Tensor] = {}
        # a save's (storage, geometry, dtype) -> (the tensor saved, held; its _Packed)
        self._packed: dict[tuple[Any, ...], tuple[Tensor, _Packed]] = {}
        self._hooks: Any = None
        self._outer: tuple[Any, Any] | None = None

    @property
    def active(self) -> bool:
        """Whether the region's hooks are installed."""
        return self._hooks is not None

    def __enter__(self) -> Fp8Saves:
        if self.enabled:
            self._hooks, self._outer = open_saved_hooks(self._pack, self._unpack)
        if self._hooks is not None:
            _regions().append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._named.clear()
        self._packed.clear()
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None
            _regions().remove(self)

    def keep(self, t: Tensor) -> Tensor:
        """Keep whatever is saved on `t`'s storage in fp8 (a floating tensor); returns t."""
        if self._hooks is not None and t.is_floating_point() and t.numel() > 0:
            self._named[t.untyped_storage().data_ptr()] = t
        return t

    def knows(self, t: Tensor) -> bool:
        """Whether `t` lies on the storage of a tensor the region keeps in fp8."""
        return self._hooks is not None and t.untyped_storage().data_ptr() in self._named

    def _pack(self, t: Tensor) -> Any:
        if t.dim() == 0 or t.numel() == 0 or t.untyped_storage().data_ptr() not in self._named:
            return t if self._outer is None else PassedOn(self._outer[0](t))
        key = (t.untyped_storage().data_ptr(), t.size(), t.stride(), t.storage_offset(), t.dtype)
        hit = self._packed.get(key)
        if hit is not None:
            return hit[1]
        rows = pack_fp8_rows(t.detach().reshape(-1, t.shape[-1]))  # (rows, fp8_row_bytes)
        packed = _Packed(rows if self._outer is None else self._outer[0](rows), t.size(), t.dtype)
        self._packed[key] = (t, packed)
        return packed

    def _unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, PassedOn):
            return self._outer[1](packed.packed)
        if isinstance(packed, _Packed):
            rows = packed.rows if self._outer is None else self._outer[1](packed.rows)
            return unpack_fp8_rows(rows, packed.shape[-1], packed.dtype).view(packed.shape)
        return packed
