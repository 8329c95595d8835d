"""Node-limited dispatch equals the flat one, and sends across nodes what its formula says.

One forked world of 4 gloo ranks stands for nodes of 2 ranks (and of 1). Each mesh's MoE layer
runs this rank's tokens twice, with the same weights: flat dispatch (`run_experts_parallel`)
and node-limited (`run_experts_node_limited`, the layer's `node_groups` set), and compares
outputs, input, router, shared and expert grads (fp32, and with the rows crossing in fp8 with
tile scales; the flat layer is proven equal to one process in test_expert_layer.py). The bytes the node-limited layer puts on its rail group
(`CommMeter`) equal `inter_node_bytes` of the (token, other node) pairs read off the routing,
plus the counts exchange; the flat dispatch's copies that cross nodes are counted from the same
routing, and a routing where tokens pick two experts of one node needs fewer rows.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from nanotrain import MegatronStrategy
from nanotrain.models import presets
from nanotrain.models.build import init_weights
from nanotrain.models.moe import DeepSeekMoE
from nanotrain.parallel import ParallelMesh
from nanotrain.parallel.node_dispatch import inter_node_bytes
from nanotrain.planning.comm_meter import CommMeter
from tests.distributed.spawn import run_world

pytestmark = pytest.mark.distributed

EXPERT_PARAMS = ("gate_proj", "up_proj", "down_proj")


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach(), ref.detach()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def run_layer(
    layer: DeepSeekMoE, x: torch.Tensor, w: torch.Tensor, bf16: bool = False
) -> dict[str, torch.Tensor]:
    """Output and grads of sum(y * w) + aux for tokens x [B, T, H] (`bf16`: under bf16
    autocast, the rows crossing in bf16)."""
    layer.zero_grad()
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        y, aux = layer(x)
    y = y.float()
    ((y * w).sum() + aux).backward()
    out = {"output": y.detach(), "input grad": x.grad, "router grad": layer.gate.weight.grad}
    for i, p in enumerate(layer.shared_experts.parameters()):
        out[f"shared grad {i}"] = p.grad
    for n in EXPERT_PARAMS:
        out[f"expert grad {n}"] = getattr(layer.experts, n).grad
    return out


def compare(
    rank: int, mesh: ParallelMesh, biased: bool, fp8: bool = False, bf16: bool = False
) -> dict[str, Any]:
    config = presets.get("tiny", aux_loss_alpha=0.01)  # 8 experts, top-2, 4 groups of 2
    layer = DeepSeekMoE(config, ep_group=mesh.ep_group)
    init_weights(layer, torch.Generator().manual_seed(3))
    # fp8 dispatch (as "fp8-emulated" sets it): rows cross in e4m3 with tile scales, on both
    # hops here; a row rounded once rounds to itself again
    layer.experts.dispatches_fp8 = fp8
    if biased:  # experts 0 and 1 (one node) win every token: two copies, one row
        layer.gate.e_score_correction_bias[:2] = 1.0
    layer.train()
    g = torch.Generator().manual_seed(100 + rank)
    x, w = torch.randn(2, 5, 64, generator=g), torch.randn(2, 5, 64, generator=g)
    flat = run_layer(layer, x, w, bf16)
    if fp8:  # the rounding shows against an fp32 dispatch
        layer.experts.dispatches_fp8 = False
        fp32 = run_layer(layer, x, w)["output"]
        layer.experts.dispatches_fp8 = True
    groups = mesh.ep_node_groups
    layer.node_groups = groups
    meter = CommMeter({"rail": groups.inter})
    with meter:
        limited = run_layer(layer, x, w, bf16)
    errs = {name: rel_err(limited[name], flat[name]) for name in flat}
    rounded = rel_err(limited["output"], fp32) if fp8 else None
    # the routing, read again: nodes each token reaches, other than this rank's
    with torch.no_grad():
        topk_idx = layer.gate(x.reshape(-1, 64))[0]
    node_of = topk_idx // (config.n_routed_experts // groups.nodes)
    other = node_of != groups.node
    # tokens reaching each node (a token once per node)
    pairs_to = [int((node_of == n).any(1).sum()) for n in range(groups.nodes)]
    return {
        "errs": errs,
        "rail bytes": meter.bytes["rail"],
        "pairs to": pairs_to,
        "pairs": sum(c for n, c in enumerate(pairs_to) if n != groups.node),
        "flat copies across nodes": int(other.sum()),
        "nodes": (groups.nodes, groups.per_node),
        "ep ranks": mesh.group_ranks("ep"),
        "fp8 rounding": rounded,
    }


def _checks(rank: int, world_size: int) -> dict[str, Any]:
    out = {}
    try:  # every rank on one node (no LOCAL_WORLD_SIZE, no ranks_per_node)
        MegatronStrategy(ep=2, node_limited_dispatch=True, backend="gloo").setup_environment()
    except ValueError as err:
        out["one node"] = str(err)
    os.environ["LOCAL_WORLD_SIZE"] = "2" if rank == 0 else "4"  # nodes of different sizes
    try:
        MegatronStrategy(ep=4, backend="gloo").setup_environment()
    except ValueError as err:
        out["uneven nodes"] = str(err)
    del os.environ["LOCAL_WORLD_SIZE"]
    for name, kwargs in MESHES.items():
        mesh = ParallelMesh.build(**kwargs)
        for biased in (False, True):
            out[(name, biased)] = compare(rank, mesh, biased)
        out[(name, "fp8")] = compare(rank, mesh, False, fp8=True)
        out[(name, "bf16")] = compare(rank, mesh, False, bf16=True)
    return out


# name -> ParallelMesh.build kwargs: nodes of 2 ranks (rail and intra-node groups), nodes of one
MESHES = {
    "ep=4, 2 nodes of 2": dict(ep=4, ranks_per_node=2),
    "ep=4, 4 nodes of 1": dict(ep=4, ranks_per_node=1),
    "ep=2 x dp=2, nodes of 1": dict(ep=2, ranks_per_node=1),
}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(_checks, 4, timeout=120)


@pytest.mark.parametrize("biased", [False, True, "fp8"])
@pytest.mark.parametrize("mesh", list(MESHES))
def test_node_limited_dispatch_equals_the_flat_one(results, mesh, biased):
    for rank, result in enumerate(results):
        for name, err in result[(mesh, biased)]["errs"].items():
            assert err < 1e-5, f"{mesh}, rank {rank}: {name} differs by {err:.2e}"
        if biased == "fp8":
            assert result[(mesh, biased)]["fp8 rounding"] > 1e-3


@pytest.mark.parametrize("mesh", list(MESHES))
def test_under_bf16_only_the_input_gradient_differs_by_bf16_rounding(results, mesh):
    # the rows cross in bf16: outputs and weight gradients are the flat dispatch's; each
    # node's partial sum of a token's gradient is rounded to bf16 once before it crosses back
    for rank, result in enumerate(results):
        errs = result[(mesh, "bf16")]["errs"]
        for name, err in errs.items():
            bound = 1e-2 if name == "input grad" else 1e-5
            assert err < bound, f"{mesh}, rank {rank}: {name} differs by {err:.2e}"


@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("mesh", list(MESHES))
def test_bytes_across_nodes_equal_the_formula(results, mesh, biased):
    for rank, result in enumerate(results):
        r = result[(mesh, biased)]
        nodes, per_node = r["nodes"]
        here = r["ep ranks"].index(rank)
        node, index = divmod(here, per_node)
        # the rows this rank forwards: its rail peers' (the same index on other nodes) pairs
        # to this node
        rail = [r["ep ranks"][n * per_node + index] for n in range(nodes) if n != node]
        received = sum(results[peer][(mesh, biased)]["pairs to"][node] for peer in rail)
        formula = inter_node_bytes(r["pairs"], received, 64, 2, 4, 4) + 16 * (nodes - 1)
        assert r["rail bytes"] == formula, f"{mesh}, rank {rank}"
        assert r["pairs"] <= r["flat copies across nodes"]


def test_required_node_limited_dispatch_on_one_node_is_an_error(results):
    for result in results:
        assert "the expert-parallel group (ep=2) lies on one node of 4 ranks" in result["one node"]


def test_ranks_that_see_different_node_sizes_are_refused_on_every_rank(results):
    for result in results:
        assert "different node sizes for node-limited dispatch ([2, 4]" in result["uneven nodes"]


def test_two_experts_on_one_node_cross_once(results):
    # biased routing: every token picks experts 0 and 1, both on node 0; the ranks of other
    # nodes send each token once where the flat dispatch sends it twice
    for rank, result in enumerate(results):
        r = result[("ep=4, 2 nodes of 2", True)]
        if rank >= 2:
            assert r["flat copies across nodes"] == 2 * r["pairs"] == 2 * 10, f"rank {rank}"
        assert r["nodes"] == (2, 2)
    assert results[0][("ep=4, 4 nodes of 1", True)]["nodes"] == (4, 1)
