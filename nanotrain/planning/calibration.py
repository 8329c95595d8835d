"""The step-time model's measured constants, each with its source, in one place.

Every number here comes from a public kernel or collective measurement (or a vendor's
stated figure), never from fitting the published training runs the planner is compared with
(`nanotrain.planning.published_runs`, docs/planning.md "Calibration"). Where a figure is an
engineering reading of several measurements rather than one table cell, the source says so.

* **GEMM efficiency** (`GEMM_EFFICIENCY`): the fraction of the datasheet's dense peak that
  large bf16 / fp8 GEMMs reach. DeepGEMM (deepseek-ai/DeepGEMM README, "Performance",
  2025) measures its fp8 GEMMs on H800 SXM at up to 1,550 TFLOP/s for the large training
  shapes, 0.78 of the 1,979 peak; FlashAttention-3 (Shah et al. 2024, "FlashAttention-3",
  §4.1, Fig. 5) reaches 740 TFLOP/s in bf16 forward, 0.75 of 989. The planner uses 0.75 as
  the large-shape figure: the attention scores run at it, the plain linears and the grouped
  expert GEMMs at it times their shapes' factor (GEMM shapes below).
* **Links** (`MEASURED_LINKS`): what collectives reach per GPU, one direction. H800: DeepEP
  (deepseek-ai/DeepEP README, "Normal kernels with NVLink and RDMA forwarding", H800 with
  CX7 400 Gb/s InfiniBand) measures its intra-node dispatch / combine at 153-158 GB/s of
  NVLink and its inter-node ones at 43-47 GB/s of RDMA: 155 and 45. H100: NCCL's
  all-reduce bus bandwidth on an 8 x H100 SXM NVSwitch node (nccl-tests on DGX H100,
  NVIDIA's "NCCL 2.12+ NVLink SHARP" measurements) is about 360 GB/s without NVLS, 0.8 of
  the 450 GB/s link; between nodes the same 400 Gb/s NIC as the H800's, 45 GB/s. A100:
  0.8 of its 300 GB/s NVLink, and 0.9 of its 25 GB/s (200 Gb/s) NIC. H200 and B200 take the
  H100's fractions of their links (no training measurement found).
* **SMs for communication** (`COMM_SMS`): DeepSeek-V3 (DeepSeek-AI 2024, "DeepSeek-V3
  Technical Report", §3.2.2) gives 20 of an H800's 132 SMs to the all-to-all kernels that
  run beside compute. NCCL's own collectives take one SM per channel (CTA), a count NCCL
  picks per topology and call (bounded by ``NCCL_MIN_CTAS`` / ``NCCL_MAX_CTAS``, formerly
  ``NCCL_MIN_NCHANNELS`` / ``NCCL_MAX_NCHANNELS``); no public measurement of how many a
  training run's all-gathers, reduce-scatters and all-reduces hold on H100 / H800 was found,
  so DeepSeek's 20 is used for every collective the code runs beside compute (ZeRO-3's
  prefetched gathers and reduce-scatters, the data-parallel buckets' reductions, the paired
  chunks' all-to-alls). `comm_sm_seconds` prices it (one formula for all of them).
* **GEMM shapes** (`GEMM_TILE`, `SMS`): how a GEMM's shape moves it off the large-shape
  efficiency, derived from the hardware, not measured per shape (no public table of bf16
  H100 GEMM throughput by M, N, K was found to cite): the output is cut into 128 x 128 tiles
  (CUTLASS's Hopper GEMM examples, 48_hopper_warp_specialized_gemm: TileShape 128x128x64),
  one tile per SM at a time, so a partial tile or a partial last wave of tiles over the SMs
  (132 on H100 / H800 SXM, NVIDIA's H100 whitepaper) idles the rest; and a GEMM whose bytes
  (2 (MK + KN + MN) in bf16) take longer at HBM speed than its FLOPs at the large-shape
  efficiency is priced at HBM speed. `nanotrain.planning.gemm_shapes` derives it and
  `plan_layout` applies it to the plain linear layers and the routed experts' grouped GEMMs
  (the large-shape 0.75 times each stage's factor); the attention scores and the head keep
  the large-shape figure.
* **Attention kernels** (`FA2_SLOWDOWN`): the planner prices attention's score and value
  matmuls at `GEMM_EFFICIENCY`, FlashAttention-3's class. PyTorch's
  `scaled_dot_product_attention` runs FlashAttention-2 on H100 by default (its backend
  priority puts flash first; cuDNN's kernel is opt-in: meta-pytorch/tritonbench issue #41,
  2024-11). FlashAttention-3 (Shah et al. 2024, §4.1, Fig. 5 and 6, H100 SXM5, bf16, head
  dim 128, 8K tokens) measures FlashAttention-2 at 333 TFLOP/s against its own 602 in the
  causal forward and at 318 against 559 in the backward: a run on SDPA takes 1.81x the
  forward and 1.76x the backward time of the attention core (`nanotrain.planning.kernels`).
* **Eager elementwise ops** (`nanotrain.planning.memory_bound`): bytes counted from the op
  lists of RMSNorm in fp32 and `silu(gate) * up` as eager PyTorch runs them (one kernel per
  op, each reading its inputs and writing its output; autograd's formulas for backward), at
  the same HBM speed; no constant is fitted.
* **HBM** (`HBM_EFFICIENCY`): a device-to-device copy or STREAM triad sustains about
  3.0 TB/s of an H100 SXM's 3.35 (0.9), the figure the memory-bound operations are priced at
  (`nanotrain.planning.memory_bound`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "COMM_SMS",
    "FA2_SLOWDOWN",
    "GEMM_EFFICIENCY",
    "GEMM_TILE",
    "SMS",
    "HBM_EFFICIENCY",
    "MEASURED_LINKS",
    "Measured",
    "comm_sm_seconds",
    "gpu_sms",
]


@dataclass(frozen=True)
class Measured:
    """A constant and where it comes from."""

    value: float
    source: str


GEMM_EFFICIENCY = Measured(
    0.75,
    "DeepGEMM README (fp8 GEMM up to 1,550 of 1,979 TFLOP/s on H800) and FlashAttention-3 "
    "(Shah et al. 2024, §4.1: 740 of 989 TFLOP/s bf16 forward)",
)

#: the output tile one SM computes at a time (rows = columns)
GEMM_TILE = Measured(128, "CUTLASS 48_hopper_warp_specialized_gemm: TileShape 128x128x64")

#: streaming multiprocessors per GPU (the GEMM's tiles run one wave of SMS at a time)
SMS: dict[str, Measured] = {
    "h100": Measured(132, "NVIDIA H100 Tensor Core GPU Architecture whitepaper: 132 SMs (SXM5)"),
    "h800": Measured(132, "the H100 SXM5's die and SM count (DeepSeek-V3 §3.2.2: 132 SMs)"),
    "h200": Measured(132, "the H100 SXM5's die and SM count"),
    "a100": Measured(108, "NVIDIA A100 Tensor Core GPU Architecture whitepaper: 108 SMs"),
    "b200": Measured(148, "NVIDIA Blackwell datasheet: 148 SMs"),
}

HBM_EFFICIENCY = Measured(
    0.9, "sustained D2D copy / STREAM triad ~3.0 of 3.35 TB/s on H100 SXM (HBM3)"
)

#: FlashAttention-2's time over FlashAttention-3's for the same attention: (forward, backward)
FA2_SLOWDOWN = (
    Measured(602 / 333, "FlashAttention-3 paper Fig. 5: causal fwd, hdim 128, 8K, H100 SXM5"),
    Measured(559 / 318, "FlashAttention-3 paper Fig. 6: backward, hdim 128, 8K, H100 SXM5"),
)

#: SMs a communication kernel takes from compute while it overlaps it
COMM_SMS = Measured(20.0, "DeepSeek-V3 Technical Report §3.2.2: 20 of 132 SMs on H800")

#: (intra-node bytes/s, inter-node bytes/s) per GPU, one direction, what collectives reach
MEASURED_LINKS: dict[str, tuple[Measured, Measured]] = {
    "h800": (
        Measured(155e9, "DeepEP README: intranode dispatch/combine 153-158 GB/s NVLink, H800"),
        Measured(45e9, "DeepEP README: internode dispatch/combine 43-47 GB/s RDMA, CX7 400G"),
    ),
    "h100": (
        Measured(360e9, "nccl-tests all_reduce busbw ~360 GB/s on 8 x H100 SXM (no NVLS)"),
        Measured(45e9, "400 Gb/s NIC per GPU as the H800's: DeepEP's 43-47 GB/s RDMA"),
    ),
    "h200": (
        Measured(360e9, "the H100's NVLink 4 measurement (same links)"),
        Measured(45e9, "400 Gb/s NIC per GPU, as the H100's"),
    ),
    "a100": (
        Measured(240e9, "0.8 of NVLink 3's 300 GB/s, the H100's measured fraction"),
        Measured(22.5e9, "0.9 of a 200 Gb/s NIC, the H800's measured fraction"),
    ),
    "b200": (
        Measured(720e9, "0.8 of NVLink 5's 900 GB/s, the H100's measured fraction"),
        Measured(45e9, "400 Gb/s NIC per GPU, as the H100's"),
    ),
}


def comm_sm_seconds(comm_s: float, compute_s: float, sms: float) -> float:
    """Extra seconds `compute_s` seconds of compute take when communication kernels holding
    `COMM_SMS` of the GPU's `sms` SMs run beside it for `comm_s` seconds, both starting
    together (k = `COMM_SMS`, S = `sms`).

    While both run the compute goes at (S - k) / S of its speed. If the communication ends
    first, in its `comm_s` seconds the compute does ``comm_s (S - k) / S`` seconds of work
    and finishes ``comm_s k / S`` late; if the compute ends first, all of it runs slowed and
    takes ``compute_s S / (S - k)``, ``compute_s k / (S - k)`` more. The smaller of the two
    is the one that happens: ``min(comm_s k / S, compute_s k / (S - k))``. 0 when either is 0.

    Raises:
        ValueError: `sms` not above `COMM_SMS`, or a negative duration.
    """
    k = COMM_SMS.value
    if sms <= k:
        raise ValueError(f"a GPU needs more than the {k:g} SMs communication takes, got {sms}")
    if comm_s < 0 or compute_s < 0:
        raise ValueError(f"durations must be >= 0, got comm {comm_s}, compute {compute_s}")
    return min(comm_s * k / sms, compute_s * k / (sms - k))


def gpu_sms(gpu_name: str) -> int | None:
    """The SM count of the GPU family `gpu_name` names ("h100", "h100-96gb": `SMS`), None
    for a device without one (the CPU, a spec of an unknown family): no shape term and no
    SMs taken by communication are priced there."""
    family = gpu_name.split("-")[0]
    return int(SMS[family].value) if family in SMS else None
