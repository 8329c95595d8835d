"""Routed experts with a capacity: token copies placed in fixed-size expert slots.

With a capacity factor every expert accepts at most C copies from each group of tokens (a
MoE layer makes each sequence a group), so the routed path can have fixed shapes: a buffer
of E x G x C slots for G groups (zeros where an expert got fewer than C copies of a group).
Nothing about it depends on how many copies each expert got, so no step of it reads the
device: not the selection of the kept copies (a boolean mask would need a `nonzero`), not
the expert-parallel all-to-all (its split sizes are E_local x G x C rows per peer, known in
advance), not the expert computation (G x C rows per expert).

    slot_positions     topk_idx, topk_weight -> position [N*K]: slot (e*G + g)*C + r of each
                                                choice (g: its token's group, r: its rank
                                                among expert e's copies from group g),
                                                E*G*C for a dropped one
    dispatch_to_slots  h, position           -> x_slots [E*G*C, H]
    slot_weights       topk_weight, position -> w_slots [E*G*C] (0 in an empty slot)
    experts                                  -> y_slots [E*G*C, H], weighted by w_slots
                                                (`run_experts_in_slots`)
    combine_from_slots y_slots, position     -> y [N, H]

Which copies are kept is `capacity_keep_mask`'s policy (per group, highest routing weight
first, then token order); an empty slot holds zeros, which the SwiGLU experts map to zeros,
so it adds nothing to any output or gradient. The cost is computing E*G*C rows however the
load falls.

Why a group per sequence: which copies a capacity drops depends on which tokens compete
for the same slots. Groups that never cross a sequence make that independent of how the
batch is cut into microbatches and data-parallel shards, so a model with a capacity factor
computes the same loss on one process as under any dp, ep or pp layout.

Shape comments: N tokens, K choices per token, H hidden, E routed experts (all ranks'), G
groups, C capacity per expert and group, S = G*C slots per expert; under expert parallelism
P ranks each own E_local = E / P experts, and `peers` lists every source rank's S.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from nanotrain.parallel.collectives import group_size
from nanotrain.parallel.expert import all_to_all, capacity_buckets, ranks_in_buckets

__all__ = [
    "combine_from_slots",
    "dispatch_to_slots",
    "run_experts_in_slots",
    "slot_positions",
    "slot_weights",
]


def slot_positions(
    topk_idx: Tensor, topk_weight: Tensor, num_experts: int, capacity: int, groups: int = 1
) -> tuple[Tensor, Tensor]:
    """Where each routing choice goes in the E x G x C slot buffer.

    Args: topk_idx [N, K] int64; topk_weight [N, K]; capacity C >= 0 per expert and group;
        groups G: equal runs of consecutive tokens (G divides N), each with its own C slots
        per expert.
    Returns: (position [N*K] int64: ``(e * G + g) * C + rank`` for a kept copy of a token of
        group g, ``E * G * C`` (one past the end) for a dropped one; keep [N*K] bool),
        indexed by the flat slot ``token * K + k``.
    """
    bucket = capacity_buckets(topk_idx, groups)  # (N*K,): e * G + g
    rank = ranks_in_buckets(bucket, topk_weight, num_experts * groups)  # (N*K,)
    keep = rank < capacity  # (N*K,) bool
    position = torch.where(keep, bucket * capacity + rank, num_experts * groups * capacity)
    return position, keep


def dispatch_to_slots(h: Tensor, topk_idx: Tensor, position: Tensor, num_slots: int) -> Tensor:
    """Copy each kept token into its slot; empty slots hold zeros.

    Args: h [N, H]; topk_idx [N, K] (for K); position [N*K] from `slot_positions`;
        num_slots: the buffer's rows, E*G*C.
    Returns: x_slots [num_slots, H] (differentiable: the gradient of a slot flows to its
        token).
    """
    n, k = topk_idx.shape
    # source[s] = the token in slot s, or n (an appended zero row) for an empty slot; dropped
    # choices all write to the extra entry num_slots, which is cut off
    source = torch.full((num_slots + 1,), n, dtype=torch.long, device=h.device)  # (E*G*C + 1,)
    source[position] = torch.arange(n * k, device=h.device) // k
    padded = torch.cat([h, h.new_zeros(1, h.shape[-1])])  # (N + 1, H)
    return padded[source[:num_slots]]  # (E*G*C, H)


def slot_weights(topk_weight: Tensor, position: Tensor, num_slots: int) -> Tensor:
    """Each slot's gate weight, 0 for an empty slot (differentiable in `topk_weight`).

    Args: topk_weight [N, K]; position [N*K] from `slot_positions`; num_slots E*G*C.
    Returns: [num_slots] in topk_weight's dtype.
    """
    # dropped choices all write to the extra entry num_slots, which is cut off (its gradient,
    # and hence theirs, is zero)
    padded = topk_weight.new_zeros(num_slots + 1).index_put((position,), topk_weight.reshape(-1))
    return padded[:num_slots]


def combine_from_slots(y_slots: Tensor, position: Tensor, num_tokens: int) -> Tensor:
    """Each token's expert outputs summed: y_t = sum_k y_slot(t,k), the slots' outputs already
    weighted (`slot_weights`); a dropped choice contributes nothing. Backward keeps only the
    positions.

    Args: y_slots [E*G*C, H]; position [N*K]; num_tokens N.
    Returns: [N, H] in y_slots' dtype.
    """
    k = position.numel() // num_tokens
    padded = torch.cat([y_slots, y_slots.new_zeros(1, y_slots.shape[-1])])  # (E*G*C + 1, H)
    return padded[position].view(num_tokens, k, -1).sum(dim=1)  # (N, K, H) summed: (N, H)


def run_experts_in_slots(
    x_slots: Tensor,
    num_experts: int,
    slots_per_expert: int,
    experts: Callable[..., Tensor],
    group: object | None,
    peer_slots: list[int] | None = None,
    fp8_dispatch: bool = False,
    scale: Tensor | None = None,
) -> Tensor:
    """The experts over the slot buffer, sending each expert's slots to the rank that owns
    it and back (all-to-all splits known in advance: no size exchange, no host read).

    Args:
        x_slots: [E*S, H], expert e's slots at rows [e*S, (e+1)*S).
        num_experts: E, all routed experts (over every rank of `group`).
        slots_per_expert: S (G x C: groups times capacity).
        experts: this rank's local experts, ``experts(x [R, H] sorted by local expert,
            rows per local expert as ints) -> [R, H]``.
        group: the expert-parallel group of P ranks (None or one rank: all experts local).
        peer_slots: S of every rank of `group` in rank order (`peer_slot_counts`), when the
            ranks' batches may differ in shape; None: every rank has this rank's S.
        fp8_dispatch: the slots go out in fp8 with tile scales (`all_to_all`'s `fp8`).
        scale: optional [E*S] per-slot factor (`slot_weights`), sent along with the slots and
            handed to the experts as ``experts(x, sizes, scale)``.
    Returns: y_slots [E*S, H] in x_slots' row order.
    """
    p = group_size(group)
    sizes = [slots_per_expert] * num_experts
    if p == 1:
        return experts(x_slots, sizes) if scale is None else experts(x_slots, sizes, scale)
    e_local, hidden = num_experts // p, x_slots.shape[-1]
    peers = peer_slots or [slots_per_expert] * p
    send = [e_local * slots_per_expert] * p
    recv = [e_local * s for s in peers]
    # (E_local * sum(peers), H), rows ordered (source rank, local expert, slot)
    x_recv = all_to_all(x_slots, recv, send, group, fp8=fp8_dispatch)
    # regroup by local expert: expert j gets every source's slots for it, in rank order;
    # one block per source rank: (E_local, that source's S, H)
    blocks = [b.view(e_local, s, hidden) for b, s in zip(x_recv.split(recv), peers, strict=True)]
    by_expert = torch.cat(blocks, dim=1)  # (E_local, sum(peers), H): all sources' slots
    local_sizes = [sum(peers)] * e_local
    if scale is None:
        y = experts(by_expert.reshape(-1, hidden), local_sizes)  # (E_local * sum(peers), H)
    else:  # the slots' weights regrouped alike: (E_local * sum(peers),)
        w_recv = all_to_all(scale, recv, send, group)
        w_blocks = [b.view(e_local, s) for b, s in zip(w_recv.split(recv), peers, strict=True)]
        w = torch.cat(w_blocks, dim=1).reshape(-1)
        y = experts(by_expert.reshape(-1, hidden), local_sizes, w)
    y = y.view(e_local, sum(peers), hidden).split(peers, dim=1)  # per source: (E_local, S, H)
    # back to rows ordered (source rank, local expert, slot): (E_local * sum(peers), H)
    y = torch.cat([part.reshape(-1, hidden) for part in y])
    # anchored on x_recv: a rank whose experts' slots are all empty still joins the backward
    return all_to_all(y, send, recv, group, anchor=x_recv)  # (E*S, H)
