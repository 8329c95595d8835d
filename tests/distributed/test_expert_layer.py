"""The expert-parallel DeepSeekMoE layer equals the one-process layer (fp32, rtol 1e-5).

One forked world of 4 gloo ranks checks ep=2 (two ep groups) and ep=4. Every rank builds the
one-process reference from the same seed as its expert-parallel layer (which must then hold
exactly the reference's experts [ep_rank * E / ep, ...)), runs its own tokens through both,
and compares:
- outputs, input grads, router and shared-expert grads: this rank's tokens only;
- expert-weight grads gathered over the ep group: the reference's grads of the sum of the
  losses of every rank of the group (their tokens reach this rank's experts);
- expert loads: this rank's routing over all E experts.
Two routings: a random one over few tokens (some expert gets no copy from some rank), and a
biased one sending every copy to experts 0-3 (the ranks holding 4-7 receive nothing at all).
With a capacity factor the outputs and dropped counts match the hand-computed routing of
tests/unit/test_expert_capacity.py. Last, `build_model` on an ep=2 mesh (MoE layer and MTP
block) gives the one-process loss and expert grads.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from nanotrain.models import build_model, presets
from nanotrain.models.balance import moe_balance_step
from nanotrain.models.build import init_weights
from nanotrain.models.moe import DeepSeekMoE
from nanotrain.parallel import ParallelMesh
from nanotrain.parallel.collectives import all_gather_along_dim
from nanotrain.parallel.expert import is_expert_param
from tests.distributed.spawn import run_world
from tests.unit.test_expert_capacity import (
    DROPPED,
    KEPT,
    KEPT_REVERSED,
    TOKENS,
    capacity_config,
    expected_output,
    hand_routed_layer,
    token_inputs,
)

EXPERT_PARAMS = ("gate_proj", "up_proj", "down_proj")


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude."""
    got, ref = got.detach(), ref.detach()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def rank_inputs(rank: int, ragged: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s tokens [2, 3, H] and loss weights (6 tokens, 12 copies over 8 experts);
    `ragged`: [2 + rank % 2, 3 + rank, H], so the ranks of a group differ in B and T."""
    g = torch.Generator().manual_seed(100 + rank)
    shape = (2 + rank % 2, 3 + rank, 64) if ragged else (2, 3, 64)
    return torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)


def loss_of(layer: DeepSeekMoE, x: torch.Tensor, w: torch.Tensor) -> tuple[Any, torch.Tensor]:
    y, aux = layer(x)
    return y, (y * w).sum() + aux


def make_layers(
    mesh: ParallelMesh, biased: bool, capacity: float | None = None
) -> tuple[DeepSeekMoE, DeepSeekMoE]:
    # 8 experts, top-2, 4 groups of 2
    config = presets.get("tiny", aux_loss_alpha=0.01, capacity_factor=capacity)
    layers = []
    for group in (None, mesh.ep_group):
        layer = DeepSeekMoE(config, ep_group=group)
        init_weights(layer, torch.Generator().manual_seed(3))
        if biased:  # groups 0 and 1 (experts 0-3) win every token
            layer.gate.e_score_correction_bias[:4] = 1.0
        layers.append(layer.train())
    return layers[0], layers[1]


def routed_counts(layer: DeepSeekMoE, x: torch.Tensor) -> torch.Tensor:
    """[E] copies the router of `layer` sends to each expert from tokens x [B, T, H]."""
    with torch.no_grad():
        topk_idx = layer.gate(x.reshape(-1, x.shape[-1]))[0]
    return torch.bincount(topk_idx.flatten(), minlength=layer.config.n_routed_experts)


def compare_layer(
    rank: int, mesh: ParallelMesh, biased: bool, ragged: bool = False
) -> dict[str, Any]:
    """Run this rank's tokens through the ep layer and the reference; relative errors and
    routing facts (see the module docstring). `ragged`: a capacity factor, and batches whose
    shape differs by rank (per-batch padding), which the CPU handles in training too."""
    ref, layer = make_layers(mesh, biased, capacity=1.0 if ragged else None)
    ex = layer.experts
    own = slice(ex.expert_offset, ex.expert_offset + ex.num_local_experts)
    errs = {
        f"init {n}": rel_err(getattr(ex, n), getattr(ref.experts, n)[own]) for n in EXPERT_PARAMS
    }
    x, w = rank_inputs(rank, ragged)
    x = x.requires_grad_()
    y, loss = loss_of(layer, x, w)
    loss.backward()

    # reference, own tokens: output, input grad, router and shared-expert grads
    x_ref = x.detach().clone().requires_grad_()
    y_ref, loss_ref = loss_of(ref, x_ref, w)
    local = [x_ref, ref.gate.weight, *ref.shared_experts.parameters()]
    grads = torch.autograd.grad(loss_ref, local, retain_graph=True)
    errs["output"] = rel_err(y, y_ref)
    errs["input grad"] = rel_err(x.grad, grads[0])
    errs["router grad"] = rel_err(layer.gate.weight.grad, grads[1])
    shared = zip(layer.shared_experts.parameters(), grads[2:], strict=True)
    errs["shared grad"] = max(rel_err(p.grad, g) for p, g in shared)
    # reference, every ep peer's tokens (they all reach this rank's experts): expert grads
    counts = []
    for peer in mesh.group_ranks("ep"):
        xp, wp = (x_ref, w) if peer == rank else rank_inputs(peer, ragged)
        counts.append(routed_counts(ref, xp))
        (loss_ref if peer == rank else loss_of(ref, xp, wp)[1]).backward()
    for n in EXPERT_PARAMS:
        gathered = all_gather_along_dim(getattr(ex, n).grad, 0, mesh.ep_group)
        errs[f"expert grad {n}"] = rel_err(gathered, getattr(ref.experts, n).grad)
    counts = torch.stack(counts)  # (ep, E): copies each member of the group routes
    return {
        "errs": errs,
        "load is own routing over all experts": torch.equal(
            layer.expert_load, counts[mesh.group_ranks("ep").index(rank)]
        ),
        "some expert gets nothing from some rank": bool((counts == 0).any()),
        "own experts receive nothing": int(counts[:, own].sum()) == 0,
        "only experts tagged": all(is_expert_param(p) for p in ex.parameters())
        and not any(is_expert_param(p) for p in layer.gate.parameters()),
    }


def capacity_check(mesh: ParallelMesh) -> dict[str, Any]:
    """Hand-routed tokens with capacity factor 1.0 (C = 2): even ep ranks send TOKENS, odd
    ones the reversed list; outputs vs the hand computation, drops summed over the group."""
    ref = hand_routed_layer(capacity_config())
    layer = hand_routed_layer(capacity_config(), ep_group=mesh.ep_group).train()
    reverse = mesh.ep_rank % 2 == 1
    tokens, kept = (TOKENS[::-1], KEPT_REVERSED) if reverse else (TOKENS, KEPT)
    y, _ = layer(token_inputs(tokens))
    full = dict(ref.experts.named_parameters())
    own_dropped = int(layer.dropped_tokens)

    def sum_over_ep(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=mesh.ep_group)
        return t

    stats = moe_balance_step([layer], [0], 0.0, sum_over_ep)
    return {
        "output err": rel_err(y[0], expected_output(full, tokens, kept)),
        "dropped": own_dropped,
        "group dropped": float(stats.dropped[0]),
        "group load": stats.loads[0].tolist(),
    }


def model_check(rank: int, mesh: ParallelMesh) -> dict[str, float]:
    """`build_model` on an ep mesh (main stack and MTP block expert-parallel) vs one process:
    this rank's loss, and expert grads vs the reference's over the whole group's batches."""
    config = presets.get("tiny", mtp_depth=1)
    ref, model = (
        build_model(config, m, generator=torch.Generator().manual_seed(5)).train()
        for m in (None, mesh)
    )
    ids = torch.randint(
        0, config.vocab_size, (4 * 2, 8), generator=torch.Generator().manual_seed(1)
    )
    batch = {r: ids[2 * r : 2 * r + 2] for r in range(4)}
    loss = model(batch[rank], labels=batch[rank].roll(-1, 1)).total_loss
    loss.backward()
    errs = {}
    for peer in mesh.group_ranks("ep"):
        ref_loss = ref(batch[peer], labels=batch[peer].roll(-1, 1)).total_loss
        ref_loss.backward()
        if peer == rank:
            errs["loss"] = rel_err(loss, ref_loss)
    for name, moe in zip(("layer 1", "mtp 0"), model.moe_layers(), strict=True):
        ref_moe = ref.get_submodule("layers.1.mlp" if name == "layer 1" else "mtp.0.block.mlp")
        for n in EXPERT_PARAMS:
            gathered = all_gather_along_dim(getattr(moe.experts, n).grad, 0, mesh.ep_group)
            errs[f"{name} {n} grad"] = rel_err(gathered, getattr(ref_moe.experts, n).grad)
    return errs


def _layer_checks(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for ep in (2, 4):
        mesh = ParallelMesh.build(ep=ep)
        for biased in (False, True):
            out[(ep, biased)] = compare_layer(rank, mesh, biased)
        if ep == 2:
            out["capacity"] = capacity_check(mesh)
            out["ragged"] = compare_layer(rank, mesh, biased=False, ragged=True)
            out["model"] = model_check(rank, mesh)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_world(_layer_checks, 4, timeout=120)


@pytest.mark.distributed
@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("biased", [False, True], ids=["random", "experts-0-3"])
def test_expert_parallel_layer_equals_one_process(results, ep, biased):
    for rank, res in enumerate(results):
        r = res[(ep, biased)]
        bad = {k: v for k, v in r["errs"].items() if not v <= 1e-5}
        assert not bad, f"rank {rank}: {bad}"
        assert r["load is own routing over all experts"] and r["only experts tagged"]


@pytest.mark.distributed
def test_the_routings_include_empty_sends_and_idle_ranks(results):
    # the random routing leaves some (rank, expert) pair empty; the biased one starves ranks
    assert any(
        res[(ep, False)]["some expert gets nothing from some rank"]
        for res in results
        for ep in (2, 4)
    )
    for ep, idle in ((2, [1, 3]), (4, [2, 3])):
        starved = [
            r for r, res in enumerate(results) if res[(ep, True)]["own experts receive nothing"]
        ]
        assert starved == idle


@pytest.mark.distributed
def test_capacity_with_expert_parallelism_matches_hand_routing(results):
    for res in results:
        c = res["capacity"]
        assert c["output err"] <= 1e-5 and c["dropped"] == DROPPED
        assert c["group dropped"] == 2 * DROPPED  # one rank of each order per ep=2 group
        assert c["group load"] == [8.0, 6.0, 2.0, 2.0, 2.0, 2.0, 2.0, 0.0]


@pytest.mark.distributed
def test_build_model_on_an_ep_mesh_equals_one_process(results):
    for rank, res in enumerate(results):
        bad = {k: v for k, v in res["model"].items() if not v <= 1e-5}
        assert len(res["model"]) == 7 and not bad, f"rank {rank}: {bad}"


@pytest.mark.distributed
def test_capacity_training_batches_may_differ_in_shape_between_cpu_ranks(results):
    # per-batch padding: ranks of a group hold [2, 3] and [3, 4] (or [2, 5] and [3, 6]) token
    # batches, in training; the slot counts are exchanged, so nothing aborts, and every
    # output and gradient is the one-process layer's
    for rank, res in enumerate(results):
        bad = {k: v for k, v in res["ragged"]["errs"].items() if not v <= 1e-5}
        assert not bad, f"rank {rank}: {bad}"
