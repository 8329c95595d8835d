"""Seconds of a planned step's communication: the link each group's collectives use (from
where the mesh places the group's ranks), their time per step, ZeRO's parameter all-gather
after the optimizer step, and what ZeRO-3's prefetched gathers and reduce-scatters leave
exposed. `nanotrain.planning.plan.plan_layout` puts them on the step's timeline."""

from __future__ import annotations

from typing import Any

from nanotrain.parallel.mesh import MeshLayout
from nanotrain.planning import zero3
from nanotrain.planning.calibration import comm_sm_seconds
from nanotrain.planning.communication import CommEstimate
from nanotrain.planning.gpus import GPUSpec
from nanotrain.planning.layout import PlanLayout, Workload
from nanotrain.planning.memory import (
    element_size,
    gather_dtype,
    param_dtype,
    zero3_optimizer_pieces,
)

#: seconds per collective call (launch + synchronization), intra-node / inter-node
LATENCY_S = (10e-6, 30e-6)


def _bandwidths(config: Any, layout: PlanLayout, gpu: GPUSpec) -> dict[str, tuple[float, float]]:
    """(bytes/s, latency) per group name, from where the mesh places the group's ranks;
    under node-limited dispatch "ep" is the hop inside a node and "ep_inter" the one between
    nodes."""
    mesh = MeshLayout(tp=layout.tp, pp=layout.pp, dp=layout.dp, ep=layout.ep)
    out = {"ep_inter": (gpu.inter_node_bw, LATENCY_S[1]), "host": (gpu.pcie_bw, LATENCY_S[0])}
    if layout.ep_nodes(config, gpu.gpus_per_node) is not None:
        out["ep"] = (gpu.intra_node_bw, LATENCY_S[0])
    for name, axis in (("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("ep", "ep"),
                       ("expert_dp", "expert_dp"), ("embedding", "pp"), ("other", "dp")):  # fmt: skip
        if name in out:
            continue
        ranks = mesh.group_of(axis, 0)
        intra = len({r // gpu.gpus_per_node for r in ranks}) == 1
        if intra:
            out[name] = (gpu.intra_node_bw, LATENCY_S[0])
        elif name == "ep":
            out[name] = (_all_to_all_bw(ranks, gpu), LATENCY_S[1])
        else:  # a ring over several nodes goes at the pace of its links between nodes
            out[name] = (gpu.inter_node_bw, LATENCY_S[1])
    return out


def _all_to_all_bw(ranks: list[int], gpu: GPUSpec) -> float:
    """Bytes/s of an all-to-all over `ranks` spanning nodes, with equal shares per peer: the
    shares for peers in the same node go over NVLink while the others go over InfiniBand, at
    the same time, so the slower of the two sets the pace."""
    node = ranks[0] // gpu.gpus_per_node
    peers = len(ranks) - 1
    local = sum(1 for r in ranks[1:] if r // gpu.gpus_per_node == node)
    return 1.0 / max(local / peers / gpu.intra_node_bw, (peers - local) / peers / gpu.inter_node_bw)


def _comm_time(comm: CommEstimate, bandwidth: dict[str, tuple[float, float]]) -> dict[str, float]:
    out = {}
    for group, nbytes in comm.bytes_per_step.items():
        bw, latency = bandwidth.get(group, bandwidth["dp"])
        out[group] = nbytes / bw + comm.calls_per_step.get(group, 0) * latency
    return out


def _gather_time(rank: Any, layout: PlanLayout, workload: Workload,
                 bandwidth: dict[str, tuple[float, float]]) -> float:  # fmt: skip
    """Seconds of ZeRO's parameter all-gather after the optimizer step (0 without ZeRO): it
    is part of the "dp" / "expert_dp" traffic but cannot overlap the backward pass."""
    if layout.zero_stage == 0:
        return 0.0
    size = element_size(param_dtype(workload.precision))
    dense, experts = rank.flat_numels(layout, size)
    out = 0.0
    for numel, group, name in ((dense, layout.dp, "dp"), (experts, layout.expert_dp, "expert_dp")):
        if numel and group > 1:
            bw, latency = bandwidth[name]
            out += numel * size * (group - 1) / group / bw + latency
    return out


def _zero3_exposed(rank: Any, layout: PlanLayout, workload: Workload, comm_t: dict[str, float],
                   bandwidth: dict[str, tuple[float, float]], compute: float,
                   num_micro: int, sms: int | None = None) -> tuple[float, float, float]:  # fmt: skip
    """(exposed data-parallel seconds, host optimizer seconds, seconds the compute loses to
    the SMs the collectives hold beside it) per step under ZeRO-3.

    FSDP2 prefetches the next unit's all-gather (and, with cpu_offload, its host copy) while
    one computes, so the gathers show only where they exceed the compute, plus the root
    unit's gathers (`zero3.gathers_per_step`: at the start of each microbatch, or once under a
    split-backward schedule), which nothing precedes. The one
    reduce-scatter per unit runs in the last microbatch's backward (pp = 1: only what exceeds
    that backward shows; with ``reduce_scatter_every_microbatch`` one in every microbatch's
    backward) or after the whole schedule (pp > 1: all of it shows). Gathers and
    reduce-scatters share the rank's link, so what exceeds the compute shows in any case. With
    cpu_offload the optimizer steps on the host after the backward, at
    `zero3.HOST_ADAM_BYTES_PER_S` (not overlapped).

    The gathers and the reduce-scatters that run beside the compute (all but the root's
    first gathers, and with pp > 1 the reduce-scatters after the schedule) hold
    `calibration.COMM_SMS` of the GPU's `sms` SMs (`calibration.comm_sm_seconds`; nothing
    when `sms` is None): the compute, longer by that, hides more of them."""
    units = zero3.zero3_units(rank)
    gather = element_size(gather_dtype(workload.precision))
    reduce_t = first = 0.0
    for name, group, unit_list in (
        ("dp", layout.dp, [units.root, *units.blocks]),
        ("expert_dp", layout.expert_dp, units.experts),
    ):
        unit_list = [u for u in unit_list if u]
        if group > 1 and unit_list:
            bw, latency = bandwidth[name]
            shard = sum(zero3.sharded_numel(u, group) for u in unit_list)
            reduce_t += (group - 1) * shard * 4 / bw + len(unit_list) * latency  # fp32
    if layout.dp > 1 and units.root:
        bw, latency = bandwidth["dp"]
        root = zero3.sharded_numel(units.root, layout.dp)
        root_gathers, _ = zero3.gathers_per_step(layout, num_micro, rank.pp_rank)
        first = root_gathers * ((layout.dp - 1) * root * gather / bw + latency)
    traffic = sum(comm_t.get(g, 0.0) for g in ("dp", "expert_dp", "embedding", "host"))
    reduces = num_micro if layout.reduce_scatter_every_microbatch else 1
    gathers = max(traffic - reduces * reduce_t - first, 0.0)
    beside = gathers + (reduces * reduce_t if layout.pp == 1 else 0.0)
    sms_t = comm_sm_seconds(beside, compute, sms) if sms else 0.0
    compute += sms_t
    backward = 0.0 if layout.pp > 1 else compute * 2 / 3 / num_micro  # of one microbatch
    exposed = max(0.0, gathers - compute) + first + reduces * max(0.0, reduce_t - backward)
    # the gathers and the reduce-scatters share the rank's link: together they hide behind
    # the compute at most
    exposed = max(exposed, gathers + reduces * reduce_t + first - compute)
    host = 0.0
    if layout.cpu_offload:
        elements = max(e for e, _ in zero3_optimizer_pieces(rank, layout))
        host = elements * zero3.ADAM_BYTES_PER_ELEMENT / zero3.HOST_ADAM_BYTES_PER_S
    return exposed, host, sms_t
