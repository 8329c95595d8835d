"""Strategies: how one training step is laid out across processes."""

from nanotrain.strategies.base import DataShard, StepOutput, Strategy
from nanotrain.strategies.ddp import DDPStrategy
from nanotrain.strategies.fsdp import FSDPStrategy
from nanotrain.strategies.megatron import MegatronStrategy
from nanotrain.strategies.optimizers import OptimizerSetup, SchedulerConfig
from nanotrain.strategies.replicated import ReplicatedStrategy
from nanotrain.strategies.single_device import SingleDeviceStrategy


def resolve_strategy(strategy: "Strategy | str", accelerator: str = "auto") -> Strategy:
    """Return a Strategy for an instance or a name: "auto", "single", "ddp", "megatron"
    (with its defaults: tp=pp=ep=1, i.e. data parallel over every process), "fsdp" (ZeRO-3
    over every process, `FSDPStrategy`) or "fsdp_cpu_offload" (the same with CPU offload).

    "auto" picks DDP when launched by torchrun with more than one process, else one device.
    A named strategy trains on the CPU for accelerator "cpu", on CUDA for "gpu"/"cuda", and
    on CUDA when available for "auto" (an instance is returned as it is).
    """
    import os

    if isinstance(strategy, Strategy):
        return strategy
    name = str(strategy).lower()
    if name == "auto":
        name = "ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "single"
    device = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}.get(accelerator)
    backend = {"cpu": "gloo", "cuda": "nccl"}.get(device or "")
    if name in ("single", "single_device"):
        return SingleDeviceStrategy(device)
    if name == "ddp":
        return DDPStrategy(backend)
    if name == "megatron":
        return MegatronStrategy(backend=backend)
    if name in ("fsdp", "fsdp_cpu_offload"):
        return FSDPStrategy(cpu_offload=name == "fsdp_cpu_offload", process_group_backend=backend)
    raise ValueError(
        f"unknown strategy {strategy!r}; use 'auto', 'single', 'ddp', 'megatron', 'fsdp', "
        "'fsdp_cpu_offload' or a Strategy instance"
    )


__all__ = [
    "DataShard",
    "DDPStrategy",
    "FSDPStrategy",
    "MegatronStrategy",
    "OptimizerSetup",
    "ReplicatedStrategy",
    "SchedulerConfig",
    "SingleDeviceStrategy",
    "StepOutput",
    "Strategy",
    "resolve_strategy",
]
