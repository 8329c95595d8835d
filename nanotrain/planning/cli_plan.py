"""`nanotrain plan` and `nanotrain fit --plan`: the planner from the command line."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from nanotrain.parallel.mesh import validate_layout
from nanotrain.planning.gpus import GPUS, GPUSpec, gpu_spec
from nanotrain.planning.layout import PlanLayout, Workload
from nanotrain.planning.plan import Plan, plan_layout
from nanotrain.planning.report import format_plan, format_search, plan_json, search_json
from nanotrain.planning.search import search_layouts
from nanotrain.strategies.layout_checks import model_dims

__all__ = ["parse_count", "plan_for_run", "run_plan"]

_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str | int) -> int:
    """``"15M"`` -> 15_000_000 (suffixes K, M, B/G, T; plain ints pass).

    Raises:
        ValueError: not a positive count.
    """
    s = str(text).strip().lower().replace("_", "")
    scale = _SUFFIX.get(s[-1:], 1) if s else 1
    try:
        value = float(s[:-1] if scale != 1 else s) * scale
    except ValueError:
        raise ValueError(f"not a count: {text!r}; write e.g. 4096, 15M or 2.5B") from None
    if value < 1 or not math.isfinite(value):
        raise ValueError(f"a count must be >= 1, got {text!r}")
    return int(round(value))


def _config(model: str) -> Any:
    from nanotrain import model_io
    from nanotrain.models import presets

    if model_io.is_pretrained_folder(model):
        return model_io.open_pretrained(model)[0]
    return presets.get(model)


def _parser() -> Any:
    from nanotrain.cli import new_parser

    p = new_parser(prog="nanotrain plan", description=run_plan.__doc__)
    p.add_argument("--model", type=str, required=True, help="preset name or pretrained folder")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs (world size)")
    p.add_argument("--gpu", type=str, default="h100", help="h100|h200|h800|a100|b200|cpu or JSON")
    p.add_argument("--seq-len", "--seq_len", type=int, dest="seq_len", required=True)
    p.add_argument(
        "--global-batch-tokens", "--global_batch_tokens", type=str, default=None,
        dest="global_batch_tokens", help="tokens per step, e.g. 15M (rounded per layout to "
        "whole microbatches on every replica)",
    )  # fmt: skip
    p.add_argument("--global-batch-size", "--global_batch_size", type=int, default=None,
                   dest="global_batch_size", help="sequences per step (instead of tokens)")  # fmt: skip
    p.add_argument("--precision", type=str, default="bf16-mixed")
    p.add_argument("--micro-batch-size", "--micro_batch_size", type=int, default=None,
                   dest="micro_batch_size", help="fixed micro batch (default: search 1, 2, 4)")  # fmt: skip
    for name in ("tp", "pp", "ep", "dp", "virtual_pp", "zero_stage"):
        p.add_argument(f"--{name}", type=int | None, default=None)
    p.add_argument("--sequence_parallel", type=bool | None, default=None)
    p.add_argument("--recompute", type=str | None, default="__search__",
                   help="none|selective|full (fixed layout default: none)")  # fmt: skip
    p.add_argument("--schedule", type=str | None, default=None)
    p.add_argument("--pipeline_layout", type=list[int] | None, default=None)
    p.add_argument("--compute_efficiency", type=float, default=0.5)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--top", type=int, default=15, help="layouts to list when searching")
    return p


def _batch(cfg: Any, seq_len: int, per_step: int) -> int:
    """Sequences per step: as given, or tokens / seq_len rounded to a multiple of per_step."""
    if cfg.global_batch_size is not None:
        return cfg.global_batch_size
    if cfg.global_batch_tokens is None:
        raise ValueError("give --global-batch-tokens (e.g. 4M) or --global-batch-size")
    sequences = parse_count(cfg.global_batch_tokens) / seq_len
    return max(1, round(sequences / per_step)) * per_step


def run_plan(argv: list[str]) -> None:
    """`nanotrain plan --model M --gpus N --gpu KIND --seq-len S --global-batch-tokens T
    [--tp .. --pp .. --ep ..]`: per-GPU memory, FLOPs, communication and step time of one
    layout (when any layout flag is given) or of every layout that fits, best first."""
    cfg = _parser().parse_args(argv)
    config, gpu = _config(cfg.model), gpu_spec(cfg.gpu)
    recompute = None if cfg.recompute in ("none", "None") else cfg.recompute
    fixed = any(getattr(cfg, k) is not None for k in ("tp", "pp", "ep", "dp", "virtual_pp"))
    if fixed:
        tp, pp, ep = cfg.tp or 1, cfg.pp or 1, cfg.ep or 1
        # the strategy's own check of the sizes against the world and the model
        dp = validate_layout(cfg.gpus, tp, pp, ep, cfg.dp, **model_dims(config))
        layout = PlanLayout(
            tp=tp, pp=pp, ep=ep, dp=dp,
            virtual_pp=cfg.virtual_pp or 1, zero_stage=cfg.zero_stage or 0,
            sequence_parallel=bool(cfg.sequence_parallel) if cfg.sequence_parallel is not None
            else tp > 1, pipeline_layout=cfg.pipeline_layout, schedule=cfg.schedule,
            recompute=None if recompute == "__search__" else recompute,
        )  # fmt: skip
        micro = cfg.micro_batch_size or 1
        gbs = _batch(cfg, cfg.seq_len, micro * layout.dp)
        workload = Workload(cfg.seq_len, micro, gbs, cfg.precision)
        plan = plan_layout(config, layout, workload, gpu, model_name=cfg.model,
                           compute_efficiency=cfg.compute_efficiency)  # fmt: skip
        print(json.dumps(plan_json(plan), indent=2) if cfg.json else format_plan(plan), end="")
        return
    result = search_layouts(
        config, cfg.gpus, gpu, seq_len=cfg.seq_len,
        global_batch_size=cfg.global_batch_size,
        global_batch_tokens=None if cfg.global_batch_tokens is None
        else parse_count(cfg.global_batch_tokens),
        precision=cfg.precision,
        micro_batch_sizes=(cfg.micro_batch_size,) if cfg.micro_batch_size else (1, 2, 4),
        zero_stages=(cfg.zero_stage,) if cfg.zero_stage is not None else (1,),
        recompute=(None, "selective", "full") if recompute == "__search__" else (recompute,),
        model_name=cfg.model, compute_efficiency=cfg.compute_efficiency,
    )  # fmt: skip
    if cfg.json:
        print(search_json(result, cfg.top))
    else:
        print(format_search(result, cfg.top), end="")
        if result.fitting:
            print("\nbest layout:\n" + format_plan(result.fitting[0]), end="")


def plan_for_run(
    module: Any, data: Any, strategy: Any, settings: dict[str, Any], gpu: str | GPUSpec | None
) -> Plan | None:
    """The plan of the run `nanotrain fit` is about to start (None when the module has no
    model config the planner knows, e.g. a custom NanoModule).

    The world size is WORLD_SIZE (1 without torchrun); the layout is the strategy's
    (single-device and DDP as plain data parallelism); the device is `gpu`, else the CUDA
    device in use, else this machine's CPU entry.
    """
    resolve = getattr(module, "_resolve_config", None)
    config = getattr(module, "config", None)
    if config is None and resolve is not None:
        try:
            vocab = getattr(data, "vocab_size", None)
        except Exception:  # the data's metadata may not be prepared yet
            vocab = None
        config = resolve(vocab)
    if config is None or not hasattr(config, "num_layers"):
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    recompute = (getattr(module, "hparams", {}) or {}).get("recompute")
    layout = PlanLayout.from_strategy(strategy, world, recompute=recompute)
    micro = int(settings.get("micro_batch_size") or 1)
    gbs = int(settings.get("global_batch_size") or micro * layout.dp)
    precision = settings.get("precision") or "32-true"
    seq_len = int(getattr(data, "seq_len", None) or getattr(config, "max_seq_len", 2048))
    workload = Workload(seq_len, micro, gbs, str(precision))
    return plan_layout(
        config, layout, workload, _device_spec(gpu), model_name=type(module).__name__
    )


def _device_spec(gpu: str | GPUSpec | None) -> GPUSpec:
    """`gpu` as a spec; None: the CUDA device in use (its real memory), else the CPU entry."""
    import torch

    if gpu is not None:
        return gpu_spec(gpu)
    if not torch.cuda.is_available():
        return gpu_spec("cpu")
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    name = props.name.lower()
    base = next((s for k, s in GPUS.items() if k in name), GPUS["h100"])
    return GPUSpec(
        name=props.name, memory_bytes=props.total_memory, peak_flops=base.peak_flops,
        intra_node_bw=base.intra_node_bw, inter_node_bw=base.inter_node_bw,
        gpus_per_node=base.gpus_per_node, mem_bw=base.mem_bw,
    )  # fmt: skip
