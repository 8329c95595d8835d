"""GPU specs the planner prices a layout on: peak FLOP/s, memory, and link bandwidths.

Figures are the vendors' published dense (no sparsity) tensor-core peaks per GPU and the
usual node: 8 GPUs joined by NVLink/NVSwitch (intra-node bandwidth: one direction, per GPU),
one 400 Gb/s (50 GB/s) InfiniBand NIC per GPU between nodes (the H800 nodes of the
DeepSeek-V3 paper also have 8 x 400 Gb/s). A user passes their own with `GPUSpec(...)` or
`--gpu-spec '{"name": ..., ...}'` on the command line.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

__all__ = ["GPUS", "GPUSpec", "gpu_spec"]

_T = 1e12
_GB = 1e9


@dataclass(frozen=True)
class GPUSpec:
    """One GPU kind.

    Attributes:
        name: short name ("h100").
        memory_bytes: device memory (bytes; what `torch.cuda.mem_get_info` reports as total).
        peak_flops: dense FLOP/s per precision name ("bf16", "fp16", "fp8", "fp32"); fp32 is
            the TF32 tensor-core figure, which PyTorch uses for fp32 matmuls when allowed.
        intra_node_bw: bytes/s one GPU sends to the others in its node (NVLink, one way).
        inter_node_bw: bytes/s one GPU sends off its node (its NIC share).
        gpus_per_node: GPUs sharing the fast intra-node links.
        mem_bw: device memory bandwidth (bytes/s; listed, not used by the step-time model).
    """

    name: str
    memory_bytes: float
    peak_flops: dict[str, float]
    intra_node_bw: float
    inter_node_bw: float
    gpus_per_node: int = 8
    mem_bw: float = 0.0

    def flops_for(self, precision: str) -> float:
        """Peak FLOP/s of the matmuls a Trainer `precision` runs (bf16 for the mixed and
        true bf16 names, fp8 for Transformer Engine when listed, else bf16)."""
        if precision == "32-true":
            key = "fp32"
        elif precision == "16-mixed":
            key = "fp16"
        elif precision == "transformer-engine":
            key = "fp8" if "fp8" in self.peak_flops else "bf16"
        else:  # bf16-mixed, bf16-true, and the emulated formats (bf16 matmuls on dequantized)
            key = "bf16"
        return self.peak_flops.get(key) or self.peak_flops["bf16"]

    def to_dict(self) -> dict:
        """JSON-ready fields."""
        return asdict(self)


def _spec(name: str, mem_gib: float, bf16_t: float, fp8_t: float | None, tf32_t: float,
          nvlink_gb: float, hbm_tb: float, ib_gb: float = 50.0) -> GPUSpec:  # fmt: skip
    flops = {"bf16": bf16_t * _T, "fp16": bf16_t * _T, "fp32": tf32_t * _T}
    if fp8_t is not None:
        flops["fp8"] = fp8_t * _T
    return GPUSpec(
        name=name,
        memory_bytes=mem_gib * 2**30,
        peak_flops=flops,
        intra_node_bw=nvlink_gb * _GB,
        inter_node_bw=ib_gb * _GB,
        mem_bw=hbm_tb * 1e12,
    )


#: the built-in table (SXM parts; NVLink figures one direction per GPU)
GPUS: dict[str, GPUSpec] = {
    "a100": _spec("a100", 80, 312, None, 156, 300, 2.0, ib_gb=25.0),
    "h100": _spec("h100", 80, 989, 1979, 494, 450, 3.35),
    "h800": _spec("h800", 80, 989, 1979, 494, 200, 3.35),  # NVLink cut to 400 GB/s both ways
    "h200": _spec("h200", 141, 989, 1979, 494, 450, 4.8),
    "b200": _spec("b200", 180, 2250, 4500, 1100, 900, 8.0),
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
            return GPUSpec(**fields)
        except (json.JSONDecodeError, TypeError) as err:
            raise ValueError(
                f"bad GPU spec {text!r}: {err}. Give a JSON object with name, memory_bytes, "
                'peak_flops (e.g. {"bf16": 1e15}), intra_node_bw, inter_node_bw'
            ) from err
    key = text.lower()
    if key not in GPUS:
        raise ValueError(
            f"unknown GPU {text!r}; known: {', '.join(sorted(GPUS))}, or pass a JSON spec "
            "with name, memory_bytes, peak_flops, intra_node_bw, inter_node_bw"
        )
    return GPUS[key]
