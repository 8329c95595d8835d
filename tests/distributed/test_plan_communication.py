"""The planner's communication bytes equal what a real training step sends, group by group.

Forked gloo worlds train the tiny presets for two steps under many `MegatronStrategy` layouts;
a `CommMeter` counts every collective of the second step by process group, and
`comm_estimate` of the same config, layout and batch must equal the count on every group
(tp, pp, ep, dp, expert-dp, embedding, and the bookkeeping reductions it files under
"other", by the group they travel on).

Routing: the router is replaced by a balanced one (token t's k-th copy goes to expert
``(t * K + k) % E``), the routing the planner assumes, so the expert-parallel bytes are
exact too. Independent checks that do not trust the planner's own arithmetic follow the
world tests: the meter's ring model on known tensors, and textbook formulas for tp and dp.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import nanotrain as nt
from nanotrain.models.moe import TopKRouter
from nanotrain.planning import PlanLayout, Workload
from nanotrain.planning.comm_meter import CommMeter
from nanotrain.planning.communication import comm_estimate
from nanotrain.strategies.megatron import MegatronStrategy
from tests.distributed.spawn import run_world
from tests.distributed.test_megatron import LM_VOCAB, SEQ, RandomTokens

pytestmark = pytest.mark.distributed

MICRO, GLOBAL = 2, 8
MEASURED = ("tp", "pp", "ep", "dp", "expert_dp", "embedding")


def balanced_select(self: TopKRouter, choice: torch.Tensor) -> torch.Tensor:
    """Token t's k-th copy to expert (t * K + k) % E: every ep rank receives N * K / ep."""
    n, k = choice.shape[0], self.config.num_experts_per_tok
    slots = torch.arange(n * k, device=choice.device).view(n, k)
    return slots % self.config.n_routed_experts


class MeterSecondStep(nt.Callback):
    """Counts the collectives of the second training step only (the first builds lazily)."""

    def __init__(self, meter: CommMeter) -> None:
        self.meter = meter

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.meter.counting = trainer.global_step == 1

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.meter.counting = False


def measure(kind: str, strategy_kwargs: dict, extra: dict, root: str) -> dict[str, Any]:
    """Train 2 steps; return this rank's bytes per group and the planner's estimate."""
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
    )
    precision = extra.get("precision", "32-true")
    trainer = nt.Trainer(
        strategy=strategy,
        max_steps=2,
        global_batch_size=GLOBAL,
        micro_batch_size=MICRO,
        precision=precision,
        callbacks=[MeterSecondStep(meter)],
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
    layout = PlanLayout.from_strategy(strategy, mesh.world_size, extra.get("recompute"))
    workload = Workload(SEQ, MICRO, GLOBAL, precision)
    estimate = comm_estimate(module.config, layout, workload, pp_rank=mesh.pp_rank)
    return {
        "measured": dict(meter.bytes),
        "calls": dict(meter.calls),
        "predicted": {g: estimate.on_group(g) for g in MEASURED},
        "estimate": estimate,
    }


def _run(rank: int, world_size: int, root: str, layouts: dict) -> dict:
    TopKRouter.select = balanced_select  # a forked child: the parent's class is untouched
    return {
        name: measure(kind, kwargs, extra, f"{root}/{i}")
        for i, (name, (kind, kwargs, extra)) in enumerate(layouts.items())
    }


# name -> (preset, MegatronStrategy kwargs, extra: recompute / precision / model overrides)
WORLD2 = {
    "dense tp=2": ("tiny-dense", dict(tp=2), {}),
    "deepseek tp=2": ("tiny", dict(tp=2), {}),
    "dense tp=2 sp": ("tiny-dense", dict(tp=2, sequence_parallel=True), {}),
    "deepseek tp=2 sp": ("tiny", dict(tp=2, sequence_parallel=True), {}),
    "dense tp=2 full recompute": ("tiny-dense", dict(tp=2), {"recompute": "full"}),
    "deepseek tp=2 sp full recompute": (
        "tiny",
        dict(tp=2, sequence_parallel=True),
        {"recompute": "full"},
    ),
    "deepseek tp=2 selective recompute": ("tiny", dict(tp=2), {"recompute": "selective"}),
    "deepseek dp=2": ("tiny", dict(), {}),
    "deepseek dp=2 zero1": ("tiny", dict(zero_stage=1), {}),
    "deepseek dp=2 zero2": ("tiny", dict(zero_stage=2), {}),
    "deepseek pp=2 1f1b": ("tiny", dict(pp=2), {}),
    "dense pp=2 x virtual 2": (
        "tiny-dense",
        dict(pp=2, virtual_pp=2),
        {"overrides": {"num_layers": 4}},
    ),
    "deepseek ep=2 (dp=2)": ("tiny", dict(ep=2), {}),
    "deepseek ep=2 full recompute": ("tiny", dict(ep=2), {"recompute": "full"}),
}


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> list[dict]:
    return run_world(_run, 2, str(tmp_path_factory.mktemp("w2")), WORLD2, timeout=240)


@pytest.mark.parametrize("layout", list(WORLD2))
def test_planned_bytes_equal_measured_bytes_two_ranks(world2, layout):
    for rank, results in enumerate(world2):
        r = results[layout]
        measured = {g: r["measured"].get(g, 0.0) for g in MEASURED}
        assert measured == pytest.approx(r["predicted"], rel=1e-9), (
            f"rank {rank}: {r['estimate'].detail}"
        )
