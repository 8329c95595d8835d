"""Whether nanotrain runs a layout on the planned hardware: the strategy's own device
checks, asked without a process, and the precision plugins' own statement of what they run
in fp8 (a layout or option that does not run is priced only when asked for, with a note,
and never offered by the search)."""

from __future__ import annotations

import torch

from nanotrain.planning.gpus import GPUSpec
from nanotrain.planning.layout import PlanLayout
from nanotrain.precision import PRECISIONS as PRECISION_PLUGINS
from nanotrain.strategies.megatron_pipeline import check_pairing_device

__all__ = ["not_run_yet", "refused_on"]


def refused_on(layout: PlanLayout, gpu: GPUSpec) -> str | None:
    """The strategy's message refusing `layout` on `gpu` (a "cpu" spec plans a CPU run,
    any other a CUDA one), or None where it runs: ``overlap_forward_backward`` runs on CPU
    (gloo) only (`megatron_pipeline.check_pairing_device`)."""
    if not layout.overlap_forward_backward:
        return None
    device = torch.device("cpu" if gpu.name == "cpu" else "cuda")
    try:
        check_pairing_device(device)
    except ValueError as err:
        return str(err)
    return None


def not_run_yet(layout: PlanLayout, precision: str) -> str | None:
    """Why nanotrain does not run `layout`'s ``fp8_expert_gemms`` under the Trainer
    `precision` (a `nanotrain.precision.PRECISIONS` name) on any device, or None where it
    does or the option is off: the plugin's `fp8_grouped_experts` says whether its routed
    experts' grouped GEMMs run in fp8."""
    if not layout.fp8_expert_gemms or PRECISION_PLUGINS[precision].fp8_grouped_experts:
        return None
    return (
        f"fp8_expert_gemms: precision {precision!r} runs the routed experts' grouped GEMMs "
        "(GroupedExperts) in bf16 autocast, not fp8; its fp8 GEMMs replace plain linear "
        "layers only"
    )
