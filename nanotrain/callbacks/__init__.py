"""Callbacks: everything around the training loop (see docs/callbacks.md)."""

from nanotrain.callbacks.base import Callback
from nanotrain.callbacks.checkpoint import ModelCheckpoint
from nanotrain.callbacks.defaults import default_callbacks
from nanotrain.callbacks.early_stopping import EarlyStopping
from nanotrain.callbacks.grad_norm import GradNormMonitor
from nanotrain.callbacks.lr_monitor import LearningRateMonitor
from nanotrain.callbacks.memory import MemoryMonitor
from nanotrain.callbacks.model_dump import ModelDump
from nanotrain.callbacks.moe_load import MoELoadMonitor
from nanotrain.callbacks.nan_guard import NaNGuard
from nanotrain.callbacks.profiler import TorchProfiler
from nanotrain.callbacks.progress import ProgressBar
from nanotrain.callbacks.report import RunReport
from nanotrain.callbacks.text_sampler import TextSampler
from nanotrain.callbacks.throughput import ThroughputMonitor
from nanotrain.callbacks.timer import Timer

__all__ = [
    "Callback",
    "EarlyStopping",
    "GradNormMonitor",
    "LearningRateMonitor",
    "MemoryMonitor",
    "ModelCheckpoint",
    "ModelDump",
    "MoELoadMonitor",
    "NaNGuard",
    "ProgressBar",
    "RunReport",
    "TextSampler",
    "ThroughputMonitor",
    "Timer",
    "TorchProfiler",
    "default_callbacks",
]
