"""Every pipeline schedule's transfers replayed under NCCL's rules: no deadlock.

NCCL runs the transfers of one process group one after another, and a large send does not
finish before its receive has started. A rank's later transfers also wait for the receives it
waited on before posting them (the compute stream waited on those, and each NCCL transfer
waits on the compute stream). Gloo buffers, so the multi-process CPU tests cannot show a
deadlock these rules allow; this test records what `run_schedule` posts on every rank (with
`torch.distributed` stubbed) and replays it under them.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from nanotrain.parallel.mesh import MeshLayout
from nanotrain.parallel.pipeline import PipelineComm
from nanotrain.parallel.schedule_runner import run_schedule
from nanotrain.parallel.schedules import (
    ONE_CHUNK_SCHEDULES,
    SCHEDULES,
    V_SHAPED_SCHEDULES,
    forward_only,
)


@dataclass
class _Op:
    """Stands in for dist.P2POp (a real one needs an initialised process group)."""

    op: object
    tensor: torch.Tensor
    peer: int
    group: object = None
    tag: int = 0


class _Work:
    def wait(self) -> None:
        pass

    def is_completed(self) -> bool:
        return False


def _posted(
    monkeypatch, schedule: str, pp: int, v: int, m: int, channels: bool, overlap: bool = False
) -> dict:
    """rank -> the transfers it posts, in order: (kind, src, dst, group, tag)."""
    monkeypatch.setattr(dist, "P2POp", _Op)
    v_shape = schedule in V_SHAPED_SCHEDULES
    pairs = {c: "{}>{}{}".format(*c) for c in MeshLayout(pp=pp).pipeline_channels(v_shape)}
    posted: dict[int, list] = {}
    for rank in range(pp):
        log = posted[rank] = []

        def isend(t, dst, group=None, tag=0, _log=log, _r=rank):
            _log.append(("S", _r, dst, group, tag))
            return _Work()

        def irecv(t, src, group=None, tag=0, _log=log, _r=rank):
            _log.append(("R", src, _r, group, tag))
            return _Work()

        monkeypatch.setattr(dist, "isend", isend)
        monkeypatch.setattr(dist, "irecv", irecv)
        comm = PipelineComm(
            list(range(pp)), rank, v, (2,), torch.float32, torch.device("cpu"),
            channels=pairs if channels else None, v_shape=v_shape,
        )  # fmt: skip
        w = torch.ones(2, requires_grad=True)

        def step(mb, chunk, inp, _comm=comm, _w=w):
            x = (_w if inp is None else inp) * 2.0
            return (None, x.sum()) if _comm.is_last(chunk) else (x, None)

        if schedule == "forward_only":
            run_schedule(forward_only(m, pp, rank, v), comm, step, forward_only=True)
        else:
            run_schedule(SCHEDULES[schedule](m, pp, rank, v), comm, step, overlap=overlap)
    return posted


def _deadlocks(posted: dict) -> bool:
    """Replay under NCCL's rules; True when some transfer can never run."""
    queues: dict = {}  # (group, src, dst) -> {"S": [...], "R": [...]} in posting order
    for rank, ops in posted.items():
        for i, (kind, src, dst, group, tag) in enumerate(ops):
            queues.setdefault((group, src, dst), {"S": [], "R": []})[kind].append((rank, i, tag))
    for q in queues.values():
        assert [t for *_, t in q["S"]] == [t for *_, t in q["R"]], "sends and receives disagree"
    done = {rank: set() for rank in posted}
    # one stream per group and rank: a transfer runs after that stream's earlier ones
    stream = {}
    for rank, ops in posted.items():
        for i, (_, _, _, group, _) in enumerate(ops):
            stream.setdefault((rank, group), []).append(i)

    def runnable(rank: int, i: int) -> bool:
        ops = posted[rank]
        earlier_receives = all(j in done[rank] for j in range(i) if ops[j][0] == "R")
        mine = stream[(rank, ops[i][3])]
        return earlier_receives and all(j in done[rank] for j in mine[: mine.index(i)])

    heads = dict.fromkeys(queues, 0)
    moved = True
    while moved:
        moved = False
        for key, q in queues.items():
            h = heads[key]
            if h < len(q["S"]):
                (sr, si, _), (rr, ri, _) = q["S"][h], q["R"][h]
                if runnable(sr, si) and runnable(rr, ri):
                    done[sr].add(si)
                    done[rr].add(ri)
                    heads[key] += 1
                    moved = True
    return any(heads[key] < len(q["S"]) for key, q in queues.items())


CASES = [
    (schedule, pp, v, m)
    for schedule in (
        "gpipe",
        "1f1b",
        "interleaved_1f1b",
        "zb_1f1b",
        "zb_interleaved_1f1b",
        "zb_h1",
        "dualpipev",
        "forward_only",
    )
    for pp in (2, 3, 4)
    for v in (
        (1,) if schedule in ONE_CHUNK_SCHEDULES else (2,) if schedule == "dualpipev" else (1, 2, 3)
    )
    for m in (pp, 2 * pp, 2 * pp + 1)
    if not ("interleaved" in schedule and (v == 1 or m % pp))
    and not (schedule == "dualpipev" and m < 2 * pp)
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "{} pp={} v={} m={}".format(*c))
def test_no_schedule_deadlocks_with_a_group_per_direction(monkeypatch, case):
    assert not _deadlocks(_posted(monkeypatch, *case, channels=True))


OVERLAP_CASES = [("dualpipev", pp, 2, m) for pp in (2, 3, 4) for m in (2 * pp + 1, 4 * pp)] + [
    (schedule, pp, 2, 4 * pp)
    for schedule in ("interleaved_1f1b", "zb_interleaved_1f1b")
    for pp in (2, 4)
]


@pytest.mark.parametrize("case", OVERLAP_CASES, ids=lambda c: "{} pp={} v={} m={}".format(*c))
def test_paired_chunks_wait_for_both_receives_without_deadlock(monkeypatch, case):
    # overlap=True receives a pair's input activation and output gradient before either
    # computes (DualPipe's order): the transfers must still all run
    posted = _posted(monkeypatch, *case, channels=True, overlap=True)
    assert not _deadlocks(posted)
    # and the order differs from the one-by-one run where a pair has a forward to send and
    # a gradient to receive from another rank (at pp=2 every pair hands one over in memory)
    if case[0] == "dualpipev" and case[1] > 2:
        assert posted != _posted(monkeypatch, *case, channels=True)


def test_one_group_for_both_directions_would_deadlock(monkeypatch):
    # what the replay guards against: the interleaved schedule on a single group (the executor
    # before it had channels) stalls under NCCL's rules, though gloo runs it
    assert _deadlocks(_posted(monkeypatch, "interleaved_1f1b", 2, 2, 4, channels=False))
