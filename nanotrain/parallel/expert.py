"""Expert parallelism: routed experts split over an expert-parallel group, token copies moved
to their experts and back with all-to-all.

The ``ep`` ranks of an expert-parallel group hold different routed experts (rank r holds the
contiguous slice ``[r * E / ep, (r + 1) * E / ep)``) and different tokens (they are data
parallel for everything else). One MoE layer's routed path, seen from one rank::

    x_sorted [M, H]      this rank's token copies sorted by global expert, hence by owner rank
    counts   [E]         copies per global expert
      1. all_to_all(counts)           -> how many copies each peer sends to each local expert
      2. all_to_all(x_sorted)         -> x_recv [R, H] ordered (source rank, local expert)
      3. regroup by local expert      -> [R, H] ordered (local expert, source rank)
      4. local experts                -> y [R, H]
      5. undo the regrouping, all_to_all back (the reverse splits) -> y_sorted [M, H]

so the caller's combine sees the copies in exactly the order it sent them (Lepikhin et al.
2020, "GShard", section 3; Megatron-Core's ``MoEAlltoAllTokenDispatcher``). The all-to-all is
an autograd function whose backward is the reverse all-to-all, so gradients retrace the
tokens' path. With a group of one rank (or none) nothing here communicates.

In GShard's terms step 2 is the *dispatch* all-to-all and step 5 the *combine* all-to-all;
Megatron-Core's dispatcher has the same shape (permute by expert, all-to-all, sort by local
expert, experts, and the reverse), and DeepSeek-V3 (section 3.2.2) trains its DeepSeekMoE
layers with the same pair of all-to-alls. Here the permutation by expert and the weighted
combine in token order stay in `nanotrain.models.moe` (`dispatch`, `combine`); this module
moves the sorted copies between ranks and regroups them (steps 1 to 5). With a capacity
factor, `nanotrain.models.capacity_dispatch` sends fixed-size slots instead, whose splits are
known in advance.

Gradients: an expert's weights see only the tokens routed to it from the ``ep`` ranks of its
group, so its gradient is summed over the *expert-data-parallel* group (the ranks holding the
same experts), never over the whole data-parallel group. `mark_expert_params` tags those
parameters for the strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from nanotrain.parallel.collectives import all_gather_along_dim, group_size
from nanotrain.parallel.fp8_wire import pack_fp8_rows, unpack_fp8_rows

__all__ = [
    "ExpertSplits",
    "all_to_all",
    "capacity_buckets",
    "capacity_keep_mask",
    "capacity_ranks",
    "expert_counts",
    "expert_range",
    "exchange_splits",
    "is_expert_param",
    "mark_expert_params",
    "peer_slot_counts",
    "ranks_in_buckets",
    "run_experts_parallel",
]

_EXPERT_ATTR = "_nano_expert_parallel"


def mark_expert_params(module: nn.Module) -> None:
    """Tag every parameter of `module` as an expert-parallel parameter: each rank of the
    expert-parallel group holds different experts, so its gradient is reduced over the
    expert-data-parallel group (not the data-parallel one) and its norm summed over ep."""
    for p in module.parameters():
        setattr(p, _EXPERT_ATTR, True)


def is_expert_param(param: nn.Parameter) -> bool:
    """Whether `param` was tagged by `mark_expert_params`."""
    return bool(getattr(param, _EXPERT_ATTR, False))


def expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """The global experts ``[start, stop)`` that rank `ep_rank` of an ep group holds.

    Raises:
        ValueError: if `ep_size` does not divide `num_experts` or `ep_rank` is out of range.
    """
    if ep_size < 1 or num_experts % ep_size != 0:
        raise ValueError(
            f"expert parallelism splits n_routed_experts={num_experts} over ep={ep_size} ranks, "
            f"which needs ep to divide it; pick ep among the divisors of {num_experts}"
        )
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank={ep_rank} is outside [0, {ep_size})")
    per_rank = num_experts // ep_size
    return ep_rank * per_rank, (ep_rank + 1) * per_rank


def capacity_keep_mask(
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
    num_experts: int,
    capacity: int,
    groups: int = 1,
) -> torch.Tensor:
    """Which routing choices fit an expert capacity of `capacity` copies per expert and group.

    Applied before dispatch, so the all-to-all carries only the kept copies.

    Policy: the N tokens form `groups` equal runs of consecutive tokens (a MoE layer uses one
    group per sequence); within each group, each expert keeps the `capacity` copies with the
    highest routing weight; equal weights are kept in token order (then choice order).
    Dropped copies simply do not contribute to their token's output (the other choices'
    weights are not renormalized).

    Args: topk_idx [N, K] int64; topk_weight [N, K]; capacity >= 0; groups divides N.
    Returns: keep [N*K] bool, indexed by the flat slot ``token * K + k``.
    """
    return capacity_ranks(topk_idx, topk_weight, num_experts, groups) < capacity


def expert_counts(flat_idx: Tensor, num_experts: int) -> Tensor:
    """How many entries of `flat_idx` [M] (int64 ids in [0, num_experts)) name each id:
    [num_experts] int64.

    `torch.bincount` with a fixed length, by a scatter-add: bincount's output shape depends on
    the data, which makes torch.compile break the graph there.
    """
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat_idx.device)
    return counts.scatter_add_(0, flat_idx, torch.ones_like(flat_idx))


def capacity_buckets(topk_idx: torch.Tensor, num_groups: int) -> Tensor:
    """The (expert, token group) bucket of each routing choice, ``e * G + g``: the tokens form
    G equal runs of consecutive tokens, ranked separately for the capacity.

    Args: topk_idx [N, K] int64; num_groups G (must divide N).
    Returns: [N*K] int64 in [0, E*G), indexed by the flat slot ``token * K + k``.
    """
    n, k = topk_idx.shape
    if n % num_groups:
        raise ValueError(f"{n} tokens do not split into {num_groups} equal capacity groups")
    group = torch.arange(n * k, device=topk_idx.device) // (k * (n // num_groups))
    return topk_idx.reshape(-1) * num_groups + group


def ranks_in_buckets(bucket: Tensor, topk_weight: Tensor, num_buckets: int) -> Tensor:
    """Each routing choice's 0-based rank in its bucket (`capacity_buckets`), in
    `capacity_keep_mask`'s order: highest weight first, ties in token order, then choice
    order. bucket [N*K]; topk_weight [N, K]. Returns [N*K] int64."""
    # by weight (descending; stable, so ties stay in slot = token order), then by bucket
    by_weight = torch.argsort(topk_weight.detach().reshape(-1), descending=True, stable=True)
    order = by_weight[torch.argsort(bucket[by_weight], stable=True)]
    counts = expert_counts(bucket, num_buckets)
    starts = torch.cumsum(counts, 0) - counts
    ranks = torch.empty_like(bucket)
    ranks[order] = torch.arange(bucket.numel(), device=bucket.device) - starts[bucket[order]]
    return ranks


def capacity_ranks(
    topk_idx: torch.Tensor, topk_weight: torch.Tensor, num_experts: int, groups: int = 1
) -> Tensor:
    """Each routing choice's rank among the copies of its expert in its token group
    (`ranks_in_buckets` of `capacity_buckets`); 0-based.

    Args: topk_idx [N, K] int64; topk_weight [N, K]; groups: equal runs of consecutive
        tokens ranked separately (must divide N).
    Returns: [N*K] int64, indexed by the flat slot ``token * K + k``.
    """
    bucket = capacity_buckets(topk_idx, groups)
    return ranks_in_buckets(bucket, topk_weight, num_experts * groups)


# Eager even inside a compiled layer: traced, the collective and the host read that follows
# it were ordered differently on ranks with different batch shapes, and validation hung
@torch.compiler.disable
def peer_slot_counts(
    slots_per_expert: int, group: ProcessGroup | None, device: torch.device
) -> list[int]:
    """Every rank's slots per expert over the expert-parallel `group` (one small all-gather
    on `device`, the device the group's backend moves, and one host read). Needed when ranks
    may hold batches of different shapes: a last, partial evaluation batch, or per-batch
    padding (exchanged in eager training only on the CPU, where the read waits for nothing)."""
    p = group_size(group)
    if p == 1:
        return [slots_per_expert]
    mine = torch.tensor([slots_per_expert], dtype=torch.int64, device=device)
    return all_gather_along_dim(mine, 0, group).tolist()


def _all_to_all_raw(
    x: Tensor, output_splits: list[int], input_splits: list[int], group: ProcessGroup
) -> Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(
        out,
        x.contiguous(),
        output_split_sizes=output_splits,
        input_split_sizes=input_splits,
        group=group,
    )
    return out


class _AllToAll(torch.autograd.Function):
    """forward: all-to-all along dim 0 with the given splits; backward: the reverse one.

    `anchor` (a tensor or None) is an extra input that is never read: it only makes the output
    require grad whenever the anchor does, so every rank takes part in the backward all-to-all
    even when its own share of the data (and hence its own graph) is empty.
    """

    @staticmethod
    def forward(ctx, x, anchor, output_splits, input_splits, group):  # noqa: ANN001, ANN205
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        return _all_to_all_raw(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        output_splits, input_splits = ctx.splits
        # the rows this rank received go back to where they came from: swap the splits
        grad_x = _all_to_all_raw(grad, input_splits, output_splits, ctx.group)
        return grad_x, None, None, None, None


class _Fp8AllToAll(_AllToAll):
    """`_AllToAll` whose forward sends the rows in fp8 (`nanotrain.parallel.fp8_wire`: e4m3
    values, one fp32 scale per 1 x 128 tile) and returns them dequantized in `x`'s dtype; its
    backward, `_AllToAll`'s, sends the gradient as it comes (the rounding counts as the
    identity, as an fp8 GEMM's input quantization does)."""

    @staticmethod
    def forward(ctx, x, anchor, output_splits, input_splits, group):  # noqa: ANN001, ANN205
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        packed = _all_to_all_raw(pack_fp8_rows(x), output_splits, input_splits, group)
        return unpack_fp8_rows(packed, x.shape[-1], x.dtype)


def all_to_all(
    x: Tensor,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
    group: ProcessGroup | None,
    anchor: Tensor | None = None,
    fp8: bool = False,
) -> Tensor:
    """forward: rows ``input_splits[r]`` of `x` go to rank r, rows from rank r land in order
    (``output_splits[r]`` of them); backward: the reverse all-to-all of the gradient.

    Args:
        x: [sum(input_splits), ...] rows grouped by destination rank.
        output_splits, input_splits: row counts per peer (every rank must pass splits that
            agree with its peers'; `exchange_splits` computes them).
        group: the process group; None or one rank returns `x` itself.
        anchor: optional tensor whose requires-grad the output inherits (see `_AllToAll`).
        fp8: x [rows, H] crosses in fp8 with tile scales (`_Fp8AllToAll`); the output is its
            fp8 rounding, in x's dtype.
    Returns: [sum(output_splits), ...].
    """
    if group_size(group) == 1:
        return x
    # no anchor given: None, not `x` twice (dynamo cannot trace an autograd.Function that
    # gets the same tensor as two inputs, and breaks the graph there)
    function = _Fp8AllToAll if fp8 else _AllToAll
    return function.apply(x, anchor, list(output_splits), list(input_splits), group)


@dataclass
class ExpertSplits:
    """Split sizes of one dispatch (all plain ints: read from the device once).

    Attributes:
        input_splits: [P] copies this rank sends to each ep rank.
        output_splits: [P] copies this rank receives from each ep rank.
        recv_counts: [P][E / P] copies from source rank s for local expert e.
        local_counts: [E / P] copies each local expert processes (summed over sources).
    """

    input_splits: list[int]
    output_splits: list[int]
    recv_counts: list[list[int]]
    local_counts: list[int]


def exchange_splits(counts: Tensor, group: ProcessGroup) -> ExpertSplits:
    """Exchange per-expert copy counts over the ep group (one small all-to-all, one host sync).

    Step 1 of the module docstring: each rank learns how many copies every peer sends to each
    of its local experts, which sizes the dispatch all-to-all of the copies themselves.

    Args: counts [E] int64, this rank's copies per global expert (E divisible by the group
    size; experts are owned in contiguous blocks of E / P, in rank order).
    Returns: `ExpertSplits`.
    """
    p = group_size(group)
    e_local = counts.numel() // p
    counts = counts.to(torch.int64).contiguous()
    received = torch.empty_like(counts)
    # block r of counts is what this rank sends to rank r: exactly all_to_all_single's layout
    dist.all_to_all_single(received, counts, group=group)
    sizes = torch.cat([counts, received]).tolist()  # the one host sync of a dispatch
    send = [sizes[r * e_local : (r + 1) * e_local] for r in range(p)]
    recv = [sizes[(p + s) * e_local : (p + s + 1) * e_local] for s in range(p)]
    return ExpertSplits(
        input_splits=[sum(row) for row in send],
        output_splits=[sum(row) for row in recv],
        recv_counts=recv,
        local_counts=[sum(recv[s][e] for s in range(p)) for e in range(e_local)],
    )


def _regroup_order(recv_counts: list[list[int]], device: torch.device) -> Tensor:
    """Permutation taking rows ordered (source rank, local expert) to (local expert, source
    rank), both stable in the rows' arrival order (step 3 of the module docstring).

    Returns: [R] int64, R the rows received (``sum`` of `recv_counts`)."""
    p, e_local = len(recv_counts), len(recv_counts[0])
    sizes = torch.tensor([c for row in recv_counts for c in row], device=device)
    total = sum(sum(row) for row in recv_counts)  # given, so CUDA need not read it back
    block = torch.repeat_interleave(
        torch.arange(p * e_local, device=device), sizes, output_size=total
    )
    source, expert = block // e_local, block % e_local
    return torch.argsort(expert * p + source, stable=True)


def run_experts_parallel(
    x_sorted: Tensor,
    counts: Tensor,
    experts: Callable[..., Tensor],
    group: ProcessGroup | None,
    fp8_dispatch: bool = False,
    scale: Tensor | None = None,
) -> Tensor:
    """Send token copies to the ranks owning their experts, run them there, bring them back.

    Steps 1 to 5 of the module docstring: exchange the counts, dispatch all-to-all, regroup
    by local expert, run the local experts, undo the regrouping and combine all-to-all back.

    Args:
        x_sorted: [M, H] this rank's token copies sorted by global expert.
        counts: [E] int64 copies per global expert (sums to M).
        experts: this rank's local experts: ``experts(x [R, H] sorted by local expert,
            counts [E / P] as a list of ints) -> [R, H]``.
        group: the expert-parallel group (P ranks); None or one rank calls
            ``experts(x_sorted, counts)`` directly with the counts tensor, so an expert
            implementation with device offsets (grouped GEMM) never syncs with the host.
        fp8_dispatch: the copies go out in fp8 with tile scales (`all_to_all`'s `fp8`); the
            combine comes back in the experts' output dtype.
        scale: optional [M] per-copy factor (the gate weights) that travels with the copies
            (one more all-to-all, as it comes) and is handed to the experts as
            ``experts(x, counts, scale)``.
    Returns: [M, H] expert outputs in `x_sorted`'s row order.
    """
    if group_size(group) == 1:
        return experts(x_sorted, counts) if scale is None else experts(x_sorted, counts, scale)
    splits = exchange_splits(counts, group)
    # dispatch: (R, H), rows ordered (source rank, local expert)
    x_recv = all_to_all(
        x_sorted, splits.output_splits, splits.input_splits, group, fp8=fp8_dispatch
    )
    order = _regroup_order(splits.recv_counts, x_sorted.device)  # (R,)
    if scale is None:
        y_local = experts(x_recv[order], splits.local_counts)  # (R, H) by local expert
    else:
        scale_recv = all_to_all(scale, splits.output_splits, splits.input_splits, group)  # (R,)
        y_local = experts(x_recv[order], splits.local_counts, scale_recv[order])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    # anchored on x_recv: a rank whose experts got no copies still joins the backward
    return all_to_all(
        y_local[inverse], splits.input_splits, splits.output_splits, group, anchor=x_recv
    )  # combine: (M, H) in x_sorted's row order
