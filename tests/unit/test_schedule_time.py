"""`schedule_step_time` replays the schedules' own action lists: it gives each schedule's
textbook step time where the textbook's assumptions hold, and what the lists really do where
they do not."""

from __future__ import annotations

import pytest

from nanotrain.parallel.schedules import SCHEDULES
from nanotrain.planning.schedule_time import schedule_step_time

VIRTUAL = {"interleaved_1f1b": 2, "zb_interleaved_1f1b": 2}


def _formula(name: str, m: int, p: int, v: int, f: float, i: float, w: float) -> float:
    """m (F + I + W) of work plus the bubble: (p - 1)(F + I + W) / v, without W for the
    split-backward schedules."""
    split = name.startswith("zb")
    return m * (f + i + w) + (p - 1) * ((f + i) if split else (f + i + w)) / v


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 12), (8, 16)])
def test_equal_stages_give_the_textbook_step(name, p, m):
    v = VIRTUAL.get(name, 1)
    for f, i, w in ((1.0, 1.0, 1.0), (0.02, 0.04, 0.02), (1.0, 1.0, 0.5)):
        got = schedule_step_time(name, m, p, v, f, i, w)
        assert got == pytest.approx(_formula(name, m, p, v, f, i, w), rel=1e-12), (f, i, w)


def test_the_replay_shows_where_a_schedule_misses_its_formula():
    # interleaved split backwards with a short input half and a long weight half: the
    # interleaved cool-down waits on W halves the formula does not count
    got = schedule_step_time("zb_interleaved_1f1b", 16, 8, 2, 1.0, 0.5, 1.5)
    assert got > _formula("zb_interleaved_1f1b", 16, 8, 2, 1.0, 0.5, 1.5) * 1.01


def test_one_stage_has_no_bubble_and_bad_input_is_refused():
    assert schedule_step_time("1f1b", 8, 1, 1, 1.0, 1.0, 1.0) == pytest.approx(24.0)
    assert schedule_step_time("1f1b", 8, 4, 1, 0.0, 0.0, 0.0) == 0.0
    with pytest.raises(ValueError, match="unknown schedule 'dualpipe'"):
        schedule_step_time("dualpipe", 8, 4, 1, 1.0, 1.0, 1.0)
