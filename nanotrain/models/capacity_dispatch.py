"""Routed experts with a capacity: token copies placed in fixed-size expert slots.

With a capacity factor every expert accepts at most C copies of this rank's tokens, so the
routed path can have fixed shapes: a buffer of E x C slots (zeros where an expert got fewer
than C copies). Nothing about it depends on how many copies each expert got, so no step of
it reads the device: not the selection of the kept copies (a boolean mask would need a
`nonzero`), not the expert-parallel all-to-all (its split sizes are E_local x C rows per
peer, known in advance), not the expert computation (C rows per expert).

    slot_positions     topk_idx, topk_weight -> position [N*K]: slot e*C + r of each choice
                                                (r: its rank among expert e's copies), E*C
                                                for a dropped one
    dispatch_to_slots  h, position           -> x_slots [E*C, H]
    experts                                  -> y_slots [E*C, H] (`run_experts_in_slots`)
    combine_from_slots y_slots, weights      -> y [N, H]

Which copies are kept is `capacity_keep_mask`'s policy (highest routing weight first, then
token order); an empty slot holds zeros, which the SwiGLU experts map to zeros, so it adds
nothing to any output or gradient. The cost is computing E*C rows however the load falls.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from nanotrain.parallel.collectives import group_size
from nanotrain.parallel.expert import all_to_all, capacity_ranks

__all__ = ["combine_from_slots", "dispatch_to_slots", "run_experts_in_slots", "slot_positions"]


def slot_positions(
    topk_idx: Tensor, topk_weight: Tensor, num_experts: int, capacity: int
) -> tuple[Tensor, Tensor]:
    """Where each routing choice goes in the E x C slot buffer.

    Args: topk_idx [N, K] int64; topk_weight [N, K]; capacity C >= 0.
    Returns: (position [N*K] int64: ``e * C + rank`` for a kept copy, ``E * C`` (one past
        the end) for a dropped one; keep [N*K] bool), indexed by the flat slot ``token * K + k``.
    """
    flat = topk_idx.reshape(-1)
    rank = capacity_ranks(topk_idx, topk_weight, num_experts)
    keep = rank < capacity
    position = torch.where(keep, flat * capacity + rank, num_experts * capacity)
    return position, keep


def dispatch_to_slots(h: Tensor, topk_idx: Tensor, position: Tensor, num_slots: int) -> Tensor:
    """Copy each kept token into its slot; empty slots hold zeros.

    Args: h [N, H]; topk_idx [N, K] (for K); position [N*K] from `slot_positions`;
        num_slots E*C.
    Returns: x_slots [E*C, H] (differentiable: the gradient of a slot flows to its token).
    """
    n, k = topk_idx.shape
    # source[s] = the token in slot s, or n (an appended zero row) for an empty slot; dropped
    # choices all write to the extra entry num_slots, which is cut off
    source = torch.full((num_slots + 1,), n, dtype=torch.long, device=h.device)
    source[position] = torch.arange(n * k, device=h.device) // k
    padded = torch.cat([h, h.new_zeros(1, h.shape[-1])])
    return padded[source[:num_slots]]


def combine_from_slots(
    y_slots: Tensor, position: Tensor, topk_weight: Tensor, num_tokens: int
) -> Tensor:
    """Weighted sum of each token's expert outputs: y_t = sum_k g_{t,k} y_slot(t,k); a dropped
    choice contributes nothing.

    Args: y_slots [E*C, H]; position [N*K]; topk_weight [N, K]; num_tokens N.
    Returns: [N, H] in y_slots' dtype.
    """
    k = topk_weight.shape[1]
    padded = torch.cat([y_slots, y_slots.new_zeros(1, y_slots.shape[-1])])
    w = topk_weight.reshape(-1, 1).to(y_slots.dtype)
    return (padded[position] * w).view(num_tokens, k, -1).sum(dim=1)


def run_experts_in_slots(
    x_slots: Tensor,
    num_experts: int,
    capacity: int,
    experts: Callable[[Tensor, list[int]], Tensor],
    group: object | None,
) -> Tensor:
    """The experts over the slot buffer, sending each expert's slots to the rank that owns
    it and back (equal all-to-all splits: no size exchange, no host read).

    Args:
        x_slots: [E*C, H], expert e's slots at rows [e*C, (e+1)*C).
        num_experts: E, all routed experts (over every rank of `group`).
        capacity: C.
        experts: this rank's local experts, ``experts(x [R, H] sorted by local expert,
            rows per local expert as ints) -> [R, H]``.
        group: the expert-parallel group of P ranks (None or one rank: all experts local).
    Returns: y_slots [E*C, H] in x_slots' row order.
    """
    p = group_size(group)
    if p == 1:
        return experts(x_slots, [capacity] * num_experts)
    e_local, hidden = num_experts // p, x_slots.shape[-1]
    splits = [e_local * capacity] * p
    x_recv = all_to_all(x_slots, splits, splits, group)  # (source rank, local expert, slot)
    by_expert = x_recv.view(p, e_local, capacity, hidden).transpose(0, 1)
    y = experts(by_expert.reshape(-1, hidden), [p * capacity] * e_local)
    y = y.view(e_local, p, capacity, hidden).transpose(0, 1).reshape(-1, hidden)
    # anchored on x_recv: a rank whose experts' slots are all empty still joins the backward
    return all_to_all(y, splits, splits, group, anchor=x_recv)
