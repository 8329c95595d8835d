"""MegatronStrategy's device in one process without torchrun (CUDA checked with torch.cuda
stubbed): the GPU when there is one, as SingleDeviceStrategy and DDPStrategy would choose."""

from __future__ import annotations

import pytest
import torch
from torch.cuda._utils import _get_device_index

import nanotrain as nt


@pytest.fixture
def one_process(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def test_one_process_trains_on_the_gpu_when_there_is_one(monkeypatch, one_process):
    # before, a single process without a group always chose the CPU, so
    # `MegatronStrategy()` on a one-GPU machine silently trained on the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(_get_device_index(d)))
    strategy = nt.MegatronStrategy()
    strategy.setup_environment()
    assert strategy.root_device == torch.device("cuda", 0)
    assert chosen == [0]


def test_gloo_backend_keeps_one_process_on_the_cpu(monkeypatch, one_process):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("no GPU was asked for"))
    strategy = nt.MegatronStrategy(backend="gloo")
    strategy.setup_environment()
    assert strategy.root_device == torch.device("cpu")


def test_without_cuda_one_process_is_on_the_cpu(monkeypatch, one_process):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    strategy = nt.MegatronStrategy()
    strategy.setup_environment()
    assert strategy.root_device == torch.device("cpu")
