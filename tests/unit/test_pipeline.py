"""Pipeline pieces that need no process group: partition, schedules, stage init, errors."""

from __future__ import annotations

import re

import pytest
import torch

from nanotrain.models import build_model, presets
from nanotrain.models.stages import build_pipeline_stage
from nanotrain.parallel.mesh import MeshLayout, ParallelMesh
from nanotrain.parallel.pipeline import partition_layers, stage_layers
from nanotrain.parallel.schedules import (
    SCHEDULES,
    SPLIT_BACKWARD_SCHEDULES,
    Action,
    gpipe,
    interleaved_1f1b,
    max_in_flight,
    one_f_one_b,
    zero_bubble_1f1b,
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


def _check_dependencies(schedules: list[list[Action]], pp: int, chunks: int) -> None:
    """Simulate the ranks in lockstep: an action runs once its input exists (a forward: the
    previous stage's forward; a backward or input half: its own forward and the next stage's
    input gradient; a weight half: its own input half); all must finish (no deadlock)."""
    done: set[tuple[str, int, int]] = set()  # (kind, microbatch, virtual stage)
    pos = [0] * pp
    last = pp * chunks - 1

    def grad_sent(m: int, k: int) -> bool:
        return ("B", m, k) in done or ("I", m, k) in done

    while any(pos[r] < len(schedules[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            if pos[r] == len(schedules[r]):
                continue
            a = schedules[r][pos[r]]
            k = a.chunk * pp + r
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


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 4)])
def test_every_schedule_runs_each_microbatch_once_without_deadlock(name, pp, m):
    chunks = 2 if "interleaved" in name else 1
    schedules = [SCHEDULES[name](m, pp, r, chunks) for r in range(pp)]
    # every microbatch-chunk: one forward and one backward, whole (B) or split (I, then W)
    kinds = "FIW" if name in SPLIT_BACKWARD_SCHEDULES else "FB"
    for actions in schedules:
        assert sorted(actions, key=lambda a: (a.kind, a.microbatch, a.chunk)) == sorted(
            [Action(kind, i, c) for kind in kinds for i in range(m) for c in range(chunks)],
            key=lambda a: (a.kind, a.microbatch, a.chunk),
        )
    _check_dependencies(schedules, pp, chunks)


@pytest.mark.parametrize(("pp", "m"), [(2, 8), (4, 8), (4, 3)])
def test_1f1b_holds_at_most_pp_microbatches_gpipe_holds_all(pp, m):
    for rank in range(pp):
        assert max_in_flight(one_f_one_b(m, pp, rank)) == min(pp - rank, m)
        assert max_in_flight(gpipe(m, pp, rank)) == m
        # split backwards free a microbatch at its W, right after its I: 1F1B's memory
        assert max_in_flight(zero_bubble_1f1b(m, pp, rank)) == min(pp - rank, m)
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


@pytest.mark.parametrize("preset", ["tiny", "tiny-dense"])
def test_stages_get_the_whole_models_weights_under_its_names(preset):
    config = presets.get(preset, num_layers=4, vocab_size=97)
    torch.manual_seed(0)
    whole = dict(build_model(config).named_parameters())
    seen = {}
    for rank in range(2):
        torch.manual_seed(0)
        stage = build_pipeline_stage(config, _fake_mesh(2, rank), layout=[1, 3])
        seen.update({n: p for n, p in stage.named_parameters()})
        if rank == 0:
            assert {n.split(".")[0] for n, _ in stage.named_parameters()} == {
                "embed_tokens",
                "layers",
            }
    assert seen.keys() == whole.keys()
    for name, value in whole.items():
        assert torch.equal(seen[name], value), name


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
