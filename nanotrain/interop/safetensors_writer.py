"""Write a safetensors file one tensor at a time.

`safetensors.torch.save_file` needs every tensor in memory at once. `save_file_streaming`
takes tensors or `LazyTensor`s, writes the header from their shapes and dtypes alone, then
reads (materializes), writes and drops one tensor after the other: peak memory is the
largest single tensor (plus what reading it needs, e.g. its shards), not the whole model.

The bytes are those `save_file` writes for the same tensors and metadata: the same compact
JSON header padded with spaces to a multiple of 8, tensors ordered by dtype (largest first,
in safetensors' own order) and then by name, little-endian data back to back.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from nanotrain.models.lazy import LazyTensor, materialize

__all__ = ["save_file_streaming"]

# safetensors' dtype names, in the order of its Rust `Dtype` enum (which orders the data)
_NAMES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.uint64: "U64",
}
_RANK = {dtype: i for i, dtype in enumerate(_NAMES)}


def save_file_streaming(
    tensors: Mapping[str, Tensor | LazyTensor],
    path: str | Path,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write `tensors` to the safetensors file `path`, reading one tensor at a time.

    Args:
        tensors: name -> tensor (any device; written from a CPU copy) or `LazyTensor` (read
            when its turn comes, then dropped).
        path: the file to write (overwritten).
        metadata: string -> string, stored under "__metadata__" as `save_file` does.

    Returns:
        `path` as a Path.

    Raises:
        TypeError: a value that is neither a tensor nor a LazyTensor, or a dtype safetensors
            cannot store.
        ValueError: a materialized tensor whose shape or dtype differs from what the header
            announced (a lazy tensor that lied).
    """
    bad = [k for k, v in tensors.items() if not isinstance(v, Tensor | LazyTensor)]
    if bad:
        raise TypeError(f"save_file_streaming needs tensors or LazyTensors; {bad[:5]} are not")
    unknown = sorted({str(v.dtype) for v in tensors.values() if v.dtype not in _RANK})
    if unknown:
        raise TypeError(f"safetensors cannot store dtypes {unknown}")
    order = sorted(tensors, key=lambda k: (-_RANK[tensors[k].dtype], k))
    header: dict[str, object] = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    for name in order:
        value = tensors[name]
        nbytes = value.numel() * value.element_size()
        header[name] = {
            "dtype": _NAMES[value.dtype],
            "shape": list(value.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    out = Path(path)
    with out.open("wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in order:
            f.write(_payload(name, tensors[name]))
    return out


def _payload(name: str, value: Tensor | LazyTensor) -> memoryview:
    """The raw little-endian bytes of one tensor (read now if lazy)."""
    tensor = materialize(value).detach().to("cpu").contiguous()
    if tensor.shape != value.shape or tensor.dtype != value.dtype:
        raise ValueError(
            f"{name!r} was announced as {tuple(value.shape)} {value.dtype} but read as "
            f"{tuple(tensor.shape)} {tensor.dtype}"
        )
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
