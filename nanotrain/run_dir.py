"""The run directory `<root>/<name>/version_N/`: config, logs, checkpoints of one run."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import yaml

_VERSION = re.compile(r"^version_(\d+)$")


def next_version(experiment_dir: Path) -> int:
    """One more than the highest `version_N` in `experiment_dir` (0 when there is none)."""
    if not experiment_dir.is_dir():
        return 0
    versions = [int(m.group(1)) for p in experiment_dir.iterdir() if (m := _VERSION.match(p.name))]
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


def default_config(
    settings: dict[str, Any], strategy: Any, module: Any, datamodule: Any
) -> dict[str, Any]:
    """The config recorded when none was given: trainer settings, the strategy's class, and the
    module's and datamodule's hyperparameters that are plain YAML values."""
    config: dict[str, Any] = {"trainer": dict(settings)}
    config["trainer"]["strategy"] = type(strategy).__name__
    for key, obj in (("model", module), ("data", datamodule)):
        hparams = getattr(obj, "hparams", None)
        if hparams:
            config[key] = {k: v for k, v in dict(hparams).items() if _is_plain(v)}
    return config


def _is_plain(value: Any) -> bool:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return not (isinstance(value, float) and not math.isfinite(value))
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False


def choose_run_dir(experiment_dir: Path, version: int | None, ckpt_path: Any) -> Path:
    """The run directory of a fit/validate: the one a resumed checkpoint lives in (for
    `ckpt_path="last"`, the experiment's newest version), else `version_<version>` (None: the
    next free number)."""
    if ckpt_path not in (None, "last"):
        resumed = run_dir_of_checkpoint(Path(ckpt_path))
        if resumed is not None:
            return resumed
    if ckpt_path == "last":
        latest = next_version(experiment_dir) - 1
        if latest >= 0:
            return experiment_dir / f"version_{latest}"
    version = version if version is not None else next_version(experiment_dir)
    return experiment_dir / f"version_{version}"
