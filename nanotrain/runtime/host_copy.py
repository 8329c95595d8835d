"""Copy small host values (lists of numbers) to the device without making the host wait.

A plain `torch.tensor(values, device="cuda")` copies from pageable memory, and torch then
synchronizes the stream: the host waits until every kernel queued so far has finished. Inside
a training step that stall serializes the host's launches with the device's work. Copying
from pinned memory with `non_blocking=True` only queues the copy.
"""

from __future__ import annotations

import torch
from torch import Tensor


def host_to_device(
    values: list[float] | list[int], device: torch.device, dtype: torch.dtype = torch.float64
) -> Tensor:
    """A [len(values)] tensor of `dtype` on `device`. To a GPU it is copied from pinned memory
    without blocking, so the host does not wait for the device (a plain copy would)."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
