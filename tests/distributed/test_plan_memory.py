"""The planner's per-rank parameters and optimizer state equal what a real gloo run allocates.

Each layout trains one step on a forked world of 4; every rank reports what it holds (its
module's parameters, the strategy's flat gradient buffers, the optimizer's state bytes after
the step) and the planner, which never ran the model, must give the same numbers for that
rank's pipeline and data-parallel coordinates.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import nanotrain as nt
from nanotrain.models import presets
from nanotrain.planning import PlanLayout, Workload, rank_models
from nanotrain.planning.memory import optimizer_pieces, state_memory
from nanotrain.strategies.megatron import MegatronStrategy
from tests.distributed.spawn import run_world

pytestmark = pytest.mark.distributed

VOCAB, SEQ = 97, 16

# name -> (preset, model overrides, MegatronStrategy kwargs, precision). What each pins:
LAYOUTS: dict[str, tuple[str, dict, dict, str]] = {
    # tp-sharded parameters, ZeRO-1's optimizer pieces over dp=2 at fp32
    "deepseek tp=2 zero1": ("tiny", {}, dict(tp=2, zero_stage=1), "32-true"),
    # each ep rank's experts, ZeRO-2's owned gradient shard, fp32 masters of the owned pieces
    "deepseek ep=2 zero2 bf16-true": ("tiny", {}, dict(ep=2, zero_stage=2), "bf16-true"),
    # two interleaved chunks per rank in ZeRO's padded flat buffers
    "deepseek pp=2 vpp=2 zero1": (
        "tiny",
        {"num_layers": 4},
        dict(pp=2, virtual_pp=2, zero_stage=1),
        "32-true",
    ),
    # an uneven pipeline over tp, the whole optimizer state and fp32 masters of every param
    "dense pp=2 uneven, tp=2, no zero, bf16-true": (
        "tiny-dense",
        {"num_layers": 3},
        dict(pp=2, tp=2, pipeline_layout=[2, 1]),
        "bf16-true",
    ),
}


class Tokens(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
        return {"input_ids": ids[:-1], "labels": ids[1:]}


def _optimizer_bytes(optimizer: Any) -> int:
    return sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )


class Snapshot(nt.Callback):
    """What the rank holds right after its first optimizer step (before teardown frees it)."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def on_train_step_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        params = {id(p): p for p in module.parameters() if p.requires_grad}
        self.seen = {
            "pp_rank": strategy.mesh.pp_rank,
            "dp_rank": strategy.mesh.dp_rank,
            "params": sum(p.numel() for p in params.values()),
            "flat": sum(s.layout.numel for s in strategy._grads.sets),
            "optimizer_bytes": _optimizer_bytes(strategy.optimizer),
            "master_bytes": _bytes(getattr(strategy._master_holder, "masters", [])),
            "flat_param_bytes": _bytes(strategy._zero.flat_params) if strategy._zero else None,
            "shard_grad_bytes": _bytes(
                [s.shard_grad for s in strategy._grads.sets if s.shard_grad is not None]
            ),
        }


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _global_batch(kwargs: dict) -> int:
    """The fewest microbatches of 2 a step of the layout takes (one per dp rank of the world
    of 4, pp of them through a pipeline): what a rank allocates does not depend on them."""
    return 2 * 4 // kwargs.get("tp", 1)


def _run(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for i, (name, (preset, overrides, kwargs, precision)) in enumerate(LAYOUTS.items()):
        strategy = MegatronStrategy(**kwargs)
        module = nt.LanguageModelModule(preset, model_overrides=overrides, vocab_size=VOCAB)
        trainer = nt.Trainer(
            strategy=strategy,
            precision=precision,
            max_steps=1,
            global_batch_size=_global_batch(kwargs),
            micro_batch_size=2,
            default_root_dir=f"{root}/{i}",
            loggers=[],
            callbacks=[snapshot := Snapshot()],
            # it reads what the step holds and sends: no final checkpoint, bar or monitors
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_monitors=False,
            seed=0,
        )
        trainer.fit(module, train_dataloaders=Tokens())
        out[name] = snapshot.seen
    return out


def _plan_inputs(name: str) -> tuple[Any, PlanLayout, Workload]:
    """The config, layout and workload the planner is given for layout `name`."""
    preset, overrides, kwargs, precision = LAYOUTS[name]
    config = presets.get(preset, vocab_size=VOCAB, **overrides)
    layout = PlanLayout.from_strategy(MegatronStrategy(**kwargs), world_size=4)
    workload = Workload(
        seq_len=SEQ,
        micro_batch_size=2,
        global_batch_size=_global_batch(kwargs),
        precision=precision,
    )
    return config, layout, workload


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict]:
    return run_world(_run, 4, str(tmp_path_factory.mktemp("plan_memory")), timeout=300)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_planned_state_equals_what_each_rank_allocates(world, name):
    config, layout, workload = _plan_inputs(name)
    precision = workload.precision
    planned = rank_models(config, layout)
    element = 2 if precision == "bf16-true" else 4
    for result in world:
        got = result[name]
        rank = planned[got["pp_rank"]]
        assert rank.params == got["params"], name
        assert sum(rank.flat_numels(layout, element)) == got["flat"], name
        if layout.zero_stage:
            elements, tensors = optimizer_pieces(rank, layout, element)[got["dp_rank"]]
            expected = 2 * 4 * elements + 4 * tensors  # AdamW: two fp32 moments + step
        else:
            expected = state_memory(rank, layout, workload).optimizer
        assert got["optimizer_bytes"] == expected, name
        state = state_memory(rank, layout, workload)
        if precision == "bf16-true":  # fp32 masters: of the owned pieces under ZeRO
            masters = 4 * (elements if layout.zero_stage else rank.params)
            assert got["master_bytes"] == masters > 0, name
        else:
            assert got["master_bytes"] == state.master == 0, name
        if layout.zero_stage:  # parameters live in ZeRO's padded flat buffers
            assert got["flat_param_bytes"] == state.params - rank.buffer_bytes, name
        if layout.zero_stage == 2:  # between steps only the owned gradient shard remains
            assert got["shard_grad_bytes"] == state.grads, name


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_planned_optimizer_memory_is_the_largest_ranks(world, name):
    config, layout, workload = _plan_inputs(name)
    for pp_rank, rank in enumerate(rank_models(config, layout)):
        measured = [r[name]["optimizer_bytes"] for r in world if r[name]["pp_rank"] == pp_rank]
        assert state_memory(rank, layout, workload).optimizer == max(measured), name
