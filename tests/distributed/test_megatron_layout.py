"""Every invalid MegatronStrategy layout errors before any process group or model exists.

No processes are started: the world size comes from the torchrun environment variables.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

import nanotrain as nt
from nanotrain.models import presets
from nanotrain.strategies.megatron import MegatronStrategy


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(tp=0), ValueError, "tp must be >= 1"),
        (dict(tp="2"), TypeError, "tp must be an int"),
        (dict(dp=0), ValueError, "dp must be >= 1"),
        (dict(zero_stage=4), ValueError, "zero_stage must be 0, 1, 2 or 3, got 4"),
        (dict(bucket_size_mb=0), ValueError, "bucket_size_mb must be > 0"),
        (dict(virtual_pp=2), ValueError, "virtual_pp=2 needs pp > 1"),
        (dict(pp=2, schedule="zigzag"), ValueError, "schedule must be one of"),
        (dict(pp=2, pipeline_layout=[1, 1, 1]), ValueError, "pipeline_layout has 3 entries"),
        (dict(ep=0), ValueError, "ep must be >= 1"),
        (dict(ep=3, dp=4), ValueError, r"ep=3 does not divide dp=4 \(expert parallelism is carved"),
    ],
)
def test_bad_option_fails_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        MegatronStrategy(**kwargs)


@pytest.mark.parametrize(
    ("world", "kwargs", "message"),
    [
        (3, dict(tp=2), r"tp=2 does not divide world_size=3; valid tp values: 1, 3"),
        (4, dict(tp=2, dp=4), r"must equal world_size=4; use dp=2"),
        (6, dict(tp=4), r"tp=4 does not divide world_size=6"),
        # world 8 with tp=2, pp=2 leaves dp=2: ep=4 cannot be carved out of it
        (8, dict(tp=2, pp=2, ep=4), r"ep=4 does not divide dp=2 .*valid ep values: 1, 2"),
        (6, dict(ep=4), r"ep=4 does not divide dp=6 .*valid ep values: 1, 2, 3, 6"),
    ],
)
def test_layout_not_fitting_the_world_fails_before_any_process_group(
    monkeypatch, world, kwargs, message
):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    strategy = MegatronStrategy(**kwargs)
    with pytest.raises(ValueError, match=message):
        strategy.setup_environment()
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("preset", "world", "tp", "message"),
    [
        # tiny-dense: 4 query heads, 2 key/value heads
        ("tiny-dense", 4, 4, r"tp=4 does not divide num_kv_heads=2; valid tp values: 1, 2"),
        # tiny (DeepSeek): 4 heads
        ("tiny", 8, 8, r"tp=8 does not divide num_heads=4; valid tp values: 1, 2, 4"),
    ],
)
def test_layout_not_fitting_the_model_fails_before_the_model_is_built(
    monkeypatch, preset, world, tp, message
):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    module = nt.LanguageModelModule(preset, vocab_size=256)
    strategy = MegatronStrategy(tp=tp)
    with pytest.raises(ValueError, match=message):
        strategy.setup_module(module)
    assert module.model is None  # configure_model never ran


def test_validate_model_names_the_layers():
    config = presets.get("tiny-dense", vocab_size=256)
    strategy = MegatronStrategy(tp=2)
    strategy.validate_model(config, world_size=4)  # tp=2 x dp=2 fits
    with pytest.raises(ValueError, match="tp=3 does not divide num_heads=4"):
        MegatronStrategy(tp=3).validate_model(config, world_size=3)


@pytest.mark.parametrize(
    ("preset", "world", "kwargs", "message"),
    [
        # tiny: 8 routed experts; world 6 -> dp=6, so ep=3 and ep=6 fit dp but not the experts
        ("tiny", 6, dict(ep=3), r"ep=3 does not divide num_experts=8; valid ep values: 1, 2"),
        ("tiny", 6, dict(ep=6), r"ep=6 does not divide num_experts=8; valid ep values: 1, 2"),
        ("tiny-dense", 4, dict(ep=2), r"ep=2 splits routed experts, but the model"),
    ],
)
def test_expert_layout_not_fitting_the_model_fails_before_the_model_is_built(
    monkeypatch, preset, world, kwargs, message
):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    module = nt.LanguageModelModule(preset, vocab_size=256)
    with pytest.raises(ValueError, match=message):
        MegatronStrategy(**kwargs).setup_module(module)
    assert module.model is None  # configure_model never ran
    assert not dist.is_initialized()


def test_expert_layouts_that_fit_are_accepted():
    config = presets.get("tiny", vocab_size=256)  # 8 routed experts
    for world, kwargs in [(2, dict(ep=2)), (4, dict(ep=4)), (8, dict(tp=2, pp=2, ep=2))]:
        MegatronStrategy(**kwargs).validate_model(config, world_size=world)
    assert MegatronStrategy(ep=2, dp=4).validate_world(4) == 4
