"""Which torch.optim kernel an optimizer runs: fused, foreach (multi-tensor) or a per-tensor loop.

torch's AdamW has three implementations of the same update: a Python loop over the parameters,
`foreach` (one multi-tensor kernel launch per operation over all parameters) and `fused` (one
kernel for the whole update). They differ only in launch count and rounding order (fused and
foreach are within float rounding of the loop, not bitwise equal to it).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

#: accepted values of `optimizer_impl`
OPTIMIZER_IMPLS = ("auto", "fused", "foreach", "loop")


def adamw_kernel_kwargs(impl: str, params: Iterable[torch.Tensor]) -> dict[str, bool]:
    """Keyword arguments selecting AdamW's kernel for `impl`.

    "auto": fused when every parameter is a floating CUDA tensor (one kernel per step), else
    torch's default (the loop on CPU, so CPU results are unchanged); "fused" / "foreach" /
    "loop": that kernel everywhere (fused AdamW also runs on CPU in current torch).

    Raises:
        ValueError: for an unknown `impl`.
    """
    if impl not in OPTIMIZER_IMPLS:
        raise ValueError(f"optimizer_impl must be one of {OPTIMIZER_IMPLS}, got {impl!r}")
    if impl == "fused":
        return {"fused": True}
    if impl == "foreach":
        return {"foreach": True}
    if impl == "loop":
        return {"foreach": False}
    params = list(params)
    if params and all(p.is_cuda and p.is_floating_point() for p in params):
        return {"fused": True}
    return {}
