"""DDPStrategy turns off torch DDP's sampled runtime statistics after its first ten steps:
on CUDA each sampled step waits on the previous step's events (a host sync)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn

import nanotrain as nt


@pytest.fixture
def one_rank_gloo(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    for name, value in {**env, "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


class _Step(nn.Module):
    """The least a training step needs: a loss from a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()


def test_ddp_samples_runtime_stats_only_in_its_first_ten_steps(one_rank_gloo):
    strategy = nt.DDPStrategy(backend="gloo")
    strategy.setup_environment()
    wrapped = strategy._wrap(_Step())
    assert isinstance(wrapped, nn.parallel.DistributedDataParallel)
    for i in range(205):
        wrapped(torch.randn(2, 4), i).backward()
    # the iteration DDP last sampled; torch's default rate would have sampled 100 and 200
    assert wrapped._get_ddp_logging_data()["iteration"] == 10
