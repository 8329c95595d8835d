"""ZeRO-3 (FSDP2) and cpu_offload in the planner: shard arithmetic against torch.chunk, the
wrapping rule's units, the collectives it prices, the search and the refusals.

The byte-exact check against a real FSDP2 run is tests/distributed/test_plan_zero3.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from nanotrain.cli import main
from nanotrain.models import presets
from nanotrain.models.accounting import total_params
from nanotrain.planning import PlanLayout, Workload, comm_estimate, plan_layout, rank_models, zero3
from nanotrain.planning.gpus import GPUS, gpu_spec
from nanotrain.planning.memory import state_memory
from nanotrain.planning.search import search_layouts
from nanotrain.planning.zero3 import local_numels, sharded_numel, zero3_units
from nanotrain.strategies.megatron import MegatronStrategy

GiB = 2**30


def test_shards_are_torch_chunk_rows_padded_to_the_first_ranks():
    rng = random.Random(0)
    for _ in range(100):
        shape = [rng.choice([1, 3, 5, 8, 97])] + [rng.choice([1, 2, 7])] * rng.randint(0, 2)
        group = rng.choice([1, 2, 3, 4, 8])
        t = torch.empty(shape)
        chunks = list(torch.chunk(t, group, dim=0))
        rows = [c.numel() for c in chunks] + [0] * (group - len(chunks))
        assert local_numels([t], group) == rows
        assert sharded_numel([t], group) == chunks[0].numel()  # every rank pads to rank 0's


@pytest.mark.parametrize(
    "preset,layout",
    [("tiny", PlanLayout(dp=4, ep=2)), ("tiny-dense", PlanLayout(tp=2, dp=2))],
)
def test_units_cover_every_trained_parameter_once(preset, layout):
    config = presets.get(preset)
    (rank,) = rank_models(config, layout)
    units = zero3_units(rank)
    listed = [*units.root, *[p for b in units.blocks for p in b],
              *[p for e in units.experts for p in e]]  # fmt: skip
    assert sorted(map(id, listed)) == sorted(map(id, rank.dense + rank.experts))
    mtp = getattr(config, "mtp_depth", 0)
    assert len(units.blocks) == config.num_layers  # the MTP blocks are in the root
    moe = sum(config.is_moe_layer(i) for i in range(config.num_layers)) if mtp else 0
    # one expert stack per MoE layer (and per MTP block, whose layer is MoE in "tiny")
    assert len(units.experts) == (moe + mtp if moe else 0)
    assert {id(p) for e in units.experts for p in e} == {id(p) for p in rank.experts}


def _dense(vocab: int = 256):
    return presets.get("tiny-dense", vocab_size=vocab)


def test_collectives_per_step_all_gather_twice_and_reduce_scatter_once():
    """tiny-dense at dp=2, where every dim 0 is even (no padding): per microbatch the root
    (embedding, head, final norm) is gathered once, each layer twice (forward, backward);
    the gradient is reduce-scattered once per step; all in fp32 under 32-true."""
    config = _dense()
    h, v = config.hidden_size, config.vocab_size
    root = 2 * v * h + h  # untied embedding and head, final norm
    layers = total_params(config) - root
    dp = 2
    for micro in (1, 3):
        work = Workload(seq_len=16, micro_batch_size=1, global_batch_size=micro * dp,
                        precision="32-true")  # fmt: skip
        for reshard, gathers in ((True, 2), (False, 1)):
            layout = PlanLayout(dp=dp, zero_stage=3, reshard_after_forward=reshard)
            comm = comm_estimate(config, layout, work)
            half = 4 * (dp - 1) / dp  # ring: (g - 1) / g of the whole tensor, fp32
            expected = micro * (root + gathers * layers) * half + (root + layers) * half
            assert comm.bytes_per_step["dp"] == expected
            units = 1 + config.num_layers
            calls = micro * (1 + gathers * config.num_layers) + units
            assert comm.calls_per_step["dp"] == calls


def test_reduce_scatter_every_microbatch_trades_the_whole_gradient_for_reduce_scatters():
    config = _dense()
    (rank,) = rank_models(config, PlanLayout(dp=2))
    work = Workload(seq_len=16, micro_batch_size=1, global_batch_size=6, precision="32-true")
    once = PlanLayout(dp=2, zero_stage=3)
    every = PlanLayout(dp=2, zero_stage=3, reduce_scatter_every_microbatch=True)
    a, b = state_memory(rank, once, work), state_memory(rank, every, work)
    assert a.grads_peak - b.grads_peak == 4 * total_params(config)
    assert b.grads_peak == b.grads
    reduce = total_params(config) * 4 / 2  # one fp32 reduce-scatter over dp=2, no padding
    extra = comm_estimate(config, every, work).bytes_per_step["dp"]
    assert extra - comm_estimate(config, once, work).bytes_per_step["dp"] == 2 * reduce
    with pytest.raises(ValueError, match="reduce_scatter_every_microbatch=True needs"):
        PlanLayout(pp=2, dp=2, zero_stage=3, reduce_scatter_every_microbatch=True)


def test_bf16_true_gathers_bf16_copies_of_fp32_shards():
    config = _dense()
    layout = PlanLayout(dp=2, zero_stage=3)
    (rank,) = rank_models(config, layout)
    fp32 = Workload(seq_len=16, micro_batch_size=1, global_batch_size=2, precision="32-true")
    bf16 = Workload(seq_len=16, micro_batch_size=1, global_batch_size=2, precision="bf16-true")
    a, b = state_memory(rank, layout, fp32), state_memory(rank, layout, bf16)
    assert (a.params, a.grads, a.optimizer) == (b.params, b.grads, b.optimizer)
    assert b.master == 0  # the fp32 shards are the masters
    gather = comm_estimate(config, layout, fp32).bytes_per_step["dp"]
    gather_bf16 = comm_estimate(config, layout, bf16).bytes_per_step["dp"]
    reduce = total_params(config) * 4 / 2  # one fp32 reduce-scatter over dp=2
    assert gather_bf16 - reduce == pytest.approx((gather - reduce) / 2)


def test_gradient_accumulation_holds_the_whole_gradient_during_backward():
    config = _dense()
    layout = PlanLayout(dp=2, zero_stage=3)
    (rank,) = rank_models(config, layout)
    one = Workload(seq_len=16, micro_batch_size=1, global_batch_size=2, precision="32-true")
    two = Workload(seq_len=16, micro_batch_size=1, global_batch_size=4, precision="32-true")
    a, b = state_memory(rank, layout, one), state_memory(rank, layout, two)
    assert a.grads_peak == a.grads
    assert b.grads_peak - b.grads == 4 * total_params(config)


def test_offload_moves_the_state_to_the_host_and_prices_pcie_and_the_host_step():
    config = presets.get("dense-100m")
    work = Workload(seq_len=1024, micro_batch_size=1, global_batch_size=8)
    on_gpu = plan_layout(config, PlanLayout(dp=8, zero_stage=3), work, GPUS["h100"])
    offload = plan_layout(
        config, PlanLayout(dp=8, zero_stage=3, cpu_offload=True), work, GPUS["h100"]
    )
    g, h = on_gpu.ranks[0].state, offload.ranks[0].state
    buffers = rank_models(config, PlanLayout(dp=8))[0].buffer_bytes
    assert h.params == buffers and h.grads == h.optimizer == 0 and g.grads > 0
    assert h.host == g.params - buffers + g.grads + g.optimizer
    assert h.gathered == g.gathered > 0  # the gathered copies are on the GPU either way
    assert offload.ranks[0].memory < on_gpu.ranks[0].memory
    # per microbatch the fp32 shards cross PCIe before each gather (1 root + 2 per layer
    # pass), the gradient shard once back
    assert offload.ranks[0].comm.bytes_per_step["host"] > 0
    assert on_gpu.ranks[0].comm.bytes_per_step["host"] == 0
    assert offload.time_parts["host_optimizer"] > 0
    assert offload.step_time_s > on_gpu.step_time_s
    assert any("cpu_offload" in n for n in offload.notes)


def test_refusals():
    with pytest.raises(ValueError, match="cpu_offload=True needs zero_stage=3"):
        PlanLayout(dp=2, zero_stage=2, cpu_offload=True)
    with pytest.raises(ValueError, match="reshard_after_forward=False needs zero_stage=3"):
        PlanLayout(dp=2, reshard_after_forward=False)
    with pytest.raises(ValueError, match="zero_stage=3 with overlap_forward_backward=True"):
        PlanLayout(pp=2, virtual_pp=2, dp=2, zero_stage=3, overlap_forward_backward=True)
    with pytest.raises(ValueError, match="zero_stage must be 0, 1, 2 or 3"):
        PlanLayout(zero_stage=4)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(dp=2, zero_stage=2, cpu_offload=True),
        dict(dp=2, reshard_after_forward=False),
        dict(pp=2, virtual_pp=2, dp=2, zero_stage=3, overlap_forward_backward=True),
        dict(pp=2, dp=2, zero_stage=3, reduce_scatter_every_microbatch=True),
        dict(pp=2, dp=2, virtual_pp=2, pipeline_layout=(1, 1, 1)),
        dict(pp=2, dp=2, schedule="no_such_schedule"),
        dict(dp=2, bucket_size_mb=0),
        dict(pp=2, dp=2, zero_stage=3, schedule="zb_1f1b"),
        dict(pp=2, dp=2, zero_stage=3, schedule="dualpipev"),
        dict(pp=2, dp=2, virtual_pp=2, zero_stage=3, schedule="zb_interleaved_1f1b"),
        dict(pp=2, dp=2, zero_stage=3, schedule="zb_h1", reshard_after_forward=False),
    ],
)
def test_plan_layout_accepts_and_refuses_what_the_strategy_does(kwargs):
    """PlanLayout runs the strategy's construction checks: the same layouts refused with
    the same message, the same accepted with the same schedule and chunks per rank."""
    try:
        strategy = MegatronStrategy(**kwargs)
    except (TypeError, ValueError) as refused:
        with pytest.raises(type(refused)) as planned:
            PlanLayout(**kwargs)
        assert str(planned.value) == str(refused)
        return
    layout = PlanLayout(**kwargs)
    assert (layout.schedule, layout.virtual_pp) == (strategy.schedule, strategy.virtual_pp)
    assert layout.strategy().schedule == strategy.schedule


def test_split_backward_schedules_keep_every_unit_gathered():
    """zb_*/DualPipeV under ZeRO-3 with pp > 1: the gathered copies of the whole stage are
    held (the other schedules hold two blocks), and each block is gathered once per
    microbatch plus once (a forward frees the copies its backward kept; the next backward
    gathers them again), the root once per step."""
    config = presets.get("tiny-dense", num_layers=8)
    work = Workload(seq_len=16, micro_batch_size=1, global_batch_size=16)
    base = dict(pp=2, dp=2, zero_stage=3)
    plain, zb = PlanLayout(**base), PlanLayout(**base, schedule="zb_1f1b")
    assert zb.keeps_gathered_in_backward and not plain.keeps_gathered_in_backward
    assert not PlanLayout(pp=2, dp=2, zero_stage=1, schedule="zb_1f1b").keeps_gathered_in_backward
    rank = rank_models(config, zb)[0]
    units = zero3.zero3_units(rank)
    blocks = [zero3.sharded_numel(b, 2) * 2 * 4 for b in units.blocks]  # fp32 gathered
    root = zero3.sharded_numel(units.root, 2) * 2 * 4
    assert len(blocks) == 4
    assert zero3.kept_gathered_bytes(rank, zb, 4) == root + sum(blocks)
    assert zero3.kept_gathered_bytes(rank, plain, 4) == 0
    kept = state_memory(rank, zb, work).gathered
    two = state_memory(rank_models(config, plain)[0], plain, work).gathered
    assert kept - two == sum(sorted(blocks)[:2])  # the two blocks not at work
    micro = work.num_microbatches(zb)
    assert zero3.gathers_per_step(plain, micro) == (micro, 2 * micro)
    assert zero3.gathers_per_step(zb, micro) == (1, micro + 1)
    no_reshard = PlanLayout(**base, schedule="zb_1f1b", reshard_after_forward=False)
    assert zero3.gathers_per_step(no_reshard, micro) == (1, 1)


def _gpu(memory: float):
    """A GPU of `memory` bytes alone in its node (so no tensor parallelism is tried)."""
    return gpu_spec(
        f'{{"name": "small", "memory_bytes": {memory}, "peak_flops": {{"bf16": 1e15}}, '
        '"intra_node_bw": 4.5e11, "inter_node_bw": 5e10, "gpus_per_node": 1}'
    )


def test_search_offers_zero3_where_zero1_does_not_fit_and_offload_where_nothing_else_does():
    """One wide layer (no pipeline) on GPUs alone in their node (no tp): only dp shards, so
    the memory needs order ZeRO-1 > ZeRO-3 > ZeRO-3 with offload; on GPUs between two of
    them the search offers what fits and nothing else."""
    config = presets.get("dense-100m", hidden_size=2048, num_layers=1, num_heads=16,
                         intermediate_size=8192)  # fmt: skip
    kw = dict(seq_len=256, global_batch_size=8, micro_batch_sizes=(1,), recompute=("full",))
    roomy = search_layouts(config, 8, _gpu(80 * GiB), **kw)
    by_kind = {(p.layout.zero_stage, p.layout.cpu_offload): p for p in roomy.fitting}
    assert set(by_kind) == {(1, False), (3, False)}  # offload only where nothing else fits
    assert not any(p.layout.reduce_scatter_every_microbatch for p in roomy.fitting)
    assert all(p.layout.dp == 8 for p in roomy.fitting)
    zero1, zero3 = by_kind[(1, False)].largest.memory, by_kind[(3, False)].largest.memory
    work = Workload(seq_len=256, micro_batch_size=1, global_batch_size=8)
    offload = plan_layout(
        config, PlanLayout(dp=8, zero_stage=3, cpu_offload=True, recompute="full"), work,
        _gpu(80 * GiB),
    ).largest.memory  # fmt: skip
    assert offload < zero3 < zero1
    tight = search_layouts(config, 8, _gpu((zero1 + zero3) / 2), **kw)
    assert [(p.layout.zero_stage, p.layout.cpu_offload) for p in tight.fitting] == [(3, False)]
    tighter = search_layouts(config, 8, _gpu((zero3 + offload) / 2), **kw)
    assert [(p.layout.zero_stage, p.layout.cpu_offload) for p in tighter.fitting] == [(3, True)]
    assert tighter.fitting[0].largest.memory == offload


def test_cli_prices_zero3_and_offload(capsys):
    argv = ["plan", "--model", "dense-100m", "--gpus", "8", "--gpu", "h100", "--seq-len",
            "1024", "--global-batch-size", "16", "--dp", "8", "--zero_stage", "3"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "dp8 zero3" in text and "gathered" in text
    assert main([*argv, "--cpu_offload", "true", "--reshard_after_forward", "false"]) == 0
    text = capsys.readouterr().out
    assert "dp8 zero3 no-reshard offload" in text and "host_optimizer" in text
