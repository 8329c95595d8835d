"""`schedule_step_time` replays the schedules' own action lists: it gives each schedule's
textbook step time where the textbook's assumptions hold, and what the lists really do where
they do not."""

from __future__ import annotations

import pytest

from nanotrain.parallel.schedules import SCHEDULES
from nanotrain.planning.schedule_time import exposed_all_to_all, schedule_step_time

VIRTUAL = {"interleaved_1f1b": 2, "zb_interleaved_1f1b": 2}
#: schedules whose textbook step is a bound (tested on their own)
BOUNDED = {"dualpipev"}


def _formula(name: str, m: int, p: int, v: int, f: float, i: float, w: float) -> float:
    """m (F + I + W) of work plus the bubble: (p - 1)(F + I + W) / v, without W for the
    split-backward schedules, less one W for ZB-H1 (Qi et al. 2024: (p - 1)(F + B - W) in
    their terms, B the input half)."""
    bubble = {"zb_h1": f + i - w}.get(name, (f + i) if name.startswith("zb") else (f + i + w))
    return m * (f + i + w) + (p - 1) * bubble / v


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


def test_all_to_alls_add_their_time_unless_paired_chunks_hide_them():
    f = 1.0
    for pp, m in ((2, 8), (4, 16)):
        blocking = m * 1.0  # an all-to-all time of 1.0 per microbatch

        def exposed(schedule, overlap, rounds=1, m=m, pp=pp):
            v = 2 if schedule == "dualpipev" else 1
            return exposed_all_to_all(schedule, m, pp, v, f, f, f, 1.0, overlap, rounds)

        # one after the other, a rank pays every all-to-all (more where they delay others)
        for schedule in ("1f1b", "dualpipev"):
            assert exposed(schedule, False) >= blocking * 0.999
        # a schedule without pairs is unchanged by overlap
        assert exposed("1f1b", True) == pytest.approx(exposed("1f1b", False))
        # paired chunks hide most of it, more with finer rounds (more MoE layers per chunk)
        paired = [exposed("dualpipev", True, rounds) for rounds in (1, 2, 4)]
        assert paired[2] < paired[1] < paired[0] < 0.6 * blocking
        # and more with more microbatches (fewer unpaired warm-up and drain actions)
        more = exposed("dualpipev", True, 4, m=4 * m) / (4 * blocking)
        assert more < paired[2] / blocking


def test_side_by_side_shares_one_compute_engine():
    from nanotrain.planning.schedule_time import _side_by_side

    compute_only = ((True, 2.0),)
    assert _side_by_side(compute_only, compute_only) == 4.0  # never two computes at once
    # an all-to-all of one runs while the other computes
    assert _side_by_side(((True, 1.0), (False, 2.0)), ((True, 2.0),)) == 3.0
    assert _side_by_side(((False, 3.0),), ((False, 3.0),)) == 3.0
