"""The planner's caches return what they stand for, and notice a config changed in place."""

from __future__ import annotations

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
