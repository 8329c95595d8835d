"""`schedule_chart` draws each rank's recorded events where they happened in time."""

from __future__ import annotations

import pytest
from PIL import Image, ImageColor

from nanotrain.parallel.schedule_runner import TimelineEvent
from nanotrain.report.schedule_chart import KIND_COLORS, schedule_chart

T0 = 100.0  # perf_counter seconds: the chart starts at the earliest event


def _ms(start: float, end: float) -> tuple[float, float]:
    return T0 + start / 1e3, T0 + end / 1e3


def _pixel(image: Image.Image, x: float, y: float) -> tuple[int, int, int]:
    return image.getpixel((round(x), round(y)))[:3]


def test_bars_sit_on_their_rank_and_time_and_the_bubble_stays_white(tmp_path):
    rank0 = [TimelineEvent("F", 0, 0, *_ms(0, 100)), TimelineEvent("W", 0, 0, *_ms(200, 300))]
    rank1 = [
        TimelineEvent("recv", 0, 0, *_ms(0, 100)),
        TimelineEvent("I", 0, 0, *_ms(100, 200)),
    ]
    path = schedule_chart([rank0, rank1], tmp_path / "chart.png", "two ranks", width=1090)
    image = Image.open(path).convert("RGB")
    # the chart's own geometry: 70 px of labels on the left, 20 on the right, rows of 40 px from
    # y=40, a time axis to 300 ms (the last event's end: nice ticks of 50 ms)
    left, right, top, row = 70, 1090 - 20, 40, 40

    def x(ms: float) -> float:
        return left + ms / 300 * (right - left)

    mid0, mid1 = top + row / 2 - 3, top + row + row / 2 - 3
    color = {k: ImageColor.getrgb(v) for k, v in KIND_COLORS.items()}
    white = (255, 255, 255)  # (off the grid lines, drawn every 50 ms)
    assert _pixel(image, x(60), mid0) == color["F"]
    assert _pixel(image, x(260), mid0) == color["W"]
    assert _pixel(image, x(140), mid0) == white  # rank 0 idles from 100 to 200 ms
    assert _pixel(image, x(140), mid1) == color["I"]
    assert _pixel(image, x(60), mid1) == white  # rank 1 computes nothing while it
    assert _pixel(image, x(60), top + 2 * row - 6) == color["recv"]  # waits: a band below
    assert _pixel(image, x(260), mid1) == white


def test_a_rank_running_paired_chunks_gets_a_lane_for_each(tmp_path):
    # a forward of chunk 0 and a backward of chunk 1 side by side from 50 to 150 ms
    rank0 = [TimelineEvent("F", 1, 0, *_ms(0, 150)), TimelineEvent("B", 0, 1, *_ms(50, 300))]
    path = schedule_chart([rank0], tmp_path / "paired.png", "paired", width=1090)
    image = Image.open(path).convert("RGB")
    left, right, top, row = 70, 1090 - 20, 40, 40

    def x(ms: float) -> float:
        return left + ms / 300 * (right - left)

    color = {k: ImageColor.getrgb(v) for k, v in KIND_COLORS.items()}
    upper, lower = top + 8, top + row - 14  # the two lanes inside the bar's height
    assert _pixel(image, x(100), upper) == color["F"]
    assert _pixel(image, x(100), lower) == color["B"]
    assert _pixel(image, x(20), lower) == (255, 255, 255)  # the backward starts at 50 ms
    assert _pixel(image, x(260), upper) == (255, 255, 255)  # the forward ended at 150 ms


def test_nothing_recorded_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no rank recorded any event"):
        schedule_chart([[], []], tmp_path / "empty.png", "empty")
