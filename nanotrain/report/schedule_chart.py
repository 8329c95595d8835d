"""A pipeline schedule as it ran: one row per rank, a bar per action, drawn with Pillow.

`run_schedule(..., timeline=events)` records what each rank did and when
(`nanotrain.parallel.schedule_runner.TimelineEvent`): forwards (F), whole backwards (B), the input
and weight halves of split backwards (I, W), and the waits for a neighbour's activation or
gradient (recv). `schedule_chart` draws the ranks' records on one time axis: the bubble is
the white space, a wait is a grey band under the row. A rank whose actions overlap (paired
chunks run side by side) gets two lanes: forwards above, backwards below. Forked ranks on one
machine share `time.perf_counter`'s clock, so their records line up as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from nanotrain.report.plots import nice_ticks

__all__ = ["KIND_COLORS", "schedule_chart"]

#: bar colour per event kind
KIND_COLORS = {
    "F": "#4c78a8",
    "B": "#2f8f3a",
    "I": "#7fc97f",
    "W": "#f28e2b",
    "recv": "#c8c8c8",
}
_KIND_NAMES = {
    "F": "forward",
    "B": "backward",
    "I": "backward, input half",
    "W": "backward, weight half",
    "recv": "waiting to receive",
}


def schedule_chart(
    timelines: Sequence[Sequence[Any]], path: str | Path, title: str, width: int = 1200
) -> Path:
    """Draw the ranks' `timelines` (rank 0's first; each a sequence of `TimelineEvent`) as a
    PNG at `path` and return its path. A compute bar is labelled with its microbatch, primed
    once per later chunk (3' is microbatch 3 on the rank's second chunk).

    Raises:
        ValueError: no rank recorded any event.
    """
    events = [e for rank in timelines for e in rank]
    if not events:
        raise ValueError(f"schedule chart {title!r}: no rank recorded any event")
    t0 = min(e.start for e in events)
    span_ms = max((e.end - t0) * 1e3 for e in events)
    ticks = nice_ticks(0.0, span_ms, count=8)
    row, left, right, top = 40, 70, width - 20, 40
    height = top + row * len(timelines) + 70
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font, small = ImageFont.load_default(size=16), ImageFont.load_default(size=11)

    def x_of(seconds: float) -> float:
        return left + (seconds - t0) * 1e3 / ticks[-1] * (right - left)

    draw.text((width / 2, 12), title, fill="black", font=font, anchor="mt")
    bottom = top + row * len(timelines)
    for tick in ticks:
        x = left + tick / ticks[-1] * (right - left)
        draw.line([(x, top), (x, bottom)], fill="#eeeeee")
        draw.text((x, bottom + 4), f"{tick:g}", fill="black", font=small, anchor="mt")
    draw.text(((left + right) / 2, bottom + 20), "ms", fill="black", font=small, anchor="mt")
    for rank, rank_events in enumerate(timelines):
        y = top + rank * row
        draw.text((left - 8, y + row / 2), f"rank {rank}", fill="black", font=small, anchor="rm")
        two_lanes = _overlaps([e for e in rank_events if e.kind != "recv"])
        for e in rank_events:
            x0, x1 = x_of(e.start), max(x_of(e.end), x_of(e.start) + 1)
            if e.kind == "recv":
                draw.rectangle([x0, y + row - 9, x1, y + row - 4], fill=KIND_COLORS["recv"])
                continue
            y0, y1 = y + 4, y + row - 11
            if two_lanes:  # forwards above, backwards below
                middle = (y0 + y1) / 2
                y0, y1 = (y0, middle) if e.kind == "F" else (middle + 1, y1)
            draw.rectangle([x0, y0, x1, y1], fill=KIND_COLORS[e.kind], outline="white")
            label = f"{e.microbatch}{chr(39) * e.chunk}"
            if x1 - x0 > 6 * len(label) + 2:
                draw.text(((x0 + x1) / 2, (y0 + y1) / 2), label, fill="white", font=small,
                          anchor="mm")  # fmt: skip
    kinds = [k for k in KIND_COLORS if any(e.kind == k for e in events)]
    x = left
    for kind in kinds:
        draw.rectangle([x, height - 22, x + 14, height - 10], fill=KIND_COLORS[kind])
        draw.text((x + 20, height - 16), _KIND_NAMES[kind], fill="black", font=small, anchor="lm")
        x += 40 + 7 * len(_KIND_NAMES[kind])
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    image.save(out, format="PNG")
    return out


def _overlaps(events: Sequence[Any]) -> bool:
    """Whether any two of `events` (one rank's compute spans) overlap in time."""
    spans = sorted((e.start, e.end) for e in events)
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:], strict=False))
