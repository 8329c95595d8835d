"""Node-limited expert dispatch: a token crosses to another node once per node, not per copy.

DeepSeek-V3 (section 3.2.2) routes each token to experts on at most ``topk_group`` nodes and
sends it over InfiniBand once per destination node, to the GPU with the sender's index on that
node, which forwards it over NVLink to the GPUs holding its experts there; the combine goes the
reverse way, summed inside the node before it crosses back. The flat dispatch of
`nanotrain.parallel.expert` sends every routed copy to its expert's rank directly: with K
experts per token, up to K rows per token cross nodes.

An expert-parallel group of P ranks spread over ``nodes`` nodes (``per_node = P / nodes`` ranks
on each, in ep order) gets two kinds of group (`NodeGroups`): ``intra``, this rank's node's ep
ranks, and ``inter`` (the *rail*), the ep ranks with this rank's index on every node. Node n
holds the experts ``[n * E / nodes, (n + 1) * E / nodes)``, which is the flat ownership
(rank r holds ``[r * E / P, ...)``) seen node by node. One MoE layer, seen from one rank::

    h [N, H], topk_idx / topk_weight [N, K]
      1. pairs (node, token): each token once per node holding one of its experts, node-major
      2. rail all-to-all: the pairs' rows, their choices on that node (expert within the node,
         or -1) and weights                        -> rows [R, H] on the forwarding rank
      3. the rows' copies sorted by expert within the node; the flat dispatch over ``intra``
         (`run_experts_parallel`) runs them on their ranks and brings them back
      4. each row's copies, weighted by the experts, summed -> [R, H]
      5. rail all-to-all back, summed per token       -> y [N, H]

Every step is differentiable (the all-to-alls are `all_to_all`'s autograd functions), so the
backward retraces the same path: gradients cross nodes once per (token, node) too. In fp32 the
result equals the flat dispatch up to the order of the weighted sum. Where the rows cross in
bf16 the outputs and weight gradients are still those of the flat dispatch, but the input
gradient is summed per node before it crosses back, so each node's partial sum is rounded to
bf16 once (the flat dispatch rounds each copy's gradient instead): relative differences of
about 1e-3, as DeepSeek-V3's bf16 combine has.

Bytes crossing nodes per MoE layer and rank (`inter_node_bytes`): per (token, other node)
pair it sends, the row in the dispatch dtype, K choice ids (int32) and K weights (fp32)
forward and the combine's gradient backward; per pair it forwards for another node, the
combined row forward and the row's and weights' gradients backward; plus the counts exchange.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from nanotrain.parallel.expert import all_to_all, expert_counts, run_experts_parallel
from nanotrain.parallel.row_sum import index_add_rows

__all__ = ["NodeGroups", "inter_node_bytes", "node_split", "run_experts_node_limited"]


@dataclass(frozen=True)
class NodeGroups:
    """An expert-parallel group split by node, as this rank sees it.

    Attributes:
        nodes: nodes the ep group spans (at least 2).
        per_node: ep ranks on each node.
        node: this rank's node within the group (0-based, in ep order).
        intra: this rank's node's ep ranks, in ep order (None when ``per_node == 1``).
        inter: the ep ranks with this rank's index within their node, one per node, in node
            order (the rail).
    """

    nodes: int
    per_node: int
    node: int
    intra: ProcessGroup | None
    inter: ProcessGroup


def node_split(ep_ranks: list[int], ranks_per_node: int) -> tuple[int, int]:
    """(nodes, ep ranks per node) of an expert-parallel group whose global ranks are
    `ep_ranks` (in ep order), on nodes of `ranks_per_node` consecutive global ranks.

    Raises:
        ValueError: when the group's ranks do not fill its nodes in ep order with equally many
            ranks each (node-limited dispatch then has no rail to send along).
    """
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    node_of = [r // ranks_per_node for r in ep_ranks]
    blocks = [node_of.count(n) for n in sorted(set(node_of))]  # ep ranks on each node
    if node_of != sorted(node_of) or len(set(blocks)) != 1:
        raise ValueError(
            f"the expert-parallel group {ep_ranks} does not split evenly over nodes of "
            f"{ranks_per_node} ranks (ep ranks per node: {node_of}); node-limited dispatch needs "
            "the same number of the group's ranks on each of its nodes: pick ep and tp so that "
            "tp * ep is a multiple or a divisor of the ranks per node, or "
            "node_limited_dispatch=False"
        )
    return len(blocks), blocks[0]


def inter_node_bytes(
    sent_pairs: int,
    received_pairs: int,
    hidden: int,
    top_k: int,
    dispatch_bytes: int,
    combine_bytes: int,
    dispatch_grad_bytes: int | None = None,
) -> int:
    """Bytes one rank sends to other nodes for one MoE layer, forward and backward.

    `sent_pairs`: its (token, other node) pairs; `received_pairs`: the rows it forwards for
    other nodes' ranks. Out go, per sent pair, the dispatched row, the combine's gradient,
    K choice ids (int32) and K weights (fp32); per received pair, the combined row, the
    dispatch's gradient and the K weights' gradients. `dispatch_bytes` is a row's bytes per
    element on the way out (an fp8 row: its packed bytes / hidden), `dispatch_grad_bytes` its
    gradient's (default: the same). (The counts exchange, 16 bytes per other node, is left
    out.)"""
    grad = dispatch_bytes if dispatch_grad_bytes is None else dispatch_grad_bytes
    out = sent_pairs * hidden * (dispatch_bytes + combine_bytes)
    back = received_pairs * hidden * (combine_bytes + grad)
    return int(out + back + top_k * (8 * sent_pairs + 4 * received_pairs))


def run_experts_node_limited(
    h: Tensor,
    topk_idx: Tensor,
    topk_weight: Tensor,
    num_experts: int,
    experts: Callable[..., Tensor],
    groups: NodeGroups,
    for_dispatch: Callable[[Tensor], Tensor] = lambda x: x,
    fp8_dispatch: bool = False,
) -> Tensor:
    """The routed experts' weighted output per token, dispatched node-limited (module doc).

    Args:
        h: [N, H] this rank's tokens.
        topk_idx: [N, K] int64 global expert ids; topk_weight: [N, K] their gate weights.
        num_experts: E (divisible by the ep group's size).
        experts: this rank's local experts, as `run_experts_parallel` calls them.
        groups: the ep group's node split (`NodeGroups`).
        for_dispatch: the cast of the rows before they cross (e.g. to bf16).
        fp8_dispatch: the rows cross in fp8 with tile scales (both hops).
    Returns: [N, H] = sum_k topk_weight[t, k] * expert_{topk_idx[t, k]}(h[t]), in the experts'
        output dtype.
    """
    n, k = topk_idx.shape
    nodes = groups.nodes
    node_experts = num_experts // nodes
    node_of = topk_idx // node_experts  # (N, K)
    hits = F.one_hot(node_of, nodes).permute(2, 0, 1).bool()  # (nodes, N, K)
    pair_hit = hits.any(-1)  # (nodes, N)
    # per node: pairs and copies sent; one exchange of both over the rail, one host read
    sent = torch.stack([pair_hit.sum(1), hits.sum((1, 2))], 1)  # (nodes, 2)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=groups.inter)
    sizes = torch.cat([sent, received]).tolist()
    send_pairs = [row[0] for row in sizes[:nodes]]
    recv_pairs = [row[0] for row in sizes[nodes:]]
    recv_copies = sum(row[1] for row in sizes[nodes:])
    pair_node, pair_token = pair_hit.nonzero().unbind(1)  # (Q,) each, node-major
    here = node_of[pair_token] == pair_node[:, None]  # (Q, K): the choices on the pair's node
    local_idx = torch.where(here, topk_idx[pair_token] - pair_node[:, None] * node_experts, -1)
    weight = topk_weight[pair_token] * here  # (Q, K)
    # 2. across nodes, once per (token, node)
    rows = all_to_all(
        for_dispatch(h[pair_token]), recv_pairs, send_pairs, groups.inter, fp8=fp8_dispatch
    )  # (R, H)
    got_idx = all_to_all(local_idx.to(torch.int32), recv_pairs, send_pairs, groups.inter)
    got_weight = all_to_all(weight.float(), recv_pairs, send_pairs, groups.inter)  # (R, K)
    # 3. the copies by expert within the node (choices elsewhere sort last, as expert E_node)
    flat = got_idx.reshape(-1).long()
    flat = torch.where(flat < 0, node_experts, flat)  # (R*K,)
    slot = torch.argsort(flat, stable=True)[:recv_copies]  # (M,): stable keeps arrival order
    counts = expert_counts(flat[slot], node_experts)  # (E_node,)
    copy_row = slot // k  # (M,)
    # the copies made in h's dtype (fp32 under autocast) and cast after, as the flat dispatch
    # does: their gradients are summed per row in that dtype
    copies = rows.to(h.dtype)[copy_row].to(rows.dtype)  # (M, H)
    # the experts weigh their outputs (`GroupedExperts`' scale)
    w = got_weight.reshape(-1)[slot]  # (M,)
    y = run_experts_parallel(copies, counts, experts, groups.intra, fp8_dispatch, scale=w)
    # 4. summed per row, inside the node
    summed = index_add_rows(y, copy_row, rows.shape[0])  # (R, H)
    # 5. back across nodes once per pair, then summed per token; anchored on the rows, so a
    # rank that received none still joins the backward all-to-all
    back = all_to_all(summed, send_pairs, recv_pairs, groups.inter, anchor=rows)  # (Q, H)
    return index_add_rows(back, pair_token, n)  # (N, H)
