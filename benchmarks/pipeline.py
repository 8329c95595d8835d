"""Pipeline schedules side by side: step time, measured bubble vs theory, peak activations.

Runs `nanotrain.parallel.schedule_runner.run_schedule` on a forked gloo world (one CPU thread per
rank) with a stack of MLP blocks split over pp stages, for pp = 2 and 4 and several
microbatch counts m. Per schedule it prints:

- step time (median of a few steps, ms);
- measured bubble: 1 - (time the busiest rank spends computing) / (step time);
- theoretical bubble: (p - 1) / (m + p - 1), interleaved (p - 1) / (v·m + p - 1);
- peak activation memory on stage 0: the most bytes of autograd-saved tensors alive at once
  (counted with saved-tensor hooks), GPipe vs 1F1B.

On a 2-core machine ranks beyond 2 share cores, so pp=4 times are only indicative; the
bubble and memory columns are what to compare. Usage: ``python benchmarks/pipeline.py``.

``--sleep`` instead measures the executor itself, on any machine: every chunk sleeps F/v in
forward and 2F/v in backward (activations of 4 floats, so the cores are idle and the transfers
free), and the step time is printed over the ideal (m + (p - 1)/v)·3F, at pp=2, m=4 and pp=4,
m=8 (``--f-ms``, default 60). A schedule at its theoretical bubble prints 1.00.

``--draw FOLDER`` draws every schedule as it ran (the executor's own timeline of each rank:
F, B, I, W and the waits for a neighbour) at pp=4, m=8 with the same sleep-based compute, one
PNG per schedule (docs/parallelism.md shows them): ``python benchmarks/pipeline.py --draw
docs/images --f-ms 20``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanotrain.parallel.mesh import ParallelMesh  # noqa: E402
from nanotrain.parallel.pipeline import PipelineComm, open_channels  # noqa: E402
from nanotrain.parallel.schedule_runner import run_schedule  # noqa: E402
from nanotrain.parallel.schedules import SCHEDULES, V_SHAPED_SCHEDULES  # noqa: E402
from nanotrain.planning.schedule_time import schedule_step_time  # noqa: E402
from nanotrain.report.schedule_chart import schedule_chart  # noqa: E402
from tests.distributed.spawn import run_world  # noqa: E402

HIDDEN, TOKENS, LAYERS, STEPS = 256, 256, 8, 4


class SavedBytes:
    """Counts bytes of tensors autograd saves for backward, and the peak alive at once."""

    def __init__(self) -> None:
        self.alive = self.peak = 0

    def pack(self, t: torch.Tensor):
        n = t.numel() * t.element_size()
        self.alive += n
        self.peak = max(self.peak, self.alive)
        return (t, n, self)

    @staticmethod
    def unpack(packed):
        t, n, me = packed
        me.alive -= n
        return t


def _comm(
    rank: int, world: int, v: int, shape: tuple[int, ...], v_shape: bool = False
) -> PipelineComm:
    """This rank's transfers over one group per direction and kind, as MegatronStrategy sets
    them up (`v_shape`: DualPipeV's placement)."""
    mesh = ParallelMesh.build(pp=world, pipeline_v_shape=v_shape)
    order = mesh.layout.pipeline_channels(v_shape)
    open_channels(order, mesh.pp_channels, rank, torch.device("cpu"))
    return PipelineComm(
        list(range(world)), rank, v, shape, torch.float32, "cpu", mesh.pp_channels, v_shape
    )


def _bench(rank: int, world: int, schedule: str, m: int, v: int) -> dict:
    torch.manual_seed(rank)
    chunks = [
        torch.nn.Sequential(
            *[torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU())] * 1,
            *[
                torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU())
                for _ in range(LAYERS // (world * v) - 1)
            ],
        )
        for _ in range(v)
    ]
    comm = _comm(rank, world, v, (TOKENS, HIDDEN))
    data = torch.randn(TOKENS, HIDDEN)
    busy = [0.0]

    def forward_step(mb: int, c: int, inp):
        start = time.perf_counter()
        x = data if inp is None else inp
        out = chunks[c](x)
        busy[0] += time.perf_counter() - start
        return (None, out.pow(2).mean()) if comm.is_last(c) else (out, None)

    actions = SCHEDULES[schedule](m, world, rank, v)
    times, peaks = [], []
    for _ in range(STEPS):
        busy[0] = 0.0
        saved = SavedBytes()
        dist.barrier()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            run_schedule(actions, comm, forward_step, loss_scales=[1.0 / m] * m)
        dist.barrier()
        times.append(time.perf_counter() - start)
        peaks.append(saved.peak)
    # backward time is not inside forward_step: estimate compute as 3x forward (fwd + 2x bwd)
    return {"step": statistics.median(times), "busy": 3 * busy[0], "peak": max(peaks)}


#: the rank's one compute engine (each rank is its own process): two threads of a rank
#: (paired chunks side by side) never compute at once, as on one GPU
ENGINE = threading.Lock()


class Compute(torch.autograd.Function):
    """Identity that holds the rank's compute engine `fwd` seconds (a sleep) in forward and
    `bwd` in backward."""

    @staticmethod
    def forward(ctx, x, fwd: float, bwd: float):
        ctx.bwd = bwd
        with ENGINE:
            time.sleep(fwd)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        with ENGINE:
            time.sleep(ctx.bwd)
        return g, None, None


def _sleep_bench(
    rank: int, world: int, schedule: str, m: int, v: int, f: float, record: bool = False
) -> Any:
    """The best of two steps' time; with `record`, (that, the second step's timeline)."""
    comm = _comm(rank, world, v, (4,), schedule in V_SHAPED_SCHEDULES)
    w = torch.ones(4, requires_grad=True)

    def forward_step(mb: int, c: int, inp):
        x = w * 1.0 if inp is None else inp
        # backward 2F/v: F/v on the path to the input (I), F/v on the path to the weight (W)
        out = Compute.apply(x, f / v, f / v) + Compute.apply(w, 0.0, f / v).sum() * 0.0
        return (None, out.sum()) if comm.is_last(c) else (out, None)

    best, timeline = best_of_two_steps(
        SCHEDULES[schedule](m, world, rank, v), comm, forward_step, w
    )
    return (best, timeline) if record else best


def best_of_two_steps(
    actions: list, comm: PipelineComm, forward_step: Any, w: torch.Tensor, overlap: bool = False
) -> tuple[float, list]:
    """Run `actions` twice between barriers: (the shorter step's seconds, the second step's
    timeline)."""
    times, timeline = [], []
    for _ in range(2):
        timeline = []
        dist.barrier()
        start = time.perf_counter()
        run_schedule(actions, comm, forward_step, params=[w], timeline=timeline, overlap=overlap)
        dist.barrier()
        times.append(time.perf_counter() - start)
    return min(times), timeline


#: (schedule, virtual stages) of each drawn or timed schedule
SLEEP_SCHEDULES = (
    ("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_1f1b", 1),
    ("zb_interleaved_1f1b", 2), ("zb_h1", 1), ("dualpipev", 2),
)  # fmt: skip


def draw_schedules(
    folder: str, f_ms: float, pp: int = 4, m: int = 8, only: str | None = None
) -> list[Path]:
    """One PNG per schedule (or only the one named `only`) of the executor's recorded
    timeline at `pp` stages and `m` microbatches, with sleep-based compute (F forward,
    I = W = F): `folder`/pipeline_<name>.png."""
    paths = []
    for schedule, v in SLEEP_SCHEDULES:
        if only is not None and schedule != only:
            continue
        ranks = run_world(_sleep_bench, pp, schedule, m, v, f_ms / 1e3, True, timeout=300)
        step = max(seconds for seconds, _ in ranks)
        chunks = " in a V" if schedule in V_SHAPED_SCHEDULES else ""
        title = f"{schedule}: pp={pp}, m={m}" + (f", {v} chunks per rank{chunks}" if v > 1 else "")
        title += f", F = {f_ms:g} ms, B = I + W = 2F; step {step * 1e3:.0f} ms"
        path = Path(folder) / f"pipeline_{schedule}.png"
        paths.append(schedule_chart([timeline for _, timeline in ranks], path, title))
        print(path, flush=True)
    return paths


def sleep_table(f_ms: float, only: str | None = None) -> None:
    """Step time over each schedule's replay by the planner (`schedule_step_time`) with
    sleep-based compute (F forward, I = W = F for the two halves of the backward): here
    m·3F plus the bubble, (p - 1)·3F/v for GPipe and (interleaved) 1F1B, (p - 1)·(F + I)/v =
    (p - 1)·2F/v with split backwards. DualPipeV's row also shows the bound of DualPipe's
    table, m·3F + (p - 1)·(F + 2B - 3W) with a chunk's F = F/2, B = 2F/2, W = F/2."""
    f = f_ms / 1e3
    print(f"sleep-based compute, F = I = W = {f_ms:g} ms")
    print("| pp | m | schedule | step ms | replayed ms | step / replayed | vs 1f1b |")
    print("|---|---|---|---|---|---|---|")
    for pp, m in ((2, 4), (4, 8)):
        one_f_one_b = None
        for schedule, v in SLEEP_SCHEDULES:
            if only is not None and schedule not in (only, "1f1b"):
                continue
            step = max(run_world(_sleep_bench, pp, schedule, m, v, f, timeout=300))
            # the planner's replay of the same action lists: m·3F plus the bubble here
            replayed = schedule_step_time(schedule, m, pp, v, f, f, f)
            one_f_one_b = step if schedule == "1f1b" else one_f_one_b
            versus = "" if one_f_one_b is None else f"{step / one_f_one_b:.2f}"
            bound = ""
            if schedule in V_SHAPED_SCHEDULES:
                chunk_f, chunk_b, chunk_w = f / 2, f, f / 2
                limit = m * 3 * f + (pp - 1) * (chunk_f + 2 * chunk_b - 3 * chunk_w)
                bound = f" (bound {limit * 1e3:.0f} ms: step / bound {step / limit:.2f})"
            print(
                f"| {pp} | {m} | {schedule} | {step * 1e3:.0f} | {replayed * 1e3:.0f} | "
                f"{step / replayed:.2f} | {versus}{bound} |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sleep", action="store_true", help="time the executor with sleep-based stage compute"
    )
    parser.add_argument("--f-ms", type=float, default=60.0, help="--sleep: forward time F (ms)")
    parser.add_argument(
        "--draw", metavar="FOLDER", help="draw each schedule's timeline (pp=4, m=8) as a PNG"
    )
    parser.add_argument(
        "--schedule", help="--sleep, --draw: only this schedule (and 1F1B, to compare)"
    )
    args = parser.parse_args()
    if args.draw:
        draw_schedules(args.draw, args.f_ms, only=args.schedule)
        return
    if args.sleep:
        sleep_table(args.f_ms, only=args.schedule)
        return
    rows = [
        "| pp | m | schedule | step ms | bubble measured | bubble theory | peak act. MiB (stage 0) |"
    ]
    rows.append("|---|---|---|---|---|---|---|")
    for pp in (2, 4):
        for m in (4, 8, 16):
            for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
                res = run_world(_bench, pp, schedule, m, v, timeout=300)
                step = max(r["step"] for r in res)
                bubble = 1 - max(r["busy"] for r in res) / step
                theory = (pp - 1) / (v * m + pp - 1)
                rows.append(
                    f"| {pp} | {m} | {schedule} | {step * 1e3:.1f} | {bubble:.2f} | "
                    f"{theory:.2f} | {res[0]['peak'] / 2**20:.1f} |"
                )
                print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
