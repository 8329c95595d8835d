"""The step-time model against its stated formulas, and the search over layouts."""

from __future__ import annotations

import dataclasses

import pytest

from nanotrain.models import presets
from nanotrain.models.accounting import flops_per_token
from nanotrain.planning import GPUS, PlanLayout, Workload, gpu_spec, plan_layout, search_layouts
from nanotrain.planning.plan import _bandwidths
from nanotrain.planning.search import SEARCH_RECOMPUTE
from nanotrain.planning.stage_replay import StageDurations, replay_stages

#: an H100 of no known SM count (`calibration.gpu_sms` is None for its family): its matmuls at
#: the flat large-shape efficiency, no shape term, no SMs held by communication; the FLOP
#: accounting below is checked against it (tests/unit/test_plan_shape_and_sms.py prices
#: the shapes)
FLAT = dataclasses.replace(GPUS["h100"], name="flat")


def test_one_gpu_step_is_its_flops_at_peak_times_efficiency():
    config = presets.get("deepseek-100m")
    work = Workload(seq_len=1024, micro_batch_size=2, global_batch_size=8, precision="bf16-true")
    plan = plan_layout(config, PlanLayout(), work, FLAT, compute_efficiency=0.4)
    flops = flops_per_token(config, 1024) * 8 * 1024  # the accounting formula, 6N + attention
    assert plan.flops_per_step == pytest.approx(flops)
    assert plan.time_parts["compute"] == pytest.approx(flops / (989.4e12 * 0.4))
    # one GPU: its matmuls and its memory-bound operations, nothing else
    assert 0 < plan.time_parts["memory_bound"] < plan.time_parts["compute"]
    assert plan.step_time_s == pytest.approx(
        plan.time_parts["compute"] + plan.time_parts["memory_bound"]
    )
    assert plan.mfu == pytest.approx(0.4 * plan.time_parts["compute"] / plan.step_time_s)
    assert plan.tokens_per_s == pytest.approx(8 * 1024 / plan.step_time_s)


def test_full_recompute_adds_a_forward_of_the_layers_and_the_head():
    config = presets.get("deepseek-100m")
    work = Workload(seq_len=512, micro_batch_size=1, global_batch_size=4)
    none = plan_layout(config, PlanLayout(), work, GPUS["h100"])
    full = plan_layout(config, PlanLayout(recompute="full"), work, GPUS["h100"])
    # one more forward of everything: forward + backward = 3 forwards, now 4
    assert full.time_parts["compute"] / none.time_parts["compute"] == pytest.approx(4 / 3)
    assert full.largest.activations.peak < none.largest.activations.peak / 2
    assert full.flops_per_step == none.flops_per_step  # model FLOPs do not count recompute


def test_selective_recompute_adds_a_forward_of_each_attention_block():
    """dense-100m by hand: attention = q, k, v, o projections + QK^T and AV; its forward is a
    third of its training FLOPs."""
    config = presets.get("dense-100m")
    s = 512
    work = Workload(seq_len=s, micro_batch_size=1, global_batch_size=4)
    none = plan_layout(config, PlanLayout(), work, FLAT)
    sel = plan_layout(config, PlanLayout(recompute="selective"), work, FLAT)
    h, n, kv, d = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    attention_fwd = 2 * (2 * h * n * d + 2 * h * kv * d) + 2 * n * 2 * d * s / 2
    total = flops_per_token(config, s)
    expected = (total + config.num_layers * attention_fwd) / total
    assert sel.time_parts["compute"] / none.time_parts["compute"] == pytest.approx(expected)
    assert sel.largest.activations.peak < none.largest.activations.peak


def test_light_recompute_adds_two_forwards_of_the_mla_up_projections():
    """deepseek-100m by hand: q_b (q_lora_rank -> heads x qk_head_dim) and kv_b (kv_lora_rank
    -> heads x (nope + v)) per layer, MTP's block included, twice; nothing for dense attention."""
    c = presets.get("deepseek-100m")
    s = 512
    work = Workload(seq_len=s, micro_batch_size=1, global_batch_size=4)
    none = plan_layout(c, PlanLayout(), work, FLAT)
    light = plan_layout(c, PlanLayout(recompute="light"), work, FLAT)
    up = c.q_lora_rank * c.num_heads * c.qk_head_dim
    up += c.kv_lora_rank * c.num_heads * (c.qk_nope_head_dim + c.v_head_dim)
    total = flops_per_token(c, s)
    expected = (total + (c.num_layers + c.mtp_depth) * 2 * 2 * up) / total
    assert light.time_parts["compute"] / none.time_parts["compute"] == pytest.approx(expected)
    assert light.largest.activations.peak < none.largest.activations.peak
    dense = presets.get("dense-100m")
    plain = plan_layout(dense, PlanLayout(), work, FLAT).time_parts["compute"]
    assert plan_layout(dense, PlanLayout(recompute="light"), work, FLAT).time_parts[
        "compute"
    ] == pytest.approx(plain)


@pytest.mark.parametrize(
    ("tp", "sp", "capacity", "rows_per_copy"),
    [
        (1, False, None, 1.0),
        (2, False, None, 1.0),  # replicated routed experts: every tp rank runs all tokens
        (2, True, None, 0.5),  # sequence parallel, dropless: each tp rank its own tokens
        (2, True, 1.0, 1.0),  # sequence parallel with a capacity: whole sequences again
        (2, False, 2.0, 2.0),  # a capacity of 2: E x C slots hold twice the copies
        (4, True, 1.25, 1.25),
    ],
)
def test_tp_splits_every_flop_but_the_routed_experts_it_replicates(tp, sp, capacity, rows_per_copy):
    """deepseek-100m without MTP by hand: the routed experts run K experts of three H x I
    matrices per token in every MoE layer; E = 16 divides S x K x f at S = 1024 here."""
    config = presets.get("deepseek-100m", mtp_depth=0, capacity_factor=capacity)
    s, tokens = 1024, 8 * 1024
    work = Workload(seq_len=s, micro_batch_size=1, global_batch_size=8, precision="bf16-true")
    layout = PlanLayout(tp=tp, sequence_parallel=sp)
    plan = plan_layout(config, layout, work, FLAT, compute_efficiency=0.4)
    moe_layers = config.num_layers - config.first_k_dense_replace
    h, inter, k = config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok
    routed = 6 * k * 3 * h * inter * moe_layers
    total = flops_per_token(config, s)
    rank_flops = ((total - routed) / tp + routed * rows_per_copy) * tokens
    assert plan.time_parts["compute"] == pytest.approx(rank_flops / (989.4e12 * 0.4))
    assert plan.flops_per_step == pytest.approx(total * tokens)  # model FLOPs: no slots, no tp


@pytest.mark.parametrize("vpp,micro", [(1, 1), (2, 1), (1, 2)])
def test_pipeline_bubble_is_pp_minus_one_over_vpp_microbatches(vpp, micro):
    # equal stages: the replay gives the textbook bubble; the plan's parts add up to its step
    m, busy = 8, 3.0
    equal = [StageDurations(1.0 / m, 1.0 / m, 1.0 / m)] * 4
    step = replay_stages("1f1b" if vpp == 1 else "interleaved_1f1b", m, vpp, equal).step
    assert step - busy == pytest.approx(busy * 3 / (vpp * m))
    config = presets.get("dense-100m")
    layout = PlanLayout(pp=2, dp=4, virtual_pp=vpp)
    work = Workload(seq_len=512, micro_batch_size=micro, global_batch_size=32)
    plan = plan_layout(config, layout, work, GPUS["h100"])
    assert plan.step_time_s == pytest.approx(sum(plan.time_parts.values()))
    assert plan.time_parts["pipeline_bubble"] > 0


def test_each_stage_replays_with_its_own_durations():
    # a light first stage and a heavy last one (the head): the step lies between the
    # heavy stage's own work and the old rule's every-stage-as-busy-as-the-heaviest replay
    m = 8
    light, heavy = StageDurations(0.1, 0.1, 0.1), StageDurations(0.2, 0.2, 0.2)
    own = replay_stages("1f1b", m, 1, [light, heavy])
    paced = replay_stages("1f1b", m, 1, [heavy, heavy])
    assert m * 0.6 < own.step < paced.step
    # the last microbatch's backward starts before each rank ends
    assert all(b < e for b, e in zip(own.last_backward, own.ends, strict=True))


@pytest.mark.parametrize(("recompute", "weight_share"), [(None, 1 / 3), ("full", 1 / 4)])
def test_split_backwards_take_the_weight_gradient_out_of_the_bubble(recompute, weight_share):
    # the weight half is a third of the training FLOPs (a quarter with full recomputation,
    # which adds a forward): zb_1f1b's bubble is 1F1B's without it (equal stages)
    m, busy = 8, 1.0
    w = busy * weight_share / m
    stage = StageDurations(w, busy / m - 2 * w, w)
    one = replay_stages("1f1b", m, 1, [stage] * 2).step - busy
    split = replay_stages("zb_1f1b", m, 1, [stage] * 2).step - busy
    assert split == pytest.approx(one * (busy - busy * weight_share) / busy)
    config = presets.get("dense-100m")
    work = Workload(seq_len=512, micro_batch_size=1, global_batch_size=32)
    plans = {
        schedule: plan_layout(
            config, PlanLayout(pp=2, dp=4, schedule=schedule, recompute=recompute), work,
            GPUS["h100"],
        )
        for schedule in ("1f1b", "zb_1f1b")
    }  # fmt: skip
    one_p, split_p = plans["1f1b"].time_parts, plans["zb_1f1b"].time_parts
    assert split_p["compute"] == one_p["compute"]
    assert split_p["pipeline_bubble"] < one_p["pipeline_bubble"]
    assert plans["zb_1f1b"].step_time_s < plans["1f1b"].step_time_s


def test_groups_inside_a_node_use_nvlink_and_across_nodes_the_network():
    h100, config = GPUS["h100"], presets.get("tiny")

    def _flat(**sizes):  # the flat dispatch: every copy straight to its expert's rank
        return PlanLayout(**sizes, node_limited_dispatch=False)

    inside = _bandwidths(config, _flat(tp=2, dp=8, ep=4), h100)  # tp and ep span ranks 0..7
    assert inside["tp"][0] == inside["ep"][0] == h100.intra_node_bw
    assert inside["dp"][0] == h100.inter_node_bw  # dp ranks 0, 2, ..., 14: two nodes
    # an all-to-all over 16 ranks on two nodes: 7 of 15 peer shares stay on NVLink while 8
    # cross the network, both at once, so the network's 8/15 set the pace
    across = _bandwidths(config, _flat(dp=16, ep=16), h100)
    assert across["ep"][0] == pytest.approx(h100.inter_node_bw * 15 / 8)
    assert across["dp"][0] == h100.inter_node_bw  # a ring: as fast as its slowest links
    # DeepSeek-V3's ep=64 over 8 nodes: 7 of 63 shares inside the node
    paper = _bandwidths(config, _flat(pp=16, dp=128, ep=64), GPUS["h800"])
    assert paper["ep"][0] == pytest.approx(GPUS["h800"].inter_node_bw * 63 / 56)
    # a slow node-internal link can set the pace instead: 1 GB/s inside, 100 GB/s outside
    slow_inside = gpu_spec(
        '{"name": "odd", "memory_bytes": 8e10, "peak_flops": {"bf16": 1e15}, '
        '"intra_node_bw": 1e9, "inter_node_bw": 1e11}'
    )
    assert _bandwidths(config, _flat(dp=16, ep=16), slow_inside)["ep"][0] == pytest.approx(
        1e9 * 15 / 7
    )
    # node-limited (the default where ep spans nodes): the hop inside the node on NVLink,
    # the one between nodes on the network
    limited = _bandwidths(config, PlanLayout(pp=16, dp=128, ep=64), GPUS["h800"])
    assert limited["ep"][0] == GPUS["h800"].intra_node_bw
    assert limited["ep_inter"][0] == GPUS["h800"].inter_node_bw


def test_search_ranks_what_fits_and_says_why_the_rest_does_not():
    config = presets.get("deepseek-100m")
    result = search_layouts(config, 8, GPUS["h100"], seq_len=1024, global_batch_size=64)
    assert result.fitting, "a 100M model fits 8 H100s many ways"
    speeds = [p.tokens_per_s for p in result.fitting]
    assert speeds == sorted(speeds, reverse=True)
    assert all(p.fits and p.layout.world_size == 8 for p in result.fitting)
    # heads=8, experts=16: no tp or ep that does not divide them is ever proposed
    assert all(8 % p.layout.tp == 0 and 16 % p.layout.ep == 0 for p in result.fitting)
    # a GPU with memory between what the layouts need: some fit, the rest are rejected for
    # memory, and the line between them is the memory each plan needs
    needs = sorted(p.largest.memory for p in result.fitting)
    limit = needs[len(needs) // 2]
    mid = gpu_spec(
        f'{{"name": "mid", "memory_bytes": {limit}, "peak_flops": {{"bf16": 1e15}}, '
        '"intra_node_bw": 4.5e11, "inter_node_bw": 5e10}'
    )
    smaller = search_layouts(config, 8, mid, seq_len=1024, global_batch_size=64)
    assert smaller.fitting and len(smaller.fitting) < len(result.fitting)
    assert all(p.largest.memory <= limit for p in smaller.fitting)
    memory = [r for r in smaller.rejected if "more than the" in r.reason]
    assert memory and all(f"{limit / 2**30:.2f} GiB of a mid" in r.reason for r in memory)


def test_search_needs_one_batch_size():
    with pytest.raises(ValueError, match="exactly one"):
        search_layouts(presets.get("tiny"), 2, GPUS["cpu"], seq_len=64)


def test_paired_chunks_hide_part_of_the_expert_all_to_all():
    # a DeepSeek model whose experts span two nodes: the all-to-all blocks for a while
    config = presets.get("deepseek-v2-lite")
    work = Workload(seq_len=2048, micro_batch_size=1, global_batch_size=256)
    # the flat dispatch in both, to set the pairing's hiding against its ep time
    layout = PlanLayout(
        pp=2, dp=16, ep=16, schedule="dualpipev", zero_stage=1, pipeline_layout=(6, 7, 7, 7),
        node_limited_dispatch=False,
    )  # fmt: skip
    plain = plan_layout(config, layout, work, GPUS["h100"])
    paired = plan_layout(config, layout.replace(overlap_forward_backward=True), work, GPUS["h100"])
    assert "overlapped" in paired.layout.describe()
    ep = plain.slowest_comm_s["ep"]
    assert plain.hidden_comm_s == 0.0 and 0.0 < paired.hidden_comm_s < ep
    assert paired.step_time_s == pytest.approx(sum(paired.time_parts.values()))
    assert paired.step_time_s < plain.step_time_s
    assert paired.time_parts["compute"] == plain.time_parts["compute"]
    # what is not hidden stays blocking
    others = plain.time_parts["blocking_comm"] - ep
    assert paired.time_parts["blocking_comm"] == pytest.approx(others + ep - paired.hidden_comm_s)
    # refused as the strategy refuses it
    with pytest.raises(ValueError, match="overlap_forward_backward needs tp=1"):
        PlanLayout(tp=2, pp=2, dp=8, schedule="dualpipev", overlap_forward_backward=True)


def test_the_first_layers_of_a_chunk_recomputed_fully_are_priced_layer_by_layer():
    """dense-100m: each fully recomputed layer adds a third of its FLOPs; a MoE model without
    MTP: the ep traffic of N fully recomputed layers of L is light's plus N/L of what full
    recomputation adds (their forward all-to-alls run again)."""
    from nanotrain.models.accounting import flops_per_token_parts
    from nanotrain.planning.communication import comm_estimate

    dense = presets.get("dense-100m")
    s = 512
    work = Workload(seq_len=s, micro_batch_size=1, global_batch_size=4)
    none = plan_layout(dense, PlanLayout(), work, FLAT).time_parts["compute"]
    two = plan_layout(dense, PlanLayout(recompute_full_layers=2), work, FLAT)
    layer = flops_per_token_parts(dense, s).layers[0]
    expected = (flops_per_token(dense, s) + 2 * layer / 3) / flops_per_token(dense, s)
    assert two.time_parts["compute"] / none == pytest.approx(expected)
    assert "no-recompute+2full" in two.layout.describe()

    moe = presets.get("deepseek-100m", mtp_depth=0, first_k_dense_replace=0)
    layers = moe.num_layers

    def ep_bytes(recompute, full_layers=0):
        layout = PlanLayout(dp=2, ep=2, recompute=recompute, recompute_full_layers=full_layers)
        return comm_estimate(moe, layout, work).bytes_per_step["ep"]

    light, full = ep_bytes("light"), ep_bytes("full")
    assert full > light
    assert ep_bytes("light", 1) == pytest.approx(light + (full - light) / layers)


@pytest.mark.parametrize("precision", ["transformer-engine", "torchao-float8"])
def test_fp8_precisions_price_only_the_plain_linear_layers_at_the_fp8_peak(precision):
    """The fp8 plugins swap the plain linear layers; the attention scores, the router, the
    routed experts (`GroupedExperts`) and the head run at bf16 (or higher): deepseek-100m by
    its parts."""
    from nanotrain.models.accounting import linear_flops_per_token_parts

    c, gpu, s = presets.get("deepseek-100m"), FLAT, 512
    work = Workload(seq_len=s, micro_batch_size=1, global_batch_size=4, precision=precision)
    plan = plan_layout(c, PlanLayout(), work, gpu, compute_efficiency=0.5)
    per_layer, mtp, _ = linear_flops_per_token_parts(c)
    linear = (sum(per_layer) + mtp) * 4 * s
    total = flops_per_token(c, s) * 4 * s
    fp8, bf16 = gpu.peak_flops["fp8"], gpu.peak_flops["bf16"]
    expected = (linear / fp8 + (total - linear) / bf16) / 0.5
    assert plan.time_parts["compute"] == pytest.approx(expected)
    assert 0 < linear < total / 2  # most of this MoE model's FLOPs are not plain linears


def test_search_in_worker_processes_gives_the_one_process_result():
    """Two forked workers price alternate candidates; merged back in candidate order, the
    ranking, the plans and the rejections are those of one process."""
    config = presets.get("deepseek-100m")
    kwargs = dict(seq_len=1024, global_batch_size=64, micro_batch_sizes=(1, 2))
    one = search_layouts(config, 8, GPUS["h100"], **kwargs)
    two = search_layouts(config, 8, GPUS["h100"], workers=2, **kwargs)
    assert [(p.layout, p.workload, p.step_time_s, p.largest.memory) for p in two.fitting] == [
        (p.layout, p.workload, p.step_time_s, p.largest.memory) for p in one.fitting
    ]
    assert two.rejected == one.rejected
    with pytest.raises(ValueError, match="workers"):
        search_layouts(config, 8, GPUS["h100"], workers=0, **kwargs)


def _every_mode_priced(config, world, gpu, **kwargs):
    """The search written straightforwardly: every candidate, micro batch and memory saver
    priced in full by `plan_layout` until one fits (no memory-first shortcut)."""
    from nanotrain.planning import search as search_mod

    fitting, rejected = [], []
    for base in search_mod._candidates(config, world, gpu, (1, 3), kwargs["seq_len"]):
        for micro in (1, 2):
            last = None
            for offload, every, mode in search_mod._memory_savers(base, SEARCH_RECOMPUTE, None):
                layout = base.replace(
                    recompute=mode, cpu_offload=offload, reduce_scatter_every_microbatch=every
                )
                workload = Workload(kwargs["seq_len"], micro, kwargs["global_batch_size"])
                try:
                    plan = plan_layout(config, layout, workload, gpu)
                except ValueError as err:
                    last = (layout, micro, str(err))
                    break
                if plan.fits:
                    fitting.append(plan)
                    last = None
                    break
                last = (layout, micro, "; ".join(plan.notes))
            if last is not None:
                rejected.append(last)
    fitting.sort(key=lambda p: -p.tokens_per_s)
    return fitting, rejected


def test_memory_first_search_gives_the_plans_and_rejections_of_pricing_every_mode(monkeypatch):
    """On a GPU that only some recomputation modes fit, pricing memory first (and the time
    of the first mode that fits only), and skipping the modes whose model state alone does
    not fit, keeps every plan, its rank and every rejection."""
    from nanotrain.planning import search as search_mod

    skipped = []
    overflows = search_mod._state_overflows

    def counted(one):
        over, tries = overflows(one)
        skipped.append(len(over))
        return over, tries

    monkeypatch.setattr(search_mod, "_state_overflows", counted)
    config = presets.get("deepseek-100m")
    kwargs = dict(seq_len=256, global_batch_size=64)
    needs = sorted(
        p.largest.memory
        for p in search_layouts(config, 8, GPUS["h100"], micro_batch_sizes=(1, 2), **kwargs).fitting
    )
    mid = gpu_spec(
        f'{{"name": "mid", "memory_bytes": {needs[len(needs) // 6]}, '
        '"peak_flops": {"bf16": 1e15}, "intra_node_bw": 4.5e11, "inter_node_bw": 5e10}'
    )
    skipped.clear()
    fast = search_layouts(config, 8, mid, micro_batch_sizes=(1, 2), **kwargs)
    # modes were skipped for their model state alone (on some candidates, not all)
    assert 0 < sum(n > 0 for n in skipped) < len(skipped)
    fitting, rejected = _every_mode_priced(config, 8, mid, **kwargs)
    # the memory-first path was taken: some plans fit only with recomputation
    assert any(p.layout.recompute is not None for p in fitting)
    assert rejected
    key = [(p.layout, p.workload, p.step_time_s, p.largest.memory, p.notes) for p in fitting]
    assert [
        (p.layout, p.workload, p.step_time_s, p.largest.memory, p.notes) for p in fast.fitting
    ] == key
    assert [(r.layout, r.micro_batch_size, r.reason) for r in fast.rejected] == rejected
