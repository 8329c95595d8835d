"""The run directory `<root>/<name>/version_N/`: config, logs, checkpoints of one run."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml


def write_config(run_dir: Path, config: dict[str, Any]) -> Path:
    """Write the resolved config as `config.yaml` in `run_dir` and return its path.

    An existing `config.yaml` (the run being resumed) is never rewritten: the new config goes
    to the first free `config-1.yaml`, `config-2.yaml`, ... instead.
    """
    path, n = run_dir / "config.yaml", 0
    while path.exists():
        n += 1
        path = run_dir / f"config-{n}.yaml"
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
