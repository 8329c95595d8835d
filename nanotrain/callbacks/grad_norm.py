"""GradNormMonitor: the global gradient norm, per-group norms, histograms and spike flags."""

from __future__ import annotations

import math
import re
import statistics
import warnings
from typing import TYPE_CHECKING, Any

import torch

from nanotrain.callbacks.base import Callback

if TYPE_CHECKING:
    from nanotrain.module import NanoModule
    from nanotrain.trainer import Trainer

_GROUPINGS = ("parameter", "module", "layer")
_LAYER_INDEX = re.compile(r"^(.*?\.\d+)\.")


def group_name(param_name: str, group_by: str) -> str:
    """The group a parameter's norm is pooled into.

    "parameter": the parameter itself ("model.layers.3.attn.wq.weight");
    "module": the module that owns it ("model.layers.3.attn.wq");
    "layer": the name up to the first numeric index ("model.layers.3"), or the owning module
    for parameters outside an indexed stack ("model.embed").
    """
    if group_by == "parameter":
        return param_name
    if group_by == "layer":
        match = _LAYER_INDEX.match(param_name)
        if match:
            return match.group(1)
    return param_name.rpartition(".")[0] or param_name


class GradNormMonitor(Callback):
    """Logs the gradient norm the strategy measured (global, before clipping), per-group
    norms and histograms at lower cadences, and flags spikes.

    Logged at the step's `trainer.logged_step` (Lightning's 0-based step, where its
    `train/loss` is logged too), on the cadences counted in `trainer.global_step` once the step
    ends:
        grad_norm/spikes (running count) every `log_every_n_steps` (the global norm itself
            is the Trainer's `train/grad_norm`, logged once under that name);
        grad_norm/<group> every `detail_every_n_steps` (L2 norm of the full gradients in the
            group, before clipping: the root of the sum of the squared per-parameter norms);
        a warning whenever a step's norm exceeds
        `spike_factor` × the median of the previous `spike_window` finite norms;
        histograms `grad_hist/<parameter>` (TensorBoard) every `histogram_every_n_steps`.

    The global norm and the per-parameter norms come from the strategy (the norm of the
    whole, unsharded gradient, identical on every rank); histograms use
    `strategy.full_tensor`. The norms are read to the host once per log step for all the
    steps since the last one, so spike detection adds no per-step device sync.

    Args:
        log_every_n_steps: cadence of the spike count; None uses the Trainer's.
        detail_every_n_steps: cadence of per-group norms; None = 10 × the global cadence,
            0 = never.
        group_by: "parameter", "module" or "layer" (see `group_name`).
        histogram_every_n_steps: cadence of gradient histograms; 0 = never (the default:
            they gather every gradient in full).
        spike_factor: a norm above this × the running median is a spike; 0 disables.
        spike_window: how many recent norms the median covers.
        min_history: spikes are flagged only once this many norms were seen.

    Raises:
        ValueError: for an unknown `group_by` or a negative cadence / factor.
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        detail_every_n_steps: int | None = None,
        group_by: str = "layer",
        histogram_every_n_steps: int = 0,
        spike_factor: float = 5.0,
        spike_window: int = 100,
        min_history: int = 10,
    ) -> None:
        if group_by not in _GROUPINGS:
            raise ValueError(f"group_by must be one of {_GROUPINGS}, got {group_by!r}")
        if log_every_n_steps is not None and log_every_n_steps <= 0:
            raise ValueError(f"log_every_n_steps must be positive or None, got {log_every_n_steps}")
        for name, value in (
            ("detail_every_n_steps", detail_every_n_steps or 0),
            ("histogram_every_n_steps", histogram_every_n_steps),
            ("spike_factor", spike_factor),
        ):
            if value < 0:
                raise ValueError(f"{name} must be >= 0 (0 disables it), got {value}")
        if spike_window < 1 or min_history < 1:
            raise ValueError("spike_window and min_history must be >= 1")
        self.log_every_n_steps = log_every_n_steps
        self.detail_every_n_steps = detail_every_n_steps
        self.group_by = group_by
        self.histogram_every_n_steps = histogram_every_n_steps
        self.spike_factor = spike_factor
        self.spike_window = spike_window
        self.min_history = min_history
        self.history: list[float] = []  # recent finite global norms, oldest first
        self.num_spikes = 0
        self._pending: list[tuple[int, torch.Tensor]] = []  # (step, norm) not yet on the host

    def on_before_optimizer_step(
        self, trainer: Trainer, module: NanoModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Gradients exist: collect the global norm, per-group norms and histograms due now."""
        out = trainer.step_output
        step = trainer.global_step + 1  # the number this step gets once it completes
        if out is not None and out.grad_norm is not None:
            self._pending.append((step, out.grad_norm.detach()))
        every = self.log_every_n_steps or trainer.settings.log_every_n_steps
        detail = 10 * every if self.detail_every_n_steps is None else self.detail_every_n_steps
        metrics: dict[str, Any] = {}
        if step % every == 0:
            metrics.update(self._flush_global(trainer))
        if detail and step % detail == 0:
            metrics.update(self.group_norms(self._unclipped_norms(trainer)))
        if metrics:
            trainer.log_metrics(metrics, step=trainer.logged_step)
        hist = self.histogram_every_n_steps
        if hist and step % hist == 0:
            self._log_histograms(trainer, module, trainer.logged_step)

    def group_norms(self, named_norms: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Pool per-parameter norms into `grad_norm/<group>` norms (sqrt of sum of squares)."""
        squares: dict[str, torch.Tensor] = {}
        for name, norm in named_norms.items():
            key = group_name(name, self.group_by)
            squares[key] = squares.get(key, 0.0) + norm.float() ** 2
        return {f"grad_norm/{key}": value.sqrt() for key, value in squares.items()}

    @staticmethod
    def _unclipped_norms(trainer: Trainer) -> dict[str, torch.Tensor]:
        """Per-parameter norms before clipping: in `on_before_optimizer_step` the gradients
        are not clipped yet (clipping follows the hook, as in Lightning)."""
        return trainer.strategy.named_grad_norms()

    def _flush_global(self, trainer: Trainer) -> dict[str, Any]:
        if not self._pending:
            return {}
        steps = [step for step, _ in self._pending]
        norms = torch.stack([norm.float() for _, norm in self._pending]).tolist()  # one sync
        self._pending = []
        for step, norm in zip(steps, norms, strict=True):
            self._check_spike(trainer, step, norm)
        return {"grad_norm/spikes": self.num_spikes}

    def _check_spike(self, trainer: Trainer, step: int, norm: float) -> None:
        if not math.isfinite(norm):
            return  # non-finite norms are NaNGuard's business and would poison the median
        if self.spike_factor and len(self.history) >= self.min_history:
            median = statistics.median(self.history)
            if norm > self.spike_factor * median:
                self.num_spikes += 1
                if trainer.is_global_zero:
                    warnings.warn(
                        f"grad-norm spike at step {step}: {norm:.4g} > {self.spike_factor:g} × "
                        f"running median {median:.4g}",
                        stacklevel=2,
                    )
        self.history = (self.history + [norm])[-self.spike_window :]

    def _log_histograms(self, trainer: Trainer, module: NanoModule, step: int) -> None:
        tb = trainer.logger
        for name, param in module.named_parameters():
            if not param.requires_grad or param.grad is None:
                continue
            # full_tensor may be a collective under sharded layouts: every rank calls it.
            grad = trainer.strategy.full_tensor(name, param.grad)
            if tb is not None:
                tb.experiment.add_histogram(f"grad_hist/{name}", grad.detach().float().cpu(), step)

    def state_dict(self) -> dict[str, Any]:
        """The running history of norms and the spike count."""
        return {"history": list(self.history), "num_spikes": self.num_spikes}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore `state_dict`'s history and spike count."""
        self.history = [float(x) for x in state_dict["history"]][-self.spike_window :]
        self.num_spikes = int(state_dict["num_spikes"])
