"""Gradient reduction in a lower dtype for DDP (a communication hook that works on gloo too)."""

# no `from __future__ import annotations`: DDP checks the hook's annotations at runtime
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["low_precision_allreduce_hook"]


def low_precision_allreduce_hook(dtype: torch.dtype) -> Any:
    """A DDP communication hook: each bucket is divided by the world size, cast to ``dtype``,
    all-reduced and copied back into the (fp32) bucket. PyTorch's ``bf16_compress_hook`` does
    the same but only on NCCL; this one runs on any backend whose all-reduce takes ``dtype``."""

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        group = state if state is not None else dist.group.WORLD
        buffer = bucket.buffer()
        wire = buffer.div(dist.get_world_size(group)).to(dtype)
        fut = dist.all_reduce(wire, group=group, async_op=True).get_future()

        def back(f: torch.futures.Future) -> torch.Tensor:
            buffer.copy_(f.value()[0])
            return buffer

        return fut.then(back)

    return hook
