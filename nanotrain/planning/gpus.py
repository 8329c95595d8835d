"""GPU specs the planner prices a layout on: peak FLOP/s, memory, and link bandwidths.

Peak FLOP/s are the datasheets' dense tensor-core figures (the H800 has the H100 SXM's
compute), the same numbers the ThroughputMonitor divides by on that device
(`nanotrain.callbacks.flops.device_peak_flops`; a test holds the two equal), so a plan's MFU
and a run's logged MFU use the same denominator. Memory is what `torch.cuda.get_device_properties` reports
(a little under the marketing figure: an "80 GB" H100 reports about 79.2 GiB). The node is the
usual one: 8 GPUs joined by NVLink/NVSwitch (intra-node bandwidth: one direction, per GPU) and
one 400 Gb/s (50 GB/s) InfiniBand NIC per GPU between nodes (the H800 nodes of the DeepSeek-V3
paper; 200 Gb/s for the A100 generation); the table's link speeds are what collectives measure
on those links (`nanotrain.planning.calibration.MEASURED_LINKS`, each with its source), not
the nominal rates. A user passes their own with `GPUSpec(...)` or
`--gpu '{"name": ..., ...}'` on the command line.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from nanotrain.planning.calibration import MEASURED_LINKS
from nanotrain.precision import PRECISIONS as PRECISION_PLUGINS

__all__ = ["GPUS", "GPUSpec", "gpu_spec"]

_T = 1e12
_GB = 1e9


@dataclass(frozen=True)
class GPUSpec:
    """One GPU kind.

    Attributes:
        name: short name ("h100").
        memory_bytes: device memory (bytes; what `torch.cuda.mem_get_info` reports as total).
        peak_flops: dense FLOP/s per column "fp8", "bf16", "fp16", "tf32" (fp32 matmuls on
            tensor cores, when CUDA TF32 is allowed) and "fp32" (plain fp32, PyTorch's
            default); at least one.
        intra_node_bw: bytes/s one GPU sends to the others in its node (NVLink, one way).
        inter_node_bw: bytes/s one GPU sends off its node (its NIC share).
        gpus_per_node: GPUs sharing the fast intra-node links.
        mem_bw: device memory bandwidth (bytes/s, the datasheet's): the memory-bound
            operations are priced at `calibration.HBM_EFFICIENCY` of it (0: not priced).
        pcie_bw: bytes/s between the GPU and its host, one direction (ZeRO-3's cpu_offload
            copies): ~80% of the PCIe x16 link's nominal rate (PCI-SIG: 32 GB/s Gen4,
            64 GB/s Gen5), what pinned-memory copies reach.
    """

    name: str
    memory_bytes: float
    peak_flops: dict[str, float]
    intra_node_bw: float
    inter_node_bw: float
    gpus_per_node: int = 8
    mem_bw: float = 0.0
    pcie_bw: float = 25 * _GB

    def __post_init__(self) -> None:
        problems = []
        if not (isinstance(self.memory_bytes, int | float) and self.memory_bytes > 0):
            problems.append(f"memory_bytes must be > 0, got {self.memory_bytes!r}")
        flops = self.peak_flops if isinstance(self.peak_flops, dict) else {}
        if not any(isinstance(v, int | float) and v > 0 for v in flops.values()):
            problems.append(
                "peak_flops must map a column (fp8, bf16, fp16, tf32, fp32) to FLOP/s > 0"
            )
        for name in ("intra_node_bw", "inter_node_bw", "pcie_bw"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
                problems.append(f"{name} must be > 0 bytes/s, got {value!r}")
        if not (isinstance(self.gpus_per_node, int) and self.gpus_per_node >= 1):
            problems.append(f"gpus_per_node must be an int >= 1, got {self.gpus_per_node!r}")
        if problems:
            raise ValueError(f"bad GPU spec {self.name!r}: " + "; ".join(problems))

    def flops_for(self, precision: str) -> float:
        """Peak FLOP/s of the matmuls a Trainer `precision` runs: the column the precision
        plugin itself names (`peak_column`), falling back to the nearest column this GPU
        lists."""
        return self.column_flops(peak_column(precision))

    def column_flops(self, column: str) -> float:
        """Peak FLOP/s of column `column` ("fp8", "bf16", "fp16", "tf32", "fp32"), or of the
        nearest column this GPU lists."""
        for key in (column, *_FALLBACK[column]):
            if self.peak_flops.get(key):
                return self.peak_flops[key]
        return max(self.peak_flops.values())

    def to_dict(self) -> dict:
        """JSON-ready fields."""
        return asdict(self)


def peak_column(precision: str) -> str:
    """The peak-FLOPs column a Trainer `precision` runs its matmuls at, as the plugin itself
    names it (`Precision.peak_precision`: fp32, or tf32 when CUDA TF32 matmuls are on, for
    "32-true"; bf16; fp16; fp8 for Transformer Engine and torchao's fp8; bf16 for the emulated
    formats)."""
    cls = PRECISION_PLUGINS[precision]
    # peak_precision reads no instance state: ask it without constructing the plugin
    # (Transformer Engine's constructor needs TE and a GPU; planning must not)
    return cls.peak_precision(cls.__new__(cls))


#: a column the GPU lacks falls back to these, in order
_FALLBACK = {
    "fp8": ("bf16", "fp16"),
    "bf16": ("fp16", "tf32"),
    "fp16": ("bf16", "tf32"),
    "tf32": ("fp32",),
    "fp32": ("tf32",),
}


# dense TFLOP/s per column: (fp8, bf16, fp16, tf32, fp32); 0 = none
_PEAK_TFLOPS = {
    "a100": (0.0, 312.0, 312.0, 156.0, 19.5),
    "h100": (1978.9, 989.4, 989.4, 494.7, 66.9),
    "b200": (4500.0, 2250.0, 2250.0, 1125.0, 75.0),
}


def _peaks(kind: str) -> dict[str, float]:
    """FLOP/s per column of a datasheet row of `_PEAK_TFLOPS`."""
    columns = ("fp8", "bf16", "fp16", "tf32", "fp32")
    return {c: v * _T for c, v in zip(columns, _PEAK_TFLOPS[kind], strict=True) if v}


def _spec(name: str, compute: str, mem_gib: float, nvlink_gb: float, hbm_tb: float,
          ib_gb: float = 50.0, pcie_gb: float = 50.0) -> GPUSpec:  # fmt: skip
    return GPUSpec(
        name=name,
        memory_bytes=mem_gib * 2**30,
        peak_flops=_peaks(compute),
        intra_node_bw=nvlink_gb * _GB,
        inter_node_bw=ib_gb * _GB,
        mem_bw=hbm_tb * 1e12,
        pcie_bw=pcie_gb * _GB,
    )


def _measured(name: str) -> tuple[float, float]:
    """(intra, inter) GB/s the collectives reach on `name` (`calibration.MEASURED_LINKS`)."""
    intra, inter = MEASURED_LINKS[name]
    return intra.value / _GB, inter.value / _GB


#: the built-in table (SXM parts; memory as torch reports it; links: what collectives
#: measure per GPU, one direction, `calibration.MEASURED_LINKS`, not the nominal rates)
GPUS: dict[str, GPUSpec] = {
    "a100": _spec(
        "a100", "a100", 79.2, _measured("a100")[0], 2.0, ib_gb=_measured("a100")[1], pcie_gb=25.0
    ),  # PCIe Gen4  # fmt: skip
    "h100": _spec("h100", "h100", 79.2, _measured("h100")[0], 3.35, ib_gb=_measured("h100")[1]),
    # H100 compute, NVLink cut to 400 GB/s nominal (155 GB/s measured all-to-all)
    "h800": _spec("h800", "h100", 79.2, _measured("h800")[0], 3.35, ib_gb=_measured("h800")[1]),
    "h200": _spec("h200", "h100", 139.8, _measured("h200")[0], 4.8, ib_gb=_measured("h200")[1]),
    "b200": _spec("b200", "b200", 178.4, _measured("b200")[0], 8.0, ib_gb=_measured("b200")[1]),
    "cpu": GPUSpec(  # this repository's test machines: for plans of CPU runs
        name="cpu",
        memory_bytes=24 * 2**30,
        peak_flops={"bf16": 0.2 * _T, "fp32": 0.1 * _T},
        intra_node_bw=5 * _GB,
        inter_node_bw=1 * _GB,
        gpus_per_node=2,
        mem_bw=20e9,
    ),
}


def gpu_spec(name_or_json: str | GPUSpec) -> GPUSpec:
    """A spec from the table by name (case-insensitive), or from a JSON object with
    `GPUSpec`'s fields (memory_bytes, peak_flops, intra_node_bw, inter_node_bw, ...).

    Raises:
        ValueError: an unknown name (the message lists the known ones) or bad JSON.
    """
    if isinstance(name_or_json, GPUSpec):
        return name_or_json
    text = str(name_or_json).strip()
    if text.startswith("{"):
        try:
            fields = json.loads(text)
            if not isinstance(fields, dict):
                raise TypeError("the spec must be a JSON object")
            return GPUSpec(**fields)
        except (json.JSONDecodeError, TypeError, AttributeError) as err:
            raise ValueError(
                f"bad GPU spec {text!r}: {err}. Give a JSON object with name, memory_bytes, "
                'peak_flops (e.g. {"bf16": 1e15}), intra_node_bw, inter_node_bw'
            ) from None  # the CLI reports the root cause: keep this message the root
    key = text.lower()
    if key not in GPUS:
        raise ValueError(
            f"unknown GPU {text!r}; known: {', '.join(sorted(GPUS))}, or pass a JSON spec "
            "with name, memory_bytes, peak_flops, intra_node_bw, inter_node_bw"
        )
    return GPUS[key]
