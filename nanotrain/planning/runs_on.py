"""Whether the strategy runs a layout on the planned hardware: the strategy's own device
checks, asked without a process (a layout it refuses there is priced only when asked for,
with a note, and never offered by the search)."""

from __future__ import annotations

import torch

from nanotrain.planning.gpus import GPUSpec
from nanotrain.planning.layout import PlanLayout
from nanotrain.strategies.megatron_pipeline import check_pairing_device

__all__ = ["refused_on"]


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
