"""ParallelMesh rank arithmetic and validate_layout, as pure functions (no torch.distributed).

The expected groups and coordinates below are worked out by hand from the documented rank
order ``rank = tp_rank + tp * (dp_rank + dp * pp_rank)``, ``dp_rank = ep_rank + ep * x``.
"""

from __future__ import annotations

import pytest

from nanotrain.parallel.mesh import AXES, MeshCoords, MeshLayout, ParallelMesh, validate_layout

# --------------------------------------------------------------------------------------------
# validate_layout
# --------------------------------------------------------------------------------------------


def test_validate_layout_infers_dp_from_world_size() -> None:
    assert validate_layout(8, tp=2, pp=2) == 2
    assert validate_layout(16, tp=2, pp=1, ep=4) == 8
    assert validate_layout(1) == 1


def test_tp_not_dividing_heads_names_numbers_and_valid_tp_values() -> None:
    with pytest.raises(
        ValueError, match=r"tp=3 does not divide num_heads=8; valid tp values: 1, 2, 4, 8"
    ):
        validate_layout(24, tp=3, num_heads=8)


def test_tp_valid_values_respect_kv_heads_and_world_size() -> None:
    # tp must divide num_heads=8, num_kv_heads=2 and world_size=8: only 1 and 2 qualify.
    with pytest.raises(
        ValueError, match=r"tp=4 does not divide num_kv_heads=2; valid tp values: 1, 2$"
    ):
        validate_layout(8, tp=4, num_heads=8, num_kv_heads=2)


def test_tp_not_dividing_world_size() -> None:
    with pytest.raises(
        ValueError, match=r"tp=3 does not divide world_size=8; valid tp values: 1, 2, 4, 8"
    ):
        validate_layout(8, tp=3)


def test_tp_times_pp_not_dividing_world_lists_valid_pp() -> None:
    with pytest.raises(
        ValueError, match=r"tp\*pp=2\*3=6 does not divide world_size=8.*valid pp values: 1, 2, 4"
    ):
        validate_layout(8, tp=2, pp=3)


def test_explicit_dp_must_fill_the_world() -> None:
    with pytest.raises(ValueError, match=r"tp\*pp\*dp=2\*1\*2=4 must equal world_size=8; use dp=4"):
        validate_layout(8, tp=2, dp=2)


def test_ep_must_divide_dp() -> None:
    with pytest.raises(ValueError, match=r"ep=3 does not divide dp=4.*valid ep values: 1, 2, 4"):
        validate_layout(8, tp=2, ep=3)


def test_ep_must_divide_num_experts() -> None:
    # dp=8 allows ep in {1, 2, 4, 8}; 6 experts allow only 1 and 2 of those.
    with pytest.raises(
        ValueError, match=r"ep=4 does not divide num_experts=6; valid ep values: 1, 2$"
    ):
        validate_layout(8, ep=4, num_experts=6)


def test_pp_larger_than_num_layers() -> None:
    with pytest.raises(ValueError, match=r"pp=4 exceeds num_layers=2.*valid pp values: 1, 2$"):
        validate_layout(8, pp=4, num_layers=2)


def test_any_vocab_size_is_accepted_because_it_is_padded() -> None:
    assert validate_layout(4, tp=4, vocab_size=50257) == 1


@pytest.mark.parametrize("bad", [0, -2])
def test_non_positive_sizes_are_value_errors(bad: int) -> None:
    with pytest.raises(ValueError, match=f"tp must be >= 1, got {bad}"):
        validate_layout(8, tp=bad)


def test_non_int_sizes_are_type_errors() -> None:
    with pytest.raises(TypeError, match="pp must be an int, got float 2.0"):
        validate_layout(8, pp=2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tp must be an int"):
        validate_layout(8, tp=True)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# MeshLayout: coordinates and groups
# --------------------------------------------------------------------------------------------


def test_worked_example_world8_tp2_pp2_dp2() -> None:
    layout = MeshLayout(tp=2, pp=2, dp=2)
    assert layout.world_size == 8
    assert [layout.coords(r).tp_rank for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [layout.coords(r).dp_rank for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [layout.coords(r).pp_rank for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("mp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # ep=1: each expert-parallel group is one rank, expert-dp groups are the dp groups.
    assert layout.groups("ep") == [[r] for r in range(8)]
    assert sorted(layout.groups("expert_dp")) == sorted(layout.groups("dp"))


def test_coords_of_one_rank() -> None:
    layout = MeshLayout(tp=2, pp=2, dp=2)
    assert layout.coords(5) == MeshCoords(
        rank=5, tp_rank=1, pp_rank=1, dp_rank=0, ep_rank=0, expert_dp_rank=0
    )
    assert layout.rank_of(tp_rank=0, dp_rank=1, pp_rank=1) == 6


def test_expert_groups_are_carved_out_of_data_parallel() -> None:
    # world 8, tp=2, dp=4, ep=2: dp groups [0,2,4,6] and [1,3,5,7]; within each, expert rank
    # is fastest, so dp ranks {0,1} and {2,3} form ep groups, {0,2} and {1,3} expert-dp groups.
    layout = MeshLayout(tp=2, dp=4, ep=2)
    assert layout.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("expert_dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.expert_dp == 2
    c = layout.coords(6)  # tp 0, dp 3 -> ep 1, expert-dp 1
    assert (c.tp_rank, c.dp_rank, c.ep_rank, c.expert_dp_rank) == (0, 3, 1, 1)


def test_ep_equal_to_dp_makes_expert_dp_groups_single_ranks() -> None:
    layout = MeshLayout(tp=2, pp=2, dp=2, ep=2)
    assert layout.groups("ep") == layout.groups("dp")
    assert layout.groups("expert_dp") == [[r] for r in range(8)]


def test_pure_pipeline_layout() -> None:
    layout = MeshLayout(pp=3, dp=2)  # rank = dp_rank + 2 * pp_rank
    assert layout.groups("pp") == [[0, 2, 4], [1, 3, 5]]
    assert layout.groups("tp") == [[r] for r in range(6)]
    assert layout.group_of("dp", 3) == [2, 3]


@pytest.mark.parametrize(
    "sizes", [dict(tp=2, pp=2, dp=2), dict(tp=2, dp=4, ep=2), dict(pp=3, dp=2), dict(tp=4)]
)
def test_groups_of_every_axis_partition_the_world(sizes: dict) -> None:
    layout = MeshLayout(**sizes)
    for axis in AXES:
        groups = layout.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(layout.world_size)), axis
        assert all(len(g) == layout.size(axis) for g in groups), axis


def test_layout_rejects_bad_rank_and_axis() -> None:
    layout = MeshLayout(tp=2)
    with pytest.raises(ValueError, match=r"rank=2 is outside \[0, 2\)"):
        layout.coords(2)
    with pytest.raises(ValueError, match="unknown mesh axis 'zz'"):
        layout.groups("zz")
    with pytest.raises(ValueError, match="ep=2 does not divide dp=1"):
        MeshLayout(tp=2, ep=2)


# --------------------------------------------------------------------------------------------
# ParallelMesh without torch.distributed
# --------------------------------------------------------------------------------------------


def test_single_mesh_has_no_groups_and_zero_coordinates() -> None:
    mesh = ParallelMesh.single()
    assert mesh.world_size == 1 and mesh.rank == 0
    assert all(mesh.group(axis) is None for axis in AXES)
    assert (mesh.tp_size, mesh.pp_size, mesh.dp_size, mesh.ep_size) == (1, 1, 1, 1)
    assert mesh.is_first_stage and mesh.is_last_stage
    assert mesh.prev_stage_rank is None and mesh.next_stage_rank is None


def test_build_without_distributed_falls_back_to_single_mesh() -> None:
    assert ParallelMesh.build().world_size == 1
    with pytest.raises(RuntimeError, match="not initialised"):
        ParallelMesh.build(tp=2, world_size=2, rank=0)


def test_build_validates_before_creating_any_group() -> None:
    created: list[list[int]] = []
    with pytest.raises(ValueError, match="tp=4 does not divide num_heads=6"):
        ParallelMesh.build(tp=4, world_size=8, rank=0, new_group=created.append, num_heads=6)
    assert created == []


def test_build_creates_every_group_in_a_fixed_order_and_keeps_its_own() -> None:
    created: list[list[int]] = []

    def fake_new_group(ranks: list[int]) -> tuple[int, ...]:
        created.append(list(ranks))
        return tuple(ranks)  # stands in for a ProcessGroup

    mesh = ParallelMesh.build(tp=2, pp=2, world_size=8, rank=5, new_group=fake_new_group)
    # Every rank creates every group (4 tp, 4 pp, 4 dp, 8 ep, 4 expert-dp, 2 mp), in AXES order,
    # then one group per direction and kind of every pipeline (2 stages: activations and
    # gradients each way, the wrap of interleaved schedules sending activations 1 -> 0:
    # 4 channels x 4 pipelines).
    assert len(created) == 4 + 4 + 4 + 8 + 4 + 2 + 16
    assert created[:4] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert created[4:8] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert created[-16:] == [pair for pair in created[4:8] for _ in range(4)]
    assert mesh.pp_channels == {
        (1, 5, False): (1, 5), (5, 1, True): (1, 5), (5, 1, False): (1, 5), (1, 5, True): (1, 5),
    }  # fmt: skip
    assert mesh.tp_group == (4, 5) and mesh.pp_group == (1, 5) and mesh.dp_group == (5, 7)
    assert mesh.ep_group == (5,) and mesh.expert_dp_group == (5, 7)
    assert mesh.mp_group == (0, 1, 4, 5)
    assert (mesh.tp_rank, mesh.dp_rank, mesh.pp_rank) == (1, 0, 1)
    assert mesh.group_ranks("pp") == [1, 5]
    assert mesh.is_last_stage and mesh.prev_stage_rank == 1 and mesh.next_stage_rank is None


def test_mesh_rejects_unknown_axis() -> None:
    mesh = ParallelMesh.single()
    with pytest.raises(ValueError, match="unknown mesh axis 'sp'"):
        mesh.group("sp")
    with pytest.raises(ValueError, match="unknown mesh axes"):
        ParallelMesh(MeshLayout(), 0, {"sp": None})


@pytest.mark.parametrize("tp,pp,dp,ep", [(2, 2, 4, 2), (2, 3, 4, 4), (1, 4, 6, 3)])
def test_group_of_is_the_group_in_groups_that_holds_the_rank(tp, pp, dp, ep):
    layout = MeshLayout(tp=tp, pp=pp, dp=dp, ep=ep)
    for axis in ("tp", "dp", "pp", "ep", "expert_dp", "mp"):
        for rank in range(layout.world_size):
            assert layout.group_of(axis, rank) == next(
                g for g in layout.groups(axis) if rank in g
            ), (axis, rank)


def test_pipeline_channels_are_every_neighbouring_direction_and_kind_once():
    four = MeshLayout(pp=4)
    # activations down, gradients up, and the interleaved wrap 3 -> 0
    assert four.pipeline_channels() == [
        (0, 1, False), (1, 0, True), (1, 2, False), (2, 1, True), (2, 3, False), (3, 2, True),
        (3, 0, False), (0, 3, True),
    ]  # fmt: skip
    # a V: down and back up between every two neighbours, no wrap, no channel at the turn
    assert four.pipeline_channels(v_shape=True) == [
        (0, 1, False), (1, 0, True), (1, 2, False), (2, 1, True), (2, 3, False), (3, 2, True),
        (3, 2, False), (2, 3, True), (2, 1, False), (1, 2, True), (1, 0, False), (0, 1, True),
    ]  # fmt: skip
    assert MeshLayout(tp=2).pipeline_channels() == []
