"""MegatronStrategy with expert parallelism matches one process step for step.

Three forked gloo worlds (2, 4 and 8 ranks) train the tiny DeepSeek preset (8 routed experts;
every layer an MoE layer so that pp=2 has MoE layers on both stages, MTP on the last) under
ep=2, ep=4 (node-limited dispatch), ep=2 x dp=2 (ZeRO-1 and ZeRO-2), ep=2 x pp=2, ep=2 x tp=2
(without sequence parallelism, and with it under node-limited dispatch) and
tp=2 x pp=2 x ep=2 x dp=2 with ZeRO-2. Every layout is checked against the
single-process reference with the same seed, data and global batch: per-step losses and grad
norms, the first step's per-parameter grad norms, validation loss, the final parameters
gathered over tp, ep and pp, and the aux-loss-free router biases (bitwise: they move by
+-speed from integer loads, so any routing difference would show).

The 4-rank world also saves sharded checkpoints under ep=2 x dp=2 and resumes them exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import nanotrain as nt
from nanotrain.callbacks.checkpoint import ModelCheckpoint
from nanotrain.strategies.megatron import MegatronStrategy
from tests.distributed.spawn import run_world
from tests.distributed.test_megatron import LM_VOCAB, RandomTokens, assert_matches
from tests.distributed.test_pipeline import fit_module, gather_over_stages

pytestmark = pytest.mark.distributed

# Every layer MoE (the preset makes layer 0 dense), so pp=2 puts MoE layers on both stages.
OVERRIDES = {"first_k_dense_replace": 0}
BIAS = "e_score_correction_bias"
EXPERT = "model.layers.0.mlp.experts.gate_proj"  # [8, moe_inter, hidden] in the full model


def _module(lr: float = 3e-3, decay_steps: int | None = None) -> nt.LanguageModelModule:
    return nt.LanguageModelModule(
        "tiny",
        vocab_size=LM_VOCAB,
        lr=lr,
        warmup_steps=2,
        decay_steps=decay_steps,
        model_overrides=OVERRIDES,
    )


def fit(strategy: Any, root: str) -> dict:
    """`test_pipeline.fit_module` on `_module()`, plus the router biases (over pp), the
    validation loss and how many experts of layer 0 this rank holds (0 on a pipeline stage
    without layer 0)."""
    module = _module()
    result = fit_module(module, strategy, root)
    biases = {n: b.clone() for n, b in module.named_buffers() if n.endswith(BIAS)}
    held = dict(module.named_parameters())
    result.update(
        biases=gather_over_stages(strategy, biases),
        val_loss=result["logged"]["val/loss"],
        local_experts=held[EXPERT].shape[0] if EXPERT in held else 0,
        node_limited=any(getattr(m, "node_groups", None) for m in module.modules()),
    )
    return result


# name -> MegatronStrategy kwargs
WORLD2 = {"ep=2": dict(ep=2)}
WORLD4 = {
    # ep=4 (2 experts a rank) under node-limited dispatch below; the flat dispatch's all-to-all
    # is the same call for any ep group ("ep=2" and the ep=2 layouts here)
    # dp=4 -> expert-dp groups of 2: expert state and (ZeRO-2) grads sharded over them
    "ep=2 x dp=2 zero1": dict(ep=2, zero_stage=1),
    # nodes of one rank: node-limited dispatch over rails of 2 (flat ZeRO-2 and pp x ep: WORLD8)
    "ep=2 x dp=2 zero2 node-limited": dict(ep=2, zero_stage=2, ranks_per_node=1),
    "ep=2 x pp=2 node-limited": dict(ep=2, pp=2, ranks_per_node=1),
    "ep=2 x tp=2": dict(ep=2, tp=2),
    # ep x tp with sequence parallelism: "ep=2 x tp=2 sp node-limited" below (each tp rank
    # routes its own part of the sequence; the dispatch after routing is the flat one of
    # "ep=2 x tp=2" or the node-limited one, both checked)
    # node-limited dispatch, nodes of 2 ranks: rail and intra-node groups; under tp=2 the ep
    # ranks (0, 2) sit on two nodes, one each
    "ep=4 node-limited": dict(ep=4, ranks_per_node=2, node_limited_dispatch=True),
    "ep=2 x tp=2 sp node-limited": dict(
        ep=2, tp=2, sequence_parallel=True, ranks_per_node=2, node_limited_dispatch=True
    ),
}
WORLD8 = {"tp=2 x pp=2 x ep=2 x dp=2 zero2": dict(tp=2, pp=2, ep=2, zero_stage=2)}
LAYOUTS = {**WORLD2, **WORLD4, **WORLD8}


def _run_layouts(rank: int, world_size: int, root: str, layouts: dict) -> dict:
    results = {}
    for i, (name, kwargs) in enumerate(layouts.items()):
        strategy = MegatronStrategy(**kwargs)
        results[name] = fit(strategy, f"{root}/{i}")
        # what MoELoadMonitor uses to see every stage's layers
        results[name]["stages"] = strategy.gather_from_stages(strategy.mesh.pp_rank)
    if world_size == 4:
        results["resume"] = _resume(f"{root}/resume")
    return results


# -- sharded checkpoints --------------------------------------------------------------------------


class StepLosses(nt.Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_step_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses[trainer.global_step] = float(outputs.loss)


def _fit_steps(root: str, max_steps: int, ckpt_path: str | None = None) -> tuple[dict, str]:
    """Per-step losses and the run's checkpoint folder."""
    recorder = StepLosses()
    trainer = nt.Trainer(  # node-limited dispatch, nodes of one rank
        strategy=MegatronStrategy(ep=2, zero_stage=1, ranks_per_node=1),
        max_steps=max_steps,
        global_batch_size=8,
        micro_batch_size=2,
        default_root_dir=root,
        loggers=[],
        seed=3,
        callbacks=[recorder, ModelCheckpoint(every_n_steps=2)],
    )
    # decay_steps fixed: by default the schedule spans max_steps, which differs between runs
    module = _module(lr=3e-3, decay_steps=8)
    trainer.fit(module, train_dataloaders=RandomTokens(), ckpt_path=ckpt_path)
    return recorder.losses, str(trainer.checkpoint_dir)


def _resume(root: str) -> dict:
    """4 steps straight, saving at step 2, vs a run resumed from that checkpoint for steps 3
    and 4 (as after a preemption); and the saved checkpoint."""
    straight, checkpoints = _fit_steps(f"{root}/straight", 4)
    saved = f"{checkpoints}/step-00000002"
    resumed, _ = _fit_steps(f"{root}/resumed", 4, ckpt_path=saved)
    return {"straight": straight, "resumed": resumed, "dir": checkpoints}


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return fit(nt.SingleDeviceStrategy("cpu"), str(tmp_path_factory.mktemp("reference")))


@pytest.fixture(scope="module")
def worlds(reference, tmp_path_factory) -> dict[str, list[dict]]:
    # after `reference`: the ranks fork with the trainer's modules imported
    root = tmp_path_factory.mktemp("ep")
    out: dict[str, list[dict]] = {}
    for size, layouts, timeout in ((2, WORLD2, 120), (4, WORLD4, 300), (8, WORLD8, 300)):
        for rank_result in run_world(
            _run_layouts, size, f"{root}/w{size}", layouts, timeout=timeout
        ):
            for name, value in rank_result.items():
                out.setdefault(name, []).append(value)
    return out


# -- tests ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_layout_matches_single_process(worlds, reference, layout):
    for rank, result in enumerate(worlds[layout]):
        what = f"{layout}, rank {rank}"
        assert_matches(result, reference, what)
        assert result["node_limited"] == ("node-limited" in layout), what
        assert result["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5), what
        assert result["biases"].keys() == reference["biases"].keys(), what
        assert len(result["biases"]) == 3, what  # two decoder layers and the MTP block
        for name, bias in reference["biases"].items():
            assert bias.abs().sum() > 0, f"{what}: {name} never moved"
            assert torch.equal(result["biases"][name], bias), f"{what}: {name}"


def test_gather_from_stages_returns_every_stage_in_order(worlds):
    for name, kwargs in LAYOUTS.items():
        for result in worlds[name]:
            assert result["stages"] == list(range(kwargs.get("pp", 1))), name


def test_each_rank_builds_only_its_share_of_the_experts(worlds, reference):
    assert reference["local_experts"] == 8
    ep = {name: kwargs["ep"] for name, kwargs in LAYOUTS.items()}
    for name, results in worlds.items():
        if name == "resume":
            continue
        first_stage = [r["local_experts"] for r in results if r["local_experts"]]
        assert first_stage and all(n == 8 // ep[name] for n in first_stage), name


def test_sharded_checkpoint_under_ep_resumes_exactly(worlds):
    for rank, result in enumerate(worlds["resume"]):
        straight, resumed = result["straight"], result["resumed"]
        assert sorted(resumed) == [3, 4], rank
        for step in (3, 4):
            assert resumed[step] == straight[step], f"rank {rank}: loss of step {step} differs"
    ckpt = Path(worlds["resume"][0]["dir"]) / "step-00000002"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["layout"]["ep"] == 2 and meta["layout"]["dp"] == 4
    # world 4, dp=4, ep=2: ranks 0 and 1 hold different experts, ranks 0 and 2 the same ones
    shards = [load_file(str(ckpt / f"model-rank-{r:05d}.safetensors")) for r in range(3)]
    assert shards[0][EXPERT].shape[0] == 4
    assert not torch.equal(shards[0][EXPERT], shards[1][EXPERT])
    assert torch.equal(shards[0][EXPERT], shards[2][EXPERT])
