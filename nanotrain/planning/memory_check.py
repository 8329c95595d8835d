"""The memory side of a plan: each pipeline rank's model state, activations and working
memory (`memory_check`, the largest rank's bytes without pricing any time), the lower bound a
search drops modes with (`memory_floor`), and the notes a plan gives for a layout that does
not run where it is priced or does not fit. `plan_layout` prices time on top of these terms.
"""

from __future__ import annotations

import functools
from typing import Any

from nanotrain.models.accounting import active_params, total_params
from nanotrain.planning.activations import activation_estimate
from nanotrain.planning.context_parallel import add_cp_activations, cp_activation_bytes, fold_cp
from nanotrain.planning.gpus import GPUSpec, peak_column
from nanotrain.planning.layout import PlanLayout, Workload
from nanotrain.planning.memory import StateMemory, state_memory
from nanotrain.planning.rank_model import config_key, rank_models
from nanotrain.planning.runs_on import not_run_yet, refused_on
from nanotrain.planning.stage_replay import schedule_runs
from nanotrain.planning.working_memory import with_fragmentation, working_memory

__all__ = ["GiB", "memory_check", "memory_floor"]

GiB = 2**30

_COUNTS: dict[str, tuple[int, int, int]] = {}


def param_counts(config: Any) -> tuple[int, int, int]:
    """(total, total with MTP, activated per token), cached per config."""
    key = config_key(config)
    if key not in _COUNTS:
        _COUNTS[key] = (
            total_params(config),
            total_params(config, include_mtp=True),
            active_params(config),
        )
    return _COUNTS[key]


def memory_terms(
    config: Any,
    given: PlanLayout,
    layout: PlanLayout,
    local: Workload,
    workload: Workload,
    rank: Any,
    last: bool,
    device: str,
) -> tuple[Any, Any, Any]:
    """(state, activations, working memory) of one pipeline rank: `given` is the layout as
    asked, `layout` / `local` its cp-folded form (`fold_cp`). The last few are kept: a
    search checks a layout's memory (`memory_check`) and then prices the same layout."""
    key = (config_key(config), given, workload, rank.pp_rank, last, device)
    hit = _TERMS.get(key)
    if hit is not None and hit[0] is rank:
        return hit[1]
    state = _state(rank, layout, local)
    acts = add_cp_activations(
        activation_estimate(config, layout, local, rank.pp_rank, device=device),
        cp_activation_bytes(config, given, workload, rank.chunks, last),
    )
    working = working_memory(config, layout, local, rank.pp_rank, device=device)
    working = with_fragmentation(working, state.total + acts.peak + working.total)
    if len(_TERMS) > 256:
        _TERMS.clear()
    _TERMS[key] = (rank, (state, acts, working))
    return state, acts, working


#: `memory_terms` of the last layouts, per (config, layout, workload, pp rank, last, device)
_TERMS: dict[tuple, tuple[Any, tuple[Any, Any, Any]]] = {}


def memory_check(
    config: Any, layout: PlanLayout, workload: Workload, gpu: GPUSpec, *, reserve_bytes: int = GiB
) -> tuple[int, str | None]:
    """The largest rank's bytes `plan_layout` would give (`Plan.largest.memory`) and, when
    they do not fit and `layout` does not offload, the plan's notes joined (a search's
    rejection reason; None otherwise), without pricing any time: a search checks with it
    which recomputation mode fits first.

    Raises:
        ValueError: as `plan_layout` may (call it for the exact message).
    """
    check_fp8_expert_gemms(layout, workload.precision)
    given, (layout, local) = layout, fold_cp(config, layout, workload)
    m = local.num_microbatches(layout)  # the same batch check as plan_layout
    if layout.pp > 1:  # and the same schedule check as its replay
        checked_schedule(layout.schedule, m, layout.pp, layout.virtual_pp,
                       layout.overlap_forward_backward)  # fmt: skip
    device = "cpu" if gpu.name == "cpu" else "cuda"
    peak, worst = 0, 0
    for rank in rank_models(config, layout):
        last = layout.pp == 1 or layout.placement.holds_last(rank.pp_rank)
        state, acts, working = memory_terms(
            config, given, layout, local, workload, rank, last, device
        )
        memory = state.total + acts.peak + working.total + reserve_bytes
        if memory > peak:  # the first largest, as max() in plan_layout
            peak, worst = memory, rank.pp_rank
    if peak <= gpu.memory_bytes or layout.cpu_offload:  # offload's note prices its host step
        return peak, None
    notes = refusal_notes(layout, gpu, workload.precision)
    return peak, "; ".join([*notes, over_memory_note(worst, peak, gpu)])


def memory_floor(
    config: Any, layout: PlanLayout, workload: Workload, *, reserve_bytes: int = GiB
) -> int:
    """The largest rank's model state plus the reserve: a lower bound of `memory_check`'s
    peak (activations and working memory add bytes, never take any) that costs no
    activation or working-memory term and does not depend on the recomputation mode. A
    search drops with it the modes that cannot fit.

    Raises:
        ValueError: where `memory_check` raises before its per-rank terms.
    """
    _, (layout, local) = layout, fold_cp(config, layout, workload)
    m = local.num_microbatches(layout)
    if layout.pp > 1:
        checked_schedule(layout.schedule, m, layout.pp, layout.virtual_pp,
                       layout.overlap_forward_backward)  # fmt: skip
    states = [_state(rank, layout, local).total for rank in rank_models(config, layout)]
    return max(states) + reserve_bytes


def _state(rank: Any, layout: PlanLayout, local: Workload) -> StateMemory:
    """`state_memory`, kept for the last layouts (`memory_floor` and `memory_check` ask for
    the same ones)."""
    key = (id(rank), layout, local)
    hit = _STATES.get(key)
    if hit is not None and hit[0] is rank:
        return hit[1]
    state = state_memory(rank, layout, local)
    if len(_STATES) > 1024:
        _STATES.clear()
    _STATES[key] = (rank, state)
    return state


_STATES: dict[tuple, tuple[Any, StateMemory]] = {}


@functools.lru_cache(maxsize=1024)
def checked_schedule(schedule: str, m: int, pp: int, v: int, overlap: bool) -> None:
    """Raise `replay_stages`'s ValueError when the schedule cannot run these sizes (whether
    it runs does not depend on the durations: the order its tasks run in says)."""
    schedule_runs(schedule, m, pp, v, overlap)


def refusal_notes(layout: PlanLayout, gpu: GPUSpec, precision: str) -> list[str]:
    notes = []
    refusal = refused_on(layout, gpu)
    if refusal:
        notes.append(
            f"does not run on a {gpu.name} yet, priced as it would run: the strategy refuses "
            f"it there ({refusal})"
        )
    unrun = not_run_yet(layout, precision)
    if unrun:
        notes.append(f"does not run in nanotrain yet, priced as it would run: {unrun}")
    return notes


def check_fp8_expert_gemms(layout: PlanLayout, precision: str) -> None:
    """Refuse ``fp8_expert_gemms`` under a precision without fp8 GEMMs (nothing to price
    them at)."""
    if layout.fp8_expert_gemms and peak_column(precision) != "fp8":
        raise ValueError(
            f"fp8_expert_gemms=True prices the routed experts' GEMMs at the fp8 peak, but "
            f"precision {precision!r} runs its matmuls at {peak_column(precision)}; use an fp8 "
            "precision ('transformer-engine' or 'torchao-float8') or fp8_expert_gemms=False"
        )


def over_memory_note(pp_rank: int, memory: int, gpu: GPUSpec) -> str:
    return (
        f"pipeline stage {pp_rank} needs {memory / GiB:.2f} GiB per GPU, more "
        f"than the {gpu.memory_bytes / GiB:.2f} GiB of a {gpu.name}"
    )
