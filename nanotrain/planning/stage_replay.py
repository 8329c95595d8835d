"""A pipeline step replayed with each stage's own durations.

`schedule_time.schedule_step_time` replays the schedule with every stage as busy as one
(the pacing stage): enough for a bubble formula, not for a pipeline whose stages differ (the
last one runs the head and the loss, the first the embedding, DeepSeek-V3's first stages
hold dense layers). `replay_stages` runs the same action lists (the executor's, through
`schedule_time`'s task lists and pairing rule) with a duration per stage, and reports when
each rank ends and when it starts the backward of its last microbatch, where the
data-parallel gradient reduction begins (`nanotrain.parallel.data_parallel` launches the
buckets' collectives on the last microbatch only).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from nanotrain.planning.schedule_time import (
    _run_order,
    _segments,
    _side_by_side,
    _tasks,
    replay_tasks,
)

__all__ = ["StageDurations", "StageReplay", "replay_stages", "schedule_runs"]


@dataclass(frozen=True)
class StageDurations:
    """One stage's seconds per microbatch through all its chunks: `forward`, the backward's
    input half `input_grad` and weight half `weight_grad` (a whole backward takes both),
    its expert all-to-all `all_to_all` (half in the forward, half in the input half) over
    `rounds` MoE layers per chunk."""

    forward: float
    input_grad: float
    weight_grad: float
    all_to_all: float = 0.0
    rounds: int = 1


@dataclass(frozen=True)
class StageReplay:
    """Per rank: when it ends (`ends`) and when it starts the backward of the last
    microbatch (`last_backward`); the step's length is ``max(ends)``."""

    ends: tuple[float, ...]
    last_backward: tuple[float, ...]

    @property
    def step(self) -> float:
        """Seconds from the first forward to the last rank's last action."""
        return max(self.ends)


def replay_stages(
    schedule: str,
    num_microbatches: int,
    virtual_pp: int,
    stages: Sequence[StageDurations],
    overlap: bool = False,
) -> StageReplay:
    """Replay `schedule` over ``len(stages)`` ranks, rank r's actions taking `stages[r]`'s
    durations (each divided by `virtual_pp` per chunk); `overlap`: the executor's pairing of
    a forward with a backward of the other chunk, side by side on one compute engine.

    Raises:
        ValueError: a schedule the sizes cannot run (its own check).
    """
    pp, m, v = len(stages), num_microbatches, virtual_pp
    lists = _tasks(schedule, m, pp, v, overlap)
    marks = _last_backward_tasks(schedule, m, pp, v, overlap)
    costs = []
    for s in stages:
        durations = {"F": s.forward / v, "I": s.input_grad / v, "W": s.weight_grad / v}
        wire = s.all_to_all / 2 / v
        costs.append((durations, wire, max(s.rounds, 1), {}))

    def seconds(rank: int, kinds: tuple[str, ...]) -> float:
        durations, wire, rounds, cache = costs[rank]
        if kinds not in cache:
            parts = [_segments(k, durations, wire, rounds) for k in kinds]
            single = len(parts) == 1
            cache[kinds] = sum(x for _, x in parts[0]) if single else _side_by_side(*parts)
        return cache[kinds]

    free, last_backward = replay_tasks(schedule, m, lists, seconds, marks)
    starts = tuple(free[r] if t is None else t for r, t in enumerate(last_backward))
    return StageReplay(tuple(free), starts)


def schedule_runs(schedule: str, m: int, pp: int, v: int, overlap: bool = False) -> None:
    """Raise what `replay_stages` raises for these sizes, without replaying any durations.

    Raises:
        ValueError: the schedule refuses the sizes, or its tasks never run to their end.
    """
    lists = _tasks(schedule, m, pp, v, overlap)
    _run_order(schedule, m, lists)


@functools.lru_cache(maxsize=256)
def _last_backward_tasks(schedule: str, m: int, pp: int, v: int, overlap: bool) -> tuple[int, ...]:
    """Per rank, the index of its first task holding a backward of the last microbatch
    (-1 if none)."""
    out = []
    for tasks in _tasks(schedule, m, pp, v, overlap):
        found = -1
        for i, (_, _, gives) in enumerate(tasks):
            if any(g is not None and not g[0] and g[1] == m - 1 for g in gives):
                found = i
                break
        out.append(found)
    return tuple(out)


@dataclass(frozen=True)
class PricedStage:
    """One pipeline stage's seconds per step, as `plan_layout` prices them: matmul
    `compute`, `memory_t` in memory-bound operations, `sms_t` lost to communication kernels
    holding SMs, `blocking` communication (its expert all-to-all `ep_t` among it when paired
    chunks may hide it), `weights_t` the weight-gradient third of the compute without
    recomputation, `comm_t` per group, `rounds` MoE layers per chunk, and the rank's model
    `rank` (a `rank_model.RankModel`)."""

    rank: object
    compute: float
    memory_t: float
    sms_t: float
    blocking: float
    ep_t: float
    weights_t: float
    comm_t: dict[str, float]
    rounds: int

    @property
    def busy(self) -> float:
        """Its work per step: compute, memory-bound operations, SMs lost, blocking comm."""
        return self.compute + self.memory_t + self.sms_t + self.blocking


def replay_priced(schedule: str, pp: int, virtual_pp: int, num_microbatches: int,
                  stages: Sequence[PricedStage], overlap: bool) -> tuple[StageReplay, float]:  # fmt: skip
    """The step of `stages` (one per pipeline rank) under `schedule`, and the seconds of
    expert all-to-all the pairing hides (0 without `overlap`): per microbatch a forward and
    a weight half take the weight-gradient third each, the input half the rest of the
    stage's busy time (less its all-to-all, replayed apart when paired)."""
    m = num_microbatches
    if pp == 1:
        st = stages[0]
        backward = st.busy / m - st.weights_t / m  # the last microbatch's backward
        return StageReplay((st.busy,), (st.busy - backward,)), 0.0

    def durations(st: PricedStage, wire: bool) -> StageDurations:
        f = st.weights_t / m
        rest = st.busy - (st.ep_t if overlap else 0.0)
        a2a = st.ep_t / m if overlap and wire else 0.0
        return StageDurations(f, max(rest / m - 2 * f, 0.0), f, a2a, st.rounds)

    run = replay_stages(schedule, m, virtual_pp, [durations(s, True) for s in stages], overlap)
    if not overlap:
        return run, 0.0
    bare = replay_stages(schedule, m, virtual_pp, [durations(s, False) for s in stages], True)
    exposed = max(run.step - bare.step, 0.0)
    pace = max(stages, key=lambda s: s.busy)
    return run, max(pace.ep_t - exposed, 0.0)
