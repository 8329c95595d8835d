"""StepAggregator, the step scope's light reduction: each reduce_fx against torch's own
reduction of the same values, with weights, and cached until the next update."""

from __future__ import annotations

import pytest
import torch

from nanotrain.trainer.step_values import StepAggregator

VALUES = [3.0, -1.5, 7.25, 0.5]
WEIGHTS = [2, 1, 4, 1]


@pytest.mark.parametrize(
    ("reduce", "expected"),
    [
        ("mean", sum(v * w for v, w in zip(VALUES, WEIGHTS, strict=True)) / sum(WEIGHTS)),
        ("sum", sum(VALUES)),
        ("max", max(VALUES)),
        ("min", min(VALUES)),
    ],
)
def test_each_reduction_gives_torchs_value(reduce, expected):
    agg = StepAggregator(reduce, sync_dist=False)
    for value, weight in zip(VALUES, WEIGHTS, strict=True):
        if agg.takes_weight:
            agg.update(torch.tensor(value), weight)
        else:
            agg.update(torch.tensor(value))
    assert agg.compute().item() == pytest.approx(expected)
    assert agg.compute() is agg.compute()  # cached
    agg.update(torch.tensor(-100.0 if reduce == "min" else 100.0))
    assert agg.compute().item() != pytest.approx(expected)  # the cache follows updates


def test_compute_before_any_update_is_an_error():
    with pytest.raises(ValueError, match="before any update"):
        StepAggregator("sum", sync_dist=False).compute()
