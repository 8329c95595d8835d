"""One low-precision copy of each weight per training step, shared by the step's microbatches.

`torch.autocast` caches its casts of leaf weights until the outermost autocast context exits.
Entered per microbatch, that is once per microbatch: every microbatch in flight (a pipeline
holds up to pp of them) keeps its own bf16 copy of every weight it used, saved for backward.
The precision plugin's `step_context` keeps one disabled autocast context open over the whole
step, so every microbatch reuses the first one's casts (Megatron-LM keeps bf16 weights for the
same reason). `cached_cast` gives the casts autocast does not make itself (the experts' weight
stacks, cast by hand for the grouped GEMM) the same lifetime, under `step_cast_cache`. A
recomputed region (`nanotrain.models.recompute`) turns both caches off: it keeps no weight
copy, as it keeps no activation.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

__all__ = ["cached_cast", "drop_step_casts", "step_cast_cache"]

_local = threading.local()


@contextmanager
def step_cast_cache() -> Iterator[None]:
    """Within it, `cached_cast` of a weight returns one cast per weight, dtype and version
    (on this thread; nested uses share the outer cache)."""
    outer = getattr(_local, "cache", None)
    if outer is None:
        _local.cache = {}
    try:
        yield
    finally:
        if outer is None:
            _local.cache = None


def drop_step_casts() -> None:
    """Forget the step's casts (autocast's and `cached_cast`'s) so the next forward casts
    again; what the current autograd graph saved stays alive through it. ZeRO-3 calls this
    after every forward: a cast made from a gathered FSDP2 parameter must not outlive its
    microbatch (autograd would accumulate the next microbatch's weight gradient through the
    old cast's node, after FSDP2 has collected that unit's gradients)."""
    torch.clear_autocast_cache()
    cache = getattr(_local, "cache", None)
    if cache:
        cache.clear()


def cached_cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """`t.to(dtype)`, made once per step for a weight (a leaf that requires grad, with grad
    enabled: the cast then carries the gradient back to it) inside `step_cast_cache`."""
    cache = getattr(_local, "cache", None)
    if cache is None or t.dtype == dtype or not (t.is_leaf and t.requires_grad):
        return t.to(dtype)
    if not torch.is_autocast_cache_enabled():  # a recomputed region keeps no copy
        return t.to(dtype)
    if not torch.is_grad_enabled():
        return t.to(dtype)
    key = (id(t), dtype)
    hit = cache.get(key)
    if hit is not None and hit[0] is t and hit[1] == t._version:
        return hit[2]
    out = t.to(dtype)
    cache[key] = (t, t._version, out)
    return out
