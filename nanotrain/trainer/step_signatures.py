"""Steps written without `batch_idx`, called as Lightning calls them.

Lightning inspects each step's signature (`is_param_in_hook_signature(step, "batch_idx",
min_args=2)`) and passes `batch_idx` only to a step that takes it: `training_step(self,
batch)` is a valid Lightning module. The strategies call every step as `step(batch,
batch_idx)`, so for the length of a stage a step that does not take it is shadowed on the
instance by a wrapper that leaves the index out (`adapt_steps`; `restore_steps` removes it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

STEPS = ("training_step", "validation_step", "test_step", "predict_step")


def adapt_steps(module: Any) -> None:
    """Shadow each step of `module` that does not take `batch_idx` (as Lightning decides) with
    one that takes it and leaves it out."""
    for name in STEPS:
        step = getattr(module, name, None)
        if step is None or getattr(step, "drops_batch_idx", False):
            continue
        if is_param_in_hook_signature(step, "batch_idx", min_args=2):
            continue
        module.__dict__[name] = _without_batch_idx(step)


def restore_steps(module: Any) -> None:
    """Remove the wrappers `adapt_steps` put on `module`."""
    for name in STEPS:
        if getattr(module.__dict__.get(name), "drops_batch_idx", False):
            del module.__dict__[name]


def _without_batch_idx(step: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(step)
    def call(batch: Any, batch_idx: int | None = None, *args: Any, **kwargs: Any) -> Any:
        return step(batch, *args, **kwargs)

    call.drops_batch_idx = True  # type: ignore[attr-defined]
    return call
