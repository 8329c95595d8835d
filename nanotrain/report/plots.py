"""Line charts as PNG files, drawn with Pillow (no plotting library needed).

The run report needs two simple pictures, loss curves and the learning-rate schedule: a few
series of (step, value) points on linear axes with a legend. Pillow is enough for that and is
small; matplotlib would be a large extra dependency for two charts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

__all__ = ["Series", "line_chart", "nice_ticks"]

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")


@dataclass
class Series:
    """One line of a chart: `points` are (x, y) pairs; non-finite y values are left out.

    `markers` draws a dot at every point (for sparse series such as validation losses).
    """

    label: str
    points: Sequence[tuple[float, float]]
    markers: bool = False


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About `count` round tick values (steps of 1, 2, 2.5 or 5 × 10^k) covering [low, high]."""
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(f"tick range must be finite, got [{low}, {high}]")
    if high <= low:
        high = low + (abs(low) or 1.0)
    raw = (high - low) / max(count - 1, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.floor(low / step) * step
    ticks, value = [], first
    while value <= high + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    if ticks[-1] < high:
        ticks.append(round(value, 12))
    return ticks


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1e4 or abs(value) < 1e-3:
        return f"{value:.1e}"
    return f"{value:.4g}"


def line_chart(
    series: Sequence[Series],
    path: str | Path,
    title: str,
    xlabel: str = "step",
    ylabel: str = "",
    size: tuple[int, int] = (800, 450),
) -> Path:
    """Draw `series` on shared linear axes with a legend and save a PNG at `path`.

    Raises:
        ValueError: when no series has a finite point.
    """
    clean = [
        (s, [(float(x), float(y)) for x, y in s.points if math.isfinite(float(y))]) for s in series
    ]
    clean = [(s, pts) for s, pts in clean if pts]
    if not clean:
        raise ValueError(f"chart {title!r} has no finite points to draw")
    xs = [x for _, pts in clean for x, _ in pts]
    ys = [y for _, pts in clean for _, y in pts]
    xticks, yticks = nice_ticks(min(xs), max(xs)), nice_ticks(min(ys), max(ys))
    width, height = size
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    font, small = ImageFont.load_default(size=16), ImageFont.load_default(size=12)
    left, right, top, bottom = 80, width - 20, 40, height - 55
    x0, x1, y0, y1 = xticks[0], xticks[-1], yticks[0], yticks[-1]

    def px(x: float, y: float) -> tuple[float, float]:
        return (
            left + (x - x0) / (x1 - x0) * (right - left),
            bottom - (y - y0) / (y1 - y0) * (bottom - top),
        )

    draw.text((width / 2, 12), title, fill="black", font=font, anchor="mt")
    for tick in xticks:
        x, _ = px(tick, y0)
        draw.line([(x, top), (x, bottom)], fill="#e6e6e6")
        draw.text((x, bottom + 6), _fmt(tick), fill="black", font=small, anchor="mt")
    for tick in yticks:
        _, y = px(x0, tick)
        draw.line([(left, y), (right, y)], fill="#e6e6e6")
        draw.text((left - 6, y), _fmt(tick), fill="black", font=small, anchor="rm")
    draw.rectangle([left, top, right, bottom], outline="black")
    draw.text(((left + right) / 2, height - 8), xlabel, fill="black", font=small, anchor="mb")
    if ylabel:
        draw.text((8, top - 20), ylabel, fill="black", font=small, anchor="lt")
    for i, (s, pts) in enumerate(clean):
        color = COLORS[i % len(COLORS)]
        coords = [px(x, y) for x, y in sorted(pts)]
        if len(coords) > 1:
            draw.line(coords, fill=color, width=2)
        if s.markers or len(coords) == 1:
            for cx, cy in coords:
                draw.ellipse([cx - 3, cy - 3, cx + 3, cy + 3], fill=color)
        ly = top + 10 + 18 * i
        draw.line([(right - 150, ly), (right - 125, ly)], fill=color, width=3)
        draw.text((right - 118, ly), s.label, fill="black", font=small, anchor="lm")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    image.save(out, format="PNG")
    return out
