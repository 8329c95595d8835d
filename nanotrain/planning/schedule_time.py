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

from nanotrain.parallel.schedules import SCHEDULES, Action

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
    lists = [SCHEDULES[schedule](m, pp, rank, v) for rank in range(pp)]
    last_stage = pp * v - 1
    done: dict[tuple[str, int, int], float] = {}  # (F or G, microbatch, virtual stage) -> end
    free = [0.0] * pp
    position = [0] * pp
    remaining = sum(len(actions) for actions in lists)
    while remaining:
        progressed = False
        for rank, actions in enumerate(lists):
            while position[rank] < len(actions):
                action = actions[position[rank]]
                ready = _ready_at(action, rank, pp, last_stage, done)
                if ready is None:
                    break
                end = max(free[rank], ready) + duration[action.kind]
                free[rank] = end
                stage = action.chunk * pp + rank
                if action.kind == "F":
                    done[("F", action.microbatch, stage)] = end
                elif action.sends_input_grad:
                    done[("G", action.microbatch, stage)] = end
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError(f"schedule {schedule!r} does not run to its end (pp={pp}, m={m})")
    return max(free)


def _ready_at(
    action: Action, rank: int, pp: int, last_stage: int, done: dict[tuple[str, int, int], float]
) -> float | None:
    """When `action`'s input from another stage exists (0 if it needs none); None: not yet."""
    stage = action.chunk * pp + rank
    if action.kind == "F":
        key = ("F", action.microbatch, stage - 1)
        return 0.0 if stage == 0 else done.get(key)
    if action.sends_input_grad:
        key = ("G", action.microbatch, stage + 1)
        return 0.0 if stage == last_stage else done.get(key)
    return 0.0  # W: after its own I, which the rank's order already put before it
