"""The planner's caches return what they stand for, and notice a config changed in place."""

from __future__ import annotations

import pytest

from nanotrain.models import presets
from nanotrain.parallel.schedules import SCHEDULES
from nanotrain.planning.gpus import gpu_spec
from nanotrain.planning.layout import PlanLayout, Workload, pipeline_actions
from nanotrain.planning.plan import plan_layout
from nanotrain.planning.rank_model import config_key


def test_pipeline_actions_are_the_schedules_own():
    for name in ("1f1b", "interleaved_1f1b", "dualpipev", "zb_1f1b"):
        v = 2 if name in ("interleaved_1f1b", "dualpipev") else 1
        for rank in range(4):
            built = SCHEDULES[name](8, 4, rank, v)
            assert list(pipeline_actions(name, 8, 4, rank, v)) == built
    assert pipeline_actions("1f1b", 8, 4, 1, 1) is pipeline_actions("1f1b", 8, 4, 1, 1)


def test_a_config_changed_in_place_gets_a_new_key_and_a_new_plan():
    config = presets.get("tiny", num_layers=4)
    key = config_key(config)
    assert config_key(config) is key  # made once, not per call
    workload = Workload(seq_len=64, micro_batch_size=1, global_batch_size=8)
    gpu = gpu_spec("h100")
    before = plan_layout(config, PlanLayout(pp=2), workload, gpu).total_params
    config.num_layers = 6
    assert config_key(config) != key
    after = plan_layout(config, PlanLayout(pp=2), workload, gpu).total_params
    assert after != before


CHUNKS = {"interleaved_1f1b": 2, "zb_interleaved_1f1b": 2, "dualpipev": 2}


@pytest.mark.parametrize(
    ("name", "overlap"),
    [(name, False) for name in sorted(SCHEDULES)] + [(name, True) for name in sorted(CHUNKS)],
)  # paired chunks: two chunks per rank
def test_the_kept_task_order_replays_as_the_rounds_over_the_ranks(name, overlap, monkeypatch):
    """Each replay runs the tasks in one order kept per task lists: every stage's end and
    last-backward start are bitwise those of walking the ranks in rounds, as the replay did
    before it kept an order, with different durations on every stage."""
    from nanotrain.planning import schedule_time
    from nanotrain.planning.stage_replay import StageDurations, replay_stages

    v = CHUNKS.get(name, 1)
    pp, m = 4, 8
    stages = [StageDurations(0.1 + 0.01 * r, 0.13 / (r + 1), 0.07, 0.02 * r, 2) for r in range(pp)]
    kept = replay_stages(name, m, v, stages, overlap)
    lists = schedule_time._tasks(name, m, pp, v, overlap)
    rounds = schedule_time._rounds_order(name, m, lists)
    if name != "gpipe":  # where the ranks wait on each other the orders differ
        assert schedule_time._run_order(name, m, lists) != rounds
    monkeypatch.setitem(schedule_time._ORDERS, id(lists), (lists, rounds))
    assert replay_stages(name, m, v, stages, overlap) == kept


def test_tasks_that_wait_on_each_other_are_refused_by_both_orders():
    from nanotrain.planning import schedule_time

    # rank 0's forward waits for rank 1's backward, which waits for rank 0's forward
    lists = (
        ((("F",), ((False, 0, 1),), ((True, 0, 0),)),),
        ((("B",), ((True, 0, 0),), ((False, 0, 1),)),),
    )
    for order in (schedule_time._run_order, schedule_time._rounds_order):
        with pytest.raises(ValueError, match="does not run to its end"):
            order("1f1b", 1, lists)


@pytest.mark.parametrize(
    ("model", "layout"),
    [
        ("deepseek-100m", PlanLayout(dp=2, ep=2)),
        ("deepseek-100m", PlanLayout(tp=2, pp=2, dp=2, ep=2, sequence_parallel=True)),
        ("deepseek-100m", PlanLayout(pp=2, dp=4, ep=4, virtual_pp=2, schedule="dualpipev")),
        ("dense-100m", PlanLayout(pp=2, virtual_pp=3)),
    ],
)
def test_rank_models_hold_what_their_modules_list(model, layout):
    """The parameters and buffers each rank model takes from its modules' kept lists are
    those `backward_order`, `expert_param_ids` and `buffers()` give its module, in order, a
    tied embedding and the MTP block included."""
    from nanotrain.parallel.data_parallel import backward_order
    from nanotrain.planning import rank_models
    from nanotrain.strategies.megatron_grads import expert_param_ids

    config = presets.get(model, tie_word_embeddings=True)
    for rank in rank_models(config, layout):
        params, experts = backward_order(rank.module), expert_param_ids(rank.module)
        assert [id(p) for p in rank.dense] == [id(p) for p in params if id(p) not in experts]
        assert [id(p) for p in rank.experts] == [id(p) for p in params if id(p) in experts]
        buffers = list(rank.module.buffers())
        assert rank.buffers == sum(b.numel() for b in buffers)
        assert rank.buffer_bytes == sum(b.numel() * b.element_size() for b in buffers)
    assert any(rank.experts for rank in rank_models(config, layout)) == model.startswith("deep")


@pytest.mark.parametrize(
    "layout",
    [
        PlanLayout(tp=2, dp=2, ep=2, sequence_parallel=True),
        PlanLayout(tp=2, pp=2, dp=2, ep=2, sequence_parallel=True),
        PlanLayout(tp=2, pp=2, dp=2, virtual_pp=2, schedule="dualpipev", sequence_parallel=True),
    ],
)
def test_sequence_parallel_numels_are_those_of_each_stage_module(layout):
    """The tp-replicated parameters a stage sums over tp, taken from its whole model's list,
    are those `sequence_parallel_params` finds in the stage's own module (a tied embedding,
    MTP and routed experts included)."""
    from nanotrain.parallel.grads import sequence_parallel_params
    from nanotrain.planning import rank_models
    from nanotrain.planning.communication_tp import _sp_param_numels

    config = presets.get("deepseek-100m", tie_word_embeddings=True)
    for rank in rank_models(config, layout):
        experts = {id(p) for p in rank.experts}
        params = sequence_parallel_params(rank.module)
        dense = sum(p.numel() for p in params if id(p) not in experts)
        assert dense > 0
        assert _sp_param_numels(rank) == (dense, sum(p.numel() for p in params) - dense)
