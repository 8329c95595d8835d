"""Bytes of the model state one rank holds: parameters, gradients, master weights, optimizer.

Every figure comes from the rank's meta-device model (`rank_model.RankModel`) laid out with
the strategy's own rules: the gradient buffer is the padded flat buffer `GradBuckets`
allocates (`FlatLayout`, buckets padded to a multiple of dp), ZeRO's owned slices are
`FlatLayout.pieces` of each data-parallel rank, and the dtypes are the precision plugin's
(`nanotrain.precision.PRECISIONS`):

============  ==========  ===============  ======================  =====================
precision     parameters  gradient buffer  fp32 master weights     optimizer state
============  ==========  ===============  ======================  =====================
32-true       fp32        fp32             none                    fp32, per owned piece
*-mixed, TE,  fp32        fp32             none                    fp32
emulated
bf16-true     bf16        fp32 (main       of the owned pieces     fp32
                          grads)
============  ==========  ===============  ======================  =====================

Under ZeRO-1/2 the parameters live in the padded flat buffer and the optimizer state (and the
bf16-true masters) exist only for the rank's pieces, 1/dp of the dense and 1/(dp/ep) of its
experts. Our ZeRO-2 reduce-scatters the gradient into a shard buffer ``[numel / dp]`` and then
drops the full buffer, so between steps a rank holds only the shard, but during backward the
full buffer is still there: the *peak* gradient memory of ZeRO-2 is the full buffer plus the
shard (Megatron frees bucket by bucket; we do not, see docs/planning.md).

ZeRO-3 (FSDP2) holds padded per-tensor fp32 shards instead (`nanotrain.planning.zero3`):
parameters and gradients ``ceil(rows / g) x rest`` per tensor (under "bf16-true" the fp32
shards are the masters, gathered in bf16), the optimizer state of the rank's own rows, while
it computes the gathered copies of the units at work (`StateMemory.gathered`), and, with more
than one microbatch, the whole gradients accumulated before the one reduce-scatter; with
``cpu_offload`` the shards, gradients, masters and optimizer state are on the host
(`StateMemory.host`) and the GPU holds only the gathered copies and the buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanotrain.parallel.data_parallel import FlatLayout
from nanotrain.planning import zero3
from nanotrain.planning.kept import kept
from nanotrain.planning.layout import PlanLayout, Workload
from nanotrain.planning.rank_model import RankModel
from nanotrain.precision import PRECISIONS as PRECISION_PLUGINS
from nanotrain.strategies.megatron_grads import bucket_numel_for

__all__ = [
    "StateMemory",
    "element_size",
    "gather_dtype",
    "optimizer_pieces",
    "param_dtype",
    "state_memory",
    "zero3_optimizer_pieces",
]

_FP32 = 4


def param_dtype(precision: str) -> torch.dtype:
    """The dtype the precision plugin gives the parameters (fp32 unless it is "bf16-true")."""
    return getattr(PRECISION_PLUGINS[precision], "param_dtype", None) or torch.float32


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of `dtype`."""
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class StateMemory:
    """Bytes of one rank's model state (one data-parallel rank: the one with most state).

    Attributes:
        params: parameters (the padded flat buffer under ZeRO) and buffers.
        grads: the gradient buffer between steps (ZeRO-2: only the owned shard).
        grads_peak: the gradient buffers at their largest, during backward.
        master: fp32 master weights (bf16-true only).
        optimizer: optimizer state: `Workload.optimizer_states` fp32 tensors per element plus
            a 4-byte step counter per tensor (AdamW), for the owned pieces under ZeRO.
        optimizer_elements: elements the optimizer updates on this rank (its pieces).
        gathered: ZeRO-3's gathered parameter and gradient copies at their peak (an
            estimate, `zero3.gathered_bytes`; 0 otherwise).
        host: bytes on the host instead of the GPU (ZeRO-3 with cpu_offload: the shards,
            gradients, masters and optimizer state), not in `total`.
    """

    params: int
    grads: int
    grads_peak: int
    master: int
    optimizer: int
    optimizer_elements: int
    gathered: int = 0
    host: int = 0

    @property
    def total(self) -> int:
        """Peak bytes of the model state on the GPU (gradients at their peak)."""
        return self.params + self.grads_peak + self.master + self.optimizer + self.gathered


def optimizer_pieces(
    rank: RankModel, layout: PlanLayout, element_size: int
) -> list[tuple[int, int]]:
    """Per data-parallel rank, (elements, tensors) the optimizer updates under ZeRO.

    The owned slices are ZeRO's own (`FlatLayout` buckets, `Bucket.owned`): dense weights are
    sharded over dp, experts over dp / ep, and data-parallel rank d owns expert slice
    ``d % (dp / ep)`` (its rank in the expert-data-parallel group). Padding is owned but
    never optimized. Counted for all ranks of a bucket at once (the same numbers as
    `FlatLayout.pieces`, without listing the pieces of 2,048 ranks one by one).
    """
    # the owned slices depend only on the parameters' sizes: ranks of equal sizes share them
    key = (rank.sizes_id, layout.dp, layout.expert_dp, layout.ep, element_size,
           layout.bucket_size_mb)  # fmt: skip
    cached = _PIECES.get(key)
    if cached is not None:
        return cached
    numel = bucket_numel_for(element_size, layout.bucket_size_mb)
    elements = torch.zeros(layout.dp, dtype=torch.int64)
    tensors = torch.zeros(layout.dp, dtype=torch.int64)
    parts = ((rank.dense, rank.sizes_id[0], layout.dp),
             (rank.experts, rank.sizes_id[1], layout.expert_dp))  # fmt: skip
    for params, sizes_id, size in parts:
        if params:
            e, t = _part_counts(params, sizes_id, size, numel)
            # data-parallel rank d is rank d % size of its (expert-)data-parallel group
            index = torch.arange(layout.dp) % size
            elements, tensors = elements + e[index], tensors + t[index]
    out = list(zip(elements.tolist(), tensors.tolist(), strict=True))
    if len(_PIECES) > 4096:
        _PIECES.clear()
    _PIECES[key] = out
    return out


_PIECES: dict[tuple, list[tuple[int, int]]] = {}
_MOST: dict[tuple, tuple[int, int]] = {}


def _most_pieces(rank: RankModel, layout: PlanLayout, element_size: int) -> tuple[int, int]:
    """``max(optimizer_pieces(...))``, the data-parallel rank with the most optimizer state,
    kept per shape (a search asks it for every layout of up to 2,048 ranks)."""
    key = (rank.sizes_id, layout.dp, layout.expert_dp, layout.ep, element_size,
           layout.bucket_size_mb)  # fmt: skip
    return kept(_MOST, key, lambda: max(optimizer_pieces(rank, layout, element_size)))


def _part_counts(
    params: list[torch.Tensor], sizes_id: int, size: int, numel: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_owned_counts` of ``FlatLayout(params, size, numel)``, kept per sizes (the dense
    and the expert parameters of many ranks are the same sizes)."""
    return kept(
        _COUNTS, (sizes_id, size, numel), lambda: _owned_counts(FlatLayout(params, size, numel))
    )


_COUNTS: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
#: (bucket, rank) entries `_owned_counts` holds at once
_BLOCK_ENTRIES = 2**20


def _owned_counts(flat: FlatLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(elements, parameter pieces) inside each rank's owned slices of `flat`, ``[dp]`` each.
    Counted with numpy for many buckets at once (a search calls this for thousands of
    layouts, each with up to thousands of ranks and buckets)."""
    numels = [p.numel() for p in flat.params]
    ranks = np.arange(flat.dp_size, dtype=np.int64)
    elements = np.zeros(flat.dp_size, dtype=np.int64)
    pieces = np.zeros(flat.dp_size, dtype=np.int64)
    # the non-empty parameters, in flat order (contiguous: each starts where the last ends,
    # or at its bucket's padded start), and per bucket holding one: start, width, real end
    nonempty = [i for i, n in enumerate(numels) if n > 0]
    starts = np.array([flat.offsets[i] for i in nonempty], dtype=np.int64)
    ends = starts + np.array([numels[i] for i in nonempty], dtype=np.int64)
    rows = [
        (b.start, (b.end - b.start) // flat.dp_size, max(flat.offsets[i] + numels[i] for i in idx))
        for b in flat.buckets
        if (idx := [i for i in b.param_indices if numels[i] > 0])
    ]
    if not rows:
        return torch.from_numpy(elements), torch.from_numpy(pieces)
    table = np.array(rows, dtype=np.int64)
    step = max(1, _BLOCK_ENTRIES // flat.dp_size)  # buckets per block
    for b in range(0, len(table), step):
        start, width, real_end = (table[b : b + step, k : k + 1] for k in range(3))
        lo = start + ranks * width  # Bucket.owned of every rank, [buckets, dp]
        hi = lo + width
        elements += np.clip(np.minimum(hi, real_end) - lo, 0, None).sum(axis=0)
        # pieces: parameters starting before hi and ending after lo; a bucket's slices lie
        # inside it, so the other buckets' parameters cancel in the difference
        before_hi = np.searchsorted(starts, hi, side="left")
        ended = np.searchsorted(ends, lo, side="right")
        pieces += np.clip(before_hi - ended, 0, None).sum(axis=0)
    return torch.from_numpy(elements), torch.from_numpy(pieces)


def gather_dtype(precision: str) -> torch.dtype:
    """The dtype ZeRO-3 gathers parameters in (`fsdp_mixed_precision`): the precision's
    parameter dtype ("bf16-true": bf16 copies of the fp32 shards), fp32 under every other
    precision (autocast casts inside the forward, as on one process)."""
    return param_dtype(precision)


def zero3_optimizer_pieces(rank: RankModel, layout: PlanLayout) -> list[tuple[int, int]]:
    """Per data-parallel rank, (elements, tensors) the optimizer updates under ZeRO-3: its
    unpadded FSDP2 shard of every tensor (dense over dp, experts over dp / ep: data-parallel
    rank d is rank ``d // ep`` of its expert-data-parallel group, `MeshLayout`'s
    ``dp_rank = ep_rank + ep * expert_dp_rank``), every tensor counted (an empty shard still
    has its state entry)."""
    dense = zero3.local_numels(rank.dense, layout.dp)
    experts = zero3.local_numels(rank.experts, layout.expert_dp)
    tensors = len(rank.dense) + len(rank.experts)
    return [(dense[d] + experts[d // layout.ep], tensors) for d in range(layout.dp)]


def _zero3_memory(rank: RankModel, layout: PlanLayout, workload: Workload) -> StateMemory:
    """`state_memory` under ZeRO-3 (module docstring), for data-parallel rank 0, which
    holds the most (torch.chunk gives the first ranks the full rows). The shards are fp32
    under every precision ("bf16-true" too: they are its master weights) and so are their
    gradients. With more than one microbatch, or any under pp > 1, the strategy lets the
    gradients accumulate unsharded (FSDP2 without gradient sync) and reduce-scatters once at
    the end (after the last microbatch; after the whole schedule under pp): during backward a
    rank then also holds every parameter's whole gradient in fp32, unless it reduce-scatters
    every microbatch (``reduce_scatter_every_microbatch``)."""
    shard = zero3.sharded_numel(rank.dense, layout.dp) + zero3.sharded_numel(
        rank.experts, layout.expert_dp
    )
    elements, tensors = zero3_optimizer_pieces(rank, layout)[0]
    params = grads = shard * _FP32
    accumulates = layout.pp > 1 or (
        workload.num_microbatches(layout) > 1 and not layout.reduce_scatter_every_microbatch
    )
    accumulated = rank.params * _FP32 if accumulates else 0
    optimizer = workload.optimizer_states * elements * _FP32 + tensors * _FP32
    gathered = zero3.gathered_bytes(
        rank, layout, element_size(gather_dtype(workload.precision)), _FP32
    )
    host = 0
    if layout.cpu_offload:
        host = params + grads + optimizer
        params = grads = optimizer = 0
    return StateMemory(
        params=params + rank.buffer_bytes,
        grads=grads,
        grads_peak=grads + accumulated,
        master=0,
        optimizer=optimizer,
        optimizer_elements=elements,
        gathered=gathered,
        host=host,
    )


def state_memory(rank: RankModel, layout: PlanLayout, workload: Workload) -> StateMemory:
    """Bytes of parameters, gradients, masters and optimizer state on one rank of `rank`'s
    pipeline stage (see the module docstring for the rules)."""
    if layout.zero_stage == 3:
        return _zero3_memory(rank, layout, workload)
    dtype = param_dtype(workload.precision)
    size = element_size(dtype)
    dense_flat, expert_flat = rank.flat_numels(layout, size)
    flat = dense_flat + expert_flat
    buffers = rank.buffer_bytes  # router bias (fp32), load counters (int64), in their dtypes
    if layout.zero_stage > 0:
        elements, tensors = _most_pieces(rank, layout, size)
        params = flat * size
    else:
        elements, tensors = rank.params, len(rank.dense) + len(rank.experts)
        params = rank.params * size
    grads = flat * _FP32  # fp32 always: bf16 parameters accumulate into fp32 main grads
    shard = (dense_flat // layout.dp + expert_flat // layout.expert_dp) * _FP32
    if layout.zero_stage == 2:
        grads, grads_peak = shard, grads + shard
    else:
        grads_peak = grads
    master = elements * _FP32 if size != _FP32 else 0
    optimizer = workload.optimizer_states * elements * _FP32 + tensors * _FP32
    return StateMemory(
        params=params + buffers,
        grads=grads,
        grads_peak=grads_peak,
        master=master,
        optimizer=optimizer,
        optimizer_elements=elements,
    )
