"""`FSDPStrategy`: Lightning's FSDP spelling for nanotrain's ZeRO-3 (`MegatronStrategy` with
``zero_stage=3`` and every rank data parallel), with Lightning's common arguments accepted
with their meaning or refused by name.

Lightning's FSDPStrategy drives FSDP1; nanotrain's ZeRO-3 is torch's FSDP2 with a fixed
wrapping rule (`nanotrain.parallel.fully_sharded`). What maps:

- ``sharding_strategy``: "FULL_SHARD" (ZeRO-3, parameters freed after each layer's forward),
  "SHARD_GRAD_OP" (ZeRO-3 keeping each layer's gathered parameters from forward to backward,
  FSDP2's ``reshard_after_forward=False``), "NO_SHARD" (plain data parallelism,
  ``zero_stage=0``); the hybrid strategies are refused (use `MegatronStrategy`);
- ``cpu_offload``: a bool or an object with ``offload_params`` (FSDP1's `CPUOffload`);
- ``state_dict_type``: "sharded" (each rank writes its shard; loads under any layout); "full"
  is refused (export one file with ``nanotrain export``);
- ``process_group_backend``, ``timeout``: the backend and collective timeout;
- ``mixed_precision``, ``auto_wrap_policy``, ``activation_checkpointing(_policy)``,
  ``device_mesh``, Lightning's plugin objects and FSDP1 keyword arguments: refused by name,
  with what to use instead.
"""

from __future__ import annotations

import datetime
from typing import Any

from nanotrain.strategies.megatron import MegatronStrategy

_SHARDING = {
    "FULL_SHARD": (3, True),
    "SHARD_GRAD_OP": (3, False),
    "NO_SHARD": (0, True),
}
_HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
_INSTEAD = {
    "mixed_precision": "pass Trainer(precision='bf16-true' | 'bf16-mixed' | '16-mixed'): the "
    "precision plugin sets FSDP2's MixedPrecisionPolicy",
    "auto_wrap_policy": "nanotrain wraps every decoder layer, every routed-expert stack and "
    "the root (fixed rule, docs/parallelism.md); leave it None",
    "activation_checkpointing": "use the model's recompute option, e.g. "
    "LanguageModelModule(recompute='full' | 'selective' | 'light')",
    "activation_checkpointing_policy": "use the model's recompute option, e.g. "
    "LanguageModelModule(recompute='full' | 'selective' | 'light')",
    "device_mesh": "use MegatronStrategy(tp=..., ep=..., zero_stage=3) for a multi-axis layout",
    "accelerator": "pass Trainer(accelerator=...)",
    "parallel_devices": "launch one process per device with torchrun",
    "cluster_environment": "launch with torchrun (RANK, WORLD_SIZE, MASTER_ADDR are read)",
    "checkpoint_io": "checkpoints are written by nanotrain's own format (docs/checkpointing.md)",
    "precision_plugin": "pass Trainer(precision=...)",
    "precision": "pass Trainer(precision=...)",
}


class FSDPStrategy(MegatronStrategy):
    """ZeRO-3 over every rank (tp = pp = ep = 1), under Lightning's FSDPStrategy name.

    Args:
        sharding_strategy: "FULL_SHARD" (default), "SHARD_GRAD_OP" or "NO_SHARD" (a string or
            torch's `ShardingStrategy` enum); see the module docstring.
        cpu_offload: offload parameter, gradient and optimizer shards to the host.
        state_dict_type: "sharded" only (the default here; Lightning's default "full" is
            refused when asked for explicitly).
        process_group_backend: "nccl", "gloo" or None (see `MegatronStrategy`'s ``backend``).
        timeout: collective timeout (a `datetime.timedelta` or seconds).
        **kwargs: Lightning's other FSDP arguments; every one that is not None is refused.

    Raises:
        ValueError: an unknown or hybrid sharding strategy, ``state_dict_type="full"``, or an
            argument nanotrain does not take (named, with what to use instead).
    """

    def __init__(
        self,
        sharding_strategy: Any = "FULL_SHARD",
        cpu_offload: Any = False,
        state_dict_type: str = "sharded",
        process_group_backend: str | None = None,
        timeout: datetime.timedelta | float | None = None,
        **kwargs: Any,
    ) -> None:
        for name, value in kwargs.items():
            if value is None or (name == "activation_checkpointing" and not value):
                continue
            instead = _INSTEAD.get(name)
            if instead is None:
                raise ValueError(
                    f"FSDPStrategy does not take {name}={value!r} (an FSDP1 option; nanotrain "
                    "runs FSDP2 with its own wrapping rule, docs/parallelism.md); remove it"
                )
            raise ValueError(f"FSDPStrategy does not take {name}; {instead}")
        zero_stage, reshard = _sharding(sharding_strategy)
        if state_dict_type != "sharded":
            raise ValueError(
                f"state_dict_type={state_dict_type!r} is not supported: nanotrain checkpoints "
                "are sharded (every rank writes its part) and load under any layout or world "
                "size; for one consolidated file run `nanotrain export` on the checkpoint. "
                "Use state_dict_type='sharded'"
            )
        offload = bool(getattr(cpu_offload, "offload_params", cpu_offload))
        if offload and zero_stage != 3:
            raise ValueError(
                "cpu_offload=True needs sharding_strategy 'FULL_SHARD' or "
                "'SHARD_GRAD_OP' (NO_SHARD keeps whole parameters on the device)"
            )
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        super().__init__(
            zero_stage=zero_stage,
            cpu_offload=offload,
            reshard_after_forward=reshard,
            backend=process_group_backend,
            timeout_s=timeout,
        )
        self.sharding_strategy = _sharding_name(sharding_strategy)
        self.state_dict_type = state_dict_type


def _sharding_name(value: Any) -> str:
    return str(getattr(value, "name", value)).upper()


def _sharding(value: Any) -> tuple[int, bool]:
    """(zero_stage, reshard_after_forward) of a Lightning/FSDP1 sharding strategy."""
    name = _sharding_name(value)
    if name in _HYBRID:
        raise ValueError(
            f"sharding_strategy={name!r} (hybrid sharding) is not supported; shard over every "
            "rank with 'FULL_SHARD', or lay out the axes with MegatronStrategy(tp=..., "
            "zero_stage=3)"
        )
    if name not in _SHARDING:
        raise ValueError(f"unknown sharding_strategy {value!r}; use one of {sorted(_SHARDING)}")
    return _SHARDING[name]
