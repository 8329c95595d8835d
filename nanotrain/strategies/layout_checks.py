"""The model sizes a parallel layout must divide (the checks themselves: `parallel.mesh`)."""

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
