"""`check_built_model`: what MegatronStrategy says about a built model before any step."""

from __future__ import annotations

import warnings

import pytest
import torch

from nanotrain.models import build_model, presets
from nanotrain.parallel.mesh import MeshLayout, ParallelMesh
from nanotrain.strategies.megatron_grads import check_built_model


def _model(preset: str):
    torch.manual_seed(0)
    return build_model(presets.get(preset, vocab_size=64, num_layers=2))


def _check(model, tp: int, rank: int = 0, pp: int = 1) -> list[str]:
    mesh = ParallelMesh(MeshLayout(tp=tp, pp=pp), rank=rank)  # sizes only: no group is used
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_built_model(model, list(model.parameters()), mesh, sequence_parallel=False)
    return [str(w.message) for w in caught]


def test_routed_experts_under_tp_without_sequence_parallel_warn_once_per_stage():
    moe = _model("tiny")
    (message,) = _check(moe, tp=2)
    assert "tp=2 without sequence_parallel" in message
    assert "pass sequence_parallel=True" in message
    assert _check(moe, tp=2, rank=1) == []  # tp rank 1 of the same stage: once per stage
    assert _check(moe, tp=2, rank=2, pp=2) != []  # the first rank of the second stage
    assert _check(moe, tp=1) == []
    assert _check(_model("tiny-dense"), tp=2) == []  # no routed experts: nothing repeated


def test_a_model_without_trainable_parameters_is_refused():
    model = _model("tiny-dense").requires_grad_(False)
    mesh = ParallelMesh(MeshLayout(), rank=0)
    with pytest.raises(ValueError, match="found no trainable parameters"):
        check_built_model(model, [], mesh, sequence_parallel=False)
