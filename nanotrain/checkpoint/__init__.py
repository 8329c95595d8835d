"""Checkpoints: atomic save, exact resume, and finding the newest checkpoint of a run.

A checkpoint is a directory (`<run>/checkpoints/step-00000100/`) committed atomically, with a
`last` pointer next to it; see `docs/checkpointing.md` for the layout and guarantees.
"""

from nanotrain.checkpoint.files import FORMAT_VERSION, UnsafeCheckpointError, read_meta
from nanotrain.checkpoint.resume import plan_resume, resolve_checkpoint_path
from nanotrain.checkpoint.save_load import load_checkpoint, load_model_weights, save_checkpoint

__all__ = [
    "FORMAT_VERSION",
    "UnsafeCheckpointError",
    "load_checkpoint",
    "load_model_weights",
    "plan_resume",
    "read_meta",
    "resolve_checkpoint_path",
    "save_checkpoint",
]
