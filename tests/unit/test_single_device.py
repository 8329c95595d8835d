"""SingleDeviceStrategy's device handling (the CUDA branch checked with torch.cuda stubbed)."""

from __future__ import annotations

import pytest
import torch
from torch.cuda._utils import _get_device_index

import nanotrain as nt


def test_cuda_without_index_becomes_the_current_device(monkeypatch):
    # torch.cuda.set_device refuses a device without an index ("Expected a torch.device with
    # a specified index"), so "cuda" must be resolved before setup_environment uses it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(_get_device_index(d)))
    strategy = nt.SingleDeviceStrategy("cuda")
    assert strategy.root_device == torch.device("cuda", 3)
    strategy.setup_environment()
    assert chosen == [3]


def test_cuda_with_index_is_kept(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert nt.SingleDeviceStrategy("cuda:1").root_device == torch.device("cuda", 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a CPU-only machine gives")
def test_cuda_on_a_machine_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="CUDA is not available"):
        nt.SingleDeviceStrategy("cuda")
