"""Peak FLOP/s of the device a run trains on, and model FLOPs utilization (MFU).

The peak is the denominator of every MFU figure. It comes from Lightning's own table
(`lightning.fabric.utilities.throughput.get_available_flops`: dense tensor-core peaks per
dtype; for fp32 it answers with the TF32 peak on Ampere and newer when torch's float32 matmul
precision allows TF32, as our precision plugins' `peak_precision` does). `OWN_PEAK_TFLOPS`
holds only what Lightning lacks or reads wrongly, from the vendors' datasheets (dense, no 2:4
sparsity):

- fp8 peaks (Lightning has no fp8 column) of H100 / H200 / B200 / GB200 / L40S / L4 / MI300X;
- H200 as `torch.cuda.get_device_name` reports it ("NVIDIA H200": Lightning knows only
  "H200 SXM1" / "H200 NVL1"), H800, B200, GB200, and AMD's MI300X / MI250X;
- L40S (Lightning reads "L40S" as the L4, a third of its compute) and H100 NVL (Lightning's
  row is the figure of an NVL pair, twice one GPU's).

When in doubt, pass your own `peak_flops_per_device` to `ThroughputMonitor`.
"""

from __future__ import annotations

import re
import warnings

import torch
from lightning.fabric.utilities.throughput import get_available_flops

# (device-name pattern, {precision: dense TFLOP/s}); the first matching pattern wins, so more
# specific names (H100 NVL, H100 PCIe, GB200, L40S) come before the names they contain.
OWN_PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    # Lightning's H100 NVL row is the two-GPU pair's figure
    (r"H100.*NVL", {"fp8": 1670.5, "bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"H100.*PCIe", {"fp8": 1513.0}),
    (r"H100", {"fp8": 1978.9}),
    # H200, GH200 and H800 have the H100 SXM's compute
    (r"H200|H800", {"fp8": 1978.9, "bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"GB200", {"fp8": 5000.0, "bf16": 2500.0, "fp16": 2500.0, "tf32": 1250.0, "fp32": 80.0}),
    (r"B200", {"fp8": 4500.0, "bf16": 2250.0, "fp16": 2250.0, "tf32": 1125.0, "fp32": 75.0}),
    (r"L40S", {"fp8": 733.0, "bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    (r"\bL4\b", {"fp8": 242.5}),
    (r"MI300X", {"fp8": 2614.9, "bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
    (r"MI250X", {"bf16": 383.0, "fp16": 383.0, "fp32": 95.7}),
)

# the dtype Lightning's table is keyed by, per precision column
_LIGHTNING_DTYPE: dict[str, torch.dtype | str] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "tf32": "tfloat32",
}

_DTYPE_ALIASES: dict[str, str] = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "16-mixed": "fp16",
    "16-true": "fp16",
    "fp32": "fp32",
    "float32": "fp32",
    "32": "fp32",
    "32-true": "fp32",
    "tf32": "tf32",
    "fp8": "fp8",
    "float8": "fp8",
}


def normalize_precision(dtype: str | torch.dtype) -> str:
    """Map a dtype or precision name to a peak column ("fp8", "bf16", "fp16", "tf32",
    "fp32").

    Raises:
        ValueError: for a name or dtype there is no column for.
    """
    if isinstance(dtype, torch.dtype):
        if dtype.is_floating_point and dtype.itemsize == 1:
            return "fp8"
        name = str(dtype).removeprefix("torch.")
    else:
        name = str(dtype).lower()
    if name not in _DTYPE_ALIASES:
        raise ValueError(
            f"unknown precision {dtype!r} for the peak-FLOPs table; use one of "
            "'fp8', 'bf16', 'fp16', 'tf32', 'fp32' (or a torch floating dtype)"
        )
    return _DTYPE_ALIASES[name]


def own_peak_flops(device_name: str, precision: str) -> float | None:
    """FLOP/s from `OWN_PEAK_TFLOPS` for a device named `device_name` (as
    `torch.cuda.get_device_name` reports it) at a normalized `precision`; None when the
    table has no entry (then Lightning's table is asked)."""
    for pattern, peaks in OWN_PEAK_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            tflops = peaks.get(precision)
            if tflops is not None:
                return tflops * 1e12
            return None
    return None


def device_peak_flops(device: torch.device, dtype: str | torch.dtype) -> float | None:
    """Dense peak FLOP/s of one CUDA `device` at `dtype`: `OWN_PEAK_TFLOPS` where it has an
    entry, else Lightning's `get_available_flops`; None on CPU and on devices neither knows
    (CPU peaks depend on core count, clock and vector width: measure and pass them yourself).

    Raises:
        ValueError: for an unknown precision name (see `normalize_precision`).
    """
    precision = normalize_precision(dtype)
    if device.type != "cuda":
        return None
    own = own_peak_flops(torch.cuda.get_device_name(device), precision)
    if own is not None or precision not in _LIGHTNING_DTYPE:
        return own
    with warnings.catch_warnings():  # "FLOPs not found" for an unknown device: None says it
        warnings.simplefilter("ignore")
        flops = get_available_flops(device, _LIGHTNING_DTYPE[precision])
    return None if flops is None else float(flops)


def model_flops_utilization(
    flops_per_token: float, tokens_per_sec: float, peak_flops_per_device: float, num_devices: int
) -> float:
    """MFU = achieved model FLOP/s ÷ the job's peak FLOP/s, as a fraction in [0, 1] (ideally).

    Args:
        flops_per_token: training FLOPs (forward + backward) one token costs the whole model.
        tokens_per_sec: tokens the whole job trains on per second.
        peak_flops_per_device: dense peak FLOP/s of one device.
        num_devices: devices in the job (every process's device, whatever the layout).
    """
    return flops_per_token * tokens_per_sec / (peak_flops_per_device * num_devices)
