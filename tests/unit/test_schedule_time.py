"""`schedule_step_time` replays the schedules' own action lists: it gives each schedule's
textbook step time where the textbook's assumptions hold, and what the lists really do where
they do not."""

from __future__ import annotations

import pytest

from nanotrain.parallel.schedules import SCHEDULES
from nanotrain.planning.schedule_time import schedule_step_time

VIRTUAL = {"interleaved_1f1b": 2, "zb_interleaved_1f1b": 2}
#: schedules whose textbook step is a bound (tested on their own)
BOUNDED = {"dualpipev"}


def _formula(name: str, m: int, p: int, v: int, f: float, i: float, w: float) -> float:
    """m (F + I + W) of work plus the bubble: (p - 1)(F + I + W) / v, without W for the
    split-backward schedules."""
    split = name.startswith("zb")
    return m * (f + i + w) + (p - 1) * ((f + i) if split else (f + i + w)) / v


@pytest.mark.parametrize("name", sorted(set(SCHEDULES) - BOUNDED))
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 12), (8, 16)])
def test_equal_stages_give_the_textbook_step(name, p, m):
    v = VIRTUAL.get(name, 1)
    for f, i, w in ((1.0, 1.0, 1.0), (0.02, 0.04, 0.02), (1.0, 1.0, 0.5)):
        got = schedule_step_time(name, m, p, v, f, i, w)
        assert got == pytest.approx(_formula(name, m, p, v, f, i, w), rel=1e-12), (f, i, w)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 12), (8, 16), (8, 40)])
def test_dualpipev_stays_within_its_bubble_bound_and_beats_1f1b(p, m):
    # DualPipe's table (deepseek-ai/DualPipe README): bubble (PP/2 - 1)(F&B + B - 3W) over
    # PP = 2p stages, F, B, W a chunk's times; without overlap F&B = F + B
    for f, i, w in ((1.0, 1.0, 1.0), (0.02, 0.04, 0.02), (1.0, 1.0, 0.5), (1.0, 2.0, 1.0)):
        F, B, W = f / 2, (i + w) / 2, w / 2  # a rank's two chunks split its time
        got = schedule_step_time("dualpipev", m, p, 2, f, i, w)
        work = m * (f + i + w)
        assert work < got <= work + (p - 1) * (F + B + B - 3 * W) + 1e-9, (f, i, w)
        # the same layers on p ranks under 1F1B and 1F1B with split backwards take longer
        assert got < schedule_step_time("zb_1f1b", m, p, 1, f, i, w)
        assert got < schedule_step_time("1f1b", m, p, 1, f, i, w)


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
