"""Tensors that are read from safetensors files only when (and as far as) they are needed.

A `LazyTensor` knows its shape and dtype and reads any box (a start..stop range per dim) of
itself on demand. It is what lets a rank of a sharded layout read only its own slices of a
pretrained folder (`nanotrain.models.sharding`) and `nanotrain export` merge shards one tensor
at a time (`nanotrain.checkpoint.merge`):

* `FileTensor` is one tensor of a safetensors file; a box is read through safetensors'
  `get_slice(name)[...]`, which copies only those elements out of the memory-mapped file;
* `stack` (per-expert HF tensors stacked over experts) and `concat` (tensor-parallel or
  expert-parallel shards put back together) combine lazy tensors without reading them;
* `narrow`, slicing with `[a:b]`, `chunk` and `unbind` give lazy windows.

`read()` materializes the whole tensor (a contiguous CPU tensor in the stored dtype). The
values are exactly those of the eager equivalents (`torch.stack`, `torch.cat`, indexing), so
a lazy load is bit-identical to reading everything first.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

__all__ = [
    "FileTensor",
    "LazyTensor",
    "SafetensorsFile",
    "concat",
    "in_memory",
    "materialize",
    "materialize_all",
    "open_safetensors",
    "stack",
]

Box = tuple[tuple[int, int], ...]  # (start, stop) per dim

# safetensors' dtype names -> torch dtypes
_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class LazyTensor:
    """A tensor of `shape` and `dtype` that is read only when asked for.

    Subclasses implement `_read(box)`. Views (`narrow`, `[a:b]`, `chunk`, `unbind`) read
    nothing; `read()` reads the whole tensor, `read_box` any part of it.
    """

    def __init__(self, shape: Sequence[int], dtype: torch.dtype) -> None:
        self.shape = torch.Size(shape)
        self.dtype = dtype

    def _read(self, box: Box) -> Tensor:
        raise NotImplementedError

    # -- reading ------------------------------------------------------------------------------
    def read_box(self, box: Box) -> Tensor:
        """The elements in `box` ((start, stop) per dim), as a new contiguous CPU tensor."""
        if len(box) != len(self.shape):
            raise ValueError(f"a box of {len(box)} dims for a tensor of shape {tuple(self.shape)}")
        return self._read(box).contiguous()

    def read(self) -> Tensor:
        """The whole tensor (a new contiguous CPU tensor in the stored dtype)."""
        return self.read_box(tuple((0, n) for n in self.shape))

    # -- tensor-like metadata -----------------------------------------------------------------
    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype})"

    # -- views (nothing is read) --------------------------------------------------------------
    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        """Elements `start .. start + length` of `dim`, as `Tensor.narrow`."""
        dim = dim % len(self.shape)
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(
                f"narrow({dim}, {start}, {length}) is outside shape {tuple(self.shape)}"
            )
        box = [(0, n) for n in self.shape]
        box[dim] = (start, start + length)
        return _Window(self, tuple(box))

    def __getitem__(self, key: Any) -> LazyTensor:
        """`t[a:b]` (dim 0, step 1) and `t[i]` (drops dim 0); other indexing is refused."""
        if isinstance(key, int):
            return self.unbind(0)[key]
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"a lazy tensor supports t[a:b] and t[i] only, got {key!r}")
        start, stop, _ = key.indices(self.shape[0])
        return self.narrow(0, start, max(stop - start, 0))

    def chunk(self, chunks: int, dim: int = 0) -> list[LazyTensor]:
        """Split like `Tensor.chunk`: pieces of ceil(size / chunks) along `dim`."""
        size = self.shape[dim]
        step = -(-size // chunks)
        return [self.narrow(dim, s, min(step, size - s)) for s in range(0, size, step)]

    def unbind(self, dim: int = 0) -> list[LazyTensor]:
        """One lazy tensor per index of `dim` (that dim dropped), as `Tensor.unbind`."""
        dim = dim % len(self.shape)
        return [_Window(self.narrow(dim, i, 1), None, drop=dim) for i in range(self.shape[dim])]


class _Window(LazyTensor):
    """A box of `base` (None: all of it), optionally without its size-1 dim `drop`."""

    def __init__(self, base: LazyTensor, box: Box | None, drop: int | None = None) -> None:
        self.base = base
        self.box = box if box is not None else tuple((0, n) for n in base.shape)
        shape = [stop - start for start, stop in self.box]
        if drop is not None:
            del shape[drop]
        self.drop = drop
        super().__init__(shape, base.dtype)

    def _read(self, box: Box) -> Tensor:
        inner = list(box)
        if self.drop is not None:
            inner.insert(self.drop, (0, 1))
        shifted = tuple((o + a, o + b) for (o, _), (a, b) in zip(self.box, inner, strict=True))
        out = self.base._read(shifted)
        return out.squeeze(self.drop) if self.drop is not None else out


class SafetensorsFile:
    """One safetensors file, opened once on first use (memory-mapped; nothing read up front).

    Args:
        path: the file. handle: an open `safe_open` handle of it to share, if there is one.

    Raises (on first use):
        ValueError: the file is corrupt or truncated (names it).
    """

    def __init__(self, path: str | Path, handle: Any = None) -> None:
        self.path = Path(path)
        self._handle: Any = handle

    def __getstate__(self) -> dict[str, Any]:
        # an open handle cannot be pickled or copied; the copy reopens the file on first use
        return {"path": self.path, "_handle": None}

    @property
    def handle(self) -> Any:
        """The `safe_open` handle (framework "pt", CPU)."""
        if self._handle is None:
            try:
                self._handle = safe_open(str(self.path), framework="pt", device="cpu")
            except (SafetensorError, OSError) as exc:
                raise ValueError(
                    f"{self.path} is corrupt or truncated ({exc}); use an intact copy"
                ) from exc
        return self._handle

    def tensors(self) -> dict[str, FileTensor]:
        """Every tensor of the file, lazily (only the header is read)."""
        return {name: self.tensor(name) for name in self.handle.keys()}

    def tensor(self, name: str) -> FileTensor:
        """Tensor `name` of the file, lazily. Raises: KeyError for a name it lacks."""
        try:
            info = self.handle.get_slice(name)
        except SafetensorError as exc:
            raise KeyError(f"{self.path} holds no tensor {name!r}") from exc
        return FileTensor(self, name, info.get_shape(), _DTYPES[info.get_dtype()])


class FileTensor(LazyTensor):
    """Tensor `name` of a `SafetensorsFile`; a box reads only its elements (`get_slice`)."""

    def __init__(
        self, file: SafetensorsFile, name: str, shape: Sequence[int], dtype: torch.dtype
    ) -> None:
        super().__init__(shape, dtype)
        self.file, self.name = file, name

    def _read(self, box: Box) -> Tensor:
        index = tuple(slice(start, stop) for start, stop in box)
        try:
            return self.file.handle.get_slice(self.name)[index]
        except (SafetensorError, OSError) as exc:
            raise ValueError(
                f"{self.file.path} is corrupt: cannot read {self.name!r} ({exc}); use an "
                "intact copy"
            ) from exc


def open_safetensors(path: str | Path) -> dict[str, FileTensor]:
    """name -> `FileTensor` for every tensor of the safetensors file `path` (header only).

    Raises:
        FileNotFoundError: no such file. ValueError: a corrupt or truncated file.
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path} not found")
    return SafetensorsFile(path).tensors()


class _Stack(LazyTensor):
    def __init__(self, parts: Sequence[LazyTensor]) -> None:
        self.parts = list(parts)
        super().__init__((len(self.parts), *self.parts[0].shape), self.parts[0].dtype)

    def _read(self, box: Box) -> Tensor:
        (start, stop), rest = box[0], box[1:]
        if start == stop:
            return torch.empty([0, *(b - a for a, b in rest)], dtype=self.dtype)
        return torch.stack([self.parts[i]._read(rest) for i in range(start, stop)])


class _Concat(LazyTensor):
    def __init__(self, pieces: Sequence[LazyTensor], dim: int) -> None:
        self.pieces, self.dim = list(pieces), dim
        shape = list(self.pieces[0].shape)
        shape[dim] = sum(p.shape[dim] for p in self.pieces)
        super().__init__(shape, self.pieces[0].dtype)

    def _read(self, box: Box) -> Tensor:
        start, stop = box[self.dim]
        parts, offset = [], 0
        for piece in self.pieces:  # read only the pieces the box overlaps
            size = piece.shape[self.dim]
            lo, hi = max(start, offset), min(stop, offset + size)
            if lo < hi:
                inner = list(box)
                inner[self.dim] = (lo - offset, hi - offset)
                parts.append(piece._read(tuple(inner)))
            offset += size
        if not parts:  # an empty range: an empty tensor of the right shape
            inner = list(box)
            inner[self.dim] = (0, 0)
            return self.pieces[0]._read(tuple(inner))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


def stack(parts: Sequence[Tensor | LazyTensor]) -> Tensor | LazyTensor:
    """`torch.stack(parts)` along a new dim 0, lazily when any part is lazy.

    Raises:
        ValueError: no parts, or parts of different shapes or dtypes.
    """
    if not any(isinstance(p, LazyTensor) for p in parts):
        return torch.stack(list(parts))
    lazy = [p if isinstance(p, LazyTensor) else in_memory(p) for p in parts]
    if not lazy or any(p.shape != lazy[0].shape or p.dtype != lazy[0].dtype for p in lazy):
        raise ValueError("stack needs one or more tensors of one shape and dtype")
    return _Stack(lazy)


def concat(pieces: Sequence[LazyTensor], dim: int) -> LazyTensor:
    """`torch.cat(pieces, dim)`, lazily: a box reads only the pieces it overlaps."""
    return pieces[0] if len(pieces) == 1 else _Concat(pieces, dim)


def in_memory(tensor: Tensor) -> LazyTensor:
    """A tensor already in memory behind the lazy interface (a box reads a copy of it)."""
    return _InMemory(tensor)


class _InMemory(LazyTensor):
    def __init__(self, tensor: Tensor) -> None:
        super().__init__(tensor.shape, tensor.dtype)
        self.tensor = tensor

    def _read(self, box: Box) -> Tensor:
        return self.tensor[tuple(slice(a, b) for a, b in box)].clone()


def materialize(value: Tensor | LazyTensor) -> Tensor:
    """`value` as a tensor (read if lazy, returned as is otherwise)."""
    return value.read() if isinstance(value, LazyTensor) else value


def materialize_all(state: dict[str, Tensor | LazyTensor]) -> dict[str, Tensor]:
    """Every value of `state` read; names that share one lazy tensor share one result."""
    done: dict[int, Tensor] = {}
    out = {}
    for key, value in state.items():
        if id(value) not in done:
            done[id(value)] = materialize(value)
        out[key] = done[id(value)]
    return out
