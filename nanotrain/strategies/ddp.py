"""Data parallelism with `torch.nn.parallel.DistributedDataParallel`, launched by torchrun."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from nanotrain.parallel.data_parallel import FlatLayout, GradBuckets, backward_order
from nanotrain.parallel.grads import all_reduce_coalesced
from nanotrain.strategies.base import DataShard
from nanotrain.strategies.megatron_grads import bucket_numel_for
from nanotrain.strategies.rendezvous import (
    LaunchedRanks,
    join_process_group,
    process_device,
)
from nanotrain.strategies.replicated import ReplicatedStrategy, TrainingStepWrapper

#: a DDP runtime-statistics sample rate no run reaches (the reducer takes a C int)
_NEVER = 2**31 - 1
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class DDPStrategy(LaunchedRanks, ReplicatedStrategy):
    """One model replica per process; gradients averaged across processes by DDP.

    Reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), or
    uses a process group that is already initialized. Uses NCCL on GPU and gloo on CPU; an
    NCCL group it creates is bound to GPU LOCAL_RANK (`device_id`).
    Gradients are synchronized only on the last microbatch of each optimizer step. Parameters
    frozen when DDP wraps the module and made trainable later (Lightning's `BaseFinetuning`
    unfreezing a backbone) are averaged after that backward by this strategy, in module order.

    With low-precision parameters (bf16-true) torch's DDP is not used: the fp32 main grads live
    in one flat buffer cut into buckets of `bucket_cap_mb` MiB of parameters (`GradBuckets`,
    as MegatronStrategy's data parallelism), each all-reduced in the precision's reduce dtype
    as soon as the last microbatch's backward completes it; parameters that get no gradient
    need no flag there (their buckets are sent after backward).

    Args:
        backend: "nccl", "gloo" or None (pick from the device).
        find_unused_parameters: forwarded to DDP; needed when some parameters get no gradient.
        bucket_cap_mb: gradient bucket size in MiB (DDP's, or of bf16 parameters as above).
        timeout_s: process-group timeout in seconds.
    """

    def __init__(
        self,
        backend: str | None = None,
        find_unused_parameters: bool = False,
        bucket_cap_mb: float = 25.0,
        timeout_s: float = 1800.0,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.find_unused_parameters = find_unused_parameters
        self.bucket_cap_mb = bucket_cap_mb
        self.timeout_s = timeout_s
        self._device: torch.device | None = None
        self._owns_process_group = False
        # the parameters torch's DDP leaves alone: those frozen when it wrapped the module
        self._unwrapped: list[nn.Parameter] = []

    def setup_environment(self) -> None:
        if join_process_group("DDPStrategy", self.backend, self.timeout_s):
            self._owns_process_group = True
        self._device = process_device(self.backend)

    @property
    def root_device(self) -> torch.device:
        if self._device is None:
            raise RuntimeError("DDPStrategy.setup_environment() has not run yet")
        return self._device

    def data_shard(self) -> DataShard:
        return DataShard(self.global_rank, self.world_size)

    def cuda_graphs_refusal(self) -> str | None:
        return (
            "CUDA graphs are not supported under DDPStrategy: torch's DDP reduces gradients "
            "from hooks that a captured graph cannot replay; use SingleDeviceStrategy('cuda') "
            "or MegatronStrategy() on one GPU, or compile without graphs (compile_model=True)"
        )

    @property
    def metric_process_group(self) -> Any:
        return dist.group.WORLD

    def barrier(self, name: str | None = None) -> None:
        dist.barrier()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        holder = [obj]
        dist.broadcast_object_list(holder, src=src)
        return holder[0]

    def reduce(self, tensor: Tensor, op: str = "mean") -> Tensor:
        if op not in _REDUCE_OPS:
            raise ValueError(f"reduce op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
        out = tensor.detach().clone()
        dist.all_reduce(out, op=_REDUCE_OPS[op])
        if op == "mean":
            out = out / self.world_size
        return out

    def average_grads_(self) -> None:
        """Average every parameter's `.grad` over the replicas (one flat all-reduce per
        dtype), as DDP's reducer does in backward: manual optimization's `manual_backward`."""
        self._average_(p.grad for p in self._all_params if p.grad is not None)

    def _finish_grad_sync(self) -> None:
        """Average the gradients torch's DDP left alone: of parameters made trainable after
        it wrapped the module (a backbone unfrozen mid-run by Lightning's BaseFinetuning).
        Every rank runs the same callbacks, so the list (in module order) is the same on all."""
        super()._finish_grad_sync()
        if self._main_grads is not None:
            return  # bf16 main grads: `GradBuckets` reduced them
        self._average_(p.grad for p in self._unwrapped if p.grad is not None)

    def _average_(self, grads: Iterable[Tensor]) -> None:
        """Average `grads` over the replicas in place, one flat all-reduce per dtype (every
        rank passes the same list, in the same order)."""
        all_reduce_coalesced(list(grads), dist.group.WORLD, average=True)

    def _wrap(self, module: Any) -> nn.Module:
        if self._main_grads is not None:
            # low-precision parameters: grads accumulate in fp32 main grads, which
            # `_reduce_main_grads` averages; DDP would reduce the bf16 .grad instead
            return TrainingStepWrapper(module)
        self._unwrapped = [p for p in module.parameters() if not p.requires_grad]
        device_ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        ddp = nn.parallel.DistributedDataParallel(
            TrainingStepWrapper(module),
            device_ids=device_ids,
            find_unused_parameters=self.find_unused_parameters,
            bucket_cap_mb=self.bucket_cap_mb,
        )
        # DDP times its first ten synchronized steps after each (re)start for its debug
        # statistics, then one in 100 by default, and reads each timing at the next step's
        # forward: on CUDA the host waits there on the previous step's CUDA events (8
        # cudaEventSynchronize on an H100), which sync debug mode does not report. The first
        # ten cannot be turned off; the later samples can.
        ddp._set_ddp_runtime_logging_sample_rate(_NEVER)
        if self.precision.reduce_dtype != torch.float32:
            from nanotrain.precision.comm import low_precision_allreduce_hook

            hook = low_precision_allreduce_hook(self.precision.reduce_dtype)
            ddp.register_comm_hook(dist.group.WORLD, hook)
        return ddp

    def _make_main_grads(self, module: Any) -> GradBuckets:
        # fp32 main grads in buckets, each all-reduced (in the precision's reduce dtype) as
        # soon as backward of the last microbatch completes it, so the reduction overlaps the
        # rest of backward as DDP's own buckets do for fp32 and autocast
        params = backward_order(module)
        if not params:
            raise ValueError("DDPStrategy found no trainable parameters after configure_model")
        bucket_numel = bucket_numel_for(params[0].element_size(), self.bucket_cap_mb)
        return GradBuckets(
            FlatLayout(params, self.world_size, bucket_numel),
            dist.group.WORLD,
            grad_dtype=torch.float32,
            reduce_dtype=self.precision.reduce_dtype,
        )

    def _reduce_main_grads(self) -> None:
        assert isinstance(self._main_grads, GradBuckets)
        self._main_grads.finish()  # launch the buckets left (e.g. unused parameters), wait

    def _found_inf_groups(self) -> list[Any]:
        return [dist.group.WORLD]

    def _sync_context(self, is_last_microbatch: bool) -> contextlib.AbstractContextManager:
        assert self._step_runner is not None
        if isinstance(self._main_grads, GradBuckets):
            self._main_grads.set_sync(is_last_microbatch)
            return contextlib.nullcontext()
        if is_last_microbatch:
            return contextlib.nullcontext()
        return self._step_runner.no_sync()

    def teardown(self) -> None:
        # Free DDP (and its reducer) before the process group goes away: destroying the group
        # under a live DDP model can hang (shared/TESTING.md).
        super().teardown()
        self._unwrapped = []
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_process_group = False
