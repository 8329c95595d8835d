"""Find host-device synchronizations: every place a step reads a tensor's value on the host.

`HostSyncCounter` is a context manager that records each operation which must wait for the
device to copy a value to the host: the aten ops that produce a host scalar or a data-dependent
shape (`_local_scalar_dense` behind `.item()`, `bool(t)`, `int(t)`; `nonzero`, `masked_select`,
`unique`, ...) and the Python calls that read tensor data without going through an aten op
(`Tensor.tolist`, `Tensor.numpy`). On CPU nothing actually waits, but the same code on a GPU
would stall the host until the device catches up, so counting them on CPU finds GPU syncs
without a GPU. Each record keeps the innermost nanotrain source line that caused it.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: aten ops whose result the host must read (a scalar, or a shape that depends on values)
SYNC_OPS = frozenset(
    {
        "aten._local_scalar_dense",
        "aten.nonzero",
        "aten.masked_select",
        "aten.unique",
        "aten._unique2",
        "aten.unique_consecutive",
        "aten.unique_dim",
        "aten.equal",
        "aten.is_nonzero",
        "aten.allclose",
        # on CPU these read the data directly, below the dispatcher; on CUDA they read values
        # back to the host: bincount its input's max, repeat_interleave (repeats given as a
        # tensor, no output_size) the sum of the repeats
        "aten.bincount",
    }
)
#: Python-level Tensor methods that copy data to the host without an aten op on CPU
SYNC_METHODS = ("tolist", "numpy")


def _unsized_repeat_interleave(func: Any, kwargs: dict[str, Any]) -> bool:
    """repeat_interleave with tensor repeats and no output_size (the other overloads reach the
    dispatcher as this one): the output's length is the repeats' sum, which CUDA must read back
    to allocate the output."""
    return str(func) == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None


def _where() -> str:
    """The innermost project frame (file:line) of the current stack, else the innermost."""
    frames = traceback.extract_stack()[:-2]
    for f in reversed(frames):
        if "nanotrain" in f.filename and "sync_guard" not in f.filename:
            return f"{f.filename}:{f.lineno} ({f.name})"
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


class HostSyncCounter(TorchDispatchMode):
    """Records host syncs while active; `records` lists (op name, source location).

    Use: ``with HostSyncCounter() as c: step(); assert not c.records``. Not re-entrant.
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, str]] = []
        self._saved: dict[str, Any] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
        if name in SYNC_OPS or _unsized_repeat_interleave(func, kwargs or {}):
            self.records.append((name, _where()))
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> HostSyncCounter:
        for method in SYNC_METHODS:
            original = getattr(torch.Tensor, method)
            self._saved[method] = original

            def patched(t: torch.Tensor, *a: Any, _m: str = method, _o: Any = original) -> Any:
                self.records.append((f"Tensor.{_m}", _where()))
                return _o(t, *a)

            setattr(torch.Tensor, method, patched)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        for method, original in self._saved.items():
            setattr(torch.Tensor, method, original)
        self._saved.clear()
        return super().__exit__(*exc)
