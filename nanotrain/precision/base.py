"""Precision plugins: what the strategy asks about dtypes, autocast, loss scaling and masters.

A strategy holds one plugin and calls it at fixed points (the Trainer never does):

    setup_module(module, ...)   after configure_model: cast parameters, apply the per-module
                                policy, print it once and write it into the run directory
    forward_context()           around every training/validation forward (autocast, fp8)
    scale_loss(loss)            before backward (loss scaling; identity unless 16-mixed)
    unscale_grads_(grads, gs)   after the reduction: unscale, found-inf over the groups gs
    skip_step / after_step()    skip the update on overflow; move the loss scale
    state_dict()                plain dict kept in checkpoints (the loss-scaler state)

`Precision` itself is "32-true": fp32 everywhere, every hook a no-op.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from nanotrain.models.cast_cache import step_cast_cache
from nanotrain.precision.policy import PrecisionPolicy, describe, write_report

__all__ = ["Precision", "SwapLinearMode", "wrap_forward"]


class Precision:
    """fp32 training ("32-true"): parameters, activations, gradients and optimizer in fp32.

    Subclasses set the class attributes and override the hooks they need.

    Args:
        policy: which linear layers run low precision (`PrecisionPolicy`; DeepSeek-V3
            defaults). Plugins without a low-precision GEMM only report it.
        reduce_dtype: dtype of the gradient all-reduce / reduce-scatter: torch.float32
            (default) or torch.bfloat16 (half the bytes on the wire, 8 mantissa bits).

    Raises:
        ValueError: for a reduce dtype other than fp32 or bf16.
    """

    name = "32-true"
    #: dtype the parameters are cast to (None: left as built, fp32)
    param_dtype: torch.dtype | None = None
    #: autocast dtype for forward (None: no autocast)
    autocast_dtype: torch.dtype | None = None
    #: what the policy's "low" layers run in (for the report)
    low_precision_format: str | None = None
    #: whether the routed experts' grouped GEMMs (`GroupedExperts`) run as fp8 GEMMs; no
    #: plugin does yet: Transformer Engine's and torchao's fp8 swap plain linear layers only,
    #: the experts stay in bf16 autocast (the planner's `fp8_expert_gemms` note reads this)
    fp8_grouped_experts: bool = False

    def __init__(
        self, policy: PrecisionPolicy | None = None, reduce_dtype: torch.dtype = torch.float32
    ) -> None:
        if reduce_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"reduce_dtype must be torch.float32 or torch.bfloat16, got {reduce_dtype!r}"
            )
        self.policy = policy if policy is not None else PrecisionPolicy()
        self.reduce_dtype = reduce_dtype
        self.device_type = "cpu"
        self.resolved_policy: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    # -- model ---------------------------------------------------------------------------------
    @property
    def master_weights(self) -> bool:
        """True when parameters are low precision, so the optimizer needs fp32 masters and
        gradients accumulate in fp32 (`nanotrain.precision.master`)."""
        return self.param_dtype is not None and self.param_dtype != torch.float32

    def setup_module(
        self,
        module: nn.Module,
        device: torch.device,
        is_global_zero: bool = True,
    ) -> None:
        """Cast parameters (``param_dtype``), apply the policy to the linear layers and print
        the resolved policy once (rank 0); `write_record` saves it in the run directory."""
        self.device_type = device.type
        if self.param_dtype is not None:
            module.to(self.param_dtype)
        self.resolved_policy = self.policy.resolve(module)
        subs = dict(module.named_modules())
        for name, where in self.resolved_policy.items():
            self.apply_to_linear(name, subs[name], low=where == "low")
        if is_global_zero:
            if self.name != "32-true":  # the default prints nothing; precision.json says it
                print(describe(self.name, self.resolved_policy, self.summary()), file=sys.stderr)

    def write_record(self, run_dir: Path) -> Path:
        """Write the resolved policy as ``<run_dir>/precision.json`` (rank 0, once the run
        directory exists); returns the path."""
        return write_report(run_dir, self.report())

    def apply_to_linear(self, name: str, layer: nn.Module, low: bool) -> None:
        """Convert or wrap one linear layer (``low``: the policy sends it to low precision).
        Under autocast a layer kept high runs with autocast off and fp32 inputs."""
        if self.autocast_dtype is not None and not low:
            wrap_forward(layer, functools.partial(_high_precision, self.device_type))

    def summary(self) -> str:
        """One line: what is kept in which dtype."""
        return "parameters, activations, gradients and optimizer state in fp32"

    def report(self) -> dict[str, Any]:
        """What `precision.json` holds: the mode, dtypes, the patterns and the resolved policy."""
        return {
            "precision": self.name,
            "summary": self.summary(),
            "low_precision_format": self.low_precision_format,
            "reduce_dtype": str(self.reduce_dtype).removeprefix("torch."),
            "policy": {
                "low_precision": list(self.policy.low_precision),
                "keep_high_precision": list(self.policy.keep_high_precision),
            },
            "modules": self.resolved_policy,
        }

    # -- forward and backward ------------------------------------------------------------------
    def forward_context(self) -> contextlib.AbstractContextManager:
        """Context for every forward (training and validation): autocast when mixed."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def step_context(self) -> contextlib.AbstractContextManager:
        """Context around one training step's forwards and backwards: under autocast, one
        low-precision copy of each weight for the whole step (`nanotrain.models.cast_cache`),
        not one per microbatch in flight. Autocast itself stays off in it (backward runs as
        without it)."""
        stack = contextlib.ExitStack()
        if self.autocast_dtype is not None:
            stack.enter_context(torch.autocast(self.device_type, enabled=False))
            stack.enter_context(step_cast_cache())
        return stack

    @property
    def loss_scale(self) -> float:
        """The factor `scale_loss` multiplies by (1.0 without loss scaling)."""
        return 1.0

    def scale_loss(self, loss: Tensor) -> Tensor:
        """The loss to call backward on."""
        return loss

    @property
    def uses_loss_scaling(self) -> bool:
        """True when gradients come out scaled and need `unscale_grads_`."""
        return False

    def unscale_grads_(self, grads: list[Tensor], groups: list[Any]) -> None:
        """Unscale the reduced gradients and check them for overflow (16-mixed only)."""

    @property
    def skip_step(self) -> bool:
        """True when this step's update must be skipped (an overflow on any rank)."""
        return False

    def after_step(self) -> None:
        """Called once per optimizer step, after the update or the skip."""

    def step_metrics(self) -> dict[str, Tensor]:
        """Scalars to add to `StepOutput.metrics` (e.g. the loss scale)."""
        return {}

    # -- throughput ------------------------------------------------------------------------------
    def peak_precision(self) -> str:
        """The column of the peak-FLOPs table (`nanotrain.callbacks.flops`) the matmuls of this
        precision run at: "fp32" ("tf32" when CUDA TF32 matmuls are on), "bf16", "fp16", "fp8"."""
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """A small plain dict for checkpoints: the mode name and (16-mixed) the scaler."""
        return {"name": self.name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict` (the name is informative: a checkpoint of another precision
        loads; only the scaler state is restored where both have one)."""


def wrap_forward(layer: nn.Module, make_context: Any) -> None:
    """Run ``layer.forward`` inside ``make_context()`` (an instance attribute, so the module's
    parameters, names and state dict are unchanged), and set ``layer.runs_own_precision``.
    Wrapping again (the same module set up a
    second time, e.g. validate after fit) replaces the earlier wrapper instead of nesting."""
    inner = layer.__dict__.get("_precision_inner_forward", layer.forward)
    layer._precision_inner_forward = inner
    layer.runs_own_precision = True  # the flag models read (e.g. GroupedExperts.for_dispatch)

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with make_context():
            return inner(*args, **kwargs)

    layer.forward = forward


@contextlib.contextmanager
def _high_precision(device_type: str):
    # Autocast off: the layer runs in its parameters' dtype (fp32). Its inputs may be bf16 from
    # an autocast layer before it; F.linear then fails on mixed dtypes, so upcast them.
    with torch.autocast(device_type, enabled=False), _UpcastLinear():
        yield


#: the ways a GEMM layer's forward multiplies by its weight (second argument)
GEMM_FUNCTIONS = (
    torch.nn.functional.linear,
    torch.matmul,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
)


class _UpcastLinear(torch.overrides.TorchFunctionMode):
    """Casts the input of a GEMM (``F.linear``, ``x @ W``) to the weight's dtype (for layers
    kept high)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in GEMM_FUNCTIONS and len(args) >= 2:
            x, w = args[0], args[1]
            if isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.dtype != w.dtype:
                args = (x.to(w.dtype), *args[1:])
        return func(*args, **kwargs)


class SwapLinearMode(torch.overrides.TorchFunctionMode):
    """Inside one layer's forward, runs its ``F.linear(x, weight, bias)`` as
    ``linear(x) + bias``: `linear` is a low-precision GEMM (Transformer Engine's Linear, or
    torchao's Float8Linear) that shares the layer's `weight` Parameter, so the layer keeps its
    communication, sharding, names and state dict and only the local GEMM changes."""

    def __init__(self, linear: Callable[[Tensor], Tensor], weight: nn.Parameter) -> None:
        super().__init__()
        self.linear, self.weight = linear, weight

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and args[1] is self.weight:
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            y = self.linear(args[0])
            # as F.linear under autocast: the bias in the output's dtype
            return y if bias is None else y + bias.to(y.dtype)
        return func(*args, **kwargs)
