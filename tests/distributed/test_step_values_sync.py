"""StepAggregator with sync_dist=True over a 2-rank gloo world: every reduce_fx gives the
reduction over both ranks' values (a weighted mean over all of them for "mean")."""

from __future__ import annotations

import pytest
import torch

from nanotrain.trainer.step_values import StepAggregator
from tests.distributed.spawn import run_world

pytestmark = pytest.mark.distributed

#: rank -> the (value, weight) pairs it logs in one step
LOGGED = {0: [(1.0, 2), (4.0, 1)], 1: [(-3.0, 1), (10.0, 4)]}


def _reduce_on_rank(rank: int, world_size: int) -> dict[str, float]:
    out = {}
    for reduce in ("mean", "sum", "max", "min"):
        agg = StepAggregator(reduce, sync_dist=True)
        for value, weight in LOGGED[rank]:
            agg.update(torch.tensor(value), weight)
        out[reduce] = agg.compute().item()
    return out


def test_sync_dist_reduces_over_every_rank():
    pairs = LOGGED[0] + LOGGED[1]
    values = [v for v, _ in pairs]
    expected = {
        "mean": sum(v * w for v, w in pairs) / sum(w for _, w in pairs),
        "sum": sum(values),
        "max": max(values),
        "min": min(values),
    }
    for result in run_world(_reduce_on_rank, 2):
        assert result == pytest.approx(expected)
