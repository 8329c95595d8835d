"""Dynamic loss scaling for fp16: scale the loss up, unscale the gradients, skip steps that
overflowed, and move the scale with the overflows.

The overflow check is a collective: a rank that holds an inf/NaN in *its* gradient shard must
make every rank skip. `unscale_` takes the process groups that together span every rank holding
a gradient shard (tp, pp and dp, which contains ep) and all-reduces the found-inf flag (MAX)
over each in turn: on a tp x pp x dp grid the result is the maximum over the whole world, so all
ranks skip the same step and halve the scale together.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["DynamicLossScaler"]


class DynamicLossScaler:
    """Loss scale with backoff on overflow and growth after ``growth_interval`` clean steps.

    Args:
        init_scale: the first scale (2**16, as torch.amp.GradScaler).
        growth_factor: multiply the scale by this after ``growth_interval`` finite steps.
        backoff_factor: multiply the scale by this after an overflow (0.5: halve it).
        growth_interval: finite steps in a row before the scale grows.
        min_scale: the scale never drops below this.

    Raises:
        ValueError: for a non-positive scale or interval, growth <= 1 or backoff not in (0, 1).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0 / 2**24,
    ) -> None:
        if not init_scale > 0 or not min_scale > 0:
            raise ValueError(f"init_scale and min_scale must be > 0, got {init_scale}, {min_scale}")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive int, got {growth_interval!r}")
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.growth_tracker = 0  # finite steps since the last change
        self.skipped_steps = 0
        self.found_inf = False  # this step, reduced over every rank
        self.local_found_inf = False  # this step, on this rank's shard only

    @torch.no_grad()
    def unscale_(self, grads: Iterable[Tensor], groups: Sequence[Any] = ()) -> bool:
        """Divide ``grads`` by the scale in place; return whether any rank found inf/NaN.

        ``groups``: process groups spanning every rank that holds a gradient shard (None or
        size-1 groups are skipped). Every rank of them must call this at the same point.
        """
        grads = [g for g in grads if g is not None and g.numel() > 0]
        device = grads[0].device if grads else _device_without_grads(groups)
        local = torch.zeros(1, dtype=torch.float32, device=device)  # 1.0: inf/NaN here
        # torch's fused check-and-unscale (GradScaler's), one launch per device and dtype
        # instead of an isfinite reduction and a multiply per gradient
        by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for g in grads:
            by_kind.setdefault((g.device, g.dtype), []).append(g)
        for (where, _), same in by_kind.items():
            found = local if where == device else torch.zeros(1, dtype=local.dtype, device=where)
            inv = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=where)
            torch._amp_foreach_non_finite_check_and_unscale_(same, found, inv)
            if found is not local:
                local.copy_(torch.maximum(local, found.to(device)))
        flag = local.clone()
        for group in groups:
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        local_bad, any_bad = torch.cat([local, flag]).tolist()  # the step's one host read
        self.local_found_inf = local_bad > 0
        self.found_inf = any_bad > 0
        return self.found_inf

    def update(self) -> None:
        """After the step: back off after an overflow, else grow every ``growth_interval``."""
        if self.found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.growth_tracker = 0
            self.skipped_steps += 1
        else:
            self.growth_tracker += 1
            if self.growth_tracker >= self.growth_interval:
                self.scale *= self.growth_factor
                self.growth_tracker = 0
        self.found_inf = False

    def state_dict(self) -> dict[str, float | int]:
        """Plain values: ``scale``, ``growth_tracker``, ``skipped_steps``."""
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (exactly)."""
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def _device_without_grads(groups: Sequence[Any]) -> torch.device:
    """Where a rank holding no gradient keeps its found-inf flag: it still joins the flag's
    all-reduce: a CUDA tensor on an NCCL group (NCCL reduces nothing else), else a CPU one."""
    for group in groups:
        if group is not None and dist.get_backend(group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
