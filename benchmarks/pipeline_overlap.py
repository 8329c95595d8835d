"""How much of the expert all-to-all a pipeline schedule leaves exposed, with injected times.

Runs `nanotrain.parallel.schedule_runner.run_schedule` on a forked gloo world (one process
per pipeline rank) with sleep-based chunks shaped like a MoE stage: per chunk and
microbatch, a forward is compute, an all-to-all (dispatch), compute, an all-to-all
(combine); its input-gradient half the same backwards; its weight half compute only. Compute
holds the rank's one compute engine (a lock: two chunks never compute at once, as on one
GPU); an all-to-all only waits (sleeps), so the other chunk may compute meanwhile, as a
communication stream lets it.

Per schedule it prints the step with the all-to-alls, the step without them, and the
exposed all-to-all (their difference) against the blocking one (every all-to-all of the
busiest rank, run back to back: what a schedule that never overlaps pays), next to what the
planner predicts with the same rule (`nanotrain.planning.schedule_time.exposed_all_to_all`).

Usage: ``python benchmarks/pipeline_overlap.py [--f-ms 20] [--a2a-ms 5] [--rounds 4]
[--sizes 2x32,4x64]``: F is a rank's forward compute per microbatch (a whole backward 2F,
its halves F each), A the time of one all-to-all of a rank's layers per microbatch (four per
microbatch: dispatch and combine, forward and backward), split over `rounds` MoE layers per
chunk; sizes are pp x microbatches. ``--draw FOLDER`` draws DualPipeV's recorded timelines at
pp=4, m=8, chunks apart and side by side (docs/parallelism.md shows them).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.pipeline import Compute, _comm, best_of_two_steps  # noqa: E402
from nanotrain.parallel.schedules import (  # noqa: E402
    ONE_CHUNK_SCHEDULES,
    SCHEDULES,
    V_SHAPED_SCHEDULES,
)
from nanotrain.planning.schedule_time import exposed_all_to_all  # noqa: E402
from nanotrain.report.schedule_chart import schedule_chart  # noqa: E402
from tests.distributed.spawn import run_world  # noqa: E402


class _AllToAll(torch.autograd.Function):
    """Identity that waits `seconds` in forward and in backward, without the engine."""

    @staticmethod
    def forward(ctx, x, seconds: float):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.seconds)
        return g, None


def _step(
    rank: int,
    world: int,
    schedule: str,
    m: int,
    f: float,
    a: float,
    overlap: bool,
    rounds: int,
    record: bool = False,
) -> Any:
    """The best of two steps' time on this rank, each chunk `rounds` MoE layers deep; with
    `record`, (that, the second step's timeline)."""
    v = 1 if schedule in ONE_CHUNK_SCHEDULES else 2
    comm = _comm(rank, world, v, (4,), schedule in V_SHAPED_SCHEDULES)
    w = torch.ones(4, requires_grad=True)

    def forward_step(mb: int, c: int, inp):
        x = w * 1.0 if inp is None else inp
        # a chunk is 1/v of the rank's layers: F/v compute, I/v and W/v backward halves, in
        # `rounds` layers of compute, dispatch, compute, combine
        piece, wire = f / v / 2 / rounds, a / v / rounds
        for _ in range(rounds):
            x = _AllToAll.apply(Compute.apply(x, piece, piece), wire)
            x = _AllToAll.apply(Compute.apply(x, piece, piece), wire)
        out = x + Compute.apply(w, 0.0, f / v).sum() * 0.0
        return (None, out.sum()) if comm.is_last(c) else (out, None)

    actions = SCHEDULES[schedule](m, world, rank, v)
    best, timeline = best_of_two_steps(actions, comm, forward_step, w, overlap)
    return (best, timeline) if record else best


def draw(folder: str, f: float, a: float, rounds: int, pp: int = 4, m: int = 8) -> None:
    """DualPipeV's recorded timeline with the injected all-to-alls, its chunks apart and side
    by side: `folder`/pipeline_dualpipev_apart.png and pipeline_dualpipev_overlapped.png."""
    for overlap, name in ((False, "apart"), (True, "overlapped")):
        ranks = run_world(_step, pp, "dualpipev", m, f, a, overlap, rounds, True, timeout=600)
        step = max(seconds for seconds, _ in ranks)
        title = (
            f"dualpipev, chunks {'side by side' if overlap else 'apart'}: pp={pp}, m={m}, "
            f"F = {f * 1e3:g} ms + all-to-alls of {a * 1e3:g} ms; step {step * 1e3:.0f} ms"
        )
        path = Path(folder) / f"pipeline_dualpipev_{name}.png"
        print(schedule_chart([timeline for _, timeline in ranks], path, title), flush=True)


#: (label, schedule, overlap) compared
RUNS = (
    ("1f1b", "1f1b", False),
    ("zb_1f1b", "zb_1f1b", False),
    ("dualpipev", "dualpipev", False),
    ("dualpipev overlapped", "dualpipev", True),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--f-ms", type=float, default=20.0, help="forward compute F (ms)")
    parser.add_argument("--a2a-ms", type=float, default=5.0, help="one all-to-all A (ms)")
    parser.add_argument("--sizes", default="2x32,4x64", help="pp x microbatches, comma-separated")
    parser.add_argument("--rounds", type=int, default=4, help="MoE layers per chunk")
    parser.add_argument("--draw", metavar="FOLDER", help="draw DualPipeV's timelines (pp=4, m=8)")
    args = parser.parse_args()
    f, a = args.f_ms / 1e3, args.a2a_ms / 1e3
    if args.draw:
        draw(args.draw, f, a, args.rounds)
        return
    print(
        f"F = {args.f_ms:g} ms compute, B = 2F, A = {args.a2a_ms:g} ms per all-to-all, "
        f"{args.rounds} MoE layers per chunk"
    )
    print(
        "| pp | m | schedule | step ms | without a2a ms | exposed a2a ms | blocking a2a ms "
        "| exposed / blocking | planner |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        pp, m = (int(n) for n in size.split("x"))
        blocking = m * 4 * a
        for label, schedule, overlap in RUNS:
            run = (_step, pp, schedule, m, f)
            step = max(run_world(*run, a, overlap, args.rounds, timeout=600))
            bare = max(run_world(*run, 0.0, overlap, args.rounds, timeout=600))
            exposed = step - bare
            v = 2 if schedule in V_SHAPED_SCHEDULES else 1
            predicted = exposed_all_to_all(schedule, m, pp, v, f, f, f, 4 * a, overlap, args.rounds)
            print(
                f"| {pp} | {m} | {label} | {step * 1e3:.0f} | {bare * 1e3:.0f} | "
                f"{exposed * 1e3:.0f} | {blocking * 1e3:.0f} | {exposed / blocking:.2f} | "
                f"{predicted / blocking:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
