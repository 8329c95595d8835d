"""bf16 / fp16 mixed precision (autocast) and bf16-true (bf16 parameters, fp32 masters)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn

from nanotrain.precision.base import Precision
from nanotrain.precision.policy import PrecisionPolicy
from nanotrain.precision.scaler import DynamicLossScaler

__all__ = ["BF16Mixed", "BF16True", "FP16Mixed"]


class BF16Mixed(Precision):
    """ "bf16-mixed": fp32 parameters, gradients and optimizer state; forward under bf16
    autocast (matmuls in bf16, reductions and the layers the policy keeps high in fp32)."""

    name = "bf16-mixed"
    autocast_dtype = torch.bfloat16
    low_precision_format = "bf16"

    def summary(self) -> str:
        return (
            "fp32 parameters, gradients, master weights and optimizer state; matmuls under "
            "bf16 autocast"
        )

    def peak_precision(self) -> str:
        return "bf16"


class BF16True(Precision):
    """ "bf16-true": bf16 parameters and activations; the optimizer updates fp32 master weights
    (sharded 1/dp under ZeRO) from gradients accumulated in fp32 over the microbatches."""

    name = "bf16-true"
    param_dtype = torch.bfloat16
    low_precision_format = "bf16"

    def summary(self) -> str:
        return (
            "bf16 parameters and activations; fp32 gradient accumulation, fp32 master weights "
            "and optimizer state (sharded under ZeRO)"
        )

    def peak_precision(self) -> str:
        return "bf16"


class FP16Mixed(Precision):
    """ "16-mixed": fp32 parameters; forward under fp16 autocast; dynamic loss scaling.

    Args:
        policy, reduce_dtype: see `Precision`.
        init_scale, growth_factor, backoff_factor, growth_interval: of the
            `DynamicLossScaler`.
    """

    name = "16-mixed"
    autocast_dtype = torch.float16
    low_precision_format = "fp16"

    def __init__(
        self,
        policy: PrecisionPolicy | None = None,
        reduce_dtype: torch.dtype = torch.float32,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        super().__init__(policy, reduce_dtype)
        self.scaler = DynamicLossScaler(init_scale, growth_factor, backoff_factor, growth_interval)

    def summary(self) -> str:
        return (
            "fp32 parameters, gradients and optimizer state; matmuls under fp16 autocast; "
            "dynamic loss scaling"
        )

    def setup_module(
        self, module: nn.Module, device: torch.device, is_global_zero: bool = True
    ) -> None:
        """As `Precision.setup_module`; on the CPU it also warns (rank 0) that fp16 runs as
        asked there, where lightning.Trainer switches to bf16-mixed."""
        super().setup_module(module, device, is_global_zero)
        if device.type == "cpu" and is_global_zero:
            warnings.warn(
                "precision='16-mixed' on the CPU runs fp16 autocast with loss scaling, as asked; "
                "lightning.Trainer would switch to 'bf16-mixed' here, so pass "
                "precision='bf16-mixed' for Lightning's run",
                stacklevel=2,
            )

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def scale_loss(self, loss: Tensor) -> Tensor:
        return loss * self.scaler.scale

    @property
    def uses_loss_scaling(self) -> bool:
        return True

    def unscale_grads_(self, grads: list[Tensor], groups: list[Any]) -> None:
        self.scaler.unscale_(grads, groups)

    @property
    def skip_step(self) -> bool:
        return self.scaler.found_inf

    def after_step(self) -> None:
        self.scaler.update()

    def step_metrics(self) -> dict[str, Tensor]:
        # logged with the step: the scale the step used and whether it was skipped
        return {
            "precision/loss_scale": torch.tensor(self.scaler.scale),
            "precision/skipped": torch.tensor(float(self.scaler.found_inf)),
        }

    def peak_precision(self) -> str:
        return "fp16"

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
