"""Context parallelism: each sequence split over the ``cp`` ranks of a context-parallel group,
attention over the whole sequence by all-gathering the keys and values.

Causal load balance (Megatron-Core's and Llama 3's placement). A sequence of T tokens is cut
into 2N chunks of T / 2N tokens (N = cp); rank i holds chunks i and 2N-1-i, so every rank
holds one early chunk (few keys to attend to) and one late chunk (many)::

    chunk   0    1    2    3    4    5    6    7        (N = 4, T / 8 tokens each)
    rank    0    1    2    3    3    2    1    0

A rank's tokens are its two chunks side by side, ``[chunk i | chunk 2N-1-i]``, and their
global positions (`chunk_positions`) drive RoPE and the causal mask.

Attention (Llama 3 section 3.3.2's all-gather, not a ring): each rank computes its queries,
keys and values for its own tokens, all-gathers the keys and values of the whole sequence
(`gather_sequence`, whose backward reduce-scatters their gradients back to the ranks that
own the tokens), and masks by global position (`causal_mask`). What a model gathers is its
choice: the dense model its K and V after RoPE, MLA its compressed latent and rope key.

Every function takes the group explicitly and is a no-op on ``None`` or a one-rank group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from nanotrain.parallel.collectives import (
    gather_from_sequence_parallel_region,
    group_rank,
    group_size,
)

__all__ = [
    "causal_mask",
    "check_context_length",
    "chunk_positions",
    "context_batch",
    "count_once",
    "gather_sequence",
    "on_whole_sequence",
    "split_sequence",
]


def check_context_length(seq_len: int, cp: int, tp: int = 1) -> None:
    """Check that ``seq_len`` splits into 2·cp equal chunks (each also divisible by ``tp``
    under sequence parallelism, which splits a rank's tokens again over tp).

    Raises:
        ValueError: naming the lengths that would work.
    """
    step = 2 * cp * tp
    if seq_len % step != 0:
        what = f"2*cp*tp = 2*{cp}*{tp}" if tp > 1 else f"2*cp = 2*{cp}"
        raise ValueError(
            f"context parallelism cuts each sequence into 2*cp chunks (causal load balance)"
            f"{' split again over tp by sequence parallelism' if tp > 1 else ''}: seq_len="
            f"{seq_len} must be a multiple of {what} = {step}; use seq_len "
            f"{max(step, seq_len - seq_len % step)} or {seq_len - seq_len % step + step}"
        )


def chunk_positions(seq_len: int, cp: int, cp_rank: int, device: Any = None) -> Tensor:
    """Global positions of the tokens context-parallel rank ``cp_rank`` holds, in its order:
    ``[chunk cp_rank | chunk 2·cp-1-cp_rank]``, int64 [seq_len / cp].

    Raises:
        ValueError: seq_len not divisible by 2·cp, or cp_rank outside [0, cp).
    """
    check_context_length(seq_len, cp)
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank={cp_rank} is outside [0, {cp})")
    c = seq_len // (2 * cp)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    last = 2 * cp - 1 - cp_rank
    second = torch.arange(last * c, (last + 1) * c, device=device)
    return torch.cat([first, second])


def split_sequence(x: Tensor, cp: int, cp_rank: int, dim: int = 1) -> Tensor:
    """This rank's two chunks of a whole-sequence tensor: x [..., T, ...] along ``dim`` ->
    [..., T / cp, ...] (chunks cp_rank and 2·cp-1-cp_rank, side by side). Not autograd-aware
    beyond slicing: meant for inputs (token ids, labels).

    Raises:
        ValueError: the length along ``dim`` does not split into 2·cp chunks.
    """
    if cp == 1:
        return x
    t = x.shape[dim]
    check_context_length(t, cp)
    c = t // (2 * cp)
    last = 2 * cp - 1 - cp_rank
    return torch.cat([x.narrow(dim, cp_rank * c, c), x.narrow(dim, last * c, c)], dim=dim)


def gather_sequence(x: Tensor, group: ProcessGroup | None, dim: int = 1) -> Tensor:
    """The whole sequence, in global order, from every context-parallel rank's two chunks.

    Forward: all-gather along ``dim`` of each rank's [chunk i | chunk 2N-1-i], then the
    chunks put back in sequence order; backward: the gradient's chunks put in rank order and
    reduce-scattered (summed over the ranks, each keeping its own tokens' part).

    x: [..., T / cp, ...] -> [..., T, ...]. A no-op on ``None`` or a one-rank group.
    """
    cp = group_size(group)
    if cp == 1:
        return x
    gathered = gather_from_sequence_parallel_region(x, group, dim)  # rank order
    c = x.shape[dim] // 2
    # global chunk j sits at slot 2j (j < N, rank j's first) or 2(2N-1-j)+1 (rank 2N-1-j's
    # second) of the gathered tensor
    slots = [2 * j if j < cp else 2 * (2 * cp - 1 - j) + 1 for j in range(2 * cp)]
    return torch.cat([gathered.narrow(dim, s * c, c) for s in slots], dim=dim)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, factor: float) -> Tensor:  # type: ignore[override]
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad * ctx.factor, None


def count_once(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """A per-sequence loss term that every context-parallel rank computes whole (from
    statistics summed over ``group`` with an identity backward) while the strategy weighs each
    rank's copy as its own sequences: the gradient is scaled by the group's size so that the
    ranks' backwards, each through its own tokens, add up to one process's.

    Forward: identity; backward: gradient x cp. A no-op on ``None`` or a one-rank group.
    """
    cp = group_size(group)
    return x if cp == 1 else _ScaleGrad.apply(x, float(cp))


def causal_mask(positions: Tensor, seq_len: int) -> Tensor:
    """Which keys each local query may attend to: query at global position p sees keys
    0..p. positions [T_local] int64 -> [1, 1, T_local, seq_len] bool (True = attend), keys in
    global order (as `gather_sequence` returns them)."""
    keys = torch.arange(seq_len, device=positions.device)
    return (positions[:, None] >= keys[None, :])[None, None]


def context_batch(batch: Any, group: ProcessGroup | None) -> Any:
    """This rank's part of a microbatch: every tensor of a dict with a sequence dim (dim 1 of
    the same length as ``input_ids``, i.e. input_ids, labels and anything aligned with them)
    cut to this rank's two chunks; other entries (per-sample values) kept whole. Labels must
    already be shifted (position t holds the target of token t), which the data does, so the
    shift crosses chunk boundaries as on one process.

    Raises:
        TypeError: the batch is not a mapping with an ``input_ids`` tensor [B, T].
        ValueError: T does not split into 2·cp chunks.
    """
    cp = group_size(group)
    if cp == 1:
        return batch
    if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), Tensor):
        raise TypeError(
            "context parallelism (cp > 1) cuts each batch along the sequence and needs dict "
            f"batches with an 'input_ids' tensor [batch, seq], got {type(batch).__name__}"
        )
    t = batch["input_ids"].shape[1]
    rank = group_rank(group)
    return {
        key: split_sequence(value, cp, rank)
        if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[1] == t
        else value
        for key, value in batch.items()
    }


def on_whole_sequence(fn: Any, tensors: tuple[Tensor, ...], group: ProcessGroup | None) -> Tensor:
    """``fn`` applied to the whole sequences, and this rank's chunks of its result: for what
    reads beyond a chunk's end, as multi-token prediction's inputs and targets (token t + k
    at position t) do. tensors: [B, T / cp] each (token ids, labels: no gradient), gathered
    to [B, T] in global order; fn(*whole) -> [B, T], cut back to [B, T / cp].
    On ``None`` or a one-rank group: ``fn(*tensors)``."""
    cp = group_size(group)
    if cp == 1:
        return fn(*tensors)
    with torch.no_grad():
        whole = [gather_sequence(x, group) for x in tensors]
    return split_sequence(fn(*whole), cp, group_rank(group))
