"""`run_info.json`: what a run knows about itself that the metric logs do not hold.

Written by the `RunReport` callback on rank 0: the static facts when training starts (strategy
and layout, model size, data and tokenizer, trainer settings) and the outcome when it ends
(status, final counters, checkpoints). `nanotrain report` rebuilds the report from this file,
`config.yaml`, the logged metrics and the checkpoints folder.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanotrain.trainer import Trainer

__all__ = ["RUN_INFO_FILE", "read_run_info", "start_info", "end_info", "write_run_info"]

RUN_INFO_FILE = "run_info.json"


def _plain(value: Any) -> bool:
    if isinstance(value, (str, int, bool)) or value is None:
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return False


def _public_settings(obj: Any) -> dict[str, Any]:
    """An object's public attributes that are plain JSON values (its constructor settings)."""
    return {
        k: list(v) if isinstance(v, tuple) else v
        for k, v in sorted(vars(obj).items())
        if not k.startswith("_") and _plain(v)
    }


def strategy_info(trainer: Trainer) -> dict[str, Any]:
    """Strategy class, its settings, world size, device, data-parallel replicas and, for a
    strategy that shards the model, its layout (as recorded in checkpoints)."""
    from nanotrain.checkpoint.layout import sharded_layout

    strategy = trainer.strategy
    return {
        "name": type(strategy).__name__,
        "settings": _public_settings(strategy),
        "world_size": trainer.world_size,
        "device": str(strategy.root_device),
        "data_parallel_replicas": strategy.data_shard().count,
        "layout": sharded_layout(strategy),
    }


def model_info(module: Any, replicated: bool) -> dict[str, Any]:
    """Module class; with a `nanotrain.models` config: its family, config, total and active
    parameters (MTP modules included in the total); else the parameters counted on this
    process when every process holds the whole model (`replicated`)."""
    info: dict[str, Any] = {"class": type(module).__name__}
    config = getattr(module, "config", None)
    from nanotrain.models.config import DeepSeekConfig, DenseConfig

    if isinstance(config, (DeepSeekConfig, DenseConfig)):
        from nanotrain.models.accounting import active_params, total_params
        from nanotrain.models.config import config_to_dict

        info["family"] = type(config).__name__
        info["config"] = config_to_dict(config)["config"]
        info["total_params"] = total_params(config, include_mtp=True)
        info["active_params"] = active_params(config)
    elif replicated:
        info["total_params"] = sum(p.numel() for p in module.parameters())
        info["active_params"] = info["total_params"]
    flops = module.flops_per_token()
    if flops:
        info["flops_per_token"] = float(flops)
    return info


def data_info(datamodule: Any) -> dict[str, Any] | None:
    """Datamodule class and settings; for prepared token data also the folder, tokenizer,
    vocabulary, bytes per token and tokens per split."""
    if datamodule is None:
        return None
    info: dict[str, Any] = {"class": type(datamodule).__name__}
    hparams = getattr(datamodule, "hparams", None)
    if hparams:
        info["settings"] = {k: v for k, v in dict(hparams).items() if _plain(v)}
    metadata = getattr(datamodule, "metadata", None)
    if isinstance(metadata, dict):
        info["path"] = str(getattr(datamodule, "path", ""))
        for key in ("tokenizer", "vocab_size", "bytes_per_token"):
            if key in metadata:
                info[key] = metadata[key]
        splits = metadata.get("splits", {})
        info["tokens"] = {name: split.get("tokens") for name, split in splits.items()}
    return info


def start_info(trainer: Trainer) -> dict[str, Any]:
    """The facts known when training starts (call on every rank; no collectives)."""
    return {
        "started": time.time(),
        "strategy": strategy_info(trainer),
        "model": model_info(trainer.module, replicated=trainer.strategy.mesh is None),
        "data": data_info(trainer.datamodule),
        "trainer": trainer.settings.to_dict(),
        "resumed_at_step": trainer.global_step,
    }


def end_info(trainer: Trainer, status: str) -> dict[str, Any]:
    """The outcome: `status`, end time, final counters and the checkpoints a checkpoint
    callback kept as best and last."""
    info: dict[str, Any] = {
        "ended": time.time(),
        "status": status,
        "state": trainer.state.state_dict(),
    }
    for cb in trainer.callbacks:
        best = getattr(cb, "best_model_path", "")
        # without a monitor Lightning's best_model_path is the newest checkpoint: no "best"
        if best and getattr(cb, "monitor", None) is not None:
            score = getattr(cb, "best_model_score", None)
            info["best_checkpoint"] = {
                "path": str(best),
                "monitor": cb.monitor,
                "score": None if score is None else float(score),
            }
        last = getattr(cb, "last_model_path", "")
        if last:
            info["last_checkpoint"] = str(last)
    return info


def write_run_info(run_dir: Path, info: dict[str, Any]) -> Path:
    """Write `info` as `<run_dir>/run_info.json` (atomically: a crash leaves the old file)."""
    path = Path(run_dir) / RUN_INFO_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(info, indent=2, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def read_run_info(run_dir: Path) -> dict[str, Any]:
    """`<run_dir>/run_info.json`, or {} when the run has none (or it is unreadable)."""
    path = Path(run_dir) / RUN_INFO_FILE
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return info if isinstance(info, dict) else {}
