"""Context parallelism in the planner: every term derived by hand on the tiny presets
(`nanotrain.planning.context_parallel`, docs/planning.md)."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from nanotrain.models import presets
from nanotrain.planning.context_parallel import cp_layer_exchange_bytes
from nanotrain.planning.gpus import gpu_spec
from nanotrain.planning.layout import PlanLayout, Workload
from nanotrain.planning.plan import LATENCY_S, plan_layout
from nanotrain.planning.search import search_layouts
from nanotrain.planning.seq_fit import SeqFit, format_seq_fits, seq_len_fits

H100 = gpu_spec("h100")
BF16 = 2  # dense K and V under bf16-mixed: linear outputs
FP32 = 4  # MLA's gathered latent under bf16-mixed: RMSNorm's fp32 weight times its input


def _dense():
    # tiny-dense: 2 layers, 4 heads, 2 kv heads of head_dim 16
    return presets.get("tiny-dense")


def _mla(mtp_depth=0):
    # tiny (MTP off unless asked): 2 layers, 4 heads, kv_lora_rank 32, rope 8, nope 16, v 16
    return presets.get("tiny", mtp_depth=mtp_depth)


def test_exchange_bytes_per_layer_by_hand():
    # the other 3 ranks' 64 tokens each: MLA 32 + 8 latent elements, dense K and V of 2 heads
    assert cp_layer_exchange_bytes(_mla(), 256, 4, BF16) == (3 * 64 * 40 * 2,) * 2
    assert cp_layer_exchange_bytes(_dense(), 256, 4, BF16) == (3 * 64 * 64 * 2,) * 2
    assert cp_layer_exchange_bytes(_dense(), 256, 1, BF16) == (0, 0)
    # DeepSeek-V3: 512 + 64 per token against Llama-3.1-8B's 2 x 8 x 128
    v3, llama = presets.get("deepseek-v3-671b"), presets.get("dense-8b")
    assert cp_layer_exchange_bytes(v3, 32768, 8, 2)[0] == 7 * 4096 * 576 * 2
    assert cp_layer_exchange_bytes(llama, 32768, 8, 2)[0] == 7 * 4096 * 2048 * 2
    with pytest.raises(ValueError, match="2\\*cp=8"):
        cp_layer_exchange_bytes(_dense(), 100, 4, BF16)


def _pair(config, cp, seq_len=256, recompute=None, tp=1, gpu=H100, micro=1, batch=4):
    """The plan with cp ranks and the same world as plain data parallelism."""
    with_cp = PlanLayout(tp=tp, dp=1, cp=cp, zero_stage=1, recompute=recompute)
    plain = PlanLayout(tp=tp, dp=cp, zero_stage=1, recompute=recompute)
    work = Workload(seq_len, micro, batch, "bf16-mixed")
    return plan_layout(config, with_cp, work, gpu), plain, work


def test_layout_world_describe_and_strategy_fields():
    layout = PlanLayout(tp=2, dp=2, cp=4, ep=8)  # ep drawn from dp x cp
    assert layout.world_size == 16 and layout.expert_dp == 1
    assert "cp4" in layout.describe()
    strategy = SimpleNamespace(tp=2, pp=1, cp=4, dp=None)
    assert PlanLayout.from_strategy(strategy, 16) == PlanLayout(tp=2, dp=2, cp=4)
    assert PlanLayout.from_strategy(SimpleNamespace(tp=2), 8).cp == 1
    assert PlanLayout(dp=2, cp=2, zero_stage=3).expert_dp == 4  # FSDP2 over dp x cp
    with pytest.raises(ValueError, match="overlap_forward_backward"):
        PlanLayout(pp=2, virtual_pp=2, dp=1, cp=2, overlap_forward_backward=True)


def test_runtime_refusals_are_priced_as_refusals():
    work = Workload(256, 1, 4, "bf16-mixed")
    with pytest.raises(ValueError, match="dropless"):
        plan_layout(presets.get("tiny", capacity_factor=1.0), PlanLayout(cp=2), work, H100)
    with pytest.raises(ValueError, match="2\\*cp\\*tp=16"):  # sp splits each chunk over tp
        plan_layout(
            _dense(),
            PlanLayout(tp=2, cp=4, sequence_parallel=True),
            replace(work, seq_len=24),
            H100,
        )


def test_state_memory_is_that_of_dp_x_cp_replicas():
    plan, plain, work = _pair(_dense(), cp=2)
    other = plan_layout(_dense(), plain, work, H100)
    assert plan.ranks[0].state == other.ranks[0].state  # ZeRO-1 over 2 ranks either way


@pytest.mark.parametrize("cp", [2, 4])
def test_dense_activations_are_the_local_tokens_plus_the_gathered_kv(cp):
    s = 256
    plan, plain, work = _pair(_dense(), cp=cp, seq_len=s)
    local = plan_layout(_dense(), plain, replace(work, seq_len=s // cp), H100)
    # per layer the other ranks' K and V (2 kv heads x 16) in bf16, 2 layers; once per
    # microbatch the [s / cp, s] bool mask; one microbatch in flight (pp = 1)
    gathered = 2 * (s - s // cp) * 2 * 2 * 16 * BF16
    mask = (s // cp) * s
    got = plan.ranks[0].activations.peak - local.ranks[0].activations.peak
    assert got == gathered + mask
    # so cp divides what grows with the sequence: cp=2 holds less than cp=1
    assert (
        plan.ranks[0].activations.peak
        < plan_layout(_dense(), plain, work, H100).largest.activations.peak
    )


def test_mla_activations_add_the_gathered_latent_and_expanded_heads():
    s, cp = 256, 2
    plan, plain, work = _pair(_mla(), cp=cp, seq_len=s)
    local = plan_layout(_mla(), plain, replace(work, seq_len=s // cp), H100)
    others = s - s // cp
    latent = others * (32 + 8) * FP32
    # per head the concatenated key (16 + 8), kv_b's output (16 + 16)
    heads = others * 4 * (24 + 16 + 16) * BF16
    got = plan.ranks[0].activations.peak - local.ranks[0].activations.peak
    assert got == 2 * (latent + heads) + (s // cp) * s


def test_full_recompute_keeps_only_the_mask_and_one_layers_rebuild():
    s, cp = 256, 2
    plan, plain, work = _pair(_dense(), cp=cp, seq_len=s, recompute="full")
    local = plan_layout(_dense(), plain, replace(work, seq_len=s // cp), H100)
    one_layer = (s - s // cp) * 2 * 2 * 16 * BF16
    got = plan.ranks[0].activations.peak - local.ranks[0].activations.peak
    assert got == (s // cp) * s + one_layer


@pytest.mark.parametrize("recompute, per_layer", [(None, 2), ("full", 3)])
def test_cp_traffic_per_step_by_hand(recompute, per_layer):
    s, cp, batch = 256, 4, 8
    plan, _, _ = _pair(_dense(), cp=cp, seq_len=s, recompute=recompute, batch=batch)
    comm = plan.ranks[0].comm
    # 8 microbatches (dp = 1), 2 layers, per layer an all-gather and a reduce-scatter (and one
    # more all-gather when the recomputed forward rebuilds attention)
    calls = batch * 2 * per_layer
    one = (cp - 1) * (s // cp) * 2 * 2 * 16 * BF16
    assert comm.calls_per_step["cp"] == calls
    assert comm.bytes_per_step["cp"] == calls * one
    # blocking, on NVLink inside a node (tp * cp = 4 <= 8)
    seconds = calls * one / H100.intra_node_bw + calls * LATENCY_S[0]
    assert plan.slowest_comm_s["cp"] == pytest.approx(seconds)
    assert plan.time_parts["blocking_comm"] >= seconds


def test_cp_group_across_nodes_goes_at_the_inter_node_bandwidth():
    plan, _, _ = _pair(_dense(), cp=8, tp=2, seq_len=512)  # tp * cp = 16 > 8 GPUs per node
    comm = plan.ranks[0].comm
    seconds = comm.bytes_per_step["cp"] / H100.inter_node_bw
    seconds += comm.calls_per_step["cp"] * LATENCY_S[1]
    assert plan.slowest_comm_s["cp"] == pytest.approx(seconds)


def test_compute_adds_the_masked_half_and_mla_expansion():
    s, cp, batch = 256, 2, 4
    dense, plain, work = _pair(_dense(), cp=cp, seq_len=s, batch=batch)
    base = plan_layout(_dense(), plain, work, H100)
    tokens = batch * s / cp  # this rank's tokens per step
    # dense: 6 * heads * (qk + v) * s / 2 per token and layer
    masked = 6 * 4 * (16 + 16) * s / 2
    assert dense.ranks[0].flops - base.ranks[0].flops == pytest.approx(2 * masked * tokens)
    assert dense.flops_per_step == base.flops_per_step  # the model's FLOPs do not change
    mla, plain, work = _pair(_mla(), cp=cp, seq_len=s, batch=batch)
    base = plan_layout(_mla(), plain, work, H100)
    masked = 6 * 4 * (24 + 16) * s / 2
    expand = 6 * 32 * 4 * (16 + 16) * (cp - 1)  # kv_b_proj on the other rank's tokens
    extra = 2 * (masked + expand) * tokens
    assert mla.ranks[0].flops - base.ranks[0].flops == pytest.approx(extra)


def test_search_considers_cp_for_long_sequences_only():
    kwargs = dict(global_batch_size=8, micro_batch_sizes=(1,), recompute=(None,))
    long = search_layouts(_dense(), 4, H100, seq_len=8192, **kwargs)
    assert {p.layout.cp for p in long.fitting} == {1, 2}  # 2 leaves 4,096 tokens per rank
    assert any(p.layout.zero_stage == 3 for p in long.fitting if p.layout.cp > 1)
    short = search_layouts(_dense(), 4, H100, seq_len=4096, **kwargs)
    assert {p.layout.cp for p in short.fitting} == {1}
    # cp does not run capacity-limited MoE layers: not even tried (nor listed as rejected)
    capacity = search_layouts(
        presets.get("tiny", capacity_factor=1.0), 4, H100, seq_len=8192, **kwargs
    )
    assert capacity.fitting and {x.layout.cp for x in capacity.fitting + capacity.rejected} == {1}


def test_seq_len_fits_lists_each_length_and_the_longest_that_fits():
    plan, _, _ = _pair(_dense(), cp=2)
    fits = seq_len_fits(_dense(), plan)
    assert [f.seq_len for f in fits] == [256, 4096, 32768, 131072]
    assert all(f.fits for f in fits)
    rows = [SeqFit(4096, 2**30, True), SeqFit(32768, 70 * 2**30, True)]
    rows += [SeqFit(65536, None, False, "not a multiple"), SeqFit(131072, 90 * 2**30, False)]
    text = format_seq_fits(rows, max_seq_len=32768)
    assert "fits up to 32768 tokens" in text
    assert "131072 tokens: 90.00 GiB, DOES NOT FIT (beyond the model's max_seq_len 32768)" in text
    assert "65536 tokens: cannot run (not a multiple)" in text


def test_plan_cli_prices_cp_and_prints_the_lengths_that_fit(capsys):
    from nanotrain.cli.plan import run_plan

    argv = ["--model", "tiny-dense", "--gpus", "4", "--gpu", "h100", "--seq-len", "1024"]
    run_plan([*argv, "--global-batch-size", "4", "--cp", "2", "--dp", "2"])
    out = capsys.readouterr().out
    assert "layout tp1 cp2 dp2" in out and "on 4 x h100" in out
    assert "cp " in out.split("communication per GPU per step")[1]
    assert "fits up to 131072 tokens" in out
    run_plan([*argv, "--global-batch-size", "4", "--cp", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["layout"]["cp"] == 2 and out["layout"]["dp"] == 2
    assert [f["seq_len"] for f in out["seq_len_fits"]] == [1024, 4096, 32768, 131072]
    with pytest.raises(ValueError, match="--cp 3 does not divide"):
        run_plan([*argv, "--global-batch-size", "4", "--cp", "3"])


def test_mtp_blocks_gather_on_the_last_stage():
    # tiny with one MTP block: its attention gathers like a decoder layer's (3 layers' worth)
    s, cp, batch = 256, 2, 4
    plan, _, _ = _pair(_mla(mtp_depth=1), cp=cp, seq_len=s, batch=batch)
    one = (cp - 1) * (s // cp) * (32 + 8) * FP32
    assert plan.ranks[0].comm.calls_per_step["cp"] == batch * 3 * 2
    assert plan.ranks[0].comm.bytes_per_step["cp"] == batch * 3 * 2 * one
    first, last = plan_layout(
        _mla(1), PlanLayout(pp=2, dp=1, cp=cp), Workload(s, 1, batch), H100
    ).ranks
    assert last.comm.calls_per_step["cp"] == 2 * first.comm.calls_per_step["cp"]  # 1 + MTP
