"""`nanotrain env`: what this machine offers nanotrain, and the usual misconfigurations.

Collects torch and its CUDA/NCCL/gloo support, Transformer Engine, the GPUs with their memory
and the peak TFLOP/s that MFU is computed against (`nanotrain.callbacks.flops.device_peak_flops`: Lightning's table plus our own rows),
CPU threads, and the strategy, device and backend nanotrain picks by default; then checks them
for problems that waste a run (`environment_warnings`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import platform
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "FP8_MIN_CC",
    "collect_environment",
    "environment_json",
    "environment_warnings",
    "format_environment",
    "run_env",
    "transformer_engine_status",
]

#: Transformer Engine's fp8 kernels need compute capability 8.9 or newer (Ada, Hopper, Blackwell).
FP8_MIN_CC = (8, 9)
_PRECISIONS = ("fp8", "bf16", "fp16", "tf32", "fp32")


def _import_module(name: str) -> Any:
    """`importlib.import_module`, kept as a seam that tests replace to fake installs."""
    return importlib.import_module(name)


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def transformer_engine_status() -> dict[str, Any]:
    """Whether Transformer Engine is installed and importable, and its version.

    `status` is "not installed", "importable", "empty meta package" (the `transformer_engine`
    meta package without its PyTorch extension, whose import raises RuntimeError rather than
    ImportError) or "broken" (another import error).
    """
    dist_version = _package_version("transformer_engine") or _package_version("transformer-engine")
    try:
        module = _import_module("transformer_engine")
    except ImportError as exc:
        status = "broken" if dist_version else "not installed"
        return {"status": status, "version": dist_version, "error": str(exc) or None}
    except RuntimeError as exc:
        return {"status": "empty meta package", "version": dist_version, "error": str(exc)}
    version = getattr(module, "__version__", None) or dist_version
    return {"status": "importable", "version": version, "error": None}


def gpu_info() -> list[dict[str, Any]]:
    """Each visible CUDA device: name, memory (GiB), compute capability and the dense peak
    TFLOP/s per precision from the MFU table (None where the table has no entry)."""
    if not torch.cuda.is_available():
        return []
    # imported here: the table comes with Lightning, which a CPU-only report never needs
    from nanotrain.callbacks.flops import device_peak_flops

    gpus = []
    for index in range(torch.cuda.device_count()):
        name = torch.cuda.get_device_name(index)
        props = torch.cuda.get_device_properties(index)
        peaks = {}
        for precision in _PRECISIONS:
            flops = device_peak_flops(torch.device("cuda", index), precision)
            peaks[precision] = None if flops is None else flops / 1e12
        gpus.append(
            {
                "index": index,
                "name": name,
                "memory_gib": round(props.total_memory / 2**30, 2),
                "compute_capability": [props.major, props.minor],
                "peak_tflops": peaks,
                "in_peak_table": any(v is not None for v in peaks.values()),
            }
        )
    return gpus


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def collect_environment(ranks_per_machine: int | None = None) -> dict[str, Any]:
    """Everything `nanotrain env` reports, as JSON-ready values, with `warnings` filled in.

    Args:
        ranks_per_machine: processes you plan to start per machine (torchrun's
            `--nproc-per-node`); None reads LOCAL_WORLD_SIZE (set by torchrun), else 1.

    Raises:
        ValueError: for `ranks_per_machine` < 1.
    """
    if ranks_per_machine is None:
        ranks_per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if ranks_per_machine < 1:
        raise ValueError(f"ranks_per_machine must be >= 1, got {ranks_per_machine}")
    cuda_available = torch.cuda.is_available()
    nccl_available = dist.is_available() and dist.is_nccl_available()
    nccl_version = None
    if nccl_available and torch.version.cuda is not None:
        try:
            nccl_version = ".".join(str(v) for v in torch.cuda.nccl.version())
        except (RuntimeError, AttributeError, TypeError):
            nccl_version = None
    gpus = gpu_info()
    from nanotrain.strategies import resolve_strategy

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": {"version": torch.__version__, "cuda_build": torch.version.cuda},
        "cuda": {"available": cuda_available, "device_count": len(gpus)},
        "nccl": {"available": nccl_available, "version": nccl_version},
        "gloo": {"available": dist.is_available() and dist.is_gloo_available()},
        "transformer_engine": transformer_engine_status(),
        "gpus": gpus,
        "cpu": {
            "logical_cores": os.cpu_count(),
            "usable_cores": _usable_cores(),
            "torch_threads": torch.get_num_threads(),
            "torch_interop_threads": torch.get_num_interop_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        },
        "ranks_per_machine": ranks_per_machine,
        "defaults": {
            "strategy": type(resolve_strategy("auto")).__name__,
            "strategy_under_torchrun": "DDPStrategy",
            "device": "cuda:0" if cuda_available else "cpu",
            "backend": "nccl" if cuda_available else "gloo",
        },
    }
    env["warnings"] = environment_warnings(env)
    return env


def environment_warnings(env: dict[str, Any]) -> list[str]:
    """The misconfigurations visible in `env` (as `collect_environment` builds it), each with
    what to do about it."""
    warnings: list[str] = []
    cpu, ranks = env["cpu"], env["ranks_per_machine"]
    threads, cores = cpu["torch_threads"], cpu["usable_cores"]
    if ranks > 1 and ranks * threads > cores:
        per_rank = max(1, cores // ranks)
        warnings.append(
            f"thread oversubscription: {ranks} ranks per machine x {threads} intra-op threads "
            f"= {ranks * threads} threads on {cores} usable cores; CPU work will crawl. Set "
            f"OMP_NUM_THREADS={per_rank} (or torch.set_num_threads({per_rank})) in each rank"
        )
    gpus = env["gpus"]
    cuda_build = env["torch"]["cuda_build"]
    if cuda_build is not None and not gpus:
        warnings.append(
            f"torch is a CUDA {cuda_build} build but no GPU is visible: training will run on "
            "the CPU. Check `nvidia-smi`, the driver and CUDA_VISIBLE_DEVICES, or install the "
            "CPU build of torch if this machine has no GPU"
        )
    te = env["transformer_engine"]
    if te["status"] == "empty meta package":
        warnings.append(
            "transformer_engine is installed without its PyTorch extension (importing it "
            "raises RuntimeError): `pip install 'transformer_engine[pytorch]'` on a CUDA "
            "machine, or `pip uninstall transformer_engine` to train without it"
        )
    if te["status"] == "importable":
        fp8_capable = [g for g in gpus if tuple(g["compute_capability"]) >= FP8_MIN_CC]
        if not gpus:
            warnings.append(
                "Transformer Engine is importable but no CUDA GPU is visible: its layers and "
                "fp8 run only on GPUs; nanotrain will not use it here"
            )
        elif not fp8_capable:
            names = ", ".join(sorted({g["name"] for g in gpus}))
            warnings.append(
                f"Transformer Engine is importable but no GPU here supports its fp8 ({names}); "
                f"fp8 needs compute capability {FP8_MIN_CC[0]}.{FP8_MIN_CC[1]}+ (Ada, Hopper, "
                "Blackwell): train in bf16 instead"
            )
    return warnings


def _peaks_text(peaks: dict[str, float | None]) -> str:
    known = [f"{k} {v:g}" for k, v in peaks.items() if v is not None]
    return ", ".join(known) if known else "not in the peak table (pass peak_flops_per_device)"


def format_environment(env: dict[str, Any]) -> str:
    """`env` as the plain-text report `nanotrain env` prints."""
    te = env["transformer_engine"]
    nccl = env["nccl"]
    cpu, defaults = env["cpu"], env["defaults"]
    lines = [
        f"python               {env['python']} ({env['platform']})",
        f"torch                {env['torch']['version']}"
        f" (CUDA build: {env['torch']['cuda_build'] or 'none, CPU only'})",
        f"CUDA available       {env['cuda']['available']}"
        f" ({env['cuda']['device_count']} device(s))",
        f"NCCL                 {'yes' if nccl['available'] else 'no'}"
        + (f" {nccl['version']}" if nccl["version"] else ""),
        f"gloo                 {'yes' if env['gloo']['available'] else 'no'}",
        f"Transformer Engine   {te['status']}" + (f" ({te['version']})" if te["version"] else ""),
        f"CPU                  {cpu['logical_cores']} logical cores, {cpu['usable_cores']} usable;"
        f" torch threads {cpu['torch_threads']} (interop {cpu['torch_interop_threads']}),"
        f" OMP_NUM_THREADS={cpu['OMP_NUM_THREADS'] or 'unset'}",
        f"ranks per machine    {env['ranks_per_machine']}",
        f"default strategy     {defaults['strategy']} on {defaults['device']}"
        f" ({defaults['strategy_under_torchrun']} under torchrun with several processes)",
        f"default backend      {defaults['backend']}",
    ]
    if not env["gpus"]:
        lines.append("GPUs                 none")
    for gpu in env["gpus"]:
        cc = ".".join(str(v) for v in gpu["compute_capability"])
        lines.append(
            f"GPU {gpu['index']:<16} {gpu['name']}, {gpu['memory_gib']:g} GiB, compute {cc};"
            f" peak TFLOP/s for MFU: {_peaks_text(gpu['peak_tflops'])}"
        )
    if env["warnings"]:
        lines.append("")
        lines += [f"WARNING: {w}" for w in env["warnings"]]
    else:
        lines.append("no warnings")
    return "\n".join(lines) + "\n"


def environment_json(env: dict[str, Any]) -> str:
    """`env` as indented JSON (what `nanotrain env --json` prints)."""
    return json.dumps(env, indent=2) + "\n"


def run_env(argv: list[str]) -> None:
    """`nanotrain env [--json] [--ranks_per_machine N]`: torch, CUDA, NCCL, gloo, Transformer
    Engine, GPUs with the peak TFLOP/s used for MFU, CPU threads, default strategy and
    backend, and warnings for common misconfigurations."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(prog="nanotrain env", description=run_env.__doc__)
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument(
        "--ranks_per_machine",
        type=int | None,
        default=None,
        help="processes per machine to check threads for (default: LOCAL_WORLD_SIZE or 1)",
    )
    cfg = parser.parse_args(argv)
    env = collect_environment(cfg.ranks_per_machine)
    print(environment_json(env) if cfg.json else format_environment(env), end="")
