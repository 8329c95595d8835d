"""Record how much of each numerical tolerance the suite uses (a measuring tool, off by default).

With ``NANOTRAIN_NUMERICS_LOG=FILE`` set, every ``torch.testing.assert_close`` and every
``pytest.approx`` scalar comparison appends one JSON line to FILE before it decides::

    {"test": node id, "site": "file:line" of the comparing code, "what": its message,
     "rtol": .., "atol": .., "rel": largest |got - want| / |want|,
     "used": largest |got - want| / (atol + rtol |want|)}

``used`` above 1 means the comparison fails. With ``NANOTRAIN_NUMERICS_LOG_ONLY=1`` as well,
the wrapped comparisons record and never raise, so one run measures every comparison of a test
even past the first that would fail (the test's outcome then means nothing). Aggregate files
from runs under each ``ATEN_CPU_CAPABILITY`` and thread count (``NANOTRAIN_TEST_THREADS``) to
see which bound is closest to its limit on which kernels: ``python -m tests.numerics_log
FILE...`` prints, per comparison and file, the worst ``used`` and ``rel`` of those meant to
pass and the smallest ``rel`` of those over their bound.
Ranks forked by ``run_world`` inherit the hook and append to the same file (one line per write).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import traceback
from pathlib import Path

import torch

_ROOT = str(Path(__file__).resolve().parents[1])


def _site() -> str:
    """The innermost frame inside this repository that is not this module: file:line."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith(_ROOT) and not frame.filename.endswith("numerics_log.py"):
            return f"{os.path.relpath(frame.filename, _ROOT)}:{frame.lineno}"
    return "?"


def _write(path: str, rtol: float, atol: float, rel: float, used: float, what: str = "") -> None:
    line = {
        "test": os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0],
        "site": _site(),
        "what": re.sub(r",? rank \d+", "", str(what or ""))[:80],
        "rtol": rtol,
        "atol": atol,
        "rel": rel,
        "used": used,
    }
    with open(path, "a") as f:  # one short append per line: safe across forked ranks
        f.write(json.dumps(line) + "\n")


def _tensor_numbers(actual, expected, rtol, atol) -> tuple[float, float] | None:
    try:
        a = torch.as_tensor(actual).detach().double()
        e = torch.as_tensor(expected).detach().double()
        if a.shape != e.shape or a.numel() == 0:
            return None
    except (TypeError, ValueError, RuntimeError):
        return None
    diff = (a - e).abs()
    finite = torch.isfinite(diff)
    if not finite.any():
        return None
    diff, e = diff[finite], e[finite]
    rel = float((diff / e.abs().clamp_min(1e-30)).max())
    bound = atol + rtol * e.abs()
    used = float((diff / bound.clamp_min(1e-300)).max()) if (atol or rtol) else math.inf
    if float(diff.max()) == 0.0:
        used = 0.0
    return rel, used


def install(path: str) -> None:
    """Wrap ``torch.testing.assert_close`` and ``pytest.approx``'s scalar ``==`` to log to path."""
    import pytest

    # the class of a scalar approx (pytest moved it between private modules in 9.2)
    approx_scalar = type(pytest.approx(0.0))
    original_close = torch.testing.assert_close
    only_log = os.environ.get("NANOTRAIN_NUMERICS_LOG_ONLY") == "1"

    def assert_close(actual, expected, *args, **kwargs):
        rtol, atol = kwargs.get("rtol"), kwargs.get("atol")
        if rtol is not None and atol is not None:  # defaults depend on dtype: not a bound we set
            numbers = _tensor_numbers(actual, expected, rtol, atol)
            if numbers is not None:
                _write(path, rtol, atol, *numbers, kwargs.get("msg") or "")
        if only_log:
            return None
        return original_close(actual, expected, *args, **kwargs)

    torch.testing.assert_close = assert_close

    original_eq = approx_scalar.__eq__

    def approx_eq(self, actual) -> bool:
        try:
            want, got = float(self.expected), float(actual)
            rel_tol = self.rel if self.rel is not None else 1e-6
            abs_tol = self.abs if self.abs is not None else 1e-12
            diff = abs(got - want)
            if math.isfinite(diff):
                bound = max(rel_tol * abs(want), abs_tol)
                rel = diff / max(abs(want), 1e-30)
                _write(path, rel_tol, abs_tol, rel, diff / bound if diff else 0.0)
        except (TypeError, ValueError):
            pass
        return True if only_log else original_eq(self, actual)

    approx_scalar.__eq__ = approx_eq


def summarize(files: list[str]) -> dict[tuple[str, str], dict[str, dict]]:
    """Per comparison (site, message up to its first colon) and per file: the bound, the worst
    rel and used of the comparisons within it (meant to pass), and the smallest rel of those
    over it (a failure, or a check that the bound catches a planted difference: the margin to
    what a bug moves)."""
    table: dict[tuple[str, str], dict[str, dict]] = {}
    for name in files:
        for raw in Path(name).read_text().splitlines():
            line = json.loads(raw)
            key = (line["site"], line.get("what", "").split(":")[0])
            s = table.setdefault(key, {}).setdefault(
                name, {"rtol": 0.0, "atol": 0.0, "rel": 0.0, "used": 0.0, "over_rel": math.inf}
            )
            s.update(rtol=max(s["rtol"], line["rtol"]), atol=max(s["atol"], line["atol"]))
            if line["used"] > 1:
                s["over_rel"] = min(s["over_rel"], line["rel"])
            else:
                s["rel"] = max(s["rel"], line["rel"])
                s["used"] = max(s["used"], line["used"])
    return table


if __name__ == "__main__":
    files = sys.argv[1:]
    rows = summarize(files)
    print("worst used per file (rel in brackets; '!' marks a comparison over its bound):")
    print("   ".join(Path(f).stem for f in files))
    for (site, what), per in sorted(
        rows.items(), key=lambda r: -max(v["used"] for v in r[1].values())
    ):
        bound = max(v["rtol"] for v in per.values()), max(v["atol"] for v in per.values())
        cells = []
        for f in files:
            v = per.get(f)
            if v is None:
                cells.append("-")
                continue
            over = f" !{v['over_rel']:.1e}" if math.isfinite(v["over_rel"]) else ""
            cells.append(f"{v['used']:.2f}({v['rel']:.1e}){over}")
        print(f"{site} {what[:36]!r} rtol={bound[0]:g} atol={bound[1]:g}: " + " ".join(cells))
