"""Checks on what a checkpoint holds: is the saved state finite, does it fit the model?

* `nonfinite_parts` tells a save whether it captures a broken state (non-finite weights, or a
  non-finite loss at the step whose update was applied); `meta.json` records the answer so
  that retention and `ckpt_path="last"` can keep and prefer the last good state.
* `config_differences` and `state_differences` turn a resume into a different model into a
  short list of what differs, before any tensor is loaded (instead of torch's
  `load_state_dict` dump).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from nanotrain.trainer import Trainer

# How many differences an error message lists before summarizing the rest.
_MAX_LISTED = 12


def nonfinite_parts(trainer: Trainer, model_state: Mapping[str, Any]) -> list[str]:
    """What is non-finite in the state a save captures on this rank: "weights" when a floating
    tensor of `model_state` holds NaN/inf, "loss" when the last step's loss is NaN/inf and its
    update was applied (a step whose update was skipped, e.g. by NaNGuard, left the weights
    as they were, so its checkpoint is still a good state). Empty when all is finite."""
    parts = []
    for value in model_state.values():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            if not bool(torch.isfinite(value).all()):
                parts.append("weights")
                break
    out = trainer.step_output
    skipped = getattr(out, "skipped", False) or getattr(trainer, "_skip_requested", False)
    flag = getattr(out, "skip_flag", None)
    skipped = skipped or (flag is not None and bool(flag))  # skipped on the device
    loss = None if out is None else out.loss  # None: a manual step that returned no loss
    if loss is not None and not skipped and not math.isfinite(float(loss.detach().float())):
        parts.append("loss")
    return parts


def gather_nonfinite(trainer: Trainer) -> list[str]:
    """`nonfinite_parts` of the current state over all ranks (a collective: call on every
    rank at the same step); sorted, empty when every rank's state is finite."""
    from nanotrain.checkpoint.collective import exchange

    mine = nonfinite_parts(trainer, trainer.strategy.model_state_dict())
    return sorted({part for parts in exchange(trainer.strategy, mine) for part in parts})


def current_model_config(module: Any) -> dict[str, Any] | None:
    """The `model_config` entry the module's `on_save_checkpoint` records (LanguageModelModule
    records its model config there), or None when it records none."""
    hook = getattr(module, "on_save_checkpoint", None)
    if not callable(hook):
        return None
    probe: dict[str, Any] = {}
    hook(probe)
    config = probe.get("model_config")
    return config if isinstance(config, dict) else None


def config_differences(saved: Any, current: Any, prefix: str = "") -> list[str]:
    """Field-by-field differences between two plain (nested dict) configs, as
    "field: saved X, now Y" lines; empty when they are equal."""
    if isinstance(saved, dict) and isinstance(current, dict):
        diffs = []
        for key in sorted(set(saved) | set(current), key=str):
            name = f"{prefix}{key}" if not prefix else f"{prefix}.{key}"
            if key not in saved:
                diffs.append(f"{name}: not in the checkpoint, now {current[key]!r}")
            elif key not in current:
                diffs.append(f"{name}: saved {saved[key]!r}, not in the current config")
            else:
                diffs += config_differences(saved[key], current[key], name)
        return diffs
    if saved != current and not (_is_nan(saved) and _is_nan(current)):
        return [f"{prefix or 'config'}: saved {saved!r}, now {current!r}"]
    return []


def state_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Names missing from / unexpected in `saved` and tensors whose shape differs, comparing a
    saved model state dict with the model's own; empty when they match."""
    diffs = [f"missing from the checkpoint: {k}" for k in current if k not in saved]
    diffs += [f"not in the model: {k}" for k in saved if k not in current]
    for name, value in saved.items():
        now = current.get(name)
        if isinstance(value, torch.Tensor) and isinstance(now, torch.Tensor):
            if tuple(value.shape) != tuple(now.shape):
                diffs.append(
                    f"{name}: saved shape {list(value.shape)}, the model has {list(now.shape)}"
                )
    return diffs


def summarize(diffs: list[str]) -> str:
    """The first differences, one per line, and how many more there are."""
    shown = "\n  ".join(diffs[:_MAX_LISTED])
    more = len(diffs) - _MAX_LISTED
    return "  " + shown + (f"\n  ... and {more} more" if more > 0 else "")


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)
