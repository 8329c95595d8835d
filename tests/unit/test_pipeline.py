"""Pipeline pieces that need no process group: partition, schedules, stage init, errors."""

from __future__ import annotations

import re

import pytest
import torch

from nanotrain.models import build_model, presets
from nanotrain.models.stages import build_pipeline_stage
from nanotrain.parallel.mesh import MeshLayout, ParallelMesh
from nanotrain.parallel.pipeline import partition_layers, stage_layers
from nanotrain.parallel.placement import StagePlacement
from nanotrain.parallel.schedules import (
    SCHEDULES,
    SPLIT_BACKWARD_SCHEDULES,
    V_SHAPED_SCHEDULES,
    Action,
    dualpipev,
    gpipe,
    interleaved_1f1b,
    max_in_flight,
    one_f_one_b,
    zero_bubble_1f1b,
    zero_bubble_h1,
    zero_bubble_interleaved_1f1b,
)
from nanotrain.strategies.megatron import MegatronStrategy


def test_even_partition_and_interleaved_assignment():
    assert partition_layers(8, 2, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # virtual stage k lives on rank k % pp
    assert stage_layers(8, 2, 1, 2) == [[2, 3], [6, 7]]


def test_custom_layout_gives_fewer_layers_to_the_ends():
    assert partition_layers(6, 3, layout=[1, 4, 1]) == [[0], [1, 2, 3, 4], [5]]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((6, 4, 1, None), "num_layers=6 does not split evenly into pp*virtual_pp=4*1=4"),
        ((8, 2, 2, [4, 4]), "pipeline_layout has 2 entries but pp*virtual_pp=2*2=4"),
        ((4, 2, 1, [1, 2]), "summing to num_layers=4 (sums to 3)"),
    ],
)
def test_bad_layouts_name_the_numbers(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        partition_layers(*args[:3], layout=args[3])


def _check_dependencies(
    schedules: list[list[Action]], pp: int, chunks: int, v_shape: bool = False
) -> None:
    """Simulate the ranks in lockstep: an action runs once its input exists (a forward: the
    previous stage's forward; a backward or input half: its own forward and the next stage's
    input gradient; a weight half: its own input half); all must finish (no deadlock)."""
    done: set[tuple[str, int, int]] = set()  # (kind, microbatch, virtual stage)
    pos = [0] * pp
    last = pp * chunks - 1
    placement = StagePlacement(pp, chunks, v_shape)

    def grad_sent(m: int, k: int) -> bool:
        return ("B", m, k) in done or ("I", m, k) in done

    while any(pos[r] < len(schedules[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            if pos[r] == len(schedules[r]):
                continue
            a = schedules[r][pos[r]]
            k = placement.stage(r, a.chunk)
            if a.kind == "F":
                ready = k == 0 or ("F", a.microbatch, k - 1) in done
            elif a.kind == "W":
                ready = ("I", a.microbatch, k) in done
            else:
                ready = ("F", a.microbatch, k) in done and (
                    k == last or grad_sent(a.microbatch, k + 1)
                )
            if ready:
                done.add((a.kind, a.microbatch, k))
                pos[r] += 1
                progressed = True
        assert progressed, f"deadlock at {pos}"


def _runs(name: str, pp: int, m: int) -> bool:
    """Whether `name` accepts these sizes (the refusals are tested on their own)."""
    if "interleaved" in name:
        return m % pp == 0
    return m >= 2 * pp if name in V_SHAPED_SCHEDULES else True


@pytest.mark.parametrize(
    ("name", "pp", "m"),
    [
        (name, pp, m)
        for name in sorted(SCHEDULES)
        for pp, m in [(2, 4), (4, 8), (4, 4), (3, 7), (4, 9), (1, 2)]
        if _runs(name, pp, m)
    ],
)
def test_every_schedule_runs_each_microbatch_once_without_deadlock(name, pp, m):
    chunks = 2 if "interleaved" in name or name in V_SHAPED_SCHEDULES else 1
    schedules = [SCHEDULES[name](m, pp, r, chunks) for r in range(pp)]
    # every microbatch-chunk: one forward, then one backward, whole (B) or split (I, then W)
    for actions in schedules:
        where = {(a.kind, a.microbatch, a.chunk): i for i, a in enumerate(actions)}
        assert len(where) == len(actions)
        splits = 0
        for i in range(m):
            for c in range(chunks):
                f = where[("F", i, c)]
                if ("B", i, c) in where:
                    assert f < where[("B", i, c)] and ("I", i, c) not in where
                else:
                    assert f < where[("I", i, c)] < where[("W", i, c)]
                    splits += 1
        assert len(actions) == 2 * m * chunks + splits
        assert (splits > 0) == (name in SPLIT_BACKWARD_SCHEDULES)
    _check_dependencies(schedules, pp, chunks, name in V_SHAPED_SCHEDULES)


@pytest.mark.parametrize(("pp", "m"), [(2, 8), (4, 8), (4, 3)])
def test_1f1b_holds_at_most_pp_microbatches_gpipe_holds_all(pp, m):
    for rank in range(pp):
        assert max_in_flight(one_f_one_b(m, pp, rank)) == min(pp - rank, m)
        assert max_in_flight(gpipe(m, pp, rank)) == m
        # split backwards free a microbatch at its W, right after its I: 1F1B's memory
        assert max_in_flight(zero_bubble_1f1b(m, pp, rank)) == min(pp - rank, m)
        # ZB-H1 defers rank r's W's by r microbatches: every rank at 1F1B's first-rank peak
        assert max_in_flight(zero_bubble_h1(m, pp, rank)) == min(pp, m)
        if m % pp == 0:  # and interleaved 1F1B's
            interleaved = max_in_flight(interleaved_1f1b(m, pp, rank, 2))
            assert max_in_flight(zero_bubble_interleaved_1f1b(m, pp, rank, 2)) == interleaved


def test_split_1f1b_sends_each_gradient_before_its_weight_half():
    for pp, m in [(2, 4), (4, 8), (4, 3)]:
        for rank in range(pp):
            actions = zero_bubble_1f1b(m, pp, rank)
            # every input half is followed at once by its own weight half
            for i, a in enumerate(actions):
                if a.kind == "I":
                    assert actions[i + 1] == Action("W", a.microbatch)
            # the last rank alternates forward and split backward from the start
            if rank == pp - 1:
                assert [a.kind for a in actions] == ["F", "I", "W"] * m
    with pytest.raises(ValueError, match="zb_1f1b runs one chunk per rank"):
        zero_bubble_1f1b(4, 2, 0, 2)


def test_interleaving_needs_whole_groups_of_pp_microbatches():
    with pytest.raises(ValueError, match=r"number of microbatches \(6\) to be a multiple of pp=4"):
        interleaved_1f1b(6, 4, 0, 2)


def _fake_mesh(pp: int, pp_rank: int) -> ParallelMesh:
    layout = MeshLayout(pp=pp)
    return ParallelMesh(layout, rank=layout.rank_of(0, 0, pp_rank))


def _two_stages_hold_the_whole_model(config, **stage_kwargs) -> list:
    """Both ranks' stages of a pp=2 build: together they hold exactly the whole model's
    weights under its names (the same seed gives the same values). Returns the stages."""
    torch.manual_seed(0)
    whole = dict(build_model(config).named_parameters())
    stages, seen = [], {}
    for rank in range(2):
        torch.manual_seed(0)
        stages.append(build_pipeline_stage(config, _fake_mesh(2, rank), **stage_kwargs))
        seen.update(dict(stages[-1].named_parameters()))
    assert seen.keys() == whole.keys()
    for name, value in whole.items():
        assert torch.equal(seen[name], value), name
    return stages


def _top_names(stage) -> set[str]:
    return {n.split(".")[0] for n, _ in stage.named_parameters()}


@pytest.mark.parametrize("preset", ["tiny", "tiny-dense"])
def test_stages_get_the_whole_models_weights_under_its_names(preset):
    config = presets.get(preset, num_layers=4, vocab_size=97)
    first, _ = _two_stages_hold_the_whole_model(config, layout=[1, 3])
    assert _top_names(first) == {"embed_tokens", "layers"}


def test_strategy_refuses_bad_pipeline_options_at_construction():
    with pytest.raises(ValueError, match="virtual_pp=2 needs pp > 1"):
        MegatronStrategy(virtual_pp=2)
    with pytest.raises(ValueError, match="schedule='1f1b' runs one chunk per rank"):
        MegatronStrategy(pp=2, virtual_pp=2, schedule="1f1b")
    with pytest.raises(ValueError, match="schedule must be one of"):
        MegatronStrategy(pp=2, schedule="zigzag")
    with pytest.raises(ValueError, match="pipeline_layout has 3 entries"):
        MegatronStrategy(pp=2, pipeline_layout=[1, 1, 1])


def test_strategy_checks_the_partition_against_the_model():
    strategy = MegatronStrategy(pp=4)
    with pytest.raises(ValueError, match="num_layers=6 does not split evenly"):
        strategy.validate_model(presets.get("tiny-dense", num_layers=6), world_size=4)


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (3, 7), (4, 8), (4, 13)])
def test_dualpipev_pairs_forward_and_backward_chunks_and_defers_weight_halves(pp, m):
    for rank in range(pp):
        actions = dualpipev(m, pp, rank)
        # the steady state: a forward of one chunk right before a backward of the other,
        # twice per microbatch past the first 2·pp
        paired = sum(
            a.kind == "F" and b.kind in "BI" and a.chunk != b.chunk
            for a, b in zip(actions, actions[1:], strict=False)
        )
        assert paired >= 2 * (m - 2 * pp + 1), (rank, paired)
        # split backwards: their weight halves run in the order of their input halves; past
        # the first rank some wait behind other backwards (they fill the drain, where the
        # first rank's fill the waits for its own chunk-0 gradients); every rank ends on one
        halves = [a for a in actions if a.kind in "IW"]
        inputs = [(a.microbatch, a.chunk) for a in halves if a.kind == "I"]
        weights = [(a.microbatch, a.chunk) for a in halves if a.kind == "W"]
        assert inputs == weights and len(inputs) >= rank + 1
        deferred = [
            i for i, a in enumerate(actions)
            if a.kind == "W" and actions[i - 1] != Action("I", a.microbatch, a.chunk)
        ]  # fmt: skip
        assert (len(deferred) > 0) == (rank > 0) and actions[-1].kind == "W"
        # activations: at most 2·pp + 1 microbatch-chunks (pp + 1/2 microbatches of the
        # rank's layers; 1F1B's first rank holds pp)
        assert max_in_flight(actions) <= 2 * pp + 1


def test_dualpipev_refuses_too_few_microbatches_and_other_chunk_counts():
    with pytest.raises(ValueError, match=r"dualpipev needs at least 2\*pp=8 microbatches.*got 6"):
        dualpipev(6, 4, 0)
    with pytest.raises(ValueError, match="dualpipev runs two chunks per rank"):
        dualpipev(8, 4, 0, 3)
    with pytest.raises(ValueError, match="schedule='dualpipev' runs two chunks per rank"):
        MegatronStrategy(pp=2, virtual_pp=3, schedule="dualpipev")
    with pytest.raises(ValueError, match="needs pp > 1"):
        MegatronStrategy(schedule="dualpipev")
    # two chunks whatever virtual_pp (1 or 2) says: the layout has 2·pp entries
    assert MegatronStrategy(pp=2, schedule="dualpipev").virtual_pp == 2
    with pytest.raises(ValueError, match="pipeline_layout has 2 entries; pp\\*virtual_pp=2\\*2"):
        MegatronStrategy(pp=2, schedule="dualpipev", pipeline_layout=[2, 2])


@pytest.mark.parametrize(("pp", "chunks", "v_shape"), [(4, 1, False), (3, 3, False), (4, 2, True)])
def test_placement_locates_every_stage_on_the_rank_that_holds_it(pp, chunks, v_shape):
    placement = StagePlacement(pp, chunks, v_shape)
    held = [placement.stage(r, c) for r in range(pp) for c in range(chunks)]
    assert sorted(held) == list(range(pp * chunks))
    for r in range(pp):
        for c in range(chunks):
            assert placement.locate(placement.stage(r, c)) == (r, c)
    # V: rank 0 holds the first and the last stage, the last rank the turn (pp - 1, pp)
    assert placement.holds_first(0) and placement.holds_last(0) == v_shape
    assert placement.stages_of(pp - 1) == ([pp - 1, pp] if v_shape else placement.stages_of(pp - 1))


def test_v_placement_gives_each_rank_a_stage_going_down_and_one_coming_back():
    # layers per virtual stage, in model order: stages 0,1 go down ranks 0,1; 2,3 come back
    assert stage_layers(4, 2, 0, 2, [1, 0, 2, 1], v_shape=True) == [[0], [3]]
    assert stage_layers(4, 2, 1, 2, [1, 0, 2, 1], v_shape=True) == [[], [1, 2]]
    with pytest.raises(ValueError, match="a V placement holds two chunks per rank"):
        StagePlacement(2, 3, v_shape=True)


@pytest.mark.parametrize("preset", ["tiny", "tiny-dense"])
def test_v_stages_hold_embedding_and_head_on_the_first_rank_once(preset):
    config = presets.get(preset, num_layers=4, vocab_size=97)
    first, second = _two_stages_hold_the_whole_model(config, virtual_pp=2, v_shape=True)
    assert {"embed_tokens", "norm", "lm_head"} <= _top_names(first)
    assert first.is_first_chunk(0) and first.is_last_chunk(1)
    assert _top_names(second) == {"layers"} and not second.is_last_chunk(1)
    # one rank holds both ends: no embedding copy to keep in step
    assert first.shared_parameter_names() == second.shared_parameter_names() == []


def test_the_second_chunk_runs_its_all_to_alls_on_the_paired_groups():
    from nanotrain.models.moe import DeepSeekMoE

    config = presets.get("tiny", num_layers=4, vocab_size=97)
    stage = build_pipeline_stage(
        config, _fake_mesh(2, 0), virtual_pp=2, layout=[2, 0, 1, 1], v_shape=True
    )
    moes = [m for m in stage.modules() if isinstance(m, DeepSeekMoE)]
    for moe in moes:
        moe.ep_group = "ep"  # stands in for the mesh's group
    stage.bind_second_chunk("ep", "paired ep")
    # rank 0 of a V: chunk 0 is layers 0 (dense) and 1 (MoE), chunk 1 layer 3 and the MTP
    # block (the last stage)
    second = [stage.layers[str(i)] for i in stage.chunks[1]] + list(stage.mtp)
    paired = {id(m) for block in second for m in block.modules() if isinstance(m, DeepSeekMoE)}
    assert paired and len(paired) < len(moes)
    for moe in moes:
        assert moe.ep_group == ("paired ep" if id(moe) in paired else "ep")
    with pytest.raises(ValueError, match="paired chunks need two chunks per rank"):
        build_pipeline_stage(config, _fake_mesh(2, 0)).bind_second_chunk("ep", "paired ep")


def test_paired_chunks_are_refused_off_the_cpu():
    from nanotrain.strategies.megatron_pipeline import check_pairing_device

    check_pairing_device(torch.device("cpu"))
    with pytest.raises(ValueError, match="overlap_forward_backward runs on CPU .gloo. only"):
        check_pairing_device(torch.device("cuda", 0))
    with pytest.raises(ValueError, match="needs tp=1, got tp=2"):
        MegatronStrategy(pp=2, tp=2, schedule="dualpipev", overlap_forward_backward=True)
    with pytest.raises(ValueError, match="two chunks per rank, got pp=2 and 1 chunk"):
        MegatronStrategy(pp=2, overlap_forward_backward=True)


def test_the_schedules_microbatch_rules_are_checked_at_fit_start():
    # the Trainer asks the strategy once the batch sizes are known, before the first step
    MegatronStrategy(pp=4, schedule="dualpipev").check_step_microbatches(8)
    with pytest.raises(ValueError, match=r"dualpipev needs at least 2\*pp=8 microbatches"):
        MegatronStrategy(pp=4, schedule="dualpipev").check_step_microbatches(6)
    with pytest.raises(ValueError, match=r"multiple of pp=4"):
        MegatronStrategy(pp=4, virtual_pp=2).check_step_microbatches(6)
    MegatronStrategy(pp=4).check_step_microbatches(3)  # 1F1B runs any number
