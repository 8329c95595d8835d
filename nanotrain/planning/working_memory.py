"""Memory a rank holds beyond its model state and saved activations: the pipeline's held
stage outputs and transfer buffers, the MoE layers' working tensors, the communication
libraries' buffers and the allocator's fragmentation.

* **Held stage outputs** (measured: tests/distributed/test_plan_activations_pp.py). The
  schedule runner (`nanotrain.parallel.schedule_runner`) keeps every forward's output in
  ``held[(m, c)]`` until that microbatch-chunk's backward (B, or the input half I of a split
  one) backpropagates into it; the last virtual stage keeps none, and an output handed to
  another chunk of the same rank (DualPipeV's turn) counts only until that chunk's forward
  saves it as its input. Autograd saves no output of
  a chunk (its last op is a residual add), so these bytes are not among the saved
  activations. The received input it also holds is what the chunk's first layer saves (its
  norm's fp32 input, or the input of a layer recomputed fully or light), already counted
  there, except under "bf16-true" (the norm saves an fp32 copy): then it is held apart too. Under paired chunks
  (``overlap_forward_backward``) the forward's output is held before the paired backward's
  is released. One output is ``[b, s / tp under sequence parallelism, h]`` in the
  activation dtype the stages send (`megatron_pipeline.activation_dtype`: the parameters'
  dtype, bf16 under "bf16-true", fp32 under the autocast precisions).
* **Pipeline transfer buffers** (a bound, not measured): during one backward a rank holds the
  received gradient of the output and the gradient of the input it sends upstream: two
  activations (four while a paired backward and forward both wait on theirs).
* **MoE working tensors** (a bound from the dispatch path of `nanotrain.parallel.expert`,
  not measured): while a MoE layer runs, beside what it saves, the copies received by the
  dispatch, the experts' output and the copies the combine receives (in backward their
  gradients): ``[T·K, h]`` tensors (T tokens of the rank, K experts per token): the
  experts' output in the GEMM dtype, and under ep the dispatch's received copies in the
  stages' activation dtype (fp8 under ``fp8_dispatch``) and the combine's in the GEMM
  dtype; twice when paired chunks run two MoE layers at once.
* **Communication buffers** (a stated allowance from NCCL's documented defaults, not
  measured): NCCL gives each channel a buffer of ``NCCL_BUFFSIZE`` (4 MiB) per peer it
  connects to. A ring or tree collective (tp, dp, expert-dp groups larger than one) talks to
  two neighbours over `NCCL_CHANNELS` channels; point-to-point traffic (the ep all-to-all's
  ``ep - 1`` peers, the pipeline's previous and next stage) uses
  ``NCCL_NCHANNELS_PER_NET_PEER`` (2) channels per peer. gloo (CPU) keeps its buffers in
  host memory: 0 on the device.
* **Fragmentation** (a stated allowance): PyTorch's CUDA caching allocator rounds blocks
  (to 512 B, large ones to 2 MiB) and cannot hand a freed block's tail to a larger request,
  so reserved exceeds allocated; `FRAGMENTATION` allows 5% of the allocated peak (PyTorch's
  "CUDA memory management" notes: ``memory_reserved`` against ``memory_allocated``; set
  ``expandable_segments:True`` to shrink it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

from nanotrain.parallel.schedule_runner import pairs_with
from nanotrain.planning.activation_parts import dtypes_for
from nanotrain.planning.layout import PlanLayout, Workload
from nanotrain.planning.memory import element_size, param_dtype

__all__ = [
    "FRAGMENTATION",
    "NCCL_CHANNEL_BYTES",
    "NCCL_CHANNELS",
    "NCCL_P2P_CHANNELS",
    "WorkingMemory",
    "comm_buffer_bytes",
    "held_peak",
    "with_fragmentation",
    "working_memory",
]

#: fraction of the allocated peak the caching allocator reserves beyond it (module docstring)
FRAGMENTATION = 0.05
#: NCCL_BUFFSIZE's default: bytes of one channel's buffer for one peer (NCCL documentation)
NCCL_CHANNEL_BYTES = 4 * 2**20
#: channels of a ring / tree collective (NCCL picks them per topology; an allowance)
NCCL_CHANNELS = 16
#: NCCL_NCHANNELS_PER_NET_PEER's default: channels per point-to-point peer
NCCL_P2P_CHANNELS = 2


@dataclass(frozen=True)
class WorkingMemory:
    """Bytes one rank holds beyond its model state and saved activations (module docstring).

    Attributes:
        pipeline_held: the pipeline's held stage outputs (and received inputs no saved
            tensor shares) at their peak.
        pipeline_buffers: the received output gradient and sent input gradient of a backward.
        moe_working: a MoE layer's dispatch, expert output and combine tensors.
        comm_buffers: the communication library's buffers on the device.
        fragmentation: the allocator's allowance (set by `with_fragmentation`).
    """

    pipeline_held: int = 0
    pipeline_buffers: int = 0
    moe_working: int = 0
    comm_buffers: int = 0
    fragmentation: int = 0

    @property
    def total(self) -> int:
        """All of it, in bytes."""
        return (
            self.pipeline_held
            + self.pipeline_buffers
            + self.moe_working
            + self.comm_buffers
            + self.fragmentation
        )


def activation_bytes(layout: PlanLayout, workload: Workload) -> int:
    """Bytes of one activation the stages send: ``[b, s / tp under sp, h]`` elements times
    the parameters' dtype (`megatron_pipeline.activation_dtype`); `hidden` is applied by the
    caller."""
    rows = workload.micro_batch_size * workload.seq_len
    if layout.sequence_parallel and layout.tp > 1:
        rows //= layout.tp
    return rows * element_size(param_dtype(workload.precision))


def held_peak(
    layout: PlanLayout, num_microbatches: int, pp_rank: int, saves_input: tuple[bool, ...]
) -> int:
    """Most activations rank `pp_rank` holds at once in ``held`` that no saved tensor shares
    (see the module docstring), in units of one stage activation. `saves_input`: per local
    chunk, whether its first layer saves its input tensor itself (an fp32 residual stream, or
    a layer recomputed fully or light), so that a received input is no extra.

    Walked over the schedule's actions: a forward holds its input (unless its chunk saves it)
    and its output (unless it is the last virtual stage); a backward or input half lets both
    go; a chunk's saved input is saved until its B or W; an output handed to a chunk of this
    rank (DualPipeV's turn) is that chunk's input. Under ``overlap_forward_backward`` the
    runner holds a forward's output before it lets the paired backward's input and output
    go, the backward having freed its saved tensors by then."""
    if layout.pp == 1:
        return 0
    placement = layout.placement
    # per local chunk: the local chunk its output goes to (-1: another rank's, -2: none, the
    # last virtual stage), and whether its input is received (not the first virtual stage)
    nexts, receives = [], []
    for c in range(layout.virtual_pp):
        stage = placement.stage(pp_rank, c)
        receives.append(stage > 0)
        if stage + 1 == placement.num_virtual:
            nexts.append(-2)
        else:
            rank, chunk = placement.locate(stage + 1)
            nexts.append(chunk if rank == pp_rank else -1)
    return _held_peak(
        layout.schedule, num_microbatches, layout.pp, pp_rank, layout.virtual_pp,
        layout.overlap_forward_backward, tuple(nexts), tuple(receives), tuple(saves_input),
    )  # fmt: skip


@functools.lru_cache(maxsize=4096)
def _held_peak(
    schedule: str | None,
    num_microbatches: int,
    pp: int,
    pp_rank: int,
    virtual_pp: int,
    overlap: bool,
    nexts: tuple[int, ...],
    receives: tuple[bool, ...],
    saves_input: tuple[bool, ...],
) -> int:
    from nanotrain.planning.layout import pipeline_actions  # the cached schedules

    feeds = {n: c for c, n in enumerate(nexts) if n >= 0}  # chunk -> the local chunk feeding it

    def input_of(m: int, c: int) -> tuple | None:
        if not receives[c]:
            return None
        return ("out", m, feeds[c]) if c in feeds else ("in", m, c)

    def tensors_of(m: int, c: int) -> list[tuple]:
        out = [] if nexts[c] == -2 else [("out", m, c)]
        inp = input_of(m, c)
        return out + ([inp] if inp is not None else [])

    actions = pipeline_actions(schedule, num_microbatches, pp, pp_rank, virtual_pp)
    # refs[storage]: held entries referring to it; extra: storages held that no saved tensor
    # shares (kept up to date as entries and saves come and go)
    refs: dict[tuple, int] = {}
    saved: set[tuple] = set()
    extra = peak = i = 0

    def hold(m: int, c: int, sign: int) -> None:
        nonlocal extra
        for t in tensors_of(m, c):
            n = refs.get(t, 0) + sign
            refs[t] = n
            if t not in saved and n == (1 if sign > 0 else 0):
                extra += sign

    def save(t: tuple | None, on: bool) -> None:
        nonlocal extra
        if t is None or (t in saved) == on:
            return
        (saved.add if on else saved.discard)(t)
        if refs.get(t, 0):
            extra += -1 if on else 1

    while i < len(actions):
        a = actions[i]
        paired = overlap and i + 1 < len(actions) and pairs_with(a, actions[i + 1])
        b = actions[i + 1] if paired else a
        if a.kind == "F":
            hold(a.microbatch, a.chunk, 1)
            if saves_input[a.chunk]:
                save(input_of(a.microbatch, a.chunk), True)
            if paired and b.frees_activations:  # the paired backward has run by now
                save(input_of(b.microbatch, b.chunk), False)
            peak = max(peak, extra)
        if b.sends_input_grad:
            hold(b.microbatch, b.chunk, -1)
        if b.frees_activations:
            save(input_of(b.microbatch, b.chunk), False)
        i += 2 if paired else 1
    return peak


def comm_buffer_bytes(layout: PlanLayout, device: str) -> int:
    """The communication library's device buffers (module docstring): per collective group
    larger than one, two neighbours on `NCCL_CHANNELS` channels; per point-to-point peer,
    `NCCL_P2P_CHANNELS` channels; `NCCL_CHANNEL_BYTES` each. 0 on the CPU (gloo)."""
    if device == "cpu":
        return 0
    rings = sum(size > 1 for size in (layout.tp, layout.dp, layout.expert_dp))
    peers = (layout.ep - 1) + (2 if layout.pp > 1 else 0)
    channels = rings * 2 * NCCL_CHANNELS + peers * NCCL_P2P_CHANNELS
    return channels * NCCL_CHANNEL_BYTES


def working_memory(
    config: Any, layout: PlanLayout, workload: Workload, pp_rank: int, *, device: str
) -> WorkingMemory:
    """`WorkingMemory` of pipeline rank `pp_rank` (module docstring), fragmentation 0 (the
    caller applies `with_fragmentation` to the whole rank)."""
    hidden = config.hidden_size
    act_size = element_size(param_dtype(workload.precision))
    act = activation_bytes(layout, workload) * hidden
    num_micro = workload.num_microbatches(layout)
    paired = layout.overlap_forward_backward and layout.pp > 1
    chunks = layout.stage_chunks(config, pp_rank) if layout.pp > 1 else [range(config.num_layers)]
    fp32_stream = dtypes_for(workload.precision).stream == 4
    saves_input = tuple(
        fp32_stream or (bool(c) and layout.chunk_recomputes(list(c))[0] in ("full", "light"))
        for c in chunks
    )
    held = held_peak(layout, num_micro, pp_rank, saves_input) * act
    buffers = (4 if paired else 2) * act if layout.pp > 1 else 0
    moe = 0
    is_moe = getattr(config, "is_moe_layer", lambda _: False)
    if any(is_moe(i) for c in chunks for i in c):
        rows = workload.micro_batch_size * workload.seq_len
        if layout.sequence_parallel and layout.tp > 1:
            rows //= layout.tp
        copies = rows * config.num_experts_per_tok * hidden
        gemm = dtypes_for(workload.precision).gemm  # the experts' output dtype
        moe = copies * gemm  # the experts' output (its gradient in backward)
        if layout.ep > 1:  # the dispatch's and the combine's received copies
            moe += copies * (1 if layout.fp8_dispatch else act_size) + copies * gemm
        moe *= 2 if paired else 1
    return WorkingMemory(
        pipeline_held=held,
        pipeline_buffers=buffers,
        moe_working=moe,
        comm_buffers=comm_buffer_bytes(layout, device),
    )


def with_fragmentation(working: WorkingMemory, allocated: int) -> WorkingMemory:
    """`working` with its fragmentation allowance: `FRAGMENTATION` of `allocated` (the
    rank's allocated peak: state, activations and the other working terms)."""
    return replace(working, fragmentation=int(FRAGMENTATION * allocated))
