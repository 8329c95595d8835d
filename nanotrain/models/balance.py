"""Aux-loss-free load balancing (DeepSeek-V3 section 2.1.2) across every MoE layer at once:
sum the step's expert loads and dropped copies over all ranks in one collective, move each
router's selection bias against its load, and report the statistics (`MoEStats`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nanotrain.models.moe import DeepSeekMoE
from nanotrain.parallel.collectives import reduce_from_tensor_parallel_region


@dataclass
class MoEStats:
    """One optimizer step's routing statistics for the MoE layers of this pipeline stage,
    summed over every rank that saw part of the global batch.

    Attributes:
        layers: [L] global decoder-layer indices of the MoE layers (MTP layers after the main
            ones: index ``num_layers + d`` for MTP module d, counted from 0 as HF numbers it).
        loads: [L, E] float64, token copies routed to each expert during the step.
        dropped: [L] float64, token copies dropped by the capacity limit (0 when dropless).
        biases: [L, E] float32, the aux-loss-free routing biases after this step's update.
    """

    layers: list[int]
    loads: torch.Tensor
    dropped: torch.Tensor
    biases: torch.Tensor


def reduce_load(
    moe_layers: list[DeepSeekMoE], reduce_fn: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layers' expert loads and dropped copies, summed by ONE call of `reduce_fn`.

    Args: moe_layers (L of them); reduce_fn: optional callable summing a tensor across
        processes, called once on the int64 stack [L, E + 1] (dropped copies in the last
        column).
    Returns: loads [L, E] float64, dropped [L] float64.
    """
    # (L, E + 1): each layer's loads, then its dropped copies
    stacked = torch.stack([torch.cat([m.expert_load, m.dropped_tokens[None]]) for m in moe_layers])
    if reduce_fn is not None:
        stacked = reduce_fn(stacked)
    stacked = stacked.double()
    return stacked[:, :-1], stacked[:, -1]  # (L, E), (L,)


@torch.no_grad()
def update_bias(moe_layers: list[DeepSeekMoE], speed: float, reduce_fn: Any = None) -> torch.Tensor:
    """Aux-loss-free balancing step (DeepSeek-V3 section 2.1.2) for every MoE layer at once.

    b_i -= speed if expert i was overloaded (load above the layer's mean), += speed if
    underloaded; then the load counters are reset. See `moe_balance_step` for the version
    that also reports drops and biases.

    Args: moe_layers, speed (gamma), reduce_fn: as `moe_balance_step`.
    Returns: the (reduced) loads [L, E] that drove the update, for logging.
    """
    if not moe_layers:
        return torch.zeros(0, 0)
    return moe_balance_step(moe_layers, list(range(len(moe_layers))), speed, reduce_fn).loads


@torch.no_grad()
def moe_balance_step(
    moe_layers: list[DeepSeekMoE],
    layer_ids: list[int],
    speed: float,
    reduce_fn: Any = None,
    sequence_group: Any = None,
) -> MoEStats | None:
    """Reduce the step's routing statistics once, move the router biases, reset the counters.

    Args:
        moe_layers: the layers whose counters were accumulated since the last call.
        layer_ids: their global decoder-layer indices (`MoEStats.layers`).
        speed: gamma of the bias update (0 = biases stay).
        reduce_fn: optional callable summing a tensor across the processes holding other
            samples (data/expert parallel); called once, on the stack of `reduce_load`.
        sequence_group: under sequence parallelism, the tensor-parallel group whose ranks
            counted other tokens of the same samples (summed first); None otherwise.
    Returns: `MoEStats` (biases after the update), or None without MoE layers.
    """
    if not moe_layers:
        return None

    def reduce_all(stacked: torch.Tensor) -> torch.Tensor:
        stacked = reduce_from_tensor_parallel_region(stacked, sequence_group)
        return stacked if reduce_fn is None else reduce_fn(stacked)

    loads, dropped = reduce_load(moe_layers, reduce_all)
    direction = torch.sign(loads.mean(dim=-1, keepdim=True) - loads)  # (L, E): +1 underloaded
    for layer, step in zip(moe_layers, direction, strict=True):
        bias = layer.gate.e_score_correction_bias
        bias += (speed * step).to(bias.dtype)
        layer.reset_load()
    biases = torch.stack([m.gate.e_score_correction_bias.float() for m in moe_layers])  # (L, E)
    return MoEStats(list(layer_ids), loads, dropped, biases)
