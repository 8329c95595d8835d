"""Bytes one rank sends per optimizer step, per process group, under a `PlanLayout`.

The model follows the code paths of `MegatronStrategy` collective by collective (see
docs/planning.md, "Communication per step", for every formula and its source):

* **tp** (`nanotrain.planning.communication_tp`): the tensor-parallel collectives of every
  module this rank runs, per microbatch: the vocab-parallel embedding, each attention and MLP
  block's input and output collective (Shoeybi et al. 2019; under sequence parallelism
  Korthikanti et al. 2022), the LM head and vocab-parallel cross-entropy, once more per MTP
  depth, and recomputed forward collectives; and once per step the sum over tp of the grads
  of tp-replicated parameters under SP.
* **pp**: the activation sent forward and its gradient sent back at every virtual-stage
  boundary, per microbatch, counted from the code's own schedule (Narayanan et al. 2021).
* **ep**: per MoE layer and microbatch the split-size exchange and the dispatch and combine
  all-to-alls, each again in backward, for balanced routing (DeepSeek-V3 section 3.2). Under
  node-limited dispatch (`nanotrain.parallel.node_dispatch`) **ep_inter** holds the hop between
  nodes (once per token and node it reaches, with the choices and weights) and **ep** the hop
  inside the node (every copy to its expert's rank).
* **dp** / **expert_dp**: per gradient bucket an all-reduce (ZeRO-0/1) or reduce-scatter
  (ZeRO-2) in the reduce dtype over the padded flat buffer, and under ZeRO-1/2 an all-gather
  of the parameters in their dtype (Rajbhandari et al. 2020).
* **embedding**: the first and last stage's sum of a shared embedding's gradient.
* **other**: the strategy's bookkeeping reductions for a `LanguageModelModule` (loss counts
  and sums, pipeline loss terms, grad-norm squares, MoE loads), split by group in
  `CommEstimate.other_by_group`; callbacks' and logging's own reductions are left out.

Bytes on the wire follow the ring model of `nanotrain.planning.comm_meter`: an all-reduce of N
bytes over g ranks sends 2(g-1)/g N, an all-gather or reduce-scatter (g-1)/g N of the full
tensor, a point-to-point send N, an all-to-all the rows that leave the rank.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from nanotrain.models.moe import expert_capacity
from nanotrain.parallel.data_parallel import FlatLayout
from nanotrain.parallel.fp8_wire import fp8_row_bytes
from nanotrain.parallel.placement import StagePlacement
from nanotrain.parallel.tensor import pad_vocab_size
from nanotrain.planning import zero3
from nanotrain.planning.communication_tp import (
    is_moe_layer,
    mtp_is_moe,
    sp_grad_numel,
    tp_collectives,
)
from nanotrain.planning.layout import PlanLayout, Workload, pipeline_actions
from nanotrain.planning.memory import element_size, gather_dtype
from nanotrain.planning.rank_model import RankModel, rank_models
from nanotrain.strategies.megatron_grads import bucket_numel_for

__all__ = ["GROUPS", "CommEstimate", "WireDtypes", "comm_estimate", "wire_dtypes"]

#: the groups of `CommEstimate.bytes_per_step`
GROUPS = ("tp", "pp", "ep", "ep_inter", "dp", "expert_dp", "embedding", "host", "other")


@dataclass(frozen=True)
class CommEstimate:
    """What one rank sends per optimizer step.

    Attributes:
        bytes_per_step: wire bytes by group (`GROUPS`); "other" is the bookkeeping estimate.
        calls_per_step: collectives (point-to-point: sends) by group, for a latency term.
        detail: the formula of each group, in words and numbers.
        other_by_group: the process groups "other"'s bytes travel on ("tp", "pp", "dp",
            "ep"), so that what a `CommMeter` counts on group g is ``on_group(g)``.
    """

    bytes_per_step: dict[str, float]
    calls_per_step: dict[str, int]
    detail: dict[str, str]
    other_by_group: dict[str, float] = field(default_factory=dict)

    def total(self) -> float:
        """Wire bytes summed over every group."""
        return sum(self.bytes_per_step.values())

    def on_group(self, group: str) -> float:
        """Everything sent on process group `group`: its own bytes plus its share of
        "other" (what a `CommMeter` measures there)."""
        return self.bytes_per_step.get(group, 0.0) + self.other_by_group.get(group, 0.0)


@dataclass(frozen=True)
class WireDtypes:
    """Bytes per element of what each kind of collective carries.

    Attributes:
        act: the residual stream and norm outputs (tp input collectives, pp).
        matmul: linear-layer outputs (tp output collectives, ep combine): the autocast dtype.
        dispatch: the routed copies sent to the experts' ranks: the dtype the experts' GEMMs
            read them in (`GroupedExperts.for_dispatch`), the autocast dtype unless an
            emulated precision quantizes the experts' fp32 inputs itself; 1 under
            "fp8-emulated", whose copies cross in fp8 plus their tile scales
            (`dispatch_fp8`).
        param: parameters (embedding output, ZeRO all-gather, pp buffers).
        grad: the gradient buffer (fp32 main grads under bf16-true).
        reduce: the data-parallel gradient reduction.
        dispatch_grad: the copies' gradients sent back in backward (None: as `dispatch`).
        dispatch_fp8: the copies go out as `nanotrain.parallel.fp8_wire` rows.
    """

    act: int
    matmul: int
    dispatch: int
    param: int
    grad: int
    reduce: int
    dispatch_grad: int | None = None
    dispatch_fp8: bool = False

    def dispatch_row(self, hidden: int) -> int:
        """Bytes one routed copy of `hidden` values takes on its way to the experts."""
        return fp8_row_bytes(hidden) if self.dispatch_fp8 else hidden * self.dispatch

    def dispatch_grad_row(self, hidden: int) -> int:
        """Bytes one copy's gradient takes on its way back in backward."""
        width = self.dispatch if self.dispatch_grad is None else self.dispatch_grad
        return hidden * width


def wire_dtypes(
    precision: str, reduce_dtype: torch.dtype = torch.float32, fp8_dispatch: bool = False
) -> WireDtypes:
    """The `WireDtypes` of a Trainer precision name (`nanotrain.planning.PRECISIONS`), with
    the routed copies in fp8 rows when `fp8_dispatch` (`LanguageModelModule(fp8_dispatch=)`;
    their gradients return in the dispatch dtype the precision has otherwise).

    Under autocast ("bf16-mixed", "16-mixed", the emulated formats, Transformer Engine,
    torchao's float8) the parameters stay fp32, so do the embedding output, norms and residual
    stream; linear outputs and the experts' dispatched inputs are 16-bit, except under the
    emulated formats, whose experts quantize fp32 inputs: "fp8-emulated" dispatches them in
    fp8 with tile scales (their gradients return in fp32), "fp4-emulated" in fp32.
    "bf16-true" is bf16 everywhere but the fp32 gradient buffer. With a precision policy that
    keeps the routed experts high the dispatch is fp32 too; the plan assumes the default
    policy.
    """
    reduce = torch.tensor([], dtype=reduce_dtype).element_size()
    if precision == "fp8-emulated":
        return WireDtypes(4, 2, 1, 4, 4, reduce, dispatch_grad=4, dispatch_fp8=True)
    if precision == "32-true":
        wire = WireDtypes(4, 4, 4, 4, 4, 4)
    elif precision == "bf16-true":
        wire = WireDtypes(2, 2, 2, 2, 4, reduce)
    else:
        wire = WireDtypes(4, 2, 4 if precision.endswith("-emulated") else 2, 4, 4, reduce)
    if not fp8_dispatch:
        return wire
    return replace(wire, dispatch=1, dispatch_grad=wire.dispatch, dispatch_fp8=True)


@dataclass
class _Tally:
    """Bytes, calls and formula pieces gathered for one group."""

    bytes: float = 0.0
    calls: int = 0
    parts: list[str] = field(default_factory=list)

    def add(self, wire: float, calls: int, text: str | None = None) -> None:
        self.bytes += wire
        self.calls += calls
        if text:
            self.parts.append(text)


def _ring(op: str, g: int) -> float:
    """Wire bytes per byte of the full tensor (ring model)."""
    return 2 * (g - 1) / g if op == "all_reduce" else (g - 1) / g


def _mib(n: float) -> str:
    return f"{n / 2**20:.3f} MiB"


def _tp(
    config: Any, layout: PlanLayout, workload: Workload, rank: RankModel, dt: WireDtypes
) -> _Tally:
    """tp bytes of one step on pipeline rank `rank.pp_rank` (see `communication_tp`)."""
    tally, t = _Tally(), layout.tp
    if t == 1:
        return tally
    tokens = workload.micro_batch_size * workload.seq_len
    colls = tp_collectives(config, layout, workload, rank, dt)
    micro = workload.num_microbatches(layout)
    per_micro = sum(c.wire(t) for c in colls)
    tally.add(
        micro * per_micro,
        micro * len(colls),
        f"{micro} microbatches x {len(colls)} collectives of b*s={tokens} tokens "
        f"({_mib(per_micro)} each microbatch)",
    )
    if layout.sequence_parallel:
        numel = sp_grad_numel(rank, layout)
        if numel:
            wire = _ring("all_reduce", t) * numel * dt.grad
            tally.add(wire, 1, f"SP grads of {numel:.0f} tp-replicated elements summed over tp")
    return tally


def _moe_layers(config: Any, layout: PlanLayout, rank: RankModel, full_only: bool = False) -> int:
    """MoE layers this pipeline rank runs (its decoder layers and, last, the MTP blocks);
    with `full_only`, those of them that recompute "full" (and so run their all-to-alls
    again in backward)."""
    count = sum(
        is_moe_layer(config, i)
        for chunk in rank.chunks
        for i, mode in zip(chunk, layout.chunk_recomputes(chunk), strict=True)
        if not full_only or mode == "full"
    )
    if layout.placement.holds_last(rank.pp_rank) and mtp_is_moe(config):
        if not full_only or layout.recompute == "full":
            count += getattr(config, "mtp_depth", 0)
    return count


def _pp(
    layout: PlanLayout, workload: Workload, config: Any, pp_rank: int, dt: WireDtypes
) -> _Tally:
    """Activations sent forward and their gradients sent back at virtual-stage boundaries
    between two ranks (a V's turn stays on its rank)."""
    tally = _Tally()
    if layout.pp == 1:
        return tally
    micro = workload.num_microbatches(layout)
    sends = _pp_sends(layout.schedule, micro, layout.pp, pp_rank, layout.virtual_pp)
    seq = workload.seq_len // (layout.tp if layout.sequence_parallel else 1)
    size = workload.micro_batch_size * seq * config.hidden_size * dt.param
    tally.add(sends * size, sends, f"{sends} sends of [b, s, h] = {_mib(size)}")
    return tally


@functools.lru_cache(maxsize=4096)
def _pp_sends(schedule: str | None, micro: int, pp: int, pp_rank: int, virtual_pp: int) -> int:
    """Activations and input gradients pipeline rank `pp_rank` sends to another rank in one
    step of `schedule` (cached: a search prices many layouts of one pipeline shape)."""
    placement = StagePlacement.for_schedule(schedule, pp, virtual_pp)

    def crosses(to: int) -> bool:
        return 0 <= to < placement.num_virtual and placement.locate(to)[0] != pp_rank

    sends = 0
    for a in pipeline_actions(schedule, micro, pp, pp_rank, virtual_pp):
        stage = placement.stage(pp_rank, a.chunk)
        sends += (a.kind == "F" and crosses(stage + 1)) or (
            a.sends_input_grad and crosses(stage - 1)
        )
    return sends


def nodes_reached(config: Any, nodes: int) -> float:
    """Nodes one token's experts sit on, on average, when the E experts fill `nodes` nodes in
    order and routing is balanced: the router picks `topk_group` of `n_group` groups (whole
    groups per node when nodes divide n_group) and K experts among them, each chosen group
    given at least one (DeepSeek-V3: 4 of 8 nodes). Without groups, K experts at random."""
    k, e = config.num_experts_per_tok, config.n_routed_experts
    groups = getattr(config, "n_group", 1)
    if groups > 1 and groups % nodes == 0:
        per_node, chosen = groups // nodes, config.topk_group
        missed = math.comb(groups - per_node, chosen) / math.comb(groups, chosen)
    else:
        missed = math.comb(e - e // nodes, k) / math.comb(e, k)
    return min(float(k), nodes * (1 - missed))


def _ep(
    config: Any,
    layout: PlanLayout,
    workload: Workload,
    rank: RankModel,
    dt: WireDtypes,
    ranks_per_node: int | None = None,
) -> dict[str, _Tally]:
    """Split exchange, dispatch and combine all-to-alls (each again in backward; the forward
    ones again under full recompute), balanced routing. With a capacity factor: the E x B x C
    slots of whole sequences, and no split exchange (the splits are known). Node-limited
    (`PlanLayout.ep_nodes` on nodes of `ranks_per_node`): "ep_inter" the rows between nodes
    (`nodes_reached` per token, with their choices and weights), "ep" the copies inside the
    node."""
    out = {"ep": _Tally(), "ep_inter": _Tally()}
    ep = layout.ep
    layers = _moe_layers(config, layout, rank)
    if ep == 1 or layers == 0:
        return out
    tokens = workload.micro_batch_size * workload.seq_len
    capacity = expert_capacity(config, workload.seq_len)
    k, h, e = config.num_experts_per_tok, config.hidden_size, config.n_routed_experts
    if capacity is None:
        if layout.sequence_parallel:
            tokens //= layout.tp
        copies = tokens * k
        split_bytes = 8  # int64 counts per expert
    else:  # E x B x C slots of whole sequences
        copies = e * workload.micro_batch_size * capacity
        split_bytes = 0
    micro = workload.num_microbatches(layout)
    rerun = _moe_layers(config, layout, rank, full_only=True)  # forwards again in backward
    node_split = layout.ep_nodes(config, ranks_per_node)
    group, experts = ep, e
    if node_split is not None:
        nodes, group = node_split
        experts = e // nodes
        pairs = tokens * nodes_reached(config, nodes) * (nodes - 1) / nodes  # leave the node
        forward = pairs * (dt.dispatch_row(h) + h * dt.matmul + 8 * k) + 16 * (nodes - 1)
        backward = pairs * (dt.dispatch_grad_row(h) + h * dt.matmul + 4 * k)
        # 5 forward (counts, rows, ids, weights, combine), 3 backward
        per_layer, calls = forward + backward, 8
        out["ep_inter"].add(
            micro * (layers * per_layer + rerun * forward),
            micro * (layers * calls + rerun * 5),
            f"{micro} microbatches x {layers} MoE layers x {pairs:.0f} (token, node) rows to "
            f"other nodes of {nodes} ({nodes_reached(config, nodes):.2f} nodes per token; "
            "dispatch + combine, forward + backward, with choices and weights)",
        )
    if group == 1:
        return out
    ring = (group - 1) / group
    split_calls = 1 if split_bytes else 0
    rows = copies * ring  # copies (or slots) that leave the rank
    # each row with its gate weight (fp32, its own all-to-all; its gradient comes back)
    forward = ring * experts * split_bytes + rows * (dt.dispatch_row(h) + h * dt.matmul + 4)
    backward = rows * (dt.dispatch_grad_row(h) + h * dt.matmul + 4)
    per_layer, calls = forward + backward, 6 + split_calls
    where = "ep ranks" if node_split is None else "ranks of the node"
    out["ep"].add(
        micro * (layers * per_layer + rerun * forward),
        micro * (layers * calls + rerun * (3 + split_calls)),
        f"{micro} microbatches x {layers} MoE layers x {rows:.0f} token copies out of "
        f"{copies} sent to other {where} (dispatch with gate weights + combine, forward + "
        "backward)" + (" + split sizes" if split_calls else ""),
    )
    return out


def _zero3(
    layout: PlanLayout, rank: RankModel, dt: WireDtypes, micro: int, gather: int
) -> dict[str, _Tally]:
    """ZeRO-3 (FSDP2), per FSDP unit (`zero3.zero3_units`): all-gathers of its padded shards
    in the gather dtype (`gather` bytes, `memory.gather_dtype`), as many as
    `zero3.gathers_per_step` counts (every microbatch in forward and, for blocks and expert
    stacks with ``reshard_after_forward``, again in backward; fewer under a split-backward
    schedule, which keeps the gathered copies from each backward); one reduce-scatter of its gradient per step, in
    the reduce dtype, on the last microbatch (the strategy syncs gradients only there), or one
    per microbatch with ``reduce_scatter_every_microbatch``.
    Wire bytes of a group of g: ``(g - 1) x shard`` each. With ``cpu_offload`` the fp32
    shards cross PCIe ("host"): to the GPU before each all-gather, the gradient shard back
    after the reduce-scatter."""
    out = {"dp": _Tally(), "expert_dp": _Tally(), "host": _Tally()}
    units = zero3.zero3_units(rank)
    root_gathers, gathers = zero3.gathers_per_step(layout, micro, rank.pp_rank)
    reduces = micro if layout.reduce_scatter_every_microbatch else 1
    for name, group, unit_list, passes in (
        ("dp", layout.dp, [units.root] if units.root else [], root_gathers),
        ("dp", layout.dp, units.blocks, gathers),
        ("expert_dp", layout.expert_dp, units.experts, gathers),
    ):
        shard = sum(zero3.sharded_numel(u, group) for u in unit_list)
        n = len(unit_list)
        if not n:
            continue
        if group > 1:
            out[name].add(
                passes * (group - 1) * shard * gather,
                passes * n,
                f"{passes} all-gathers of {n} units ({shard} shard elements x {gather} B)",
            )
            out[name].add(
                reduces * (group - 1) * shard * dt.reduce,
                reduces * n,
                f"{reduces} reduce-scatters of {n} units x {dt.reduce} B",
            )
        if layout.cpu_offload:
            out["host"].add(
                (passes + reduces) * shard * 4,
                (passes + reduces) * n,
                f"{passes} copies of {n} fp32 shards in, their gradients out",
            )
    return out


def _dp(
    layout: PlanLayout, rank: RankModel, dt: WireDtypes, micro: int = 1, gather: int = 2
) -> dict[str, _Tally]:
    """Per bucket: grad all-reduce / reduce-scatter (ZeRO-2) in the reduce dtype; under ZeRO
    an all-gather of the updated parameters in their dtype. Dense over dp, experts over
    expert-dp; the padded flat buffers of `RankModel.flat_numels`. ZeRO-3: `_zero3`."""
    if layout.zero_stage == 3:
        return _zero3(layout, rank, dt, micro, gather)
    out = {"dp": _Tally(), "expert_dp": _Tally()}
    bucket = bucket_numel_for(dt.param, layout.bucket_size_mb)
    for name, params, g in (
        ("dp", rank.dense, layout.dp),
        ("expert_dp", rank.experts, layout.expert_dp),
    ):
        if g == 1 or not params:
            continue
        flat = FlatLayout(params, g, bucket)
        n = len(flat.buckets)
        op = "reduce_scatter" if layout.zero_stage == 2 else "all_reduce"
        out[name].add(
            _ring(op, g) * flat.numel * dt.reduce,
            n,
            f"{op} of {n} buckets, {flat.numel} padded elements x {dt.reduce} B",
        )
        if layout.zero_stage:
            out[name].add(
                _ring("all_gather", g) * flat.numel * dt.param,
                n,
                f"ZeRO all-gather of the parameters x {dt.param} B",
            )
    return out


def _embedding(config: Any, layout: PlanLayout, pp_rank: int, dt: WireDtypes) -> _Tally:
    """The first and last stage sum the grad of the embedding both hold (MTP or tied; not
    when one rank holds both, as in a V)."""
    tally = _Tally()
    shared = getattr(config, "mtp_depth", 0) > 0 or config.tie_word_embeddings
    placement = layout.placement
    ends = {placement.locate(0)[0], placement.locate(placement.num_virtual - 1)[0]}
    if layout.pp == 1 or not shared or pp_rank not in ends or len(ends) == 1:
        return tally
    numel = pad_vocab_size(config.vocab_size, layout.tp) // layout.tp * config.hidden_size
    tally.add(numel * dt.grad, 1, f"all-reduce over 2 ranks of {numel} embedding-grad elements")
    return tally


def _other(
    config: Any, layout: PlanLayout, workload: Workload, rank: RankModel
) -> dict[str, _Tally]:
    """Bookkeeping reductions of `MegatronStrategy` + `LanguageModelModule` (float64 /
    int64 tensors of a few elements each): loss counts and sums over dp, the pipeline's loss
    terms over pp and dp, the grad-norm squares (one float64 per parameter) over tp, the ZeRO-2
    group and ep, the MoE loads [L, E + 1] over tp (SP) and dp."""
    out = {g: _Tally() for g in ("tp", "pp", "dp", "ep", "expert_dp")}
    size = {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "ep": layout.ep}
    size["expert_dp"] = layout.expert_dp

    def all_reduce(group: str, numel: int, itemsize: int = 8) -> None:
        if size[group] > 1:
            out[group].add(_ring("all_reduce", size[group]) * numel * itemsize, 1)

    terms, micro = 2 + getattr(config, "mtp_depth", 0), workload.num_microbatches(layout)
    all_reduce("dp", terms + 2)  # the global counts of every loss term, tokens, samples
    all_reduce("dp", terms)  # the step's loss sums
    if layout.pp > 1:
        all_reduce("pp", 6 * micro)  # per-microbatch loss terms, then over dp
        all_reduce("dp", 6 * micro)
        all_reduce("pp", terms)  # loss sums over stages
        all_reduce("pp", 1)  # grad-norm square over stages
    num_params = len(rank.dense) + len(rank.experts)
    for members, group, expert in (
        (rank.dense, "dp", False),
        (rank.experts, "expert_dp", True),
    ):
        if not members:
            continue
        all_reduce("tp", num_params)
        if layout.zero_stage == 2:
            all_reduce(group, num_params)
        if expert:
            all_reduce("ep", num_params)
    layers = _moe_layers(config, layout, rank)
    if layers:
        numel = layers * (config.n_routed_experts + 1)
        if layout.sequence_parallel:
            all_reduce("tp", numel)
        all_reduce("dp", numel)
    return out


def _gather_size(workload: Workload) -> int:
    return element_size(gather_dtype(workload.precision))


def comm_estimate(
    config: Any,
    layout: PlanLayout,
    workload: Workload,
    pp_rank: int = 0,
    *,
    reduce_dtype: torch.dtype = torch.float32,
    ranks_per_node: int | None = None,
) -> CommEstimate:
    """Wire bytes one rank of pipeline stage `pp_rank` sends per optimizer step, by group.

    Args:
        config: a DenseConfig or DeepSeekConfig.
        layout: the parallel layout (validated against `config`).
        workload: sequence length, micro and global batch, precision.
        pp_rank: which pipeline stage (stages hold different layers, embedding and head).
        reduce_dtype: the precision's gradient reduce dtype (`Precision.reduce_dtype`).
        ranks_per_node: GPUs per node, for node-limited dispatch (`PlanLayout.ep_nodes`);
            None: every rank on one node.

    Returns:
        `CommEstimate` (every group of `GROUPS` present, 0 where nothing is sent).

    Raises:
        ValueError: when the layout does not fit the model or the batch does not split
            into microbatches (`PlanLayout.validate`, `Workload.num_microbatches`), or
            `pp_rank` is outside the pipeline.
    """
    if not 0 <= pp_rank < layout.pp:
        raise ValueError(f"pp_rank={pp_rank} is outside [0, pp={layout.pp})")
    rank = rank_models(config, layout)[pp_rank]
    dt = wire_dtypes(workload.precision, reduce_dtype, layout.fp8_dispatch)
    tallies = {
        "tp": _tp(config, layout, workload, rank, dt),
        "pp": _pp(layout, workload, config, pp_rank, dt),
        **_ep(config, layout, workload, rank, dt, ranks_per_node),
        **_dp(layout, rank, dt, workload.num_microbatches(layout), _gather_size(workload)),
        "embedding": _embedding(config, layout, pp_rank, dt),
    }
    tallies.setdefault("host", _Tally())
    other = _other(config, layout, workload, rank)
    tallies["other"] = _Tally(
        sum(t.bytes for t in other.values()),
        sum(t.calls for t in other.values()),
        ["bookkeeping reductions (float64 / int64), LanguageModelModule without callbacks"],
    )
    return CommEstimate(
        bytes_per_step={g: tallies[g].bytes for g in GROUPS},
        calls_per_step={g: tallies[g].calls for g in GROUPS},
        detail={g: "; ".join(tallies[g].parts) or "nothing sent" for g in GROUPS},
        other_by_group={g: t.bytes for g, t in other.items() if t.bytes},
    )
