"""A pipeline step's time from the schedules' own action lists.

`schedule_step_time` replays the lists `nanotrain.parallel.schedules` gives every rank (the
lists the executor runs) with a time per action: each rank runs its actions in order, an
action starts once its rank is free and its input exists (a forward needs the previous
virtual stage's forward of the same microbatch, a backward or input half the next virtual
stage's backward or input half; a weight half needs nothing from other ranks), and the step
ends when the last rank finishes. The bubble the planner prices is this time minus the work
of one rank, so a schedule's bubble follows from its actions, not from a formula kept beside
them. Pipeline transfers are not part of it (the planner prices them as blocking
communication).

Expert all-to-alls (``all_to_all`` > 0) are part of an action: a forward computes and
dispatches, computes and combines, per MoE layer; its input half does the same backwards;
its weight half only computes. Run one after the other they add to the action's time. Under
``overlap`` the executor's rule applies (`nanotrain.parallel.schedule_runner`): a forward
followed by a backward of another chunk waits for both inputs, then the two run side by side
on one compute engine, each one's all-to-alls waiting while the other computes, and both
results leave when both are done. `exposed_all_to_all` is what the all-to-alls add to a
step.
"""

from __future__ import annotations

import functools
from typing import Any

from nanotrain.parallel.placement import StagePlacement
from nanotrain.parallel.schedule_runner import pairs_with
from nanotrain.parallel.schedules import SCHEDULES
from nanotrain.planning.layout import pipeline_actions

__all__ = ["exposed_all_to_all", "schedule_step_time"]


def schedule_step_time(
    schedule: str,
    num_microbatches: int,
    pp: int,
    virtual_pp: int,
    forward: float,
    input_grad: float,
    weight_grad: float,
    all_to_all: float = 0.0,
    overlap: bool = False,
    rounds: int = 1,
) -> float:
    """Time of one step of `schedule` when every virtual stage takes `forward` per microbatch
    forward and `input_grad` + `weight_grad` backward (the halves of a split backward; a
    whole backward B takes their sum), each divided by `virtual_pp` per chunk.

    Args:
        all_to_all: a rank's expert all-to-all time per microbatch, half in the forward and
            half in the input half of the backward (divided by `virtual_pp` per chunk).
        overlap: pair forwards with the next backward of another chunk, as the executor's
            ``overlap`` does.
        rounds: compute / all-to-all rounds per chunk (its MoE layers): the finer, the more
            of one chunk's all-to-alls the other's compute can cover.

    Raises:
        ValueError: an unknown schedule, or sizes the schedule cannot run (its own check).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {sorted(SCHEDULES)}")
    if forward <= 0:
        return 0.0
    # the step time is linear in the durations: replay once per ratio, scaled by F
    ratios = tuple(round(x / forward, 12) for x in (input_grad, weight_grad, all_to_all))
    return forward * _unit_step_time(
        schedule, num_microbatches, pp, virtual_pp, *ratios, overlap, max(rounds, 1)
    )


def exposed_all_to_all(
    schedule: str,
    num_microbatches: int,
    pp: int,
    virtual_pp: int,
    forward: float,
    input_grad: float,
    weight_grad: float,
    all_to_all: float,
    overlap: bool = False,
    rounds: int = 1,
) -> float:
    """Seconds the all-to-alls add to a step of `schedule` (arguments as
    `schedule_step_time`): the step with them minus the step without them. Without overlap
    about ``num_microbatches · all_to_all`` (their blocking time) or more, where they also
    delay other ranks."""
    args = (schedule, num_microbatches, pp, virtual_pp, forward, input_grad, weight_grad)
    with_them = schedule_step_time(*args, all_to_all, overlap, rounds)
    return with_them - schedule_step_time(*args, 0.0, overlap, rounds)


Need = tuple[bool, int, int]
#: (compute?, seconds) pieces of an action, in the order it runs them
Segments = tuple[tuple[bool, float], ...]


def _segments(kind: str, durations: dict[str, float], wire: float, rounds: int) -> Segments:
    """An action's compute and all-to-all pieces: per round a forward computes, dispatches,
    computes, combines; an input half runs that backwards; a weight half only computes (a
    whole backward: its weight part first, as autograd reaches the last-made nodes first)."""
    a = wire / (2 * rounds)
    if kind == "F":
        c = durations["F"] / (2 * rounds)
        return ((True, c), (False, a), (True, c), (False, a)) * rounds
    if kind == "W":
        return ((True, durations["W"]),)
    c = durations["I"] / (2 * rounds)
    backward = ((False, a), (True, c), (False, a), (True, c)) * rounds
    return (((True, durations["W"]),) if kind == "B" else ()) + backward


def _side_by_side(first: Segments, second: Segments) -> float:
    """Time two threads take to run their pieces on one compute engine: a compute piece
    waits for the engine, an all-to-all piece only for its own thread; the piece that can
    start first goes first (the first thread's on a tie: the executor's own thread runs the
    forward at once, the worker's backward starts a moment later)."""
    clock, at, engine = [0.0, 0.0], [0, 0], 0.0
    pieces = (first, second)
    while at[0] < len(first) or at[1] < len(second):
        best = None
        for k in (0, 1):
            if at[k] < len(pieces[k]):
                compute, seconds = pieces[k][at[k]]
                start = max(clock[k], engine) if compute else clock[k]
                if best is None or start < best[0]:
                    best = (start, k, compute, seconds)
        start, k, compute, seconds = best
        clock[k] = start + seconds
        at[k] += 1
        if compute:
            engine = clock[k]
    return max(clock)


@functools.lru_cache(maxsize=4096)
def _unit_step_time(
    schedule: str,
    m: int,
    pp: int,
    v: int,
    input_grad: float,
    weight_grad: float,
    all_to_all: float,
    overlap: bool,
    rounds: int,
) -> float:
    """`schedule_step_time` with a forward of 1."""
    durations = {"F": 1.0 / v, "I": input_grad / v, "W": weight_grad / v}
    wire = all_to_all / 2 / v  # per chunk, in the forward and again in the input half
    lists = _tasks(schedule, m, pp, v, overlap)
    cost: dict[tuple[str, ...], float] = {}

    def seconds(kinds: tuple[str, ...]) -> float:
        if kinds not in cost:
            parts = [_segments(k, durations, wire, rounds) for k in kinds]
            if len(parts) == 1:
                cost[kinds] = sum(s for _, s in parts[0])
            else:
                cost[kinds] = _side_by_side(*parts)
        return cost[kinds]

    free, _ = replay_tasks(schedule, m, lists, lambda rank, kinds: seconds(kinds))
    return max(free)


def replay_tasks(
    schedule: str,
    m: int,
    lists: tuple[tuple[Task, ...], ...],
    seconds: Any,
    marks: tuple[int, ...] | None = None,
) -> tuple[list[float], list[float | None]]:
    """Run every rank's tasks (`_tasks`) in order, each starting when its rank is free and
    everything it needs has ended; ``seconds(rank, kinds)`` is a task's duration.

    Returns:
        (each rank's end, and the start of its task number ``marks[rank]``, None where it
        has none or no `marks` are given).

    Raises:
        ValueError: the tasks wait on each other and never run to their end.
    """
    order, slots, kinds_of = _run_order(schedule, m, lists)
    done = [0.0] * slots  # per slot (forward?, microbatch, stage): its end
    free = [0.0] * len(lists)
    marked: list[float | None] = [None] * len(lists)
    durations: list[list[float | None]] = [[None] * len(kinds_of) for _ in lists]
    for rank, at, kind, needs, gives in order:
        start = free[rank]
        for need in needs:
            start = max(start, done[need])
        if marks is not None and at == marks[rank]:
            marked[rank] = start
        took = durations[rank][kind]
        if took is None:
            took = durations[rank][kind] = seconds(rank, kinds_of[kind])
        clock = free[rank] = start + took
        for g in gives:
            done[g] = clock
    return free, marked


#: `_run_order` per task lists object (the lists `_tasks` caches), with the lists kept
_ORDERS: dict[int, tuple[Any, tuple]] = {}
#: one task in run order: (rank, its index there, its kinds' index, slots it needs, gives)
_Step = tuple[int, int, int, tuple[int, ...], tuple[int, ...]]


def _run_order(
    schedule: str, m: int, lists: tuple[tuple[Task, ...], ...]
) -> tuple[tuple[_Step, ...], int, tuple[tuple[str, ...], ...]]:
    """An order `replay_tasks` can run the tasks in: each after its rank's previous task and
    after every task giving what it needs (each thing given once, so any such order gives
    every start and end the same operations on the same numbers). Returns (the tasks, each
    as (rank, its index there, its kinds' index, slots of what it needs, slots of what it
    gives); how many slots; the kinds by index). Which task waits does not depend on the
    durations, so one order per task lists serves every replay of them.

    Raises:
        ValueError: the tasks wait on each other and never run to their end.
    """
    hit = _ORDERS.get(id(lists))
    if hit is not None and hit[0] is lists:
        return hit[1]
    pp = len(lists)
    slot: dict[Need, int] = {}
    kinds_index: dict[tuple[str, ...], int] = {}
    position = [0] * pp
    waiting: dict[Need, list[int]] = {}  # what a blocked rank waits for
    ready = list(range(pp - 1, -1, -1))  # ranks to run on (a stack: rank 0 first)
    order: list[_Step] = []
    while ready:
        rank = ready.pop()
        tasks, at = lists[rank], position[rank]
        while at < len(tasks):
            kinds, needs, gives = tasks[at]
            missing = next((n for n in needs if n is not None and n not in slot), None)
            if missing is not None:
                waiting.setdefault(missing, []).append(rank)
                break
            given = []
            for g in gives:
                if g is not None:
                    if g in slot:  # given twice: the order would matter, walk in rounds
                        return _cache_order(lists, _rounds_order(schedule, m, lists))
                    given.append(slot.setdefault(g, len(slot)))
                    ready.extend(waiting.pop(g, ()))
            kind = kinds_index.setdefault(kinds, len(kinds_index))
            order.append((rank, at, kind, tuple(slot[n] for n in needs if n is not None),
                          tuple(given)))  # fmt: skip
            at += 1
        position[rank] = at
    if any(position[r] < len(tasks) for r, tasks in enumerate(lists)):
        raise ValueError(f"schedule {schedule!r} does not run to its end (pp={pp}, m={m})")
    return _cache_order(lists, (tuple(order), len(slot), tuple(kinds_index)))


def _cache_order(lists: tuple, found: tuple) -> tuple:
    if len(_ORDERS) > 256:
        _ORDERS.clear()
    _ORDERS[id(lists)] = (lists, found)
    return found


def _rounds_order(
    schedule: str, m: int, lists: tuple[tuple[Task, ...], ...]
) -> tuple[tuple[_Step, ...], int, tuple[tuple[str, ...], ...]]:
    """`_run_order` in the order of rounds over the ranks in turn, each running its tasks
    until one waits on something not given yet (what the replay did before it kept an
    order; needed only where something is given twice, which no schedule does)."""
    slot: dict[Need, int] = {}
    kinds_index: dict[tuple[str, ...], int] = {}
    pp = len(lists)
    position = [0] * pp
    order: list[_Step] = []
    remaining = sum(len(tasks) for tasks in lists)
    while remaining:
        progressed = False
        for rank, tasks in enumerate(lists):
            at = position[rank]
            while at < len(tasks):
                kinds, needs, gives = tasks[at]
                if any(need is not None and need not in slot for need in needs):
                    break
                given = tuple(slot.setdefault(g, len(slot)) for g in gives if g is not None)
                kind = kinds_index.setdefault(kinds, len(kinds_index))
                order.append((rank, at, kind, tuple(slot[n] for n in needs if n is not None),
                              given))  # fmt: skip
                at += 1
            remaining -= at - position[rank]
            progressed = progressed or at > position[rank]
            position[rank] = at
        if not progressed:
            raise ValueError(f"schedule {schedule!r} does not run to its end (pp={pp}, m={m})")
    return tuple(order), len(slot), tuple(kinds_index)


#: per task: (action kinds, what each waits for from another stage, what each gives)
Task = tuple[tuple[str, ...], tuple[Need | None, ...], tuple[Need | None, ...]]


@functools.lru_cache(maxsize=256)
def _tasks(schedule: str, m: int, pp: int, v: int, overlap: bool) -> tuple[tuple[Task, ...], ...]:
    """Per rank, its actions as tasks: one action, or under `overlap` a forward and the
    backward paired with it. A forward needs the previous virtual stage's forward of its
    microbatch, a backward or input half the next stage's; a weight half only follows its
    own input half, which the rank's order puts first."""
    placement = StagePlacement.for_schedule(schedule, pp, v)
    last_stage = placement.num_virtual - 1
    out = []
    for rank in range(pp):
        actions = pipeline_actions(schedule, m, pp, rank, v)  # SCHEDULES[schedule]'s, cached
        stage_of = [placement.stage(rank, c) for c in range(v)]
        rows, i, n = [], 0, len(actions)
        while i < n:
            group = (actions[i],)
            if overlap and i + 1 < n and pairs_with(actions[i], actions[i + 1]):
                group = (actions[i], actions[i + 1])
            kinds, needs, gives = [], [], []
            for a in group:
                stage, kind, mb = stage_of[a.chunk], a.kind, a.microbatch
                kinds.append(kind)
                if kind == "F":
                    needs.append(None if stage == 0 else (True, mb, stage - 1))
                    gives.append((True, mb, stage))
                elif a.sends_input_grad:
                    needs.append(None if stage == last_stage else (False, mb, stage + 1))
                    gives.append((False, mb, stage))
                else:
                    needs.append(None)
                    gives.append(None)
            rows.append((tuple(kinds), tuple(needs), tuple(gives)))
            i += len(group)
        out.append(tuple(rows))
    return tuple(out)
