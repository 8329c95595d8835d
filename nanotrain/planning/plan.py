"""One layout priced whole: per-rank memory, FLOPs, communication and an estimated step time.

The step-time model is deliberately simple and stated in full (docs/planning.md):

* compute: each pipeline stage's FLOPs per step (`flops_per_token_parts` of its layers, plus
  head and MTP on the last stage, times the tokens it sees, split over tp except the routed
  experts', which every tp rank computes for all its tokens unless sequence parallelism
  gives it only its own, dropless: `routed_rows_per_copy`; a capacity factor prices its
  E x C slots) at
  ``peak_flops * compute_efficiency`` (default `calibration.GEMM_EFFICIENCY`, 0.75: what
  large GEMMs measure; under an fp8 precision the plain linear layers, and with
  ``fp8_expert_gemms`` the routed experts, at the fp8 peak, the rest at the bf16 one), the
  plain linears and the routed experts times their shapes' factor
  (`gemm_shapes.stage_shape_factors`: partial tiles and waves, the HBM roofline), attention
  on FlashAttention-2 slower where `Workload.kernels` says the
  run uses PyTorch's SDPA (`nanotrain.planning.kernels`), plus the memory-bound operations at
  HBM bandwidth (`nanotrain.planning.memory_bound`; eager or fused, as `Workload.kernels`
  says) and the SMs communication kernels hold while they run beside compute
  (`calibration.comm_sm_seconds`: the paired chunks' hidden all-to-alls, the data-parallel
  reductions beside each stage's last backward, ZeRO-3's prefetched gathers and
  reduce-scatters; blocking collectives take none);
  full recomputation adds one forward of the layers, the head + loss and the MTP modules
  (+1/3 of their FLOPs), selective one forward of each attention block (projections and
  scores: `attention_flops_per_token` / 3), light two forwards of MLA's up-projections
  (`up_projection_flops_per_token`; norms and activations are not counted as FLOPs);
* pipeline: the schedule's action lists replayed with each stage's own durations
  (`nanotrain.planning.stage_replay`); the bubble is that step less the busiest stage's
  work: with equal stages, for 1F1B / interleaved ``(pp - 1) / (virtual_pp * microbatches)``
  of it (GPipe's is the same); with split backwards (``zb_1f1b``, ``zb_interleaved_1f1b``,
  DualPipeV) the weight-gradient third of the compute (without recomputation) leaves it;
* communication: tp, sequence-parallel, ep and pp traffic sit on the critical path, except
  the ep all-to-all of chunks paired side by side (``overlap_forward_backward``), replayed
  under the executor's pairing rule; the data-parallel gradient reduction starts with each
  stage's last microbatch's backward (the buckets launch on the last microbatch only) and
  what outlasts the stage's end shows, and ZeRO's parameter all-gather after the optimizer
  step does not overlap; each group's bytes travel at the GPU's measured intra-node
  bandwidth when all its ranks share a node (by the mesh's own rank placement), else at the
  inter-node one, plus a fixed latency per collective. A layout the strategy refuses on
  the GPU (`runs_on.refused_on`), or an option no precision plugin runs yet
  (`runs_on.not_run_yet`: ``fp8_expert_gemms``), is priced as it would run, with a note.

Context parallelism (cp > 1) is priced by `nanotrain.planning.context_parallel`: cp folded
into dp for state, gradients and experts, seq_len / cp tokens per rank for per-token terms,
the whole sequence's attention FLOPs plus what the runtime computes beyond them (the masked
half of the scores, MLA's latent expanded for the whole sequence), the gathered context in
the activations, and the K/V (MLA: latent) all-gather and reduce-scatter as blocking "cp"
traffic.

A layout fits when the largest rank's model state, activation peak, working memory
(`nanotrain.planning.working_memory`: the pipeline's held stage outputs and transfer buffers,
the MoE layers' dispatch and combine tensors, the communication library's buffers and the
allocator's fragmentation allowance) and a fixed reserve (CUDA context and library
workspaces: 1 GiB by default) stay within the GPU's memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from nanotrain.planning import zero3
from nanotrain.planning.activations import ActivationEstimate
from nanotrain.planning.calibration import GEMM_EFFICIENCY, comm_sm_seconds, gpu_sms
from nanotrain.planning.communication import CommEstimate, comm_estimate
from nanotrain.planning.communication_tp import is_moe_layer
from nanotrain.planning.context_parallel import (
    add_cp_traffic,
    cp_extra_flops,
    cp_link,
    cp_traffic,
    fold_cp,
)
from nanotrain.planning.gemm_shapes import stage_shape_factors
from nanotrain.planning.gpus import GPUSpec
from nanotrain.planning.kernels import attention_kernel_seconds
from nanotrain.planning.layout import PlanLayout, Workload
from nanotrain.planning.memory import (
    StateMemory,
)
from nanotrain.planning.memory_bound import memory_bound_seconds
from nanotrain.planning.memory_check import (
    GiB,
    check_fp8_expert_gemms,
    memory_check,
    memory_floor,
    memory_terms,
    over_memory_note,
    param_counts,
    refusal_notes,
)
from nanotrain.planning.rank_model import rank_models
from nanotrain.planning.stage_flops import compute_seconds, flop_parts, stage_flops
from nanotrain.planning.stage_replay import (
    PricedStage,
    replay_priced,
)
from nanotrain.planning.step_comm import (
    LATENCY_S,
    _bandwidths,
    _comm_time,
    _gather_time,
    _zero3_exposed,
)
from nanotrain.planning.working_memory import WorkingMemory

__all__ = ["Plan", "RankPlan", "memory_check", "memory_floor", "plan_layout"]

#: collectives the step waits for (the data-parallel ones overlap the backward)
BLOCKING_GROUPS = ("tp", "ep", "ep_inter", "pp", "cp", "other")


@dataclass(frozen=True)
class RankPlan:
    """One pipeline stage's rank (all its tp/dp/ep ranks hold the same amounts).

    Attributes:
        pp_rank: the stage.
        layers: decoder layers it holds (all chunks).
        params: trainable parameter elements on one of its ranks.
        state: parameters, gradients, master weights and optimizer state (bytes).
        activations: activation memory (bytes) under the schedule.
        reserve: fixed bytes for the CUDA context and library workspaces.
        flops: training FLOPs per step on one of its ranks.
        comm: bytes it sends per step, per group.
        working: held stage outputs, transfer and MoE working tensors, communication
            buffers and fragmentation (`nanotrain.planning.working_memory`).
    """

    pp_rank: int
    layers: int
    params: int
    state: StateMemory
    activations: ActivationEstimate
    reserve: int
    flops: float
    comm: CommEstimate
    working: WorkingMemory = WorkingMemory()

    @property
    def memory(self) -> int:
        """Peak bytes: model state + activations + working memory + reserve."""
        return self.state.total + self.activations.peak + self.working.total + self.reserve

    def memory_parts(self) -> dict[str, int]:
        """Bytes by kind (for tables and JSON)."""
        return {
            "params": self.state.params,
            "grads": self.state.grads_peak,
            "master_weights": self.state.master,
            "optimizer": self.state.optimizer,
            "gathered": self.state.gathered,
            "activations": self.activations.peak,
            "pipeline_held": self.working.pipeline_held,
            "pipeline_buffers": self.working.pipeline_buffers,
            "moe_working": self.working.moe_working,
            "comm_buffers": self.working.comm_buffers,
            "fragmentation": self.working.fragmentation,
            "reserve": self.reserve,
            "total": self.memory,
        }


@dataclass(frozen=True)
class Plan:
    """A layout of a model on a GPU kind, priced (see the module docstring).

    Attributes:
        model: the model's name (preset or config class).
        layout, workload, gpu: what was planned.
        ranks: one `RankPlan` per pipeline stage.
        total_params: parameters of the model as the papers count them (MTP modules
            excluded: DeepSeek-V3's 671B).
        mtp_params: parameters of the MTP modules (trained, so priced in memory and FLOPs).
        active_params_per_token: parameters one token computes with (MTP excluded, as the
            papers count: DeepSeek-V3's 37B).
        flops_per_step: model FLOPs of one optimizer step (6 N per token plus attention; no
            recomputation), the numerator of MFU.
        step_time_s: estimated seconds per step; `time_parts` splits it.
        fits: whether the largest rank fits the GPU's memory.
        slowest_stage: the pipeline stage that sets the pace (most compute plus blocking
            communication per step), whose figures `time_parts` holds.
        slowest_comm_s: that stage's communication seconds per step, per group.
        hidden_comm_s: seconds of that stage's expert all-to-all run while the paired chunk
            computes (``overlap_forward_backward``; 0 otherwise): the rest is in
            ``time_parts["blocking_comm"]``.
        notes: why it does not fit, or other caveats.
    """

    model: str
    layout: PlanLayout
    workload: Workload
    gpu: GPUSpec
    ranks: list[RankPlan]
    total_params: int
    mtp_params: int
    active_params_per_token: int
    flops_per_step: float
    step_time_s: float
    time_parts: dict[str, float]
    fits: bool
    slowest_stage: int
    slowest_comm_s: dict[str, float]
    notes: list[str] = field(default_factory=list)
    hidden_comm_s: float = 0.0

    @property
    def largest(self) -> RankPlan:
        """The rank with the most memory."""
        return max(self.ranks, key=lambda r: r.memory)

    @property
    def slowest(self) -> RankPlan:
        """The rank of the stage that sets the pace (`slowest_stage`)."""
        return self.ranks[self.slowest_stage]

    @property
    def bottleneck(self) -> str:
        """The largest part of the step time ("compute", "pipeline_bubble",
        "exposed_dp_comm", or for blocking communication the group that blocks longest, e.g.
        "ep communication")."""
        part = max(self.time_parts, key=lambda k: self.time_parts[k])
        if part != "blocking_comm":
            return part
        blocking = {g: t for g, t in self.slowest_comm_s.items() if g in BLOCKING_GROUPS}
        return f"{max(blocking, key=lambda g: blocking[g])} communication"

    @property
    def tokens_per_s(self) -> float:
        """Estimated training throughput of the whole world."""
        return self.workload.tokens_per_step / self.step_time_s

    @property
    def mfu(self) -> float:
        """Estimated model FLOPs utilization (model FLOPs / (time x world x peak))."""
        peak = self.gpu.flops_for(self.workload.precision)
        return self.flops_per_step / (self.step_time_s * self.layout.world_size * peak)


def plan_layout(
    config: Any,
    layout: PlanLayout,
    workload: Workload,
    gpu: GPUSpec,
    *,
    model_name: str | None = None,
    compute_efficiency: float | None = None,
    reserve_bytes: int = GiB,
) -> Plan:
    """Price `layout` for `config` (see the module docstring).

    Raises:
        ValueError: a layout that does not divide the model or the world, or a global batch
            that does not split into micro_batch_size * dp (the strategy's messages);
            ``fp8_expert_gemms`` under a precision without fp8 GEMMs.
    """
    if compute_efficiency is None:
        compute_efficiency = GEMM_EFFICIENCY.value
    if not 0 < compute_efficiency <= 1:
        raise ValueError(f"compute_efficiency must be in (0, 1], got {compute_efficiency}")
    check_fp8_expert_gemms(layout, workload.precision)
    # context parallelism: dp x cp ranks on seq_len / cp tokens each (`fold_cp`); `workload`
    # keeps the whole sequence for the attention FLOPs
    given, (layout, local) = layout, fold_cp(config, layout, workload)
    num_micro = local.num_microbatches(layout)
    models = rank_models(config, layout)
    device = "cpu" if gpu.name == "cpu" else "cuda"  # which attention kernels save what
    bandwidth = _bandwidths(config, layout, gpu)
    bandwidth["cp"] = cp_link(given, gpu, LATENCY_S)
    ranks, stages = [], []
    no_recompute = replace(layout, recompute=None, recompute_full_layers=0)
    for rank in models:
        last = layout.pp == 1 or layout.placement.holds_last(rank.pp_rank)
        stage = stage_flops(config, layout, workload, rank.chunks, last)
        extra = cp_extra_flops(config, given, workload, rank.chunks, last)
        stage = (stage[0] + extra[0], stage[1] + extra[1], stage[2])
        shapes = stage_shape_factors(config, layout, local, rank.chunks, last, gpu)
        flops = stage[0]
        comm = add_cp_traffic(
            comm_estimate(config, layout, local, rank.pp_rank, ranks_per_node=gpu.gpus_per_node),
            cp_traffic(config, given, workload, rank.chunks, last),
        )
        state, acts, working = memory_terms(
            config, given, layout, local, workload, rank, last, device
        )
        ranks.append(
            RankPlan(
                pp_rank=rank.pp_rank,
                layers=sum(len(c) for c in rank.chunks),
                params=rank.params,
                state=state,
                activations=acts,
                reserve=reserve_bytes,
                flops=flops,
                comm=comm,
                working=working,
            )
        )
        compute = compute_seconds(
            stage, gpu, workload.precision, compute_efficiency, shapes, layout.fp8_expert_gemms
        )
        # SDPA's FlashAttention-2 where the run does not use FlashAttention-3's kernels
        compute += attention_kernel_seconds(
            config, layout, workload, rank.chunks, gpu, compute_efficiency
        )
        memory_t = memory_bound_seconds(config, layout, workload, rank.chunks, last, gpu)
        comm_t = _comm_time(comm, bandwidth)
        blocking = sum(t for g, t in comm_t.items() if g in BLOCKING_GROUPS)
        # the weight-gradient half of the backward: a third of the training FLOPs without
        # recomputation (forward, input gradient, weight gradient: one each)
        plain = stage_flops(config, no_recompute, workload, rank.chunks, last)
        weights_t = (
            compute_seconds(
                plain, gpu, workload.precision, compute_efficiency, shapes, layout.fp8_expert_gemms
            )
            / 3
        )
        paired = layout.overlap_forward_backward and layout.pp > 1
        ep_t = comm_t.get("ep", 0.0) + comm_t.get("ep_inter", 0.0) if paired else 0.0
        moe = sum(is_moe_layer(config, i) for c in rank.chunks for i in c)
        stages.append(
            PricedStage(rank, compute, memory_t, 0.0, blocking, ep_t, weights_t, comm_t,
                   max(1, round(moe / layout.virtual_pp)))
        )  # fmt: skip
    sms = gpu_sms(gpu.name)  # None: no SMs to take (CPU), nothing charged
    replay, hidden = replay_priced(
        layout.schedule, layout.pp, layout.virtual_pp, num_micro, stages, paired
    )
    if paired and sms and hidden > 0:
        # while the paired chunks' all-to-alls run beside compute their kernels hold SMs:
        # each stage's hidden seconds (the pacing stage's exposure taken for all) slow its
        # compute; replayed again with that time in each stage's work
        exposed_a2a = stages[max(range(len(stages)), key=lambda i: stages[i].busy)].ep_t - hidden
        stages = [
            replace(st, sms_t=comm_sm_seconds(max(st.ep_t - exposed_a2a, 0.0), st.compute, sms))
            for st in stages
        ]
        replay, hidden = replay_priced(
            layout.schedule, layout.pp, layout.virtual_pp, num_micro, stages, paired
        )
    slowest = max(range(len(stages)), key=lambda i: stages[i].busy)
    pace = stages[slowest]
    finish, tail_sms, host_step = [], [], 0.0
    for i, st in enumerate(stages):
        dp = sum(st.comm_t.get(g, 0.0) for g in ("dp", "expert_dp", "embedding"))
        if layout.zero_stage == 3:
            # the prefetched gathers and the reduce-scatters run beside the compute, their
            # kernels holding SMs (`_zero3_exposed`)
            exposed, host, extra = _zero3_exposed(
                st.rank, layout, workload, st.comm_t, bandwidth, st.compute, num_micro, sms
            )
            host_step = max(host_step, host)  # every stage waits for the slowest step
            finish.append(replay.ends[i] + extra + exposed)
        else:
            # the buckets' reductions start with the last microbatch's backward
            # (`data_parallel`: collectives launch on the last microbatch only) and run
            # beside what the stage has left, their kernels holding SMs; ZeRO's parameter
            # all-gather follows the optimizer step
            gather = min(_gather_time(st.rank, layout, workload, bandwidth), dp)
            left = replay.ends[i] - replay.last_backward[i]
            extra = comm_sm_seconds(dp - gather, left, sms) if sms else 0.0
            reduced = max(replay.ends[i] + extra, replay.last_backward[i] + dp - gather)
            finish.append(reduced + gather)
        tail_sms.append(extra)
    blocking = pace.blocking - hidden
    busy = pace.compute + pace.memory_t + pace.sms_t + blocking
    bubble = replay.step - busy
    if bubble < 0:  # the pacing stage's all-to-all hides less than the replay's share
        blocking, hidden, bubble = blocking - bubble, hidden + bubble, 0.0
    exposed_dp = max(finish) - replay.step
    # the last stage to finish: its SMs lost beside the data-parallel traffic, reported apart
    last_sms = min(tail_sms[max(range(len(finish)), key=lambda i: finish[i])], max(exposed_dp, 0))
    exposed_dp -= last_sms
    step = replay.step + exposed_dp + last_sms + host_step
    compute = pace.compute
    fits = max(r.memory for r in ranks) <= gpu.memory_bytes
    notes = []
    time_parts = {
        "compute": compute,
        "memory_bound": pace.memory_t,
        "blocking_comm": blocking,
        "pipeline_bubble": bubble,
        "exposed_dp_comm": exposed_dp,
    }
    if paired or pace.sms_t + last_sms > 0:
        time_parts["comm_sms"] = pace.sms_t + last_sms
    if layout.cpu_offload:
        time_parts["host_optimizer"] = host_step
        notes.append(
            f"cpu_offload: {max(r.state.host for r in ranks) / GiB:.2f} GiB of shards, "
            f"gradients and optimizer state per GPU on the host; the optimizer steps there "
            f"({host_step:.3f} s at an assumed {zero3.HOST_ADAM_BYTES_PER_S / 1e9:.0f} GB/s "
            "of host memory traffic per GPU)"
        )
    notes.extend(refusal_notes(layout, gpu, workload.precision))
    if not fits:
        worst = max(ranks, key=lambda r: r.memory)
        notes.append(over_memory_note(worst.pp_rank, worst.memory, gpu))
    counts = param_counts(config)
    return Plan(
        model=model_name or type(config).__name__,
        layout=given,
        workload=workload,
        gpu=gpu,
        ranks=ranks,
        total_params=counts[0],
        mtp_params=counts[1] - counts[0],
        active_params_per_token=counts[2],
        flops_per_step=flop_parts(config, workload.seq_len)[0].total * workload.tokens_per_step,
        step_time_s=step,
        time_parts=time_parts,
        fits=fits,
        notes=notes,
        slowest_stage=slowest,
        slowest_comm_s=dict(pace.comm_t),
        hidden_comm_s=hidden,
    )


def suggest_fp8_saves(plan: Plan, config: Any, **plan_kwargs: Any) -> Plan:
    """`plan` with a note when it does not fit but would with the routed experts' saves in
    fp8 (`fp8_expert_activations`, off in its layout): the largest rank's memory then, and
    the step time, which it does not change. `plan_kwargs`: as given to `plan_layout`."""
    layout = plan.layout
    routed = getattr(config, "n_routed_experts", 0) > 0
    if plan.fits or layout.fp8_expert_activations or not routed or layout.recompute == "full":
        return plan
    fp8 = replace(layout, fp8_expert_activations=True)
    other = plan_layout(config, fp8, plan.workload, plan.gpu, **plan_kwargs)
    if other.fits:
        plan.notes.append(
            f"with the routed experts' activations in fp8 (fp8_expert_activations=True, "
            f"--fp8_expert_activations true) it fits: {other.largest.memory / GiB:.2f} GiB on "
            f"stage {other.largest.pp_rank} (the plan prices no time for packing them)"
        )
    return plan
