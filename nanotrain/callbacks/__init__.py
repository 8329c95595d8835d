"""Callbacks: everything around the training loop."""

from nanotrain.callbacks.base import Callback

__all__ = ["Callback"]
