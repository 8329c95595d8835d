"""`MegatronStrategy`'s argument checks: its options against each other at construction
(`check_options`) and its layout against a model config before the model is built
(`check_model_layout`). The world-size checks live in `nanotrain.parallel.mesh`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nanotrain.parallel.context import check_context_length
from nanotrain.parallel.mesh import check_sizes, validate_layout
from nanotrain.parallel.pipeline import partition_layers
from nanotrain.strategies.layout_checks import model_dims
from nanotrain.strategies.megatron_pipeline import check_pairing, chunks_per_rank, pick_schedule
from nanotrain.strategies.megatron_zero3 import check_zero3_options


def check_options(
    *,
    tp: int,
    pp: int,
    ep: int,
    dp: int | None,
    zero_stage: int,
    bucket_size_mb: float,
    virtual_pp: int,
    schedule: str | None,
    pipeline_layout: Sequence[int] | None,
    overlap_forward_backward: bool,
    ranks_per_node: int | None,
    node_limited_dispatch: bool | None,
    cpu_offload: bool,
    reshard_after_forward: bool,
    reduce_scatter_every_microbatch: bool,
    cp: int = 1,
) -> tuple[str, int]:
    """Check `MegatronStrategy`'s arguments (same names and meaning) without a process.

    Returns:
        (the schedule's name, model chunks per pipeline rank): ``schedule=None`` picks 1F1B
        (interleaved when ``virtual_pp > 1``); DualPipeV always has 2 chunks per rank.

    Raises:
        TypeError, ValueError: naming the invalid value or combination and what to use.
    """
    check_sizes(tp=tp, pp=pp, ep=ep, dp=dp, virtual_pp=virtual_pp, cp=cp)
    check_context_options(cp, zero_stage, overlap_forward_backward)
    if virtual_pp > 1 and pp == 1:
        raise ValueError(f"virtual_pp={virtual_pp} needs pp > 1; use virtual_pp=1")
    schedule = pick_schedule(schedule, virtual_pp)
    virtual_pp = chunks_per_rank(schedule, virtual_pp, pp)
    if pipeline_layout is not None and len(pipeline_layout) != pp * virtual_pp:
        raise ValueError(
            f"pipeline_layout has {len(pipeline_layout)} entries; pp*virtual_pp="
            f"{pp}*{virtual_pp}={pp * virtual_pp} chunks need one each"
        )
    if overlap_forward_backward:
        check_pairing(pp, tp, virtual_pp, schedule)
    if ranks_per_node is not None and ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    if node_limited_dispatch and ep == 1:
        raise ValueError(
            "node_limited_dispatch=True needs expert parallelism (ep > 1): with ep=1 every "
            "expert is on every rank and no token leaves it; set ep or drop the option"
        )
    if dp is not None and (dp * cp) % ep != 0:
        what = f"dp={dp}" if cp == 1 else f"dp*cp={dp}*{cp}={dp * cp}"
        raise ValueError(
            f"ep={ep} does not divide {what} (expert parallelism is carved out of the data "
            f"(x context) parallel ranks); pick ep among the divisors of {dp * cp}, or a dp "
            "that ep divides"
        )
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    check_zero3_options(zero_stage, cpu_offload, reshard_after_forward, overlap_forward_backward)
    if reduce_scatter_every_microbatch and (zero_stage != 3 or pp > 1):
        raise ValueError(
            "reduce_scatter_every_microbatch=True needs zero_stage=3 and pp=1 (got "
            f"zero_stage={zero_stage}, pp={pp}): only ZeRO-3 keeps gradient shards, and "
            "under pp the schedule reduces once after all its backwards"
        )
    if not bucket_size_mb > 0:
        raise ValueError(f"bucket_size_mb must be > 0, got {bucket_size_mb}")
    return schedule, virtual_pp


def check_model_layout(
    config: Any,
    world_size: int,
    *,
    tp: int,
    pp: int,
    ep: int,
    dp: int | None,
    virtual_pp: int,
    pipeline_layout: Sequence[int] | None,
    node_limited_dispatch: bool | None,
) -> None:
    """Check a layout (`MegatronStrategy`'s arguments after `check_options`) against a model
    config's heads, experts and layers.

    Raises:
        ValueError: naming the numbers and a valid alternative.
    """
    dims = model_dims(config)
    if ep > 1 and not dims["num_experts"]:
        raise ValueError(
            f"ep={ep} splits routed experts, but the model ({type(config).__name__}) "
            "has none; use ep=1 (its ranks then stay plain data parallel)"
        )
    validate_layout(world_size, tp, pp, ep, dp, **dims)
    layers = getattr(config, "num_layers", None)
    if pp > 1 and layers is not None:
        partition_layers(layers, pp, virtual_pp, pipeline_layout)
    if node_limited_dispatch and getattr(config, "capacity_factor", None) is not None:
        raise ValueError(
            "node_limited_dispatch=True needs dropless MoE layers, but the model has "
            f"capacity_factor={config.capacity_factor} (its fixed expert slots go by the "
            "flat dispatch); set capacity_factor=None or node_limited_dispatch=None"
        )


def check_context_options(cp: int, zero_stage: int, overlap_forward_backward: bool) -> None:
    """The options context parallelism (cp > 1) cannot run with, refused at construction.

    Raises:
        ValueError: naming the combination and what to change.
    """
    if cp == 1:
        return
    if overlap_forward_backward:
        raise ValueError(
            f"cp={cp} with overlap_forward_backward=True is not supported: the two chunks' "
            "key/value all-gathers would run side by side on one context-parallel group; "
            "set overlap_forward_backward=False"
        )


def check_context_config(config: Any, cp: int) -> None:
    """Check a model config for what context parallelism (cp > 1) cannot split: no
    capacity-limited MoE layers (their drops are decided per whole sequence). The planner
    runs the same check on the config it prices.

    Raises:
        ValueError: naming the setting and how to change it.
    """
    if cp > 1 and getattr(config, "capacity_factor", None) is not None:
        raise ValueError(
            f"cp={cp} needs dropless MoE layers, but the model has capacity_factor="
            f"{config.capacity_factor} (its drops are decided per whole sequence); set "
            "capacity_factor=None or cp=1"
        )


def check_context_module(module: Any, cp: int, tp: int = 1) -> None:
    """Check a built module for what context parallelism (cp > 1) cannot split: the data's
    sequence length must be a multiple of 2·cp·tp (tp: the tensor-parallel size under
    sequence parallelism, else 1); no capacity-limited MoE layers (their drops are decided
    per whole sequence).

    Raises:
        ValueError: naming the setting and how to change it.
    """
    check_context_config(getattr(module, "config", None), cp)
    seq_len = getattr(module, "_seq_len", None)
    if seq_len is not None:
        check_context_length(int(seq_len), cp, tp)
