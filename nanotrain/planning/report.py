"""A plan as a readable table and as JSON (`nanotrain plan`, `nanotrain fit --plan`)."""

from __future__ import annotations

import json
from typing import Any

from nanotrain.planning.plan import BLOCKING_GROUPS, Plan
from nanotrain.planning.search import Rejected, SearchResult

__all__ = ["format_plan", "format_search", "plan_json", "search_json"]

GiB = 2**30


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def _count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def _traffic(bytes_per_group: dict[str, float]) -> str:
    """ "tp 1.25 GiB, ep 340 MiB, dp 12 KiB": every group that sends anything, in a unit
    that shows it; "none" only when nothing is sent."""
    parts = []
    for group, n in bytes_per_group.items():
        if n <= 0:
            continue
        unit, size = next((u, s) for u, s in _UNITS if n >= s or u == "B")
        value = n / size
        parts.append(
            f"{group} {value:.0f} {unit}" if value >= 100 else f"{group} {value:.3g} {unit}"
        )
    return ", ".join(parts) or "none"


_UNITS = (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def _seconds(comm_s: dict[str, float], blocking: bool) -> str:
    """ "ep 23.791 s, pp 0.571 s": the groups that block the step (or, with `blocking`
    False, those that overlap the backward) taking at least a millisecond."""
    shown = [
        f"{g} {t:.3f} s"
        for g, t in comm_s.items()
        if (g in BLOCKING_GROUPS) == blocking and t >= 5e-4
    ]
    return ", ".join(shown) or "none"


def format_plan(plan: Plan) -> str:
    """Multi-line text: the model and layout, per-stage memory (GiB) by kind, FLOPs and
    communication per step, and the estimated step time."""
    w, lay = plan.workload, plan.layout
    zero3 = lay.zero_stage == 3
    lines = [
        f"model {plan.model}: {_count(plan.total_params)} parameters"
        + (f" (+{_count(plan.mtp_params)} MTP)" if plan.mtp_params else "")
        + f", {_count(plan.active_params_per_token)} activated per token",
        f"layout {lay.describe()} on {lay.world_size} x {plan.gpu.name} "
        f"({_gib(plan.gpu.memory_bytes)} GiB); schedule {lay.schedule if lay.pp > 1 else '-'}",
        f"batch {w.global_batch_size} x {w.seq_len} tokens ({_count(w.tokens_per_step)} per "
        f"step), micro batch {w.micro_batch_size}, {w.num_microbatches(lay)} microbatches "
        f"per replica, precision {w.precision}"
        + (f", {w.kernels} kernels" if w.kernels != "fused" else ""),
        "",
        "memory per GPU (GiB; pipe: held stage outputs and transfer buffers, moe: MoE "
        "dispatch/combine working tensors, comm: NCCL buffers, frag: allocator allowance)"
        + (" (gathered: ZeRO-3's unsharded copies at work)" if zero3 else ""),
        f"{'stage':>5} {'layers':>6} {'params':>9} {'weights':>8} {'grads':>8} {'master':>8} "
        f"{'optim':>8} {'activ':>8} {'pipe':>8} {'moe':>8} {'comm':>8} {'frag':>8} "
        f"{'reserve':>8} {'total':>8}",
    ]
    for r in plan.ranks:
        m = r.memory_parts()
        lines.append(
            f"{r.pp_rank:>5} {r.layers:>6} {_count(r.params):>9} {_gib(m['params']):>8} "
            f"{_gib(m['grads']):>8} {_gib(m['master_weights']):>8} {_gib(m['optimizer']):>8} "
            + (f"{_gib(m['gathered']):>8} " if zero3 else "")
            + f"{_gib(m['activations']):>8} "
            + f"{_gib(m['pipeline_held'] + m['pipeline_buffers']):>8} {_gib(m['moe_working']):>8} "
            + f"{_gib(m['comm_buffers']):>8} {_gib(m['fragmentation']):>8} "
            + f"{_gib(m['reserve']):>8} {_gib(m['total']):>8}"
        )
    big, slow = plan.largest, plan.slowest
    lines += [
        f"largest: stage {big.pp_rank}, {_gib(big.memory)} GiB of "
        f"{_gib(plan.gpu.memory_bytes)}: {'fits' if plan.fits else 'DOES NOT FIT'}",
        "",
        f"compute: {_count(plan.flops_per_step)}FLOP per step (model), "
        f"{_count(slow.flops)}FLOP on one GPU of stage {slow.pp_rank} (the slowest)",
    ]
    stages = [(slow, "the slowest")] + ([(big, "the largest")] if big is not slow else [])
    for rank, what in stages:
        lines.append(
            f"communication per GPU per step, stage {rank.pp_rank} ({what}): "
            + _traffic(rank.comm.bytes_per_step)
        )
    lines += [
        "",
        f"estimated step {plan.step_time_s:.3f} s ("
        + ", ".join(f"{k} {v:.3f}" for k, v in plan.time_parts.items())
        + f"), {_count(plan.tokens_per_s)} tokens/s, MFU {plan.mfu:.1%}",
        f"bottleneck: {plan.bottleneck}; stage {slow.pp_rank} sets the pace (its compute "
        f"{plan.time_parts['compute']:.3f} s; blocking communication "
        + _seconds(plan.slowest_comm_s, blocking=True)
        + (
            f", of which {plan.hidden_comm_s:.3f} s of ep hides behind the paired chunk's compute"
            if plan.hidden_comm_s
            else ""
        )
        + ("; overlapping the compute " if zero3 else "; overlapping the backward ")
        + _seconds(plan.slowest_comm_s, blocking=False)
        + ")",
    ]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines) + "\n"


def plan_json(plan: Plan) -> dict[str, Any]:
    """JSON-ready dict: total_params, active_params_per_token, layout, workload, gpu, and per
    pipeline stage the memory in bytes by kind, FLOPs and bytes sent per group."""
    lay, w = plan.layout, plan.workload
    return {
        "model": plan.model,
        "total_params": plan.total_params,
        "mtp_params": plan.mtp_params,
        "active_params_per_token": plan.active_params_per_token,
        "layout": {
            "tp": lay.tp,
            "pp": lay.pp,
            "dp": lay.dp,
            "cp": lay.cp,
            "ep": lay.ep,
            "virtual_pp": lay.virtual_pp,
            "zero_stage": lay.zero_stage,
            "cpu_offload": lay.cpu_offload,
            "reshard_after_forward": lay.reshard_after_forward,
            "reduce_scatter_every_microbatch": lay.reduce_scatter_every_microbatch,
            "sequence_parallel": lay.sequence_parallel,
            "pipeline_layout": None if lay.pipeline_layout is None else list(lay.pipeline_layout),
            "schedule": lay.schedule,
            "recompute": lay.recompute,
            "world_size": lay.world_size,
        },  # fmt: skip
        "workload": {
            "seq_len": w.seq_len,
            "micro_batch_size": w.micro_batch_size,
            "global_batch_size": w.global_batch_size,
            "precision": w.precision,
            "kernels": w.kernels,
            "num_microbatches": w.num_microbatches(lay),
            "tokens_per_step": w.tokens_per_step,
        },  # fmt: skip
        "gpu": plan.gpu.to_dict(),
        "ranks": [
            {
                "pp_rank": r.pp_rank,
                "layers": r.layers,
                "params": r.params,
                "memory_bytes": r.memory_parts(),
                "host_bytes": r.state.host,  # ZeRO-3 cpu_offload: state on the host
                "activations_per_microbatch_bytes": r.activations.per_microbatch_chunk,
                "in_flight_microbatches": r.activations.in_flight,
                "flops_per_step": r.flops,
                "comm_bytes_per_step": dict(r.comm.bytes_per_step),
            }
            for r in plan.ranks
        ],
        "max_memory_bytes": plan.largest.memory,
        "fits": plan.fits,
        "flops_per_step": plan.flops_per_step,
        "step_time_s": plan.step_time_s,
        "time_parts_s": plan.time_parts,
        "slowest_stage": plan.slowest_stage,
        "slowest_comm_s": plan.slowest_comm_s,
        "hidden_comm_s": plan.hidden_comm_s,
        "bottleneck": plan.bottleneck,
        "tokens_per_s": plan.tokens_per_s,
        "mfu": plan.mfu,
        "notes": plan.notes,
    }


def format_search(result: SearchResult, top: int = 15) -> str:
    """The best `top` fitting layouts (one line each: layout, micro batch, sequences per step,
    largest rank's memory, step time, throughput, MFU), then how many layouts were rejected
    for each reason, with one example of each."""
    shown = result.fitting[:top]
    width = max([44, *(len(p.layout.describe()) for p in shown)])
    lines = [
        f"{len(result.fitting)} layouts fit, {len(result.rejected)} rejected",
        f"{'#':>3} {'layout':<{width}} {'mb':>3} {'batch':>6} {'max GiB':>8} {'step s':>8} "
        f"{'tokens/s':>10} {'MFU':>6}",
    ]
    for i, p in enumerate(shown):
        lines.append(
            f"{i + 1:>3} {p.layout.describe():<{width}} {p.workload.micro_batch_size:>3} "
            f"{p.workload.global_batch_size:>6} {_gib(p.largest.memory):>8} "
            f"{p.step_time_s:>8.3f} {_count(p.tokens_per_s):>10} {p.mfu:>6.1%}"
        )
    notes = {n for p in result.fitting[:top] for n in p.notes}
    lines += [f"note: {n}" for n in sorted(notes)]
    if result.rejected:
        groups: dict[str, list[Rejected]] = {}
        for r in result.rejected:
            groups.setdefault(_reason_kind(r.reason), []).append(r)
        lines += ["", "rejected, by reason (count, one example):"]
        for kind, members in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            r = members[0]
            lines.append(
                f"  {len(members):>5} {kind}: e.g. {r.layout.describe()} mb "
                f"{r.micro_batch_size}: {r.reason}"
            )
    return "\n".join(lines) + "\n"


def _reason_kind(reason: str) -> str:
    """A short class of a rejection reason (memory, or the first words of the message)."""
    if "more than the" in reason and "GiB" in reason:
        return "out of memory"
    return " ".join(reason.split()[:4])


def search_json(result: SearchResult, top: int = 50) -> str:
    """JSON text: the best `top` fitting plans (as `plan_json`) and every rejection."""
    return json.dumps(
        {
            "fitting": [plan_json(p) for p in result.fitting[:top]],
            "rejected": [
                {
                    "layout": r.layout.describe(),
                    "micro_batch_size": r.micro_batch_size,
                    "reason": r.reason,
                }  # fmt: skip
                for r in result.rejected
            ],
        },
        indent=2,
    )
