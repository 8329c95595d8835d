"""Search: every layout of a model on N GPUs, priced, the ones that fit ranked by throughput.

Candidates: tp among the divisors of the world that divide the heads and stay within a node;
pp among the divisors of what is left (layers that do not split evenly get
`layout.balanced_pipeline_layout`), virtual_pp 1 or 2 (with 2: interleaved 1F1B and
DualPipeV); cp among the divisors of what is left that keep at least 4,096 tokens of each
sequence per rank (`context_parallel.search_cp_sizes`; only 1 for short sequences and for
models cp does not run: capacity factor); ep
among the divisors of dp x cp that divide the routed experts; ZeRO 1 and 3 (and 0 / 2 when asked; ZeRO-3 only where dp > 1, since it shards
over dp); micro batch sizes 1, 2, 4; recomputation none, then light, then selective, then
full (`SEARCH_RECOMPUTE`: each costs more compute than the one before), stopping at the first
that fits; under ZeRO-3 with pp = 1 each mode also with ``reduce_scatter_every_microbatch``
(no whole gradients accumulated, at one reduce-scatter per microbatch), and when nothing
fits, the same again with ``cpu_offload`` (it frees the GPU of the shards and optimizer
state, at the price of PCIe copies and a host optimizer step); sequence parallelism on whenever tp > 1 (it only
saves memory, at the same traffic). Each is checked by the strategy's own rules; a layout the
strategy refuses, or that does not fit in memory, is listed with the reason.

Memory is checked before time (`plan.memory_check`): only the first mode that fits is priced
in full, and a mode whose largest rank's model state and reserve alone exceed the GPU
(`plan.memory_floor`, which activations and working memory only raise) is not checked at
all; the last mode is always checked, for the rejection's figures. The result is the one of
pricing every mode in full (tests/unit/test_plan_search.py).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from nanotrain.parallel.layout_checks import divisors
from nanotrain.planning.context_parallel import search_cp_sizes
from nanotrain.planning.gpus import GPUSpec
from nanotrain.planning.layout import PlanLayout, Workload, balanced_pipeline_layout
from nanotrain.planning.plan import GiB, Plan, memory_check, memory_floor, plan_layout

__all__ = ["Rejected", "SearchResult", "search_layouts"]


@dataclass(frozen=True)
class Rejected:
    """A layout that cannot run, and why."""

    layout: PlanLayout
    micro_batch_size: int
    reason: str


@dataclass(frozen=True)
class SearchResult:
    """Layouts that fit (best estimated throughput first) and the rejected ones."""

    fitting: list[Plan]
    rejected: list[Rejected]


#: recompute modes a search tries, in order of the compute they add
SEARCH_RECOMPUTE: tuple[str | None, ...] = (None, "light", "selective", "full")


def _candidates(
    config: Any,
    world: int,
    gpu: GPUSpec,
    zero_stages: Sequence[int],
    seq_len: int = 1,
) -> Iterator[PlanLayout]:
    heads = config.num_heads
    experts = getattr(config, "n_routed_experts", 0) or 0
    for tp in divisors(world):
        if tp > gpu.gpus_per_node or heads % tp:
            continue
        for pp in divisors(world // tp):
            if pp > config.num_layers:
                continue
            for cp in search_cp_sizes(config, world // (tp * pp), seq_len):
                yield from _for_cp(config, world, tp, pp, cp, experts, zero_stages)


def _for_cp(
    config: Any, world: int, tp: int, pp: int, cp: int, experts: int, zero_stages: Sequence[int]
) -> Iterator[PlanLayout]:
    """The candidates of one (tp, pp, cp): dp the rest of the world, ep from dp x cp."""
    dp = world // (tp * pp * cp)
    for vpp in (1, 2) if pp > 1 else (1,):
        try:
            layout = balanced_pipeline_layout(config.num_layers, pp * vpp)
        except ValueError:
            continue
        for ep in divisors(dp * cp) if experts else [1]:
            if experts and experts % ep:
                continue
            for zero in zero_stages:
                if zero == 3 and dp * cp == 1:
                    continue  # nothing to shard over
                for schedule in _schedules(vpp):
                    yield PlanLayout(
                        tp=tp,
                        pp=pp,
                        dp=dp,
                        cp=cp,
                        ep=ep,
                        virtual_pp=vpp,
                        zero_stage=zero,
                        sequence_parallel=tp > 1,
                        pipeline_layout=layout,
                        schedule=schedule,
                    )


def _schedules(vpp: int) -> list[str | None]:
    """Schedules tried for `vpp` chunks per rank: the strategy's default; with two chunks also
    DualPipeV (its paired chunks side by side run on CPU only, so a GPU plan leaves them
    apart)."""
    return [None, "dualpipev"] if vpp == 2 else [None]


def search_layouts(
    config: Any,
    world_size: int,
    gpu: GPUSpec,
    *,
    seq_len: int,
    global_batch_size: int | None = None,
    global_batch_tokens: int | None = None,
    precision: str = "bf16-mixed",
    micro_batch_sizes: Sequence[int] = (1, 2, 4),
    zero_stages: Sequence[int] = (1, 3),
    recompute: Sequence[str | None] = SEARCH_RECOMPUTE,
    cpu_offload: bool | None = None,
    reshard_after_forward: bool = True,
    fp8_expert_activations: bool = False,
    fp8_dispatch: bool = False,
    model_name: str | None = None,
    workers: int = 1,
    **plan_kwargs: Any,
) -> SearchResult:
    """Price every candidate layout (module docstring); return those that fit, fastest first.
    With `fp8_expert_activations` every candidate keeps the routed experts' saves in fp8, with
    `fp8_dispatch` every one sends the routed copies in fp8. `cpu_offload`: None tries
    ZeRO-3 layouts with it only where they fit nowhere without it, True / False always /
    never; `reshard_after_forward`: ZeRO-3's option, for every candidate.

    The batch is `global_batch_size` sequences, or `global_batch_tokens` tokens rounded per
    layout to the nearest whole number of microbatches on every data-parallel replica.
    `workers` > 1 prices the candidates in that many forked processes (one intra-op thread
    each), merged back in candidate order: the same result as one process.

    Raises:
        ValueError: world_size < 1, or neither batch size given.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if (global_batch_size is None) == (global_batch_tokens is None):
        raise ValueError("give exactly one of global_batch_size and global_batch_tokens")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    args = (config, world_size, gpu, seq_len, global_batch_size, global_batch_tokens, precision,
            micro_batch_sizes, zero_stages, recompute, cpu_offload, reshard_after_forward,
            fp8_expert_activations, fp8_dispatch, model_name, plan_kwargs)  # fmt: skip
    if workers == 1:
        fitting, rejected = _price(args, 0, 1)
    else:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(workers, _one_thread) as pool:
            parts = pool.starmap(_price, [(args, i, workers) for i in range(workers)])
        fitting = sorted((x for f, _ in parts for x in f), key=lambda t: t[0])
        rejected = sorted((x for _, r in parts for x in r), key=lambda t: t[0])
    plans = [p for _, p in fitting]
    plans.sort(key=lambda p: -p.tokens_per_s)
    return SearchResult(plans, [r for _, r in rejected])


def _one_thread() -> None:
    """A forked worker's first act: one intra-op thread (forked thread pools can deadlock,
    and two cores are shared by the workers)."""
    import torch

    torch.set_num_threads(1)


def _price(args: tuple, index: int, workers: int) -> tuple[list, list]:
    """(fitting, rejected) of the candidates ``index, index + workers, ...``, each entry
    (candidate number, Plan or Rejected), so that the workers' lists merge back in order.

    Python's cyclic garbage collector is paused meanwhile: the search makes millions of
    small tuples beside a large heap of meta-device models and caches, and the collector's
    passes over that heap took a sixth of it (the search makes no cycle that must go)."""
    paused = gc.isenabled()
    gc.disable()
    try:
        return _price_all(args, index, workers)
    finally:
        if paused:
            gc.enable()


def _price_all(args: tuple, index: int, workers: int) -> tuple[list, list]:
    """`_price` with the collector as it is."""
    (config, world_size, gpu, seq_len, global_batch_size, global_batch_tokens, precision,
     micro_batch_sizes, zero_stages, recompute, cpu_offload, reshard_after_forward,
     fp8_expert_activations, fp8_dispatch, model_name, plan_kwargs) = args  # fmt: skip
    fitting: list[tuple[int, Plan]] = []
    rejected: list[tuple[int, Rejected]] = []
    n = -1
    for base in _candidates(config, world_size, gpu, zero_stages, seq_len):
        for micro in micro_batch_sizes:
            n += 1
            if n % workers != index:
                continue
            one = _Candidate(
                config, base, micro, _memory_savers(base, recompute, cpu_offload), seq_len,
                global_batch_size, global_batch_tokens, precision, gpu, model_name,
                plan_kwargs, fp8_expert_activations, fp8_dispatch, reshard_after_forward,
            )  # fmt: skip
            # the modes whose model state alone overflows the GPU are over memory whatever
            # their activations: not checked one by one (if a check then raises, the
            # candidate is tried again mode by mode, to give the same error at the same mode)
            over, tries = _state_overflows(one)
            plan, last, exact = _first_fit(one, tries, assume_over=over)
            if not exact:
                plan, last, _ = _first_fit(one, tries, assume_over=frozenset())
            if plan is not None:
                fitting.append((n, plan))
            if last is not None:
                rejected.append((n, last))
    return fitting, rejected


@dataclass(frozen=True)
class _Candidate:
    """One candidate layout and micro batch size, with what the search prices it for."""

    config: Any
    base: PlanLayout
    micro: int
    savers: list[tuple[bool, bool, str | None]]  # `_memory_savers`
    seq_len: int
    global_batch_size: int | None
    global_batch_tokens: int | None
    precision: str
    gpu: GPUSpec
    model_name: str | None
    plan_kwargs: dict
    fp8_expert_activations: bool
    fp8_dispatch: bool
    reshard_after_forward: bool

    def layouts(self) -> Iterator[tuple[int, PlanLayout, Workload | None, ValueError | None]]:
        """Per memory saver, in order: (its index, its layout, its workload, or None and the
        ValueError making the workload raised)."""
        base = self.base
        for i, (offload, every, mode) in enumerate(self.savers):
            layout = base.replace(
                recompute=mode,
                fp8_expert_activations=self.fp8_expert_activations,
                fp8_dispatch=self.fp8_dispatch,
                cpu_offload=offload,
                reduce_scatter_every_microbatch=every,
                reshard_after_forward=self.reshard_after_forward or base.zero_stage != 3,
            )
            try:
                batch = self.global_batch_size
                if batch is None:
                    sequences = self.global_batch_tokens / self.seq_len
                    batch = _rounded_batch(layout, self.micro, sequences)
                yield i, layout, Workload(self.seq_len, self.micro, batch, self.precision), None
            except ValueError as err:
                yield i, layout, None, err


def _state_overflows(one: _Candidate) -> tuple[frozenset[int], list | None]:
    """Indices of the memory savers (all but the last) whose largest rank's model state and
    reserve alone exceed the GPU (`memory_floor`), and `_Candidate.layouts` as a list; no
    index where a check raises or the plan's arguments are invalid (the savers are then
    checked one by one), and None for the list where making a layout raised."""
    efficiency = one.plan_kwargs.get("compute_efficiency")
    checked = efficiency is None or 0 < efficiency <= 1
    reserve = one.plan_kwargs.get("reserve_bytes", GiB)
    over, tries = set(), []
    try:
        for i, layout, workload, err in one.layouts():
            tries.append((i, layout, workload, err))
            checked = checked and err is None
            if checked and i < len(one.savers) - 1:
                floor = memory_floor(one.config, layout, workload, reserve_bytes=reserve)
                if floor > one.gpu.memory_bytes:
                    over.add(i)
    except ValueError:
        return frozenset(), None
    return (frozenset(over) if checked else frozenset()), tries


def _first_fit(
    one: _Candidate, tries: list | None, assume_over: frozenset[int]
) -> tuple[Plan | None, Rejected | None, bool]:
    """The candidate's first memory saver that fits, priced; or its rejection (the last
    saver's memory, or the error of the first that raises). `tries`: `one.layouts()` as a
    list, or None to make them one by one; `assume_over`: savers known not to fit
    (`_state_overflows`), not checked.

    Returns:
        (the plan or None, the rejection or None, whether the answer is exact: False when a
        check raised after some savers were assumed over memory, since the first of those
        would have raised it).
    """
    # recomputation only trades time for memory: the first mode (in the order given) that
    # fits is the fastest that fits, the heavier ones are not priced; a layout is rejected
    # when even the last mode does not fit
    last: Rejected | None = None
    for i, layout, workload, err in one.layouts() if tries is None else tries:
        if i in assume_over:
            continue
        try:
            if err is not None:
                raise err
            # memory first: only the first mode that fits is priced in time; a layout no
            # mode fits is rejected with the last one's reason
            over = _over_memory(one.config, layout, workload, one.gpu, one.plan_kwargs)
            if over is not None and i < len(one.savers) - 1:
                continue
            if over:
                return None, Rejected(layout, one.micro, over), True
            plan = plan_layout(
                one.config, layout, workload, one.gpu, model_name=one.model_name,
                **one.plan_kwargs,
            )  # fmt: skip
        except ValueError as error:
            # the layout itself is invalid: recomputing will not help
            return None, Rejected(layout, one.micro, str(error)), not assume_over
        if plan.fits:
            _note_rounding(plan, one.global_batch_tokens)
            return plan, None, True
        last = Rejected(layout, one.micro, "; ".join(plan.notes))
    return None, last, True


def _over_memory(
    config: Any, layout: PlanLayout, workload: Workload, gpu: GPUSpec, plan_kwargs: dict
) -> str | None:
    """None when `layout` may fit (`memory_check`, the bytes `plan_layout` counts) or raises
    (`plan_layout` then gives the error); else the reason `plan_layout` would give, or ""
    under cpu_offload (whose reason prices its host step: `plan_layout` gives it)."""
    reserve = plan_kwargs.get("reserve_bytes", GiB)
    efficiency = plan_kwargs.get("compute_efficiency")
    if efficiency is not None and not 0 < efficiency <= 1:
        return None  # plan_layout's error
    try:
        peak, reason = memory_check(config, layout, workload, gpu, reserve_bytes=reserve)
    except ValueError:
        return None
    if peak <= gpu.memory_bytes:
        return None
    return reason or ""


def _memory_savers(
    base: PlanLayout, recompute: Sequence[str | None], cpu_offload: bool | None
) -> list[tuple[bool, bool, str | None]]:
    """(cpu_offload, reduce_scatter_every_microbatch, recompute mode) a candidate tries, in
    order: each recompute mode as it is and, under ZeRO-3 with pp = 1, reduce-scattering
    every microbatch (its reduce-scatters hide behind the backwards, where recomputation
    costs compute); then (`cpu_offload` None) the same with offload. `cpu_offload` True:
    only with offload; False: never."""
    if base.zero_stage != 3:
        return [(False, False, mode) for mode in recompute]
    every = (False, True) if base.pp == 1 else (False,)
    offloads = {None: (False, True), True: (True,), False: (False,)}[cpu_offload]
    return [(off, rs, mode) for off in offloads for mode in recompute for rs in every]


def _rounded_batch(layout: PlanLayout, micro: int, sequences: float) -> int:
    """`sequences` rounded to whole microbatches on every replica: a multiple of pp of them
    for interleaved 1F1B, at least 2·pp for DualPipeV."""
    if layout.placement.v_shape:
        per_step = micro * layout.dp
        return max(2 * layout.pp, round(sequences / per_step)) * per_step
    per_step = micro * layout.dp * (layout.pp if layout.virtual_pp > 1 else 1)
    return max(1, round(sequences / per_step)) * per_step


def _note_rounding(plan: Plan, tokens: int | None) -> None:
    """Say so when whole microbatches moved the batch more than 10% off the tokens asked."""
    if tokens is None:
        return
    got = plan.workload.tokens_per_step
    if abs(got - tokens) > 0.1 * tokens:
        plan.notes.append(
            f"the batch is {got} tokens, not about {tokens}: the step takes whole microbatches "
            f"of {plan.workload.micro_batch_size} x {plan.workload.seq_len} tokens on each of "
            f"{plan.layout.dp} replicas" + _rounding_rule(plan.layout)
        )


def _rounding_rule(layout: PlanLayout) -> str:
    if layout.placement.v_shape:
        return " (at least 2·pp of them, DualPipeV)"
    return " (a multiple of pp of them, interleaved)" if layout.virtual_pp > 1 else ""
