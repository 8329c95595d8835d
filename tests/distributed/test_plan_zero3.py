"""The planner's ZeRO-3 model-state bytes equal what FSDP2 really allocates on every rank.

Each layout trains one step on a forked world of 4 with torch's FSDP2 applied by the
strategy's wrapping rule (`nanotrain.parallel.fully_sharded`): each routed-expert stack over
the expert-data-parallel group, each decoder layer and MTP block over the data-parallel
group, then the root, never resharded after forward. Every rank reports the bytes of the
storages behind its parameter shards and gradient shards and its optimizer state; the
planner, which never ran the model, must give the same numbers, byte for byte.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from nanotrain.models import presets
from nanotrain.models.build import build_model
from nanotrain.parallel.mesh import ParallelMesh
from nanotrain.planning import PlanLayout, Workload, rank_models
from nanotrain.planning.memory import state_memory, zero3_optimizer_pieces
from nanotrain.strategies.megatron_grads import expert_param_ids
from tests.distributed.spawn import run_world

pytestmark = pytest.mark.distributed

VOCAB, SEQ, MICRO = 97, 16, 2

# 6 routed experts: 3 per ep=2 rank, split 2 + 1 over expert-dp=2 (uneven shards, so the
# test tells which expert-dp rank each data-parallel rank is)
SIX_EXPERTS = dict(n_routed_experts=6, n_group=2, topk_group=1)
# name -> (preset, model overrides, mesh sizes); world 4, fp32; vocab 97 splits unevenly
LAYOUTS: dict[str, tuple[str, dict[str, int], dict[str, int]]] = {
    "dense dp=4": ("tiny-dense", {}, dict(dp=4)),
    "dense tp=2 x dp=2": ("tiny-dense", {}, dict(tp=2, dp=2)),
    "deepseek dp=4": ("tiny", {}, dict(dp=4)),
    "deepseek ep=2 x dp=4": ("tiny", SIX_EXPERTS, dict(ep=2, dp=4)),
}


def _shard(model: nn.Module, mesh: ParallelMesh) -> nn.Module:
    """FSDP2 by the strategy's wrapping rule (module docstring)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    dp = DeviceMesh.from_group(mesh.dp_group, "cpu")
    expert_dp = DeviceMesh.from_group(mesh.expert_dp_group, "cpu")
    experts = expert_param_ids(model)
    for sub in model.modules():
        own = list(sub.parameters(recurse=False))
        if own and all(id(p) in experts for p in own):
            fully_shard(sub, mesh=expert_dp)
    # the decoder layers (the MTP blocks stay in the root here: the model calls an MTP
    # block's norm outside that block's forward, where FSDP2 has not gathered it; the padding
    # is per tensor, so which unit holds a tensor does not change its bytes)
    for block in model.layers:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp, reshard_after_forward=False)
    return model


def _bytes_of_storages(tensors: list[torch.Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _run(rank: int, world_size: int) -> dict[str, dict[str, int]]:
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    out = {}
    for name, (preset, overrides, sizes) in LAYOUTS.items():
        mesh = ParallelMesh.build(**sizes)
        config = presets.get(preset, vocab_size=VOCAB, **overrides)
        torch.manual_seed(0)
        model = _shard(build_model(config, mesh=mesh, device="cpu"), mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(mesh.dp_rank)
        ids = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)
        model(ids[:, :-1], labels=ids[:, 1:]).total_loss.backward()
        optimizer.step()
        params = [p for p in model.parameters() if p.requires_grad]
        out[name] = {
            "dp_rank": mesh.dp_rank,
            "params": _bytes_of_storages([local(p) for p in params]),
            "grads": _bytes_of_storages([local(p.grad) for p in params]),
            "buffers": sum(b.numel() * b.element_size() for b in model.buffers()),
            "optimizer": sum(
                local(v).numel() * v.element_size()
                for state in optimizer.state.values()
                for v in state.values()
                if isinstance(v, torch.Tensor)
            ),
        }
    return out


def _plan(name: str) -> tuple[Any, PlanLayout, Workload]:
    preset, overrides, sizes = LAYOUTS[name]
    config = presets.get(preset, vocab_size=VOCAB, **overrides)
    layout = PlanLayout(**sizes, zero_stage=3)
    workload = Workload(
        seq_len=SEQ, micro_batch_size=MICRO, global_batch_size=MICRO * layout.dp,
        precision="32-true",
    )  # fmt: skip
    return config, layout, workload


@pytest.fixture(scope="module")
def world() -> list[dict[str, dict[str, int]]]:
    return run_world(_run, 4, timeout=300)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_planned_zero3_state_equals_what_each_rank_allocates(world, name):
    config, layout, workload = _plan(name)
    (rank,) = rank_models(config, layout)
    state = state_memory(rank, layout, workload)
    pieces = zero3_optimizer_pieces(rank, layout)
    for result in world:
        got = result[name]
        # every rank allocates the padded shards, whatever rows it really holds
        assert got["buffers"] == rank.buffer_bytes, name
        assert got["params"] + got["buffers"] == state.params, name
        assert got["grads"] == state.grads == state.grads_peak, name  # one microbatch
        elements, tensors = pieces[got["dp_rank"]]
        assert got["optimizer"] == 2 * 4 * elements + 4 * tensors, name  # AdamW: 2 moments + step
    # the plan prices the rank that holds the most
    assert state.optimizer == max(r[name]["optimizer"] for r in world), name


def test_shards_are_about_one_dp_th_of_the_model(world):
    """Independent of the planner: dp ranks hold 1/dp of the unsharded fp32 parameters each,
    within FSDP2's padding (under one row per tensor)."""
    for name, (preset, overrides, sizes) in LAYOUTS.items():
        if "ep" in sizes or "tp" in sizes:
            continue
        config = presets.get(preset, vocab_size=VOCAB, **overrides)
        whole = sum(p.numel() for p in build_model(config, device="meta").parameters())
        for result in world:
            held = result[name]["params"] / 4
            assert whole / sizes["dp"] <= held < whole / sizes["dp"] * 1.1, name
