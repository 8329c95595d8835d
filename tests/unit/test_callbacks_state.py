"""Every monitoring/control callback's state survives a checkpoint round trip."""

from __future__ import annotations

import io

import pytest
import torch

from nanotrain.callbacks.early_stopping import EarlyStopping
from nanotrain.callbacks.grad_norm import GradNormMonitor
from nanotrain.callbacks.lr_monitor import LearningRateMonitor
from nanotrain.callbacks.memory import MemoryMonitor
from nanotrain.callbacks.model_dump import ModelDump
from nanotrain.callbacks.nan_guard import NaNGuard
from nanotrain.callbacks.progress import ProgressBar
from nanotrain.callbacks.text_sampler import TextSampler
from nanotrain.callbacks.throughput import ThroughputMonitor


def used_grad_norm() -> GradNormMonitor:
    cb = GradNormMonitor()
    cb.history, cb.num_spikes = [1.5, 2.0, 0.25], 2
    return cb


def used_nan_guard() -> NaNGuard:
    cb = NaNGuard()
    cb.bad_steps, cb.consecutive = 4, 1
    return cb


def used_early_stopping() -> EarlyStopping:
    cb = EarlyStopping(patience=5)
    for value in (3.0, 2.0, 2.5):
        cb.update(value)
    cb.stopped_step = 17
    return cb


FACTORIES = {
    "GradNormMonitor": (used_grad_norm, GradNormMonitor),
    "NaNGuard": (used_nan_guard, NaNGuard),
    "EarlyStopping": (used_early_stopping, lambda: EarlyStopping(patience=5)),
    "ThroughputMonitor": (ThroughputMonitor, ThroughputMonitor),
    "LearningRateMonitor": (LearningRateMonitor, LearningRateMonitor),
    "MemoryMonitor": (MemoryMonitor, MemoryMonitor),
    "ModelDump": (ModelDump, ModelDump),
    "ProgressBar": (ProgressBar, ProgressBar),
    "TextSampler": (lambda: TextSampler(["a"]), lambda: TextSampler(["a"])),
}


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_state_dict_round_trips_through_a_weights_only_checkpoint(name):
    make_used, make_fresh = FACTORIES[name]
    state = make_used().state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)  # checkpoints are read this way
    fresh = make_fresh()
    fresh.load_state_dict(loaded)
    assert fresh.state_dict() == state


def test_early_stopping_keeps_counting_after_resume():
    resumed = EarlyStopping(patience=2)
    resumed.load_state_dict(used_early_stopping().state_dict())  # best 2.0, one run without gain
    assert resumed.best == 2.0 and resumed.wait_count == 1
    assert resumed.update(2.1) is not None  # the second run without improvement stops
