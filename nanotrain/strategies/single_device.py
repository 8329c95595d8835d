"""One process, one device (a CUDA GPU when there is one, else the CPU)."""

from __future__ import annotations

import torch

from nanotrain.strategies.replicated import ReplicatedStrategy


def default_device() -> torch.device:
    """The first CUDA device when CUDA is available, else the CPU."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


class SingleDeviceStrategy(ReplicatedStrategy):
    """Train in one process on one device.

    Args:
        device: "cpu", "cuda" (the current CUDA device), "cuda:1", a `torch.device`, or None
            to pick CUDA when available.
    """

    def __init__(self, device: str | torch.device | None = None) -> None:
        super().__init__()
        self._device = torch.device(device) if device is not None else default_device()
        if self._device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"SingleDeviceStrategy(device={str(self._device)!r}) but CUDA is not available; "
                "pass device='cpu' or leave device unset"
            )
        if self._device.type == "cuda" and self._device.index is None:
            # "cuda" means the current device; torch.cuda.set_device and the checkpoint's
            # device records need its index
            self._device = torch.device("cuda", torch.cuda.current_device())

    @property
    def root_device(self) -> torch.device:
        return self._device

    def setup_environment(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
