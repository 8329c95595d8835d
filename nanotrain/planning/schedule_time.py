"""A pipeline step's time from the schedules' own action lists.

`schedule_step_time` replays the lists `nanotrain.parallel.schedules` gives every rank (the
lists the executor runs) with a time per action: each rank runs its actions in order, an
action starts once its rank is free and its input exists (a forward needs the previous
virtual stage's forward of the same microbatch, a backward or input half the next virtual
stage's backward or input half; a weight half needs nothing from other ranks), and the step
ends when the last rank finishes. The bubble the planner prices is this time minus the work
of one rank, so a schedule's bubble follows from its actions, not from a formula kept beside
them. Transfers are not part of it (the planner prices them as blocking communication).
"""

from __future__ import annotations

import functools

from nanotrain.parallel.placement import StagePlacement
from nanotrain.parallel.schedules import SCHEDULES

__all__ = ["schedule_step_time"]


def schedule_step_time(
    schedule: str,
    num_microbatches: int,
    pp: int,
    virtual_pp: int,
    forward: float,
    input_grad: float,
    weight_grad: float,
) -> float:
    """Time of one step of `schedule` when every virtual stage takes `forward` per microbatch
    forward and `input_grad` + `weight_grad` backward (the halves of a split backward; a
    whole backward B takes their sum), each divided by `virtual_pp` per chunk.

    Raises:
        ValueError: an unknown schedule, or sizes the schedule cannot run (its own check).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {sorted(SCHEDULES)}")
    if forward <= 0:
        return 0.0
    # the step time is linear in the three durations: replay once per ratio, scaled by F
    ratios = (round(input_grad / forward, 12), round(weight_grad / forward, 12))
    return forward * _unit_step_time(schedule, num_microbatches, pp, virtual_pp, *ratios)


@functools.lru_cache(maxsize=4096)
def _unit_step_time(
    schedule: str, m: int, pp: int, v: int, input_grad: float, weight_grad: float
) -> float:
    """`schedule_step_time` with a forward of 1."""
    duration = {
        "F": 1.0 / v,
        "B": (input_grad + weight_grad) / v,
        "I": input_grad / v,
        "W": weight_grad / v,
    }
    lists = _needs(schedule, m, pp, v)
    done: dict[tuple[bool, int, int], float] = {}  # (forward?, microbatch, stage) -> its end
    free = [0.0] * pp
    position = [0] * pp
    remaining = sum(len(actions) for actions in lists)
    while remaining:
        progressed = False
        for rank, actions in enumerate(lists):
            at, clock = position[rank], free[rank]
            while at < len(actions):
                kind, needs, gives = actions[at]
                ready = 0.0 if needs is None else done.get(needs)
                if ready is None:
                    break
                clock = max(clock, ready) + duration[kind]
                if gives is not None:
                    done[gives] = clock
                at += 1
            remaining -= at - position[rank]
            progressed = progressed or at > position[rank]
            position[rank], free[rank] = at, clock
        if not progressed:
            raise ValueError(f"schedule {schedule!r} does not run to its end (pp={pp}, m={m})")
    return max(free)


Need = tuple[bool, int, int]


@functools.lru_cache(maxsize=256)
def _needs(
    schedule: str, m: int, pp: int, v: int
) -> tuple[tuple[tuple[str, Need | None, Need | None], ...], ...]:
    """Per rank, its actions as (kind, the result it waits for from another stage or None,
    the result it gives or None): a forward needs the previous virtual stage's forward of
    its microbatch, a backward or input half the next stage's; a weight half only follows
    its own input half, which the rank's order puts first."""
    placement = StagePlacement.for_schedule(schedule, pp, v)
    last_stage = placement.num_virtual - 1
    out = []
    for rank in range(pp):
        rows = []
        for a in SCHEDULES[schedule](m, pp, rank, v):
            stage = placement.stage(rank, a.chunk)
            if a.kind == "F":
                needs = None if stage == 0 else (True, a.microbatch, stage - 1)
                rows.append((a.kind, needs, (True, a.microbatch, stage)))
            elif a.sends_input_grad:
                needs = None if stage == last_stage else (False, a.microbatch, stage + 1)
                rows.append((a.kind, needs, (False, a.microbatch, stage)))
            else:
                rows.append((a.kind, None, None))
        out.append(tuple(rows))
    return tuple(out)
