"""The planner's parameter counts and model-state bytes, checked against independent numbers.

* per-rank parameters summed over a layout's ranks equal the model's (accounting formulas,
  which never build a model), with the pipeline's shared embedding copy counted where the
  strategy keeps it;
* DeepSeek-V3 671B: 671B parameters, ~37B activated, and the paper's layout priced;
* ZeRO's owned element counts equal `FlatLayout.pieces` for random shapes;
* bad layouts and GPUs fail with the strategy's / planner's message.
"""

from __future__ import annotations

import random

import pytest
import torch

from nanotrain.models import presets
from nanotrain.models.accounting import active_params, main_params, mtp_params, total_params
from nanotrain.parallel.data_parallel import FlatLayout
from nanotrain.planning import PlanLayout, Workload, memory, rank_models
from nanotrain.planning.gpus import GPUS, gpu_spec
from nanotrain.planning.layout import balanced_pipeline_layout
from nanotrain.planning.memory import _owned_counts, state_memory

LAYOUTS = [
    ("tiny", PlanLayout(tp=2, dp=1)),
    ("tiny", PlanLayout(ep=4, dp=4)),
    ("tiny", PlanLayout(tp=2, ep=2, dp=2, sequence_parallel=True)),
    ("deepseek-100m", PlanLayout(pp=2, dp=2, ep=2)),
    ("deepseek-100m", PlanLayout(pp=2, virtual_pp=2, tp=2)),
    ("deepseek-100m", PlanLayout(pp=3, pipeline_layout=(3, 3, 2))),
    ("dense-100m", PlanLayout(pp=4, tp=4, pipeline_layout=(2, 4, 4, 2))),
]


@pytest.mark.parametrize(
    "preset,layout", LAYOUTS, ids=[f"{p}-{lay.describe()}" for p, lay in LAYOUTS]
)
def test_rank_parameters_add_up_to_the_model(preset, layout):
    """Experts: every stage's 1/ep share times ep is every expert once (the accounting
    formulas). Everything at tp=1: the model once, plus the embedding copy the last stage
    keeps for MTP or tied weights."""
    config = presets.get(preset)
    mtp = getattr(config, "mtp_depth", 0) > 0
    experts = main_params(config).experts + mtp_params(config).experts
    ranks = rank_models(config, layout)
    assert sum(r.expert_params for r in ranks) * layout.ep == experts
    whole = rank_models(config, layout.replace(tp=1, ep=1, dp=1, sequence_parallel=False))
    shared = config.vocab_size * config.hidden_size
    copy = shared if layout.pp > 1 and (mtp or config.tie_word_embeddings) else 0
    assert sum(r.params for r in whole) == total_params(config, include_mtp=mtp) + copy
    assert [r.chunks for r in whole] == [r.chunks for r in ranks]


def test_tensor_parallel_halves_the_sharded_matrices_and_keeps_the_rest():
    """tiny at tp=2, read from the built modules: the Megatron-sharded projections, embedding
    and head hold half their rows or columns (vocabulary padded to a multiple of tp), while
    norms, the router, MLA's low-rank down-projections, MTP's projection and the routed
    experts (split by ep, not tp) stay whole."""
    config = presets.get("tiny")
    (one,) = rank_models(config, PlanLayout())
    (half,) = rank_models(config, PlanLayout(tp=2))
    full = dict(one.module.named_parameters())
    kept, split = set(), set()
    for name, p in half.module.named_parameters():
        kind = name.split(".")[-2]
        if p.shape == full[name].shape:
            kept.add(kind)
            continue
        split.add(kind)
        (dim,) = [d for d in range(p.dim()) if p.shape[d] != full[name].shape[d]]
        assert p.shape[dim] == -(-full[name].shape[dim] // 2), name
    assert kept == {"enorm", "hnorm", "norm", "input_layernorm", "post_attention_layernorm",
                    "q_a_layernorm", "kv_a_layernorm", "gate", "q_a_proj",
                    "kv_a_proj_with_mqa", "eh_proj", "experts"}  # fmt: skip
    assert split == {"embed_tokens", "lm_head", "q_b_proj", "kv_b_proj", "o_proj",
                     "gate_proj", "up_proj", "down_proj"}  # fmt: skip
    assert half.params < one.params


def test_deepseek_v3_671b_totals_and_paper_layout():
    config = presets.get("deepseek-v3-671b")
    assert round(total_params(config) / 1e9) == 671
    assert round(active_params(config) / 1e9) == 37
    layout = PlanLayout(pp=16, dp=128, ep=64, zero_stage=1, pipeline_layout=(4,) * 15 + (1,))
    ranks = rank_models(config, layout)
    # 256 routed experts over ep=64: 4 per MoE layer on every rank
    moe_layers = sum(1 for c in ranks[1].chunks for i in c if config.is_moe_layer(i))
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size
    assert ranks[1].expert_params == moe_layers * 4 * per_expert
    # over the pipeline, every parameter once, plus the embedding copy of the MTP stage
    everything = total_params(config, include_mtp=True)
    experts_all = sum(r.expert_params for r in ranks) * layout.ep
    dense_all = sum(r.dense_params for r in ranks)
    assert dense_all + experts_all == everything + config.vocab_size * config.hidden_size
    # bf16 training: ZeRO-1 shards optimizer state over dp=128 (dense) and dp/ep=2 (experts)
    work = Workload(
        seq_len=4096, micro_batch_size=1, global_batch_size=15360, precision="bf16-mixed"
    )
    mem = state_memory(ranks[1], layout, work)
    assert mem.optimizer_elements == pytest.approx(
        ranks[1].dense_params / 128 + ranks[1].expert_params / 2, rel=1e-3
    )


@pytest.mark.parametrize("block", [2**20, 5])  # all buckets at once, or a few at a time
def test_zero_owned_counts_equal_flat_layout_pieces(block, monkeypatch):
    monkeypatch.setattr(memory, "_BLOCK_ENTRIES", block)
    rng = random.Random(0)
    for _ in range(200):
        params = [torch.empty(rng.choice([0, 1, 3, 64, 513]), device="meta")
                  for _ in range(rng.randint(1, 10))]  # fmt: skip
        if not sum(p.numel() for p in params):
            continue
        dp, bucket = rng.choice([1, 2, 3, 8]), rng.choice([1, 50, 10_000])
        flat = FlatLayout(params, dp, bucket)
        pieces = [flat.pieces(r) for r in range(dp)]
        elements, counts = _owned_counts(flat)
        assert list(zip(elements.tolist(), counts.tolist(), strict=True)) == [
            (sum(p.numel for p in ps), len(ps)) for ps in pieces
        ]


def test_balanced_pipeline_layout():
    assert balanced_pipeline_layout(61, 16) == (4,) * 15 + (1,)
    assert balanced_pipeline_layout(8, 4) is None
    assert balanced_pipeline_layout(10, 4) == (3, 3, 3, 1)
    assert sum(balanced_pipeline_layout(27, 8)) == 27
    with pytest.raises(ValueError, match="cannot fill"):
        balanced_pipeline_layout(3, 4)


@pytest.mark.parametrize(
    "layout,match",
    [
        (PlanLayout(tp=3), "tp=3"),
        (PlanLayout(ep=3, dp=3), "ep=3"),
        (PlanLayout(pp=3), "num_layers=2"),
    ],
)
def test_layouts_that_do_not_divide_are_refused(layout, match):
    with pytest.raises(ValueError, match=match):
        rank_models(presets.get("tiny"), layout)


def test_a_mesh_that_does_not_divide_is_refused_when_the_layout_is_made():
    with pytest.raises(ValueError, match="ep=2 does not divide dp=1"):
        PlanLayout(ep=2, dp=1)


def test_unknown_gpu_and_bad_spec_are_refused():
    with pytest.raises(ValueError, match="unknown GPU 'h900'.*h100"):
        gpu_spec("h900")
    with pytest.raises(ValueError, match="bad GPU spec"):
        gpu_spec('{"name": "x", "flops": 1}')
    own = gpu_spec('{"name": "mine", "memory_bytes": 1e10, "peak_flops": {"bf16": 1e14}, '
                   '"intra_node_bw": 1e11, "inter_node_bw": 1e10}')  # fmt: skip
    assert own.flops_for("bf16-true") == 1e14 and own.flops_for("transformer-engine") == 1e14
    assert {"h100", "h200", "h800", "a100", "b200"} <= set(GPUS)


def test_bad_workloads_are_refused():
    with pytest.raises(ValueError, match="precision"):
        Workload(seq_len=16, precision="bf8")
    with pytest.raises(ValueError, match="global_batch_size=6 is not a multiple"):
        Workload(seq_len=16, micro_batch_size=2, global_batch_size=6).num_microbatches(
            PlanLayout(dp=2)
        )
