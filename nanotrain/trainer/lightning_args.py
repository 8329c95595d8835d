"""Lightning Trainer arguments about where a job runs (`accelerator`, `devices`, `num_nodes`)
and the ones nanotrain does not take, each with what to do instead.

nanotrain's processes come from torchrun, so `devices` and `num_nodes` cannot choose them:
they are accepted when they describe the job as it was launched and refused otherwise.
`accelerator` picks the device of a strategy given by name and must agree with a strategy
given as an object.
"""

from __future__ import annotations

import os
from dataclasses import fields
from typing import Any

ACCELERATORS = ("auto", "cpu", "gpu", "cuda")

# Lightning Trainer arguments nanotrain does not take, with what to use instead
REFUSED_ARGUMENTS = {
    "limit_test_batches": "pass a shorter test DataLoader",
    "limit_predict_batches": "pass a shorter predict DataLoader",
    "min_epochs": "nanotrain has no lower bound on training; drop it (EarlyStopping's "
    "patience delays a stop)",
    "min_steps": "nanotrain has no lower bound on training; drop it (EarlyStopping's "
    "patience delays a stop)",
    "profiler": "add nanotrain.callbacks.TorchProfiler (docs/callbacks.md)",
    "detect_anomaly": "wrap your training_step in torch.autograd.detect_anomaly()",
    "benchmark": "set torch.backends.cudnn.benchmark yourself before fit",
    "inference_mode": "validate/test/predict run under torch.no_grad(); drop it",
    "use_distributed_sampler": "nanotrain always gives each data-parallel replica its "
    "share of the data (as Lightning's DistributedSampler); drop it",
    "sync_batchnorm": "convert the model with torch.nn.SyncBatchNorm.convert_sync_batchnorm "
    "yourself",
    "plugins": "pass a precision plugin as precision=...; other plugins have no nanotrain "
    "counterpart",
    "barebones": "pass enable_progress_bar=False, enable_monitors=False, logger=False",
    "model_registry": "no nanotrain counterpart; drop it",
}


def unknown_setting_error(name: str, known: list[str]) -> TypeError:
    """The TypeError for a Trainer keyword nanotrain does not take: for Lightning's own
    arguments, what to do instead; else the list of known settings."""
    hint = REFUSED_ARGUMENTS.get(name)
    if hint:
        return TypeError(
            f"Trainer got Lightning's argument {name!r}, which nanotrain does not take: {hint}"
        )
    return TypeError(f"Trainer got an unknown argument {name!r}; settings are: {', '.join(known)}")


def launched_sizes() -> tuple[int, int]:
    """(processes per node, nodes) of this job as torchrun launched it; (1, 1) without it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return per_node, max(1, world // max(1, per_node))


def check_launch_arguments(accelerator: str, devices: Any, num_nodes: int | None) -> None:
    """Refuse `accelerator`, `devices` and `num_nodes` values that do not describe this job.

    Args:
        accelerator: "auto", "cpu", "gpu" or "cuda".
        devices: "auto", -1 (all), or the number of processes per node ("2" as a string too).
        num_nodes: None (as launched) or the number of nodes.

    Raises:
        ValueError: an unknown accelerator, a device list, or a count that differs from the
            launch, with the torchrun flag that sets it.
    """
    if accelerator not in ACCELERATORS:
        raise ValueError(
            f"accelerator={accelerator!r}: nanotrain trains on {', '.join(ACCELERATORS[1:])} "
            "(or 'auto')"
        )
    per_node, nodes = launched_sizes()
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, list | tuple) or (isinstance(devices, str) and devices != "auto"):
        raise ValueError(
            f"devices={devices!r}: nanotrain does not pick devices; choose the GPUs with "
            "CUDA_VISIBLE_DEVICES and start one process per device with torchrun "
            "--nproc-per-node N (devices='auto' or N then agrees)"
        )
    if isinstance(devices, int) and devices != -1 and devices != per_node:
        raise ValueError(
            f"devices={devices} but this job runs {per_node} process(es) per node; nanotrain "
            f"does not start processes: launch with torchrun --nproc-per-node {devices}, or "
            "pass devices='auto'"
        )
    if num_nodes is not None and num_nodes != nodes:
        raise ValueError(
            f"num_nodes={num_nodes} but this job runs on {nodes} node(s); launch with "
            f"torchrun --nnodes {num_nodes}, or drop num_nodes"
        )


def check_accelerator(accelerator: str, device_type: str, strategy_name: str) -> None:
    """Refuse an `accelerator` that differs from the device the strategy trains on.

    Raises:
        ValueError: e.g. accelerator="gpu" with a strategy that trains on the CPU.
    """
    wanted = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}.get(accelerator)
    if wanted is not None and wanted != device_type:
        raise ValueError(
            f"accelerator={accelerator!r} but {strategy_name} trains on {device_type}: pass the "
            f"strategy for that device (e.g. SingleDeviceStrategy({wanted!r}), or "
            f"DDPStrategy(backend={'nccl' if wanted == 'cuda' else 'gloo'!r})), or drop "
            "accelerator"
        )


def setting_names(config_class: Any) -> list[str]:
    """The names of the settings of a dataclass config (for error messages)."""
    return [f.name for f in fields(config_class)]
