"""`nanotrain plan` and `nanotrain fit --plan`: the planner from the command line."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from typing import Any

from nanotrain.parallel.mesh import validate_layout
from nanotrain.planning.gpus import GPUS, GPUSpec, gpu_spec
from nanotrain.planning.layout import PlanLayout, Workload
from nanotrain.planning.plan import Plan, plan_layout, suggest_fp8_saves
from nanotrain.planning.report import format_plan, format_search, plan_json, search_json
from nanotrain.planning.search import SEARCH_RECOMPUTE, search_layouts
from nanotrain.planning.seq_fit import format_seq_fits, seq_len_fits
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


def _config(model: str, overrides: dict[str, Any] | None = None) -> Any:
    """The model config `--model` names (a preset, a model folder or a config file: no
    weights needed), with `--model_overrides` replacing fields.

    Raises:
        ValueError: an unknown preset, a field the config does not have, or a config the
            overrides make inconsistent; FileNotFoundError: a path with no config.
    """
    from nanotrain.interop import weights as model_io
    from nanotrain.models import presets
    from nanotrain.models.config import unknown_fields_error

    overrides = dict(overrides or {})
    if model in presets.names():
        return presets.get(model, **overrides)
    if not (os.sep in model or model.endswith(".json") or os.path.exists(model)):
        presets.get(model)  # raises: unknown preset, listing them
    config = model_io.read_model_config(model)
    error = unknown_fields_error(type(config), overrides, "--model_overrides")
    if error is not None:
        raise error
    return dataclasses.replace(config, **overrides)


_LAYOUT_FLAGS = ("tp", "pp", "ep", "dp", "cp", "virtual_pp", "sequence_parallel", "schedule",
                 "pipeline_layout", "overlap_forward_backward")  # fmt: skip


def _parser() -> Any:
    from nanotrain.cli.parser import new_parser

    p = new_parser(prog="nanotrain plan", description=run_plan.__doc__)

    def flag(name: str, **kwargs: Any) -> None:
        # both spellings, as the issue's `--seq-len` and jsonargparse's `--seq_len`
        dashed = name.replace("_", "-")
        names = [f"--{name}"] + ([f"--{dashed}"] if dashed != name else [])
        p.add_argument(*names, dest=name, **kwargs)

    flag("model", type=str, required=True,
         help="a preset name, a model folder, or a config file (a transformers config.json or "
         "nanotrain's model_config.json): no weights needed")  # fmt: skip
    flag(
        "model_overrides",
        type=dict | None,
        default=None,
        help='config fields to replace, as JSON: \'{"num_layers": 8, "n_routed_experts": 64}\'',
    )
    flag("gpus", type=int, required=True, help="number of GPUs (the world size)")
    flag("gpu", type=str, default="h100", help="h100|h200|h800|a100|b200|cpu, or a JSON spec")
    flag("seq_len", type=int, required=True, help="tokens per sequence")
    flag("global_batch_tokens", type=str | None, default=None, help="tokens per step, e.g. "
         "15M (rounded to whole microbatches on every replica)")  # fmt: skip
    flag("global_batch_size", type=int | None, default=None,
         help="sequences per step (instead of --global-batch-tokens)")  # fmt: skip
    flag("precision", type=str, default="bf16-mixed", help="a Trainer precision name")
    flag("kernels", type=str, default="fused",
         help="fused|compiled|eager: fused norms and FlashAttention-3 (default), "
         "torch.compile around SDPA (FlashAttention-2), or eager PyTorch ops and SDPA; "
         "prices one layout")  # fmt: skip
    flag("micro_batch_size", type=int | None, default=None,
         help="sequences per microbatch (searching: 1, 2 and 4)")  # fmt: skip
    for name, what in (("tp", "tensor"), ("pp", "pipeline"), ("ep", "expert"), ("dp", "data")):
        flag(name, type=int | None, default=None, help=f"{what}-parallel size (fixes the layout)")
    flag("cp", type=int | None, default=None,
         help="context-parallel size: ranks that share each sequence (fixes the layout)")  # fmt: skip
    flag("virtual_pp", type=int | None, default=None, help="chunks per pipeline rank")
    flag("sequence_parallel", type=bool | None, default=None, help="default: on when tp > 1")
    flag(
        "schedule",
        type=str | None,
        default=None,
        help="gpipe|1f1b|interleaved_1f1b|zb_1f1b|zb_interleaved_1f1b|zb_h1|dualpipev",
    )
    flag("overlap_forward_backward", type=bool | None, default=None,
         help="run paired forward and backward chunks side by side (two chunks per rank)")  # fmt: skip
    flag("node_limited_dispatch", type=bool | None, default=None,
         help="a token crosses to another node once per node (default: where ep spans "
         "nodes); false: once per expert")  # fmt: skip
    flag("pipeline_layout", type=list[int] | None, default=None, help="layers per chunk")
    flag("zero_stage", type=int | None, default=None,
         help="0, 1, 2 or 3 (fixed layout default 0; the search tries 1 and 3)")  # fmt: skip
    flag("cpu_offload", type=bool | None, default=None,
         help="ZeRO-3's shards, gradients and optimizer state on the host (default: off for "
         "a fixed layout; the search tries it where nothing else fits)")  # fmt: skip
    flag("reshard_after_forward", type=bool, default=True,
         help="ZeRO-3 gathers each layer again in backward (false: keeps it gathered)")  # fmt: skip
    flag("reduce_scatter_every_microbatch", type=bool, default=False,
         help="ZeRO-3 (pp=1) reduce-scatters every microbatch instead of accumulating whole "
         "gradients (a fixed layout; the search tries it where nothing else fits)")  # fmt: skip
    flag("recompute_full_layers", type=int, default=0,
         help="the first N layers of each pipeline chunk recompute fully, the rest "
         "--recompute (a fixed layout)")  # fmt: skip
    flag("recompute", type=str | None, default=None,
         help="none|light|selective|full (default: none for a fixed layout; searching tries "
         "none, then light, then selective, then full)")  # fmt: skip
    flag("fp8_expert_activations", type=bool, default=False,
         help="the routed experts keep their rows and SwiGLU inputs in fp8 for backward")  # fmt: skip
    flag("fp8_dispatch", type=bool, default=False,
         help="the routed copies cross the ep group in fp8 with tile scales")  # fmt: skip
    flag("fp8_expert_gemms", type=bool, default=False,
         help="price the routed experts' GEMMs at the fp8 peak of an fp8 precision, as "
         "Megatron-Core's grouped GEMMs run them (a fixed layout; nanotrain does not run "
         "this yet: the plan says so in a note)")  # fmt: skip
    flag("compute_efficiency", type=float, default=None,
         help="fraction of peak FLOP/s the matmuls reach (default: the measured 0.75 of "
         "nanotrain.planning.calibration.GEMM_EFFICIENCY)")  # fmt: skip
    flag("json", action="store_true", help="print JSON")
    flag("top", type=int, default=15, help="layouts to list when searching")
    flag("workers", type=int, default=1,
         help="processes a search prices the candidates in (same result as one)")  # fmt: skip
    return p


def _check_args(cfg: Any) -> None:
    """Refuse inputs that would otherwise be ignored or make every layout fail alike.

    Raises:
        ValueError: naming the flag and what it takes.
    """
    for name in ("gpus", "seq_len", "micro_batch_size", "global_batch_size", "top", "cp"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if (cfg.global_batch_size is None) == (cfg.global_batch_tokens is None):
        raise ValueError("give one of --global-batch-tokens (e.g. 4M) and --global-batch-size")
    if cfg.zero_stage is not None and cfg.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"--zero_stage must be 0, 1, 2 or 3, got {cfg.zero_stage}")
    if cfg.cpu_offload and cfg.zero_stage not in (None, 3):
        raise ValueError(f"--cpu_offload true needs --zero_stage 3, got {cfg.zero_stage}")
    if cfg.compute_efficiency is not None and not 0 < cfg.compute_efficiency <= 1:
        raise ValueError(f"--compute_efficiency must be in (0, 1], got {cfg.compute_efficiency}")
    if cfg.recompute not in (None, "none", "None", "light", "selective", "full"):
        raise ValueError(
            f"--recompute must be none, light, selective or full, got {cfg.recompute!r}"
        )
    Workload(cfg.seq_len, 1, 1, cfg.precision, kernels=cfg.kernels)  # the names


def _batch(cfg: Any, per_step: int) -> int:
    """Sequences per step: as given, or tokens / seq_len rounded to a multiple of per_step."""
    if cfg.global_batch_size is not None:
        return cfg.global_batch_size
    sequences = parse_count(cfg.global_batch_tokens) / cfg.seq_len
    return max(1, round(sequences / per_step)) * per_step


def run_plan(argv: list[str]) -> None:
    """`nanotrain plan --model M --gpus N --gpu KIND --seq-len S --global-batch-tokens T
    [--tp .. --pp .. --ep ..]`: per-GPU memory, FLOPs, communication and step time of one
    layout (when any layout flag is given) or of every layout that fits, best first."""
    cfg = _parser().parse_args(argv)
    _check_args(cfg)
    config, gpu = _config(cfg.model, cfg.model_overrides), gpu_spec(cfg.gpu)
    recompute = None if cfg.recompute in ("none", "None") else cfg.recompute
    fixed = any(getattr(cfg, k) is not None for k in _LAYOUT_FLAGS)
    if cfg.recompute_full_layers and not fixed:
        raise ValueError(
            "--recompute_full_layers prices one layout: give its sizes too (--tp, --pp, "
            "--ep, ...); the search tries one recompute mode for every layer"
        )
    if cfg.reduce_scatter_every_microbatch and not fixed:
        raise ValueError(
            "--reduce_scatter_every_microbatch prices one layout: give its sizes too (--tp, "
            "--pp, --dp, ...); the search tries it for ZeRO-3 where nothing else fits"
        )
    if cfg.fp8_expert_gemms and not fixed:
        raise ValueError(
            "--fp8_expert_gemms prices one layout: give its sizes too (--tp, --pp, --ep, ...); "
            "the search does not offer it (no nanotrain precision runs the routed experts' "
            "GEMMs in fp8 yet)"
        )
    if cfg.node_limited_dispatch is not None and not fixed:
        raise ValueError(
            "--node_limited_dispatch prices one layout: give its sizes too (--tp, --pp, --ep, "
            "...); the search prices node-limited dispatch wherever an ep group spans nodes"
        )
    if cfg.kernels != "fused" and not fixed:
        raise ValueError(
            f"--kernels {cfg.kernels} prices one layout: give its sizes too (--tp, --pp, "
            "--dp, ...); the search prices fused kernels"
        )
    if fixed:
        tp, pp, ep, cp = cfg.tp or 1, cfg.pp or 1, cfg.ep or 1, cfg.cp or 1
        # the strategy's own check of the sizes against the world and the model, with the
        # cp ranks among the data-parallel ones (experts are drawn from dp x cp)
        dp_cp = validate_layout(
            cfg.gpus, tp, pp, ep, None if cfg.dp is None else cfg.dp * cp, **model_dims(config)
        )
        if dp_cp % cp:
            raise ValueError(
                f"--cp {cp} does not divide the {dp_cp} ranks left by tp * pp on "
                f"{cfg.gpus} GPUs; pick a cp that does"
            )
        layout = PlanLayout(
            tp=tp, pp=pp, ep=ep, dp=dp_cp // cp, cp=cp,
            virtual_pp=cfg.virtual_pp or 1,
            zero_stage=cfg.zero_stage if cfg.zero_stage is not None
            else 3 if cfg.cpu_offload else 0,
            cpu_offload=bool(cfg.cpu_offload), reshard_after_forward=cfg.reshard_after_forward,
            reduce_scatter_every_microbatch=cfg.reduce_scatter_every_microbatch,
            sequence_parallel=bool(cfg.sequence_parallel) if cfg.sequence_parallel is not None
            else tp > 1, pipeline_layout=cfg.pipeline_layout, schedule=cfg.schedule,
            recompute=recompute, recompute_full_layers=cfg.recompute_full_layers,
            overlap_forward_backward=bool(cfg.overlap_forward_backward),
            node_limited_dispatch=cfg.node_limited_dispatch,
            fp8_expert_activations=cfg.fp8_expert_activations,
            fp8_dispatch=cfg.fp8_dispatch,
            fp8_expert_gemms=cfg.fp8_expert_gemms,
        )  # fmt: skip
        micro = cfg.micro_batch_size or 1
        workload = Workload(
            cfg.seq_len,
            micro,
            _batch(cfg, micro * layout.dp),
            cfg.precision,
            kernels=cfg.kernels,
        )
        priced = dict(model_name=cfg.model, compute_efficiency=cfg.compute_efficiency)
        plan = plan_layout(config, layout, workload, gpu, **priced)
        plan = suggest_fp8_saves(plan, config, **priced)
        _print_plan(plan, config, priced, cfg.json)
        return
    result = search_layouts(
        config, cfg.gpus, gpu, seq_len=cfg.seq_len,
        global_batch_size=cfg.global_batch_size,
        global_batch_tokens=None if cfg.global_batch_tokens is None
        else parse_count(cfg.global_batch_tokens),
        precision=cfg.precision,
        micro_batch_sizes=(cfg.micro_batch_size,) if cfg.micro_batch_size else (1, 2, 4),
        zero_stages=(cfg.zero_stage,) if cfg.zero_stage is not None
        else (3,) if cfg.cpu_offload else (1, 3),
        cpu_offload=cfg.cpu_offload, reshard_after_forward=cfg.reshard_after_forward,
        recompute=SEARCH_RECOMPUTE if cfg.recompute is None else (recompute,),
        fp8_expert_activations=cfg.fp8_expert_activations,
        fp8_dispatch=cfg.fp8_dispatch,
        model_name=cfg.model, compute_efficiency=cfg.compute_efficiency,
        workers=cfg.workers,
    )  # fmt: skip
    if cfg.json:
        print(search_json(result, cfg.top))
    else:
        print(format_search(result, cfg.top), end="")
        if result.fitting:
            print("\nbest layout:")
            priced = dict(model_name=cfg.model, compute_efficiency=cfg.compute_efficiency)
            _print_plan(result.fitting[0], config, priced, False)


def _print_plan(plan: Plan, config: Any, priced: dict[str, Any], as_json: bool) -> None:
    """The plan as text or JSON, with the sequence lengths its layout fits
    (`nanotrain.planning.seq_fit`; JSON key "seq_len_fits")."""
    fits = seq_len_fits(config, plan, **priced)
    if as_json:
        out = plan_json(plan)
        out["seq_len_fits"] = [
            {"seq_len": f.seq_len, "memory": f.memory, "fits": f.fits, "reason": f.reason}
            for f in fits
        ]
        print(json.dumps(out, indent=2))
        return
    print(format_plan(plan), end="")
    print(format_seq_fits(fits, getattr(config, "max_seq_len", None)), end="")


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
    hparams = getattr(module, "hparams", {}) or {}
    layout = PlanLayout.from_strategy(
        strategy,
        world,
        hparams.get("recompute"),
        hparams.get("recompute_full_layers", 0),
        hparams.get("fp8_expert_activations", False),
        hparams.get("fp8_dispatch", False),
    )
    # the micro batch the run will read: the Trainer's, else its data's loaders' (as the
    # Trainer resolves it: nanotrain.trainer.loaders)
    micro = int(settings.get("micro_batch_size") or getattr(data, "loader_batch_size", None) or 1)
    accumulate = int(settings.get("accumulate_grad_batches") or 1)
    gbs = int(settings.get("global_batch_size") or micro * accumulate * layout.dp)
    seq_len = int(getattr(data, "seq_len", None) or getattr(config, "max_seq_len", 2048))
    # the Trainer's precision as given: a name, an alias or a plugin object
    workload = Workload(seq_len, micro, gbs, settings.get("precision") or "32-true")
    device = _device_spec(gpu)
    plan = plan_layout(config, layout, workload, device, model_name=type(module).__name__)
    plan = suggest_fp8_saves(plan, config, model_name=type(module).__name__)
    if not is_megatron(strategy):
        plan.notes.append(
            f"{type(strategy).__name__} is priced as MegatronStrategy(dp={layout.dp}); torch "
            "DDP also keeps a second copy of the gradients in its buckets, not counted here"
        )
    return plan


def is_megatron(strategy: Any) -> bool:
    """Whether `strategy` is a MegatronStrategy (the layouts the planner models exactly)."""
    from nanotrain.strategies.megatron import MegatronStrategy

    return isinstance(strategy, MegatronStrategy)


def _device_spec(gpu: str | GPUSpec | None) -> GPUSpec:
    """`gpu` as a spec; None: the CUDA device in use (its real memory), else the CPU entry."""
    import torch

    if gpu is not None:
        return gpu_spec(gpu)
    if not torch.cuda.is_available():
        return gpu_spec("cpu")
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    name = props.name.lower()
    base = next((s for k, s in GPUS.items() if k in name), None)
    if base is None:
        warnings.warn(
            f"the planner has no entry for {props.name}; it prices it with the H100's FLOP/s "
            "and links (pass --plan_gpu with a JSON spec for exact figures)",
            stacklevel=2,
        )
        base = GPUS["h100"]
    return GPUSpec(
        name=props.name, memory_bytes=props.total_memory, peak_flops=base.peak_flops,
        intra_node_bw=base.intra_node_bw, inter_node_bw=base.inter_node_bw,
        gpus_per_node=base.gpus_per_node, mem_bw=base.mem_bw,
    )  # fmt: skip
