"""DeepSeekMoE (DeepSeek-V3 section 2.1.2): shared experts + fine-grained routed experts.

The routed path is four separate steps with plain tensors in between, so expert parallelism
only has to change where tokens go (an all-to-all between `dispatch` and `experts`):

    route    (router)  h [N, H]             -> topk_idx [N, K], topk_weight [N, K], scores [N, E]
    dispatch           h, topk_idx          -> x_sorted [N*K, H] grouped by expert, counts [E]
    experts            x_sorted, counts,    -> y_sorted [N*K, H], each copy's output times its
                       copy_weights            gate weight (applied to the activation, before
                                               the down projection)
    combine            y_sorted             -> y [N, H] (scatter-add in token order)

With an expert-parallel group, `experts` becomes `run_experts_parallel` (all-to-all to the
ranks owning the experts and back, `nanotrain.parallel.expert`). With a capacity factor the
copies go to fixed-size expert slots instead (`nanotrain.models.capacity_dispatch`), leaving
out those over each expert's capacity, with no host read.

Shape comments: B batch; T the positions of each sequence this rank holds (T / tp under
sequence parallelism); N = B*T tokens; H hidden; K experts per token; E routed experts (all
of them: the router scores every one); M token copies sent to experts (N*K, fewer when a
capacity drops some); with a capacity, C copies per expert and sequence and T_full the whole
sequence (T * tp once gathered under sequence parallelism, else T).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanotrain.models import expert_compute
from nanotrain.models.capacity_dispatch import (
    combine_from_slots,
    dispatch_to_slots,
    run_experts_in_slots,
    slot_positions,
    slot_weights,
)
from nanotrain.models.config import DeepSeekConfig
from nanotrain.models.expert_compute import GroupedExperts
from nanotrain.models.layers import SwiGLU
from nanotrain.models.recompute import is_recomputing
from nanotrain.parallel.collectives import (
    all_gather_along_dim,
    gather_from_sequence_parallel_region,
    group_rank,
    group_size,
    reduce_from_tensor_parallel_region,
)
from nanotrain.parallel.context import count_once
from nanotrain.parallel.expert import (
    expert_counts,
    mark_expert_params,
    peer_slot_counts,
    run_experts_parallel,
)
from nanotrain.parallel.fp8_wire import fp8_wire_roundtrip
from nanotrain.parallel.node_dispatch import NodeGroups, run_experts_node_limited
from nanotrain.parallel.row_sum import index_add_rows
from nanotrain.parallel.saved_rebuild import cast_in_region


@dataclass
class Dispatched:
    """Token copies sorted by expert (M = N*K copies, fewer when a capacity drops some).

    Attributes:
        x: [M, H] token copies, expert 0's first, then expert 1's, ...
        counts: [E] int64, how many copies each expert received (sums to M).
        token_index: [M] int64, the source token (row of the router input) of each copy.
        slot: [M] int64, flat index `token * K + k` of each copy's routing choice.
    """

    x: torch.Tensor
    counts: torch.Tensor
    token_index: torch.Tensor
    slot: torch.Tensor


class TopKRouter(nn.Module):
    """Scores tokens against experts and picks the top-K (group-limited) experts per token.

    Scores s = sigmoid(h W^T) or softmax(h W^T) in float32. Selection uses s + b, where b is the
    aux-loss-free balancing bias (`e_score_correction_bias`, a buffer: never a parameter, no
    gradient); the gate weights use s alone. With n_group > 1 only the `topk_group` groups with
    the highest group score are eligible: the sum of a group's two best (biased) scores for
    sigmoid (V3), its best score for softmax (V2). Selected weights are
    normalized to sum to one when `norm_topk_prob`, then multiplied by `routed_scaling_factor`.

    The bias stays float32 when the model is cast (`model.to(torch.bfloat16)`, bf16-true):
    its updates (gamma = 1e-3 a step) are smaller than bf16's spacing once |b| >= 0.5, so in
    bf16 the balancing would stall.

    Shapes: h [N, H] -> topk_idx [N, K] int64, topk_weight [N, K] float32, scores [N, E] float32.
    """

    def __init__(self, config: DeepSeekConfig, *, device: Any = None):
        super().__init__()
        self.config = config
        e = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(e, config.hidden_size, device=device))
        self.register_buffer("e_score_correction_bias", torch.zeros(e, device=device))

    def _apply(self, fn: Any, recurse: bool = True) -> TopKRouter:
        bias = self.e_score_correction_bias
        out = super()._apply(fn, recurse)
        moved = self.e_score_correction_bias
        if moved.dtype != bias.dtype and bias.dtype == torch.float32:
            self.e_score_correction_bias = bias.to(moved.device)  # the fp32 values, moved
        return out

    def scores(self, h: torch.Tensor) -> torch.Tensor:
        """Affinities s [N, E] in float32 (sigmoid or softmax of the router logits)."""
        # h in fp32 (under recompute "light" a copy of a rebuilt norm output is rebuilt too)
        logits = F.linear(cast_in_region(h, torch.float32), self.weight.float())  # (N, E)
        if self.config.scoring_func == "sigmoid":
            return logits.sigmoid()
        return logits.softmax(dim=-1)

    def select(self, choice: torch.Tensor) -> torch.Tensor:
        """Top-K expert indices [N, K] from selection scores [N, E], limited to the best groups."""
        c = self.config
        n = choice.shape[0]
        if c.n_group > 1:
            grouped = choice.view(n, c.n_group, -1)  # (N, groups, experts per group)
            if c.scoring_func == "sigmoid":
                # V3: a group's score is the sum of its two best (biased) affinities
                best = min(2, grouped.shape[-1])
                group_score = grouped.topk(best, dim=-1).values.sum(dim=-1)  # (N, groups)
            else:
                # V2 (softmax): a group's score is its best affinity
                group_score = grouped.amax(dim=-1)  # (N, groups)
            top_groups = group_score.topk(c.topk_group, dim=-1).indices  # (N, topk_group)
            keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, top_groups, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(n, -1)  # (N, E)
        return choice.topk(c.num_experts_per_tok, dim=-1).indices  # (N, K)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        scores = self.scores(h)  # (N, E)
        # the bias only steers which experts are chosen, never the weights (V3 eq. 16)
        topk_idx = self.select(scores.detach() + self.e_score_correction_bias.float())  # (N, K)
        weight = scores.gather(1, topk_idx)  # (N, K): the chosen experts' unbiased scores
        if c.norm_topk_prob:
            weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_idx, weight * c.routed_scaling_factor, scores


def dispatch(
    h: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, keep: torch.Tensor | None = None
) -> Dispatched:
    """Copy each token once per chosen expert and sort the copies by expert (stable).

    Args: h [N, H]; topk_idx [N, K] int64 in [0, num_experts); keep: optional [N*K] bool from
        `capacity_keep_mask` (dropped copies are left out; selecting them costs a host sync).
    Returns: `Dispatched` (see its fields; with `keep`, M = kept copies instead of N*K).
    """
    k = topk_idx.shape[1]
    flat = topk_idx.reshape(-1)  # (N*K,), indexed by slot token * K + k
    slot = torch.argsort(flat, stable=True)  # (N*K,): stable keeps token order within an expert
    if keep is not None:
        slot = slot[keep[slot]]  # (M,): the kept copies only
    token_index = slot // k  # (M,)
    # not torch.bincount: on CUDA it reads its input's max back to the host
    counts = expert_counts(flat[slot], num_experts)  # (E,)
    return Dispatched(h[token_index], counts, token_index, slot)  # x: (M, H)


def combine(y_sorted: torch.Tensor, dispatched: Dispatched, num_tokens: int) -> torch.Tensor:
    """Sum of each token's expert outputs, back in token order: y_t = sum_k y_{t,k}, the
    outputs already weighted by their gate weights (the experts' `scale`). Backward keeps
    only the token index (`index_add_rows`).

    Args: y_sorted [M, H] in `dispatched` order; num_tokens N.
    Returns: [N, H] in y_sorted's dtype.
    """
    return index_add_rows(y_sorted, dispatched.token_index, num_tokens)  # (N, H)


def copy_weights(topk_weight: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
    """Each routed copy's gate weight g_{t,k}, in `dispatched` order: [M] from topk_weight
    [N, K] (its dtype)."""
    return topk_weight.reshape(-1)[dispatched.slot]


def sequence_balance_loss(
    scores: torch.Tensor,
    topk_idx: torch.Tensor,
    batch: int,
    alpha: float,
    sequence_group: Any = None,
    context_group: Any = None,
) -> torch.Tensor:
    """Sequence-wise balance loss (DeepSeek-V3 eqs. 17-20), averaged over the batch.

    L = alpha * sum_i f_i P_i per sequence, f_i = E / (K T) * #{t : expert i chosen for t},
    P_i = mean_t s'_{i,t}, s' = scores normalized to sum to one over experts.

    Args:
        scores: [B*T_local, E] unbiased affinities; topk_idx: [B*T_local, K]; batch: B.
        alpha: the loss weight.
        sequence_group: under sequence parallelism, the tensor-parallel group whose ranks hold
            the other T_local-long parts of the same B sequences (T = T_local * group size);
            None when this rank holds whole sequences.
        context_group: under context parallelism, the group whose ranks hold the other
            chunks of the same B sequences (summed after `sequence_group`). Every rank of it
            then computes the whole loss but backpropagates only its own tokens' part, while
            the strategy weighs each rank's copy as separate sequences: the gradient is
            scaled by the group's size (`nanotrain.parallel.context.count_once`).
    Returns: scalar tensor, the same on every rank of `sequence_group` and `context_group`.
    """
    n, e = scores.shape
    k = topk_idx.shape[1]
    t_local = n // batch
    probs = scores / scores.sum(dim=-1, keepdim=True)
    prob_sum = probs.view(batch, t_local, e).sum(dim=1)  # (B, E)
    hits = torch.zeros(batch, e, device=scores.device, dtype=scores.dtype)  # (B, E)
    hits.scatter_add_(
        1,
        topk_idx.view(batch, t_local * k),  # (B, T_local * K): each sequence's choices
        torch.ones_like(hits[:, :1]).expand(-1, t_local * k),
    )
    # Whole-sequence statistics: sum both per-sequence sums over the ranks holding the other
    # parts of each sequence (one all-reduce). Its backward is the identity, which is exact:
    # the loss is linear in each rank's prob_sum, so every rank backpropagates d L / d P into
    # its own tokens, and the router's grad is then summed over tp like any replicated grad.
    # stats: (2, B, E)
    stats = reduce_from_tensor_parallel_region(torch.stack([hits, prob_sum]), sequence_group)
    stats = reduce_from_tensor_parallel_region(stats, context_group)
    hits, prob_sum = stats.unbind(0)  # each (B, E), over whole sequences
    t = t_local * group_size(sequence_group) * group_size(context_group)
    f = hits * (e / (k * t))
    return count_once(alpha * (f * (prob_sum / t)).sum(dim=-1).mean(), context_group)


def expert_capacity(config: Any, num_tokens: int) -> int | None:
    """Copies each routed expert accepts from a group of `num_tokens` tokens under the config's
    capacity factor f: ceil(f * N * K / E); None when dropless (no factor, or a dense config).
    The planner prices the E x C slots per sequence with it too."""
    f = getattr(config, "capacity_factor", None)
    if f is None:
        return None
    return math.ceil(f * num_tokens * config.num_experts_per_tok / config.n_routed_experts)


class DeepSeekMoE(nn.Module):
    """Shared experts + routed experts + router; counts expert load for aux-loss-free balancing.

    `expert_load` (a non-persistent int64 buffer [E], so `model.to(bfloat16)` leaves it exact)
    accumulates how many token copies the router sent to each of ALL E experts in
    training-mode forwards since `reset_load()`, before any capacity drop; `dropped_tokens`
    (int64 scalar, same rules) counts the copies a capacity limit dropped.

    Tensor parallelism splits the shared experts' width; the router is replicated. With
    `sequence_parallel` every part runs on this rank's tokens [B, T / tp, H] (except, with a
    capacity factor, the routed experts, which run on the gathered whole sequences),
    `expert_load` counts only those tokens (sum it over tp:
    `nanotrain.models.balance.moe_balance_step` does), the balance loss sums its
    per-sequence statistics over tp, and the router's and routed experts' grads are partial
    sums over tp (the strategy sums the grads of tp-replicated parameters).

    Expert parallelism (`ep_group` of P ranks) gives this rank only the routed experts
    [ep_rank * E / P, (ep_rank + 1) * E / P); the router still scores all E, and token copies
    travel to their experts' ranks and back by all-to-all (`nanotrain.parallel.expert`), or,
    with `node_groups` set and no capacity factor, once per node and on inside it
    (`nanotrain.parallel.node_dispatch`).
    The routed experts' parameters are always tagged with `mark_expert_params`.

    `config.capacity_factor` f (None = dropless) caps each expert at
    C = ceil(f * T * K / E) copies of each sequence's T tokens, dropping the rest (policy:
    `capacity_keep_mask`, one group per sequence), in training and evaluation alike; the
    kept copies run in fixed E x B x C slots (`nanotrain.models.capacity_dispatch`). Per
    whole sequence, so the drops do not depend on the layout: under sequence parallelism the
    routed part gathers the sequences first (see `_routed_in_slots`).

    Shapes: forward(x [B, T, H]) -> (y [B, T, H], aux_loss scalar). aux_loss is the
    sequence-wise balance loss times alpha (0 when alpha is 0 or in eval mode).

    Raises:
        ValueError: if the ep group's size does not divide n_routed_experts.
    """

    def __init__(
        self,
        config: DeepSeekConfig,
        *,
        tp_group: Any = None,
        ep_group: Any = None,
        device: Any = None,
        sequence_parallel: bool = False,
        cp_group: Any = None,
    ):
        super().__init__()
        c = config
        self.config = c
        # the group holding the rest of each sequence (None: this rank holds whole sequences)
        self.sequence_group = tp_group if sequence_parallel else None
        # the context-parallel ranks holding the other chunks of each sequence (or None)
        self.context_group = cp_group
        self.ep_group = ep_group
        # the ep group split by node (`nanotrain.models.build` sets it from the mesh): the
        # dropless dispatch is then node-limited
        self.node_groups: NodeGroups | None = None
        self.gate = TopKRouter(c, device=device)
        self.experts = GroupedExperts(
            c.n_routed_experts,
            c.hidden_size,
            c.moe_intermediate_size,
            ep_size=group_size(ep_group),
            ep_rank=group_rank(ep_group),
            device=device,
        )
        mark_expert_params(self.experts)  # (GroupedExperts re-tags after to_empty / .to())
        self.shared_experts = None
        if c.n_shared_experts > 0:
            width = c.n_shared_experts * c.moe_intermediate_size
            self.shared_experts = SwiGLU(
                c.hidden_size,
                width,
                tp_group=tp_group,
                device=device,
                sequence_parallel=sequence_parallel,
            )
        e = c.n_routed_experts
        for name, shape in (("expert_load", (e,)), ("dropped_tokens", ())):
            self.register_buffer(
                name, torch.zeros(shape, dtype=torch.long, device=device), persistent=False
            )

    def reset_load(self) -> None:
        """Zero the expert load and dropped-copy counters."""
        self.expert_load.zero_()
        self.dropped_tokens.zero_()

    def capacity(self, num_tokens: int) -> int | None:
        """Copies each expert accepts from a group of `num_tokens` tokens (`expert_capacity`).
        The forward's groups are its sequences."""
        return expert_capacity(self.config, num_tokens)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, hidden = x.shape
        e = self.config.n_routed_experts
        h = x.reshape(b * t, hidden)  # (N, H)
        topk_idx, topk_weight, scores = self.gate(h)  # (N, K), (N, K), (N, E)
        keep = None
        if self.config.capacity_factor is None and self.node_groups is not None:
            y = run_experts_node_limited(
                h, topk_idx, topk_weight, e, self.experts, self.node_groups,
                self.experts.for_dispatch, self.experts.dispatches_fp8,
            ).view(b, t, hidden)  # fmt: skip
        elif self.config.capacity_factor is None:  # dropless: copies sorted by expert
            d = dispatch(h, topk_idx, e)  # d.x: (N*K, H) sorted by expert
            x_sorted = self._for_dispatch(d.x)  # (N*K, H), the dtype it crosses ranks in
            # the experts weigh their outputs by the copies' gate weights, which travel along
            y_sorted = run_experts_parallel(
                x_sorted, d.counts, self.experts, self.ep_group, self.experts.dispatches_fp8,
                scale=copy_weights(topk_weight, d),
            )  # fmt: skip
            y = combine(y_sorted, d, b * t).view(b, t, hidden)  # (B, T, H)
        else:  # fixed slots: training reads nothing from the device
            y, keep = self._routed_in_slots(x, topk_idx, topk_weight)  # (B, T, H), (N*K,)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        aux = x.new_zeros((), dtype=torch.float32)
        if self.training:
            if not is_recomputing():  # a recomputed forward must not count its tokens again
                # routing demand over all E experts (the router is replicated), drops or not
                self.expert_load += expert_counts(topk_idx.reshape(-1), e)
                if keep is not None:
                    self.dropped_tokens += keep.numel() - keep.sum()
            if self.config.aux_loss_alpha > 0:
                alpha = self.config.aux_loss_alpha
                aux = sequence_balance_loss(
                    scores, topk_idx, b, alpha, self.sequence_group, self.context_group
                )
        return y, aux

    def _for_dispatch(self, copies: torch.Tensor) -> torch.Tensor:
        """The routed copies [M, H] as they cross the ep group (`GroupedExperts.for_dispatch`:
        bf16 under bf16 autocast); without expert parallelism they stay as they are, unless
        the dispatch is in fp8 (`GroupedExperts.dispatches_fp8`): they then get the wire's
        rounding without the wire, as under every other layout. Cast after the copies are
        made, so their gradients are summed per token in fp32."""
        if group_size(self.ep_group) == 1:
            if self.experts.dispatches_fp8:  # the values the fp8 wire would deliver
                return fp8_wire_roundtrip(self.experts.for_dispatch(copies))
            return copies
        return self.experts.for_dispatch(copies)

    def _routed_in_slots(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed experts on fixed E x B x C slots, C per whole sequence.

        Args: x [B, T, H] (T / tp under sequence parallelism); topk_idx, topk_weight
            [B*T, K] of x's tokens.
        Returns: (y [B, T, H], keep [B*T*K] bool of x's tokens' routing choices).
        """
        b, t, hidden = x.shape
        k = topk_idx.shape[-1]
        group = self.sequence_group
        tp = group_size(group)
        if tp > 1:
            # This rank holds T / tp tokens of each sequence. Drops are decided per whole
            # sequence, as on one rank, so gather the sequences: the routed experts then run
            # on all T tokens on every tp rank, as tensor parallelism without SP does. The
            # gathers' backward reduce-scatters the partial gradients of this rank's outputs.
            x = gather_from_sequence_parallel_region(x, group, 1)  # (B, T_full, H)
            # topk_weight, topk_idx: (B, T, K) -> (B, T_full, K)
            topk_weight = gather_from_sequence_parallel_region(topk_weight.view(b, t, k), group)
            topk_idx = all_gather_along_dim(topk_idx.view(b, t, k), 1, group)
        full_t, e = x.shape[1], self.config.n_routed_experts
        capacity = self.capacity(full_t)
        idx, weight = topk_idx.reshape(-1, k), topk_weight.reshape(-1, k)  # (B*T_full, K) each
        position, keep = slot_positions(idx, weight, e, capacity, groups=b)  # (B*T_full*K,) each
        # (E*B*C, H): expert e's slots are rows [e*B*C, (e+1)*B*C), sequence g's C at g*C
        x_slots = dispatch_to_slots(x.reshape(-1, hidden), idx, position, e * b * capacity)
        x_slots = self._for_dispatch(x_slots)  # the dtype it crosses ranks in
        # Batches may differ in shape between ranks: a last, partial evaluation batch, or
        # data padded per batch. Learning the peers' slot counts costs a host read, free on
        # the CPU but a device wait per layer on CUDA, where training relies on the one
        # micro batch shape instead (docs/parallelism.md). The exchange runs eagerly and
        # breaks a compiled graph, so compiled training relies on that shape on the CPU too.
        peers = None
        compiled = torch.compiler.is_compiling()
        exchange = not self.training or (expert_compute.reads_sizes_first(x) and not compiled)
        if exchange and group_size(self.ep_group) > 1:
            peers = peer_slot_counts(b * capacity, self.ep_group, x.device)
        # (E*B*C, H) in x_slots' row order, weighted by each slot's gate weight
        y_slots = run_experts_in_slots(
            x_slots,
            e,
            b * capacity,
            self.experts,
            self.ep_group,
            peers,
            self.experts.dispatches_fp8,
            scale=slot_weights(weight, position, e * b * capacity),
        )
        # (B, T_full, H)
        y = combine_from_slots(y_slots, position, b * full_t).view(b, full_t, hidden)
        if tp > 1:  # this rank's tokens: slicing sends no gradient to the others' outputs
            start = group_rank(group) * t
            y = y[:, start : start + t]  # (B, T, H)
            keep = keep.view(b, full_t, k)[:, start : start + t].reshape(-1)  # (B*T*K,)
        return y, keep
