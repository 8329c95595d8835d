"""Node-limited dispatch's set-up: the node split of an ep group, the groups the mesh makes
for it (in one order on every rank), and the strategy's refusals, each before any work."""

from __future__ import annotations

import pytest

import nanotrain as nt
from nanotrain.models import presets
from nanotrain.parallel import ParallelMesh
from nanotrain.parallel.node_dispatch import node_split


def test_node_split_reads_the_ranks_off_the_nodes():
    assert node_split([0, 1, 2, 3], 2) == (2, 2)
    assert node_split([0, 2, 4, 6], 4) == (2, 2)  # tp=2: every other rank
    assert node_split([0, 1, 2, 3], 8) == (1, 4)
    assert node_split([4, 5, 6, 7], 1) == (4, 1)
    with pytest.raises(ValueError, match="does not split evenly over nodes of 3 ranks"):
        node_split([0, 1, 2, 3], 3)
    with pytest.raises(ValueError, match="ranks_per_node must be >= 1"):
        node_split([0, 1], 0)


def _mesh(rank: int, **kwargs) -> tuple[ParallelMesh, list[list[int]]]:
    made: list[list[int]] = []

    def new_group(ranks: list[int]) -> tuple[int, ...]:
        made.append(list(ranks))
        return tuple(ranks)  # stands for the group: its members

    return ParallelMesh.build(world_size=8, rank=rank, new_group=new_group, **kwargs), made


def test_the_mesh_makes_intra_node_and_rail_groups_of_every_ep_group():
    # dp=8, ep=4: ep groups (0-3) and (4-7), nodes of 2 ranks
    mesh, made = _mesh(5, ep=4, ranks_per_node=2)
    groups = mesh.ep_node_groups
    assert (groups.nodes, groups.per_node, groups.node) == (2, 2, 0)
    assert groups.intra == (4, 5) and groups.inter == (5, 7)
    plain, made_plain = _mesh(5, ep=4)
    assert plain.ep_node_groups is None
    # after the mesh's own groups, every rank creates the same node groups in one order
    assert made[len(made_plain) :] == [
        [0, 1], [2, 3], [0, 2], [1, 3], [4, 5], [6, 7], [4, 6], [5, 7]
    ]  # fmt: skip
    assert _mesh(0, ep=4, ranks_per_node=2)[1] == made


def test_paired_chunks_get_a_second_set_of_node_groups():
    mesh, made = _mesh(5, ep=4, ranks_per_node=2, paired_chunks=True)
    first, second = mesh.ep_node_groups, mesh.paired_ep_node_groups
    assert (first.intra, first.inter) == (second.intra, second.inter) == ((4, 5), (5, 7))
    node_groups = [[0, 1], [2, 3], [0, 2], [1, 3], [4, 5], [6, 7], [4, 6], [5, 7]]
    assert made[-16:] == node_groups + node_groups  # made twice: two sets of groups


def test_an_ep_group_on_one_node_gets_no_node_groups():
    mesh, _ = _mesh(1, ep=4, ranks_per_node=8)
    assert mesh.ep_node_groups is None


def test_nodes_of_one_rank_have_no_intra_group():
    mesh, _ = _mesh(2, tp=2, ep=4, ranks_per_node=2)  # ep ranks 0, 2, 4, 6: one per node
    groups = mesh.ep_node_groups
    assert (groups.nodes, groups.per_node, groups.intra, groups.inter) == (4, 1, None, (0, 2, 4, 6))


def test_an_ep_group_that_does_not_fill_its_nodes_evenly_is_refused_before_any_group():
    made = []
    with pytest.raises(ValueError, match="node-limited dispatch needs the same number"):
        ParallelMesh.build(
            world_size=8, rank=0, ep=4, ranks_per_node=3, new_group=lambda r: made.append(r)
        )
    assert made == []


def test_the_strategy_refuses_what_node_limited_dispatch_cannot_do():
    with pytest.raises(ValueError, match="needs expert parallelism"):
        nt.MegatronStrategy(node_limited_dispatch=True)
    with pytest.raises(ValueError, match="ranks_per_node must be >= 1"):
        nt.MegatronStrategy(ep=2, ranks_per_node=0)
    strategy = nt.MegatronStrategy(ep=2, node_limited_dispatch=True)
    config = presets.get("tiny", capacity_factor=1.0)
    with pytest.raises(ValueError, match="needs dropless MoE layers"):
        strategy.validate_model(config, world_size=2)


def test_the_nodes_come_from_the_argument_else_torchrun_else_one_node(monkeypatch):
    # (the error of node_limited_dispatch=True on one node: tests/distributed/test_node_dispatch)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert nt.MegatronStrategy(ep=2, node_limited_dispatch=True)._node_size(2) == 2
    # by default, ep groups that do not fill their nodes evenly keep the flat dispatch
    assert nt.MegatronStrategy(ep=4, ranks_per_node=3)._node_size(4) is None
    with pytest.raises(ValueError, match="does not split evenly"):
        strict = nt.MegatronStrategy(ep=4, ranks_per_node=3, node_limited_dispatch=True)
        ParallelMesh.build(
            ep=4, world_size=4, rank=0, new_group=tuple, ranks_per_node=strict._node_size(4)
        )
    assert nt.MegatronStrategy(ep=2, ranks_per_node=1)._node_size(4) == 1
    assert nt.MegatronStrategy(ep=2, node_limited_dispatch=False)._node_size(4) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert nt.MegatronStrategy(ep=4)._node_size(4) == 2


def test_the_planner_follows_the_strategy_rule():
    from nanotrain.planning import PlanLayout

    config = presets.get("tiny")
    assert PlanLayout(dp=16, ep=16).ep_nodes(config, 8) == (2, 8)  # the default: on
    assert PlanLayout(dp=16, ep=16, node_limited_dispatch=False).ep_nodes(config, 8) is None
    assert PlanLayout(dp=16, ep=8).ep_nodes(config, 8) is None  # one node: flat
    with pytest.raises(ValueError, match="lies on one node of 8 GPUs"):
        PlanLayout(dp=16, ep=8, node_limited_dispatch=True).ep_nodes(config, 8)
    slots = presets.get("tiny", capacity_factor=1.0)
    assert PlanLayout(dp=16, ep=16).ep_nodes(slots, 8) is None  # fixed slots: flat


def test_the_plan_command_refuses_the_dispatch_flag_without_a_layout(capsys):
    from nanotrain.cli.plan import run_plan

    args = ["--model", "tiny", "--gpus", "16", "--seq-len", "64", "--global-batch-size", "16"]
    with pytest.raises(ValueError, match="--node_limited_dispatch prices one layout"):
        run_plan([*args, "--node_limited_dispatch", "false"])
