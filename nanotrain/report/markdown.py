"""The run report as Markdown: a few tables a person reads top to bottom, pictures embedded."""

from __future__ import annotations

import time
from typing import Any

import yaml

__all__ = ["render_markdown"]


def _num(value: Any, digits: int = 4) -> str:
    if value is None:
        return "unknown"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or float(value).is_integer() and abs(value) >= 1000:
        return f"{int(value):,}"
    return f"{value:.{digits}g}"


def _when(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(int(minutes), 60)
    return f"{hours}h {minutes:02d}m {secs:04.1f}s" if hours else f"{minutes}m {secs:04.1f}s"


def _table(rows: list[tuple[str, str]]) -> list[str]:
    return ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), ""]


def _model_rows(model: dict[str, Any] | None) -> list[tuple[str, str]]:
    if not model:
        return [("model", "unknown")]
    rows = [("module", model.get("class", "?"))]
    if "family" in model:
        rows.append(("family", model["family"]))
    rows.append(("parameters (total)", _num(model.get("total_params"))))
    rows.append(("parameters (active per token)", _num(model.get("active_params"))))
    if "flops_per_token" in model:
        rows.append(("training FLOPs per token", _num(model["flops_per_token"])))
    return rows


def _data_rows(data: dict[str, Any] | None) -> list[tuple[str, str]]:
    if not data:
        return [("data", "unknown (no datamodule)")]
    rows = [("datamodule", data.get("class", "?"))]
    if "path" in data:
        rows.append(("path", f"`{data['path']}`"))
    tokenizer = data.get("tokenizer")
    if isinstance(tokenizer, dict):
        tokenizer = ", ".join(f"{k}={v}" for k, v in tokenizer.items())
    if tokenizer is not None:
        rows.append(("tokenizer", str(tokenizer)))
    for key in ("vocab_size", "bytes_per_token"):
        if key in data:
            rows.append((key.replace("_", " "), _num(data[key])))
    for split, tokens in (data.get("tokens") or {}).items():
        rows.append((f"{split} tokens", _num(tokens)))
    settings = data.get("settings") or {}
    if "seq_len" in settings:
        rows.append(("sequence length", _num(settings["seq_len"])))
    return rows


def _strategy_rows(strategy: dict[str, Any] | None) -> list[tuple[str, str]]:
    if not strategy:
        return [("strategy", "unknown")]
    rows = [
        ("strategy", strategy.get("name", "?")),
        ("processes", _num(strategy.get("world_size"))),
        ("device (rank 0)", str(strategy.get("device"))),
        ("data-parallel replicas", _num(strategy.get("data_parallel_replicas"))),
    ]
    layout = strategy.get("layout")
    if layout:
        sizes = ", ".join(f"{k}={v}" for k, v in layout.items() if k not in ("strategy",))
        rows.append(("layout", sizes))
    settings = strategy.get("settings") or {}
    if settings:
        rows.append(("settings", ", ".join(f"{k}={v}" for k, v in settings.items())))
    return rows


def _validation_rows(validation: dict[str, Any] | None) -> list[tuple[str, str]]:
    if not validation:
        return [("validation", "none logged")]
    rows = []
    for which in ("best", "last"):
        entry = validation.get(which)
        if entry:
            # the step as logged (Lightning's 0-based: validation after step N is at N - 1)
            text = f"{_num(entry['loss'])} at logged step {entry['step']}"
            if entry.get("bpb") is not None:
                text += f" ({_num(entry['bpb'])} bits per byte)"
            rows.append((f"{which} val/loss", text))
    rows.append(("validation runs", _num(validation.get("evaluations"))))
    return rows


def _throughput_rows(throughput: dict[str, Any] | None) -> list[tuple[str, str]]:
    if not throughput:
        return [("throughput", "not logged (add ThroughputMonitor)")]
    rows = [
        (name, f"{_num(v['mean'])} (mean), {_num(v['last'])} (last window)")
        for name, v in throughput.items()
    ]
    if "mfu" not in throughput:
        rows.append(("mfu", "not measured: no peak FLOP/s known for this device"))
    return rows


def _checkpoint_rows(checkpoints: dict[str, Any]) -> list[tuple[str, str]]:
    best = checkpoints.get("best")
    best_text = "none"
    if best:
        best_text = f"`{best['path']}` (step {best.get('step')}, by {best.get('monitor')})"
    last = checkpoints.get("last")
    return [
        ("last", f"`{last}`" if last else "none"),
        ("best", best_text),
        ("kept", _num(len(checkpoints.get("kept", [])))),
    ]


def render_markdown(report: dict[str, Any]) -> str:
    """`report` (from `build_report`, pictures added) as a Markdown document."""
    t = report["training"]
    lines = [f"# Run report: `{report['run_dir']}`", ""]
    lines += _table(
        [
            ("status", str(report["status"])),
            ("started", _when(report["started"])),
            ("ended", _when(report["ended"])),
            ("wall time", _duration(report["wall_time_s"])),
            ("steps", _num(t["steps"])),
            ("tokens", _num(t["tokens"])),
            ("samples", _num(t["samples"])),
            ("epochs", _num(t["epochs"])),
            ("skipped steps", _num(t["skipped_steps"])),
            ("last train/loss", _num(t["last_train_loss"])),
            ("global / micro batch", f"{_num(t['global_batch_size'])} / {t['micro_batch_size']}"),
        ]
    )
    sections = (
        ("Validation", _validation_rows(report["validation"])),
        ("Throughput", _throughput_rows(report["throughput"])),
        ("Model", _model_rows(report["model"])),
        ("Data", _data_rows(report["data"])),
        ("Strategy", _strategy_rows(report["strategy"])),
        ("Checkpoints", _checkpoint_rows(report["checkpoints"])),
    )
    for title, rows in sections:
        lines += [f"## {title}", "", *_table(rows)]
    pictures = report.get("pictures") or {}
    if pictures:
        lines += ["## Pictures", ""]
        for name, path in pictures.items():
            lines += [f"![{name}]({path})", ""]
    lines += [f"Metrics read from `{report['metrics_source']}`.", ""]
    if report.get("config") is not None:
        config = yaml.safe_dump(report["config"], sort_keys=False).rstrip()
        lines += ["## Resolved config", "", "```yaml", config, "```", ""]
    return "\n".join(lines)
