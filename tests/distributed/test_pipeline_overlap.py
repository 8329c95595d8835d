"""The pipeline executor lets the next stage start while this one still computes: under GPipe
stage 1's first forward starts before stage 0's last forward (sleep-based compute)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from nanotrain.parallel.pipeline import PipelineComm, run_schedule
from nanotrain.parallel.schedules import SCHEDULES
from tests.distributed.spawn import run_world

F = 0.05  # seconds of sleep per forward: far above any transfer on localhost gloo


def _starts(rank: int, world: int, schedule: str) -> list[float]:
    comm = PipelineComm([0, 1], rank, 1, (4,), torch.float32, "cpu")
    w = torch.ones(4, requires_grad=True)
    starts: list[float] = []

    def forward_step(mb, c, inp):
        starts.append(time.time())
        time.sleep(F)
        out = (w * 1.0 if inp is None else inp) * 2.0
        return (None, out.sum()) if comm.is_last(c) else (out, None)

    dist.barrier()
    run_schedule(SCHEDULES[schedule](4, 2, rank, 1), comm, forward_step)
    return starts


def test_next_stage_starts_while_first_stage_still_runs_forwards():
    for schedule in ("gpipe", "1f1b"):
        stage0, stage1 = run_world(_starts, 2, schedule, timeout=60)
        # stage 1 gets microbatch 0 right after stage 0 computed it (~F), not after all four
        assert stage1[0] < stage0[-1], (schedule, stage0, stage1)
