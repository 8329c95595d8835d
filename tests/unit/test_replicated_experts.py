"""The warning for layouts whose tensor-parallel ranks all run the same routed experts on the
same tokens (tp without sequence parallelism, or SP with a capacity factor)."""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace

import pytest

from nanotrain.language_model import LanguageModelModule
from nanotrain.models import presets
from nanotrain.models.build import replicated_expert_compute

TINY = presets.get("tiny")


@pytest.mark.parametrize(
    ("tp", "sp", "capacity", "repeated"),
    [
        (1, False, None, False),  # one rank: nothing to repeat
        (2, False, None, True),  # every tp rank runs all of its replica's tokens
        (2, True, None, False),  # SP dropless: each rank its own T / tp tokens
        (4, True, 1.25, True),  # SP with a capacity gathers whole sequences first
        (2, False, 1.25, True),
    ],
)
def test_repeated_routed_compute_is_named_with_its_fix(tp, sp, capacity, repeated):
    config = dataclasses.replace(TINY, capacity_factor=capacity)
    message = replicated_expert_compute(config, tp, sp)
    assert (message is not None) == repeated
    if repeated:
        assert f"{tp}x the routed-expert FLOPs" in message
        fix = "sequence_parallel=True" if not sp else "capacity_factor=None"
        assert fix in message


def test_models_without_routed_experts_never_warn():
    all_dense = dataclasses.replace(TINY, first_k_dense_replace=TINY.num_layers)
    assert replicated_expert_compute(all_dense, 4, False) is None
    assert replicated_expert_compute(presets.get("tiny-dense"), 4, False) is None


@pytest.mark.parametrize(("rank", "warns"), [(0, True), (1, False)])
def test_configure_model_warns_once_on_global_rank_zero(rank, warns):
    module = LanguageModelModule(model="tiny")
    module.config = TINY
    mesh = SimpleNamespace(tp_size=2, rank=rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module._warn_replicated_experts(mesh, sequence_parallel=False)
    assert any("routed experts are replicated" in str(w.message) for w in caught) == warns
