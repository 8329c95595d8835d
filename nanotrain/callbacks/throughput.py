"""ThroughputMonitor: tokens/s, samples/s, step time, TFLOP/s and MFU."""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from nanotrain.callbacks.base import Callback
from nanotrain.callbacks.flops import (
    device_peak_flops,
    model_flops_utilization,
    normalize_precision,
)

if TYPE_CHECKING:
    from nanotrain.module import NanoModule
    from nanotrain.strategies.base import StepOutput
    from nanotrain.trainer import Trainer


class ThroughputMonitor(Callback):
    """Measures how fast training runs, averaged over the steps between two log steps.

    The clock runs from the end of one logged step to the end of the next, so data loading
    and every callback count; validation time is taken out. The first window starts at the
    end of the first step after training (re)started, which carries CUDA's start-up and
    torch.compile's compilation; that step logs no throughput, even when it is a log step. On
    CUDA the device is synchronized on log steps and that first step only (the timing must
    include queued kernels; other steps stay free of host-device syncs).

    Logged (every `log_every_n_steps`):
        throughput/step_time (s), throughput/samples_per_sec (whole job); with token data
        (`NanoModule.count_tokens`) also throughput/tokens_per_sec (whole job) and
        throughput/tokens_per_sec_per_device; with FLOPs per token known also
        throughput/tflops (whole job) and throughput/tflops_per_device; with the peak known
        also throughput/mfu (fraction of peak, the same per device and for the job).

    Args:
        peak_flops_per_device: dense peak FLOP/s of one device. None looks the device up in
            `nanotrain.callbacks.flops.device_peak_flops` (GPUs only); on CPU or an unlisted GPU, MFU
            is not logged unless you pass it. Then `mfu_note` says why in words (the run's
            report and `nanotrain fit`'s closing summary show MFU as n/a with it); an unlisted
            GPU also gets a warning at fit start (on CPU no peak is the expected case).
        precision: which column of the peak table applies ("bf16", "fp16", "fp8", "tf32",
            "fp32" or a torch dtype): the precision the matmuls run in. None (default) asks
            the strategy's precision plugin (`Precision.peak_precision`: bf16 for the bf16
            modes and the emulations, fp16 for 16-mixed, fp8 for Transformer Engine); under
            "32-true" the dtype of the module's parameters at fit start (fp32 counts as "tf32"
            when CUDA's TF32 matmuls are enabled). Which peak was used is printed at fit start.
        flops_per_token: training FLOPs (forward + backward) per token; None asks the module
            (`NanoModule.flops_per_token()`), which the language model answers with
            6 × active non-embedding parameters + the attention term.
        log_every_n_steps: cadence; None uses the Trainer's.
        clock: seconds as a float (monotonic); tests inject a fake one.

    Raises:
        ValueError: for a non-positive peak, FLOPs or cadence, or an unknown precision.
    """

    def __init__(
        self,
        peak_flops_per_device: float | None = None,
        precision: str | torch.dtype | None = None,
        flops_per_token: float | None = None,
        log_every_n_steps: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        for name, value in (
            ("peak_flops_per_device", peak_flops_per_device),
            ("flops_per_token", flops_per_token),
            ("log_every_n_steps", log_every_n_steps),
        ):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive or None, got {value!r}")
        self.precision = None if precision is None else normalize_precision(precision)
        self.peak_flops_per_device = peak_flops_per_device
        self.flops_per_token = flops_per_token
        self.log_every_n_steps = log_every_n_steps
        self.clock = clock
        self._peak: float | None = None
        self._flops: float | None = None
        self._reset_window(None)
        self._validation_started: float | None = None
        self._start_step = 0  # the step training (re)started from
        # why MFU is not measured (None when it is): shown as "MFU n/a" with this note
        self.mfu_note: str | None = None

    def _reset_window(self, start: float | None) -> None:
        self._window_start = start
        self._paused = 0.0  # seconds of validation inside the window
        self._steps = self._samples = self._tokens = 0

    def on_fit_start(self, trainer: Trainer, module: NanoModule) -> None:
        """Resolve FLOPs per token and the peak FLOP/s once the model exists."""
        self._flops = self.flops_per_token or module.flops_per_token()
        if self.precision is None:
            self.precision = _matmul_precision(trainer, module)
        self._peak = self.peak_flops_per_device or device_peak_flops(
            trainer.strategy.root_device, self.precision
        )
        if self._peak is not None and trainer.is_global_zero:
            source = "given" if self.peak_flops_per_device else "table"
            print(
                f"ThroughputMonitor: MFU against the {self.precision} peak of "
                f"{self._peak / 1e12:.1f} TFLOP/s per device ({source})",
                file=sys.stderr,
            )
        device = trainer.strategy.root_device
        self.mfu_note = None
        if self._peak is None:
            self.mfu_note = (
                f"no peak FLOP/s is known for {device.type} at {self.precision}; pass "
                "ThroughputMonitor(peak_flops_per_device=...) to measure it"
            )
        if self._peak is None and trainer.is_global_zero and device.type != "cpu":
            # a GPU missing from the table: MFU was likely expected, so say so at once
            warnings.warn(
                f"ThroughputMonitor: throughput/mfu is not logged: {self.mfu_note}",
                stacklevel=1,  # point at this callback, not at the Trainer that calls it
            )

    def on_train_start(self, trainer: Trainer, module: NanoModule) -> None:
        """Start the first window (it restarts after the first step)."""
        self._start_step = trainer.global_step
        self._reset_window(self.clock())

    def on_validation_start(self, trainer: Trainer, module: NanoModule) -> None:
        """Stop counting time while validation runs."""
        if trainer.is_fitting:
            self._validation_started = self.clock()

    def on_validation_end(self, trainer: Trainer, module: NanoModule) -> None:
        """Resume counting time."""
        if self._validation_started is not None:
            self._paused += self.clock() - self._validation_started
            self._validation_started = None

    def on_train_step_end(
        self,
        trainer: Trainer,
        module: NanoModule,
        outputs: StepOutput,
        microbatches: list[Any],
        step_idx: int,
    ) -> None:
        """Count the step; on log steps compute and log the window's rates."""
        self._steps += 1
        # device tensors: summed on the device, read only on the log step below
        self._samples = self._samples + outputs.num_samples
        self._tokens = self._tokens + outputs.num_tokens
        if trainer.global_step == self._start_step + 1:
            # the first step after (re)start carries CUDA's start-up and torch.compile's
            # compilation: the first window starts after it, and the step itself is not logged
            # even on a log step (it reads the device anyway: it checks the token ids)
            self._synchronize(trainer)
            self._reset_window(self.clock())
            return
        every = self.log_every_n_steps or trainer.settings.log_every_n_steps
        if trainer.global_step % every or self._window_start is None:
            return
        self._samples, self._tokens = (float(v) for v in (self._samples, self._tokens))
        self._synchronize(trainer)
        now = self.clock()
        elapsed = now - self._window_start - self._paused
        if elapsed > 0:
            trainer.log_metrics(self.compute(elapsed, trainer.world_size))
        self._reset_window(now)

    @staticmethod
    def _synchronize(trainer: Trainer) -> None:
        """Wait for the queued kernels (CUDA), so that the clock includes them."""
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def compute(self, elapsed: float, num_devices: int) -> dict[str, float]:
        """The metrics of the current window, `elapsed` seconds long, over `num_devices`."""
        metrics = {
            "throughput/step_time": elapsed / self._steps,
            "throughput/samples_per_sec": self._samples / elapsed,
        }
        if self._tokens:
            tokens_per_sec = self._tokens / elapsed
            metrics["throughput/tokens_per_sec"] = tokens_per_sec
            metrics["throughput/tokens_per_sec_per_device"] = tokens_per_sec / num_devices
            if self._flops:
                flops_per_sec = self._flops * tokens_per_sec
                metrics["throughput/tflops"] = flops_per_sec / 1e12
                metrics["throughput/tflops_per_device"] = flops_per_sec / num_devices / 1e12
                if self._peak:
                    metrics["throughput/mfu"] = model_flops_utilization(
                        self._flops, tokens_per_sec, self._peak, num_devices
                    )
        return metrics


def _matmul_precision(trainer: Trainer, module: NanoModule) -> str:
    """The peak-table column of the precision in use: asked of the strategy's precision plugin
    (bf16 for bf16 modes, fp8 for Transformer Engine, ...); for the default fp32 plugin, the
    dtype the module's parameters hold (a model cast by hand keeps its own column)."""
    plugin = getattr(trainer.strategy, "precision", None)
    if plugin is not None and plugin.name != "32-true":
        return normalize_precision(plugin.peak_precision())
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return normalize_precision(dtype)
