"""Peak FLOP/s of common accelerators, and model FLOPs utilization (MFU).

The table holds *dense* tensor-core peaks (no 2:4 sparsity) from the vendors' datasheets, in
TFLOP/s per device. MFU divides the FLOPs the model needs by what the hardware could do at
that peak, so the numbers here are the denominator every MFU figure rests on: when in doubt,
pass your own `peak_flops_per_device` to `ThroughputMonitor`.
"""

from __future__ import annotations

import re

import torch

# (device-name pattern, {precision: dense TFLOP/s}); the first matching pattern wins, so more
# specific names (H100 NVL, H100 PCIe, GB200, L40S) come before the names they contain.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"H100.*NVL", {"fp8": 1670.5, "bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"H100.*PCIe", {"fp8": 1513.0, "bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    # H100 SXM ("H100 80GB HBM3"); H200 and GH200 have the same compute as H100 SXM.
    (r"H100|H200", {"fp8": 1978.9, "bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"GB200", {"fp8": 5000.0, "bf16": 2500.0, "fp16": 2500.0, "tf32": 1250.0, "fp32": 80.0}),
    (r"B200", {"fp8": 4500.0, "bf16": 2250.0, "fp16": 2250.0, "tf32": 1125.0, "fp32": 75.0}),
    (r"A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"L40S", {"fp8": 733.0, "bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    (r"\bL4\b", {"fp8": 242.5, "bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"\bA10G?\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"V100.*PCIE", {"fp16": 112.0, "fp32": 14.0}),
    (r"V100", {"fp16": 125.0, "fp32": 15.7}),
    (r"MI300X", {"fp8": 2614.9, "bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
    (r"MI250X", {"bf16": 383.0, "fp16": 383.0, "fp32": 95.7}),
)

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
    """Map a dtype or precision name to a key of `PEAK_TFLOPS` ("fp8", "bf16", "fp16",
    "tf32", "fp32").

    Raises:
        ValueError: for a name or dtype the table has no column for.
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


def peak_flops_for(device_name: str, dtype: str | torch.dtype) -> float | None:
    """Dense peak FLOP/s of one device named `device_name` (as `torch.cuda.get_device_name`
    reports it) at precision `dtype`; None when the device or precision is not in the table.

    Raises:
        ValueError: for an unknown precision name (see `normalize_precision`).
    """
    precision = normalize_precision(dtype)
    for pattern, peaks in PEAK_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            tflops = peaks.get(precision)
            return None if tflops is None else tflops * 1e12
    return None


def device_peak_flops(device: torch.device, dtype: str | torch.dtype) -> float | None:
    """Peak FLOP/s of `device` at `dtype` from the table; None on CPU and unknown devices
    (CPU peaks depend on core count, clock and vector width: measure and pass them yourself)."""
    if device.type != "cuda":
        return None
    return peak_flops_for(torch.cuda.get_device_name(device), dtype)


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
