"""Code blocks in the docs that claim to run, run as written."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def first_python_block(page: str) -> str:
    text = (DOCS / page).read_text(encoding="utf-8")
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def test_models_md_first_snippet_trains_one_step():
    namespace: dict = {}
    exec(compile(first_python_block("models.md"), "docs/models.md", "exec"), namespace)
    out = namespace["out"]
    assert out.logits.shape[:2] == (2, 16) and out.loss.isfinite()
    assert all(p.grad is not None for p in namespace["model"].parameters() if p.requires_grad)


def test_planning_md_first_snippet_prints_a_plan(capsys):
    namespace: dict = {}
    exec(compile(first_python_block("planning.md"), "docs/planning.md", "exec"), namespace)
    plan = namespace["plan"]
    assert len(plan.ranks) == 2 and plan.step_time_s > 0
    assert "memory per GPU" in capsys.readouterr().out
