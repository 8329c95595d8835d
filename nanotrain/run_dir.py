"""The run directory `<root>/<name>/version_N/`: config, logs, checkpoints of one run."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

_VERSION = re.compile(r"^version_(\d+)$")


def next_version(experiment_dir: Path) -> int:
    """One more than the highest `version_N` in `experiment_dir` (0 when there is none)."""
    if not experiment_dir.is_dir():
        return 0
    versions = [
        int(m.group(1)) for p in experiment_dir.iterdir() if (m := _VERSION.match(p.name))
    ]
    return max(versions, default=-1) + 1


def run_dir_of_checkpoint(ckpt_path: Path) -> Path | None:
    """The run directory a checkpoint lives in (`.../version_N/checkpoints/x`), if any."""
    for parent in ckpt_path.resolve().parents:
        if _VERSION.match(parent.name):
            return parent
    return None


def write_config(run_dir: Path, config: dict[str, Any]) -> Path:
    """Write the resolved config as `config.yaml` in `run_dir` and return its path."""
    path = run_dir / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path
