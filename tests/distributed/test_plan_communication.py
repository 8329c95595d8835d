"""The planner's communication bytes equal what a real training step sends, group by group.

Forked gloo worlds train the tiny presets for one step of two microbatches per rank (a
per-microbatch term still differs from a per-step one) under many `MegatronStrategy` layouts;
a `CommMeter` counts every collective of that step by process group (what the fit sets up
before it is not counted: the model and groups are built at fit start, outside the step), and
`comm_estimate` of the same config, layout and batch must equal the count on every group
(tp, pp, ep, dp, expert-dp, embedding, and the bookkeeping reductions it files under
"other", by the group they travel on).

Each layout pins terms no other layout of the file pins (the comments at `WORLD2` and
`WORLD4` say which): a layout whose terms others hold too is folded into them (a recompute
mode's layout holds the terms of the same layout without it, SP's regathers aside; a 16-bit
one those of its fp32 twin, with the dtypes told apart).

Routing: the router is replaced by a balanced one (token t's k-th copy goes to expert
``(t * K + k) % E``), the routing the planner assumes, so the expert-parallel bytes are
exact too; under node-limited dispatch by one that also reaches the planner's average of
nodes per token (`group_pairs_select`). Independent checks that do not trust the planner's
own arithmetic follow the world tests: the meter's ring model on known tensors, and textbook
formulas for tp and dp.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import nanotrain as nt
from nanotrain.models import expert_compute, presets
from nanotrain.models.build import build_model
from nanotrain.models.moe import TopKRouter
from nanotrain.planning import PlanLayout, Workload
from nanotrain.planning.comm_meter import CommMeter
from nanotrain.planning.communication import comm_estimate
from nanotrain.strategies.megatron import MegatronStrategy
from tests.distributed.spawn import run_world
from tests.distributed.test_megatron import LM_VOCAB, SEQ, RandomTokens

MICRO, GLOBAL = 2, 8
MEASURED = ("tp", "pp", "ep", "ep_inter", "dp", "expert_dp", "embedding")
BF16_MIXED, BF16_TRUE = {"precision": "bf16-mixed"}, {"precision": "bf16-true"}
CAPACITY, FULL = {"overrides": {"capacity_factor": 1.25}}, {"recompute": "full"}


def balanced_select(self: TopKRouter, choice: torch.Tensor) -> torch.Tensor:
    """Token t's k-th copy to expert (t * K + k) % E: every ep rank receives N * K / ep."""
    n, k = choice.shape[0], self.config.num_experts_per_tok
    slots = torch.arange(n * k, device=choice.device).view(n, k)
    return slots % self.config.n_routed_experts


def group_pairs_select(self: TopKRouter, choice: torch.Tensor) -> torch.Tensor:
    """Token t takes the (t % P)-th of the P pairs of expert groups and, in each group, its
    ((t // P) % group size)-th expert: over every P * group size tokens each expert gets
    the same copies, and a token reaches each set of groups as often as the planner's
    `nodes_reached` assumes (one expert per chosen group: K = topk_group)."""
    c = self.config
    size = c.n_routed_experts // c.n_group
    pairs = torch.combinations(torch.arange(c.n_group, device=choice.device), c.topk_group)
    t = torch.arange(choice.shape[0], device=choice.device)
    return pairs[t % len(pairs)] * size + ((t // len(pairs)) % size)[:, None]


class MeterStep(nt.Callback):
    """Counts the collectives of the training step only (not the fit's set-up around it)."""

    def __init__(self, meter: CommMeter) -> None:
        self.meter = meter

    def on_train_step_start(self, trainer, module, batch, batch_idx) -> None:
        self.meter.counting = True

    def on_train_step_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.meter.counting = False


def measure(kind: str, strategy_kwargs: dict, extra: dict, root: str) -> dict[str, Any]:
    """Train 1 step (by default 2 microbatches per rank); return this rank's bytes per group
    and the planner's estimate."""
    strategy = MegatronStrategy(**strategy_kwargs)
    strategy.setup_environment()
    meter = CommMeter.for_strategy(strategy)
    meter.counting = False
    overrides = extra.get("overrides", {})
    module = nt.LanguageModelModule(
        kind,
        vocab_size=LM_VOCAB,
        model_overrides=overrides,
        recompute=extra.get("recompute"),
        fp8_dispatch=extra.get("fp8_dispatch", False),
    )
    precision = extra.get("precision", "32-true")
    micro, batch = extra.get("batch", (MICRO, 2 * MICRO * strategy.mesh.dp_size))
    TopKRouter.select = extra.get("select", balanced_select)  # the next layout gets its own
    trainer = nt.Trainer(
        strategy=strategy,
        max_steps=1,
        global_batch_size=batch,
        micro_batch_size=micro,
        precision=precision,
        callbacks=[MeterStep(meter)],
        default_root_dir=root,
        loggers=[],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_monitors=False,
        seed=0,
    )
    with meter:
        trainer.fit(module, train_dataloaders=RandomTokens())
    mesh = strategy.mesh
    layout = PlanLayout.from_strategy(
        strategy,
        mesh.world_size,
        extra.get("recompute"),
        fp8_dispatch=extra.get("fp8_dispatch", False),
    )
    workload = Workload(SEQ, micro, batch, precision)
    estimate = comm_estimate(
        module.config,
        layout,
        workload,
        pp_rank=mesh.pp_rank,
        ranks_per_node=strategy.ranks_per_node,
    )
    measured = dict(meter.bytes)  # the hop inside a node is the planner's "ep" too
    measured["ep"] = measured.get("ep", 0.0) + measured.pop("ep_intra", 0.0)
    return {
        "measured": measured,
        "calls": dict(meter.calls),
        "predicted": {g: estimate.on_group(g) for g in MEASURED},
        "estimate": estimate,
    }


def _run(rank: int, world_size: int, root: str, layouts: dict) -> dict:
    TopKRouter.select = balanced_select  # a forked child: the parent's class is untouched
    # the plan prices the GPU path, whose capacity routing trusts one batch shape; on the
    # CPU training would also all-gather the ranks' slot counts (8 B per MoE layer)
    expert_compute.reads_sizes_first = lambda x: False
    return {
        name: measure(kind, kwargs, extra, f"{root}/{i}")
        for i, (name, (kind, kwargs, extra)) in enumerate(layouts.items())
    }


# name -> (preset, MegatronStrategy kwargs, extra: recompute / precision / model overrides /
# (micro, global) batch). What each layout pins (tp: `communication_tp`'s collectives):
WORLD2 = {
    # dense tp without SP: the embedding's, attention's and MLP's all-reduces, the head's and
    # the vocab-parallel loss's, and (full recompute) every forward one rerun but the layer's
    # trailing MLP output (nothing saved after it) and the head's and loss's rerun; the plain
    # layout's terms are all here (dense SP: "dense tp=2 sp bf16-mixed")
    "dense tp=2 full recompute": ("tiny-dense", dict(tp=2), FULL),
    # MLA's latents, the shared experts and the MTP block over tp without SP, 16-bit wires
    # (activations, linear outputs and the embedding's parameters' dtype all 2 bytes), the
    # tp-replicated routed experts; selective reruns no MLA collective without SP (its attention
    # output is the trailing one). Its fp32 twin's terms only differ by the dtype, which the
    # fp32 layouts pin
    "deepseek tp=2 bf16-true selective recompute": (
        "tiny",
        dict(tp=2),
        {**BF16_TRUE, "recompute": "selective"},
    ),
    # dense SP: all-gathers / reduce-scatters, the backward regathers of inputs saved as
    # shards, the norm weights' grads summed over tp once per step; fp32 inputs entering the
    # region beside bf16 linear outputs (autocast); the fp32 wires of dense SP are the same
    # collectives ("deepseek tp=2 x pp=2 sp" has them at fp32)
    "dense tp=2 sp bf16-mixed": ("tiny-dense", dict(tp=2, sequence_parallel=True), BF16_MIXED),
    # MoE under SP with a capacity: the whole sequences and their routing gathered over tp,
    # the balance loss's statistics and the MoE loads summed over tp; full recompute: every
    # forward collective rerun (the MoE layer's balance loss keeps its trailing one), the regathers
    # dropped, the heads' and MTP's rerun. Holds every term of the same layout without
    # recompute but the regathers (pinned by "deepseek tp=2 x pp=2 sp"), and those of dropless
    # SP with full recompute (also pinned with ep by "deepseek tp=2 x ep=2 sp zero1 full
    # recompute")
    "deepseek tp=2 sp capacity full recompute": (
        "tiny",
        dict(tp=2, sequence_parallel=True),
        {**CAPACITY, **FULL},
    ),
    # dp: ZeRO-0's all-reduce over dp and expert-dp (no all-gather), ZeRO-1's all-reduce and
    # all-gather, ZeRO-2's reduce-scatter in fp32 and all-gather of bf16 parameters (bf16-true
    # tells the two dtypes apart; fp32 ZeRO-2 is "deepseek ep=2 x dp=4 zero2")
    "deepseek dp=2": ("tiny", dict(), {}),
    "deepseek dp=2 zero1": ("tiny", dict(zero_stage=1), {}),
    "deepseek dp=2 zero2 bf16-true": ("tiny", dict(zero_stage=2), BF16_TRUE),
    # pp: 1F1B's sends, the shared (MTP) embedding's grad summed by the two ends, the pipeline
    # loss terms; interleaved: every chunk's boundary crossings, no shared embedding
    "deepseek pp=2 1f1b": ("tiny", dict(pp=2), {}),
    "dense pp=2 x virtual 2": (
        "tiny-dense",
        dict(pp=2, virtual_pp=2),
        {"overrides": {"num_layers": 4}},
    ),
    # ep dropless: split sizes, dispatch (bf16 under autocast) with gate weights, combine,
    # each again in backward, the forward ones rerun under full recompute (it holds every
    # term of the layout without recompute; fp32 wires: "deepseek ep=2 x dp=4 zero2")
    "deepseek ep=2 bf16-mixed full recompute": ("tiny", dict(ep=2), {**BF16_MIXED, **FULL}),
    # a capacity: fixed E x B x C slots, no split exchange, rerun under full recompute (holds
    # every term of the layout without recompute)
    "deepseek ep=2 capacity full recompute": ("tiny", dict(ep=2), {**CAPACITY, **FULL}),
    # fp8 rows with their tile scales out (an emulated format quantizes the experts' fp32
    # inputs), fp32 gradients back; bf16 linear outputs
    "deepseek ep=2 fp8-emulated": ("tiny", dict(ep=2), {"precision": "fp8-emulated"}),
    # fp8 rows out under bf16 autocast, the copies' gradients back in bf16
    "deepseek ep=2 bf16-mixed fp8 dispatch": (
        "tiny",
        dict(ep=2),
        {**BF16_MIXED, "fp8_dispatch": True},
    ),
}
WORLD4 = {
    # tp x pp: SP on pipeline ranks (MLA's and the MoE's regathers without recompute, the
    # balance statistics, the head and MTP on the last stage), sends of [b, s / tp, h]
    "deepseek tp=2 x pp=2 sp": ("tiny", dict(tp=2, pp=2, sequence_parallel=True), {}),
    # expert-dp of 2 beside dp of 4, ZeRO-2 at fp32, the grad-norm squares over ep; fp32
    # dropless dispatch (one microbatch per rank: the dp terms are per step, and ep's
    # per-microbatch count is pinned by the world of 2)
    "deepseek ep=2 x dp=4 zero2": ("tiny", dict(ep=2, zero_stage=2), {"batch": (MICRO, 8)}),
    # nodes of 2 ranks: the rail between them and the hop inside; 48 tokens per microbatch,
    # a multiple of the 6 pairs of the tiny model's 4 expert groups
    "deepseek ep=4 node-limited": (
        "tiny",
        dict(ep=4, ranks_per_node=2, node_limited_dispatch=True),
        {"select": group_pairs_select, "batch": (3, 12)},
    ),
    # tp x ep: dropless SP dispatches 1/tp of the tokens, ZeRO-1 over dp, full recompute's
    # reruns of the split exchange and the all-to-alls at fp32
    "deepseek tp=2 x ep=2 sp zero1 full recompute": (
        "tiny",
        dict(tp=2, ep=2, sequence_parallel=True, zero_stage=1),
        FULL,
    ),
}


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> list[dict]:
    return run_world(_run, 2, str(tmp_path_factory.mktemp("w2")), WORLD2, timeout=240)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(WORLD2))
def test_planned_bytes_equal_measured_bytes_two_ranks(world2, layout):
    _assert_planned_equals_measured(world2, layout)


def _assert_planned_equals_measured(world: list[dict], layout: str) -> None:
    """Every rank's counted bytes per group equal the plan's, to rounding."""
    for rank, results in enumerate(world):
        r = results[layout]
        measured = {g: r["measured"].get(g, 0.0) for g in MEASURED}
        assert measured == pytest.approx(r["predicted"], rel=1e-9), (
            f"rank {rank}: {r['estimate'].detail}"
        )


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> list[dict]:
    return run_world(_run, 4, str(tmp_path_factory.mktemp("w4")), WORLD4, timeout=240)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(WORLD4))
def test_planned_bytes_equal_measured_bytes_four_ranks(world4, layout):
    _assert_planned_equals_measured(world4, layout)


# -- the meter's ring model on tensors of known size ---------------------------------------------


def _meter_known_tensors(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    pair = dist.new_group([0, 1])
    meter = CommMeter({"pair": pair}, peers={1 - rank: "peer"})
    with meter:
        dist.all_reduce(torch.ones(100), group=pair)
        dist.all_gather_into_tensor(torch.empty(2 * 50), torch.ones(50), group=pair)
        dist.reduce_scatter_tensor(torch.empty(50), torch.ones(100), group=pair)
        # rows of 4 fp32 values: rank 0 sends 3 to itself and 5 to rank 1, rank 1 2 and 7
        send = [3, 5] if rank == 0 else [2, 7]
        recv = [3, 2] if rank == 0 else [5, 7]
        out = torch.empty(sum(recv), 4)
        dist.all_to_all_single(out, torch.ones(sum(send), 4), recv, send, group=pair)
        ops = [
            dist.P2POp(dist.isend, torch.ones(10, dtype=torch.float64), 1 - rank),
            dist.P2POp(dist.irecv, torch.empty(10, dtype=torch.float64), 1 - rank),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return {"bytes": dict(meter.bytes), "calls": dict(meter.calls)}


@pytest.mark.distributed
def test_meter_counts_ring_wire_bytes_of_known_tensors():
    results = run_world(_meter_known_tensors, 2)
    # g = 2: all-reduce 2(g-1)/g * 400 B; all-gather and reduce-scatter (g-1)/g * 400 B of
    # the full tensor; all-to-all the rows leaving the rank (5 or 2 rows of 16 B)
    assert results[0]["bytes"] == {"pair": 400 + 200 + 200 + 5 * 16, "peer": 80}
    assert results[1]["bytes"] == {"pair": 400 + 200 + 200 + 2 * 16, "peer": 80}
    assert results[0]["calls"] == {"pair": 4, "peer": 1}  # a receive is no call of its own


# -- the planner against textbook formulas (no processes) ----------------------------------------

DENSE = presets.get("tiny-dense", vocab_size=LM_VOCAB)
WORK = Workload(SEQ, MICRO, GLOBAL, "32-true")


def test_tp_bytes_are_megatrons_four_all_reduces_per_layer():
    # Shoeybi et al. 2019: 2 all-reduces forward + 2 backward of [b, s, h] per layer, one for
    # the embedding, one for the head's input grad; plus the vocab-parallel cross-entropy's
    # fp32 max [b, s] and sums [2, b, s]. 4 microbatches (global 8 / micro 2, dp 1).
    t, b, s, h, layers = 2, MICRO, SEQ, DENSE.hidden_size, DENSE.num_layers
    ring = 2 * (t - 1) / t
    per_micro = ring * ((4 * layers + 2) * b * s * h * 4 + 3 * b * s * 4)
    got = comm_estimate(DENSE, PlanLayout(tp=t), WORK).bytes_per_step["tp"]
    assert got == pytest.approx(4 * per_micro)


def test_sequence_parallel_moves_the_same_tp_bytes_plus_the_replicated_grads():
    # Korthikanti et al. 2022: all-gather + reduce-scatter cost what one all-reduce costs; SP
    # adds the sum over tp of the norm weights' grads (2 per layer + the final norm), and the
    # all-gather in backward of every block input saved as its shard (attention, MLP, head:
    # (g-1)/g of [b, s, h] fp32 each)
    plain = comm_estimate(DENSE, PlanLayout(tp=2), WORK).bytes_per_step["tp"]
    sp = comm_estimate(DENSE, PlanLayout(tp=2, sequence_parallel=True), WORK)
    norms = (2 * DENSE.num_layers + 1) * DENSE.hidden_size
    micro = WORK.num_microbatches(PlanLayout(tp=2))
    regathers = micro * (2 * DENSE.num_layers + 1) * (1 / 2) * MICRO * SEQ * DENSE.hidden_size * 4
    assert sp.bytes_per_step["tp"] == pytest.approx(plain + 2 * (1 / 2) * norms * 4 + regathers)


def test_dp_bytes_follow_zero_stages():
    # one bucket (a large bucket size): the whole gradient, padded to a multiple of dp
    numel = sum(p.numel() for p in build_model(DENSE).parameters())
    padded = -(-numel // 4) * 4
    ring = (4 - 1) / 4

    def dp_bytes(stage: int) -> float:
        layout = PlanLayout(dp=4, zero_stage=stage, bucket_size_mb=1024.0)
        return comm_estimate(DENSE, layout, WORK).bytes_per_step["dp"]

    assert dp_bytes(0) == pytest.approx(2 * ring * padded * 4)  # all-reduce
    assert dp_bytes(1) == pytest.approx(3 * ring * padded * 4)  # all-reduce + all-gather
    assert dp_bytes(2) == pytest.approx(2 * ring * padded * 4)  # reduce-scatter + all-gather


def test_pipeline_sends_one_activation_per_microbatch_and_boundary():
    deeper = presets.get("tiny-dense", vocab_size=LM_VOCAB, num_layers=4)
    size = MICRO * SEQ * deeper.hidden_size * 4
    for rank in (0, 1):  # 1F1B: stage 0 sends 4 activations, stage 1 4 gradients
        got = comm_estimate(deeper, PlanLayout(pp=2), WORK, pp_rank=rank)
        assert got.bytes_per_step["pp"] == 4 * size
    for rank in (0, 1):  # 4 virtual stages: each rank's chunks sit at 3 boundary crossings
        got = comm_estimate(deeper, PlanLayout(pp=2, virtual_pp=2), WORK, pp_rank=rank)
        assert got.bytes_per_step["pp"] == 3 * 4 * size
