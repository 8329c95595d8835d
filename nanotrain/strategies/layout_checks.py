"""Checks of the sizes a parallel layout is given, before any process group exists."""

from __future__ import annotations

from typing import Any


def model_dims(config: Any) -> dict[str, int | None]:
    """The sizes of a model config that a parallel layout must divide (None when absent)."""
    return {
        "num_heads": getattr(config, "num_heads", None),
        "num_kv_heads": getattr(config, "num_kv_heads", None),
        "num_experts": getattr(config, "n_routed_experts", None),
        "num_layers": getattr(config, "num_layers", None),
    }


def check_sizes(**sizes: int | None) -> None:
    """Check that every given parallel size is an int >= 1 (None: not given).

    Raises:
        TypeError: a size is not an int.
        ValueError: a size is below 1.
    """
    for name, value in sizes.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
