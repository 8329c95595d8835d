"""The pipeline executor lets the next stage start while this one still computes: under GPipe
stage 1's first forward starts before stage 0's last forward (sleep-based compute). The same
runs record the executor's timeline (what `benchmarks/pipeline.py --draw` pictures): one
compute span per action, in the schedule's order, and the waits for a neighbour."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from nanotrain.parallel.pipeline import PipelineComm
from nanotrain.parallel.schedule_runner import TimelineEvent, pairs_with, run_schedule
from nanotrain.parallel.schedules import SCHEDULES
from tests.distributed.spawn import run_world

F = 0.05  # seconds of sleep per forward: far above any transfer on localhost gloo


def _starts(rank: int, world: int, schedule: str) -> tuple[list[float], list[TimelineEvent]]:
    """Each forward's start time and the executor's timeline of the run."""
    comm = PipelineComm([0, 1], rank, 1, (4,), torch.float32, "cpu")
    w = torch.ones(4, requires_grad=True)
    starts: list[float] = []
    timeline: list[TimelineEvent] = []

    def forward_step(mb, c, inp):
        starts.append(time.time())
        time.sleep(F)
        out = (w * 1.0 if inp is None else inp) * 2.0
        return (None, out.sum()) if comm.is_last(c) else (out, None)

    dist.barrier()
    actions = SCHEDULES[schedule](4, 2, rank, 1)
    run_schedule(actions, comm, forward_step, params=[w], timeline=timeline)
    return starts, timeline


SCHEDULE_NAMES = ("gpipe", "1f1b", "zb_1f1b")


@pytest.fixture(scope="module")
def runs() -> dict[str, list]:
    return {name: run_world(_starts, 2, name, timeout=60) for name in SCHEDULE_NAMES}


def test_next_stage_starts_while_first_stage_still_runs_forwards(runs):
    for schedule in ("gpipe", "1f1b"):
        (stage0, _), (stage1, _) = runs[schedule]
        # stage 1 gets microbatch 0 right after stage 0 computed it (~F), not after all four
        assert stage1[0] < stage0[-1], (schedule, stage0, stage1)


def test_the_timeline_holds_each_action_once_in_order_and_the_waits(runs):
    for schedule in SCHEDULE_NAMES:
        for rank, (_, timeline) in enumerate(runs[schedule]):
            actions = SCHEDULES[schedule](4, 2, rank, 1)
            computed = [e for e in timeline if e.kind != "recv"]
            assert [(e.kind, e.microbatch) for e in computed] == [
                (a.kind, a.microbatch) for a in actions
            ], (schedule, rank)
            # spans follow one another on the rank's clock, and a forward lasts its sleep
            pairs = list(zip(timeline, timeline[1:], strict=False))
            assert all(a.end <= b.start for a, b in pairs), schedule
            assert all(e.end - e.start >= F for e in computed if e.kind == "F"), schedule
        # stage 1 first waits for microbatch 0's activation
        first = runs[schedule][1][1][0]
        assert (first.kind, first.microbatch) == ("recv", 0), schedule
        # a wait feeds the action right after it: on stage 0 a backward (the gradient of
        # its output), on stage 1 a forward (its input)
        for rank, kinds in ((0, ("B", "I")), (1, ("F",))):
            timeline = runs[schedule][rank][1]
            fed = [(a, b) for a, b in zip(timeline, timeline[1:], strict=False) if a.kind == "recv"]
            assert fed and all(b.kind in kinds for _, b in fed), (schedule, rank, fed)
            assert all(a.microbatch == b.microbatch for a, b in fed), (schedule, rank, fed)


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward sleeps `F` seconds."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(F)
        return g


def _paired(rank: int, world: int, overlap: bool) -> list[TimelineEvent]:
    """DualPipeV's timeline at pp=2, m=4, forwards and backwards sleeping F each."""
    comm = PipelineComm([0, 1], rank, 2, (4,), torch.float32, "cpu", v_shape=True)
    w = torch.ones(4, requires_grad=True)
    timeline: list[TimelineEvent] = []

    def forward_step(mb, c, inp):
        time.sleep(F)
        out = _SleepInBackward.apply((w * 1.0 if inp is None else inp) * 2.0)
        return (None, out.sum()) if comm.is_last(c) else (out, None)

    dist.barrier()
    actions = SCHEDULES["dualpipev"](4, 2, rank, 2)
    run_schedule(actions, comm, forward_step, params=[w], timeline=timeline, overlap=overlap)
    return timeline


def test_paired_chunks_run_side_by_side_only_when_asked():
    for overlap in (True, False):
        for rank, timeline in enumerate(run_world(_paired, 2, overlap, timeout=60)):
            actions = SCHEDULES["dualpipev"](4, 2, rank, 2)
            spans = {(e.kind, e.microbatch, e.chunk): e for e in timeline if e.kind != "recv"}
            pairs = [(a, b) for a, b in zip(actions, actions[1:], strict=False) if pairs_with(a, b)]
            assert pairs, rank
            for f, b in pairs:
                fs, bs = spans[("F", f.microbatch, f.chunk)], spans[(b.kind, b.microbatch, b.chunk)]
                side_by_side = bs.start < fs.end and fs.start < bs.end
                assert side_by_side == overlap, (overlap, rank, f, b, fs, bs)
