"""Deterministic kernels, and capturing/restoring every random number generator of a process
(seeding itself is Lightning's `seed_everything`)."""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch


def set_deterministic(mode: bool | str | None) -> None:
    """Ask torch for deterministic kernels as Lightning's `deterministic` does: True (errors on
    ops that have none), "warn" (warns on them), False (off); None leaves torch as it is."""
    if mode is None:
        return
    enabled = mode is True or mode == "warn"
    if enabled:
        # cuBLAS needs a fixed workspace to be deterministic; harmless on CPU.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled, warn_only=mode == "warn")
    torch.backends.cudnn.benchmark = not enabled
    torch.backends.cudnn.deterministic = enabled


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors and plain Python values (safe for weights_only)."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore states captured by `capture_rng_state` (CUDA states only where CUDA exists)."""
    python_state = state["python"]
    random.setstate((python_state[0], tuple(python_state[1]), python_state[2]))
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["kind"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
