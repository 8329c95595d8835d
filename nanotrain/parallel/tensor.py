"""Tensor-parallel layers (Megatron-LM semantics) that reduce to ``nn.Linear``/``nn.Embedding``.

With ``tp_group=None`` (or a group of one rank) every layer here has the same parameter
names, shapes, initialisation (bit for bit, for the same RNG state) and forward math as the
plain ``torch.nn`` layer, so one-process code can use them unconditionally.

With a tensor-parallel group of ``tp`` ranks:

* ``ColumnParallelLinear`` holds rows ``[r*out/tp, (r+1)*out/tp)`` of the full ``[out, in]``
  weight: its input is replicated, its output is split along the last dim.
* ``RowParallelLinear`` holds columns ``[r*in/tp, (r+1)*in/tp)``: its input is split along the
  last dim, its output is the all-reduced (or sequence reduce-scattered) full result.
* ``VocabParallelEmbedding`` holds rows ``[r*Vp/tp, (r+1)*Vp/tp)`` of the embedding table padded
  to ``Vp``, the vocabulary rounded up to a multiple of ``tp``.

A ``ColumnParallelLinear`` followed by a ``RowParallelLinear`` is Megatron-LM's split of a
transformer MLP or attention block (Shoeybi et al. 2019, section 3): *f* before the first
(identity forward, all-reduce backward), *g* after the second (all-reduce forward, identity
backward), and no communication in between. Under sequence parallelism (Korthikanti et al.
2022, section 4.2.2) *f* becomes an all-gather along the sequence (*g*) and *g* a
reduce-scatter (*g-bar*); the operators live in `nanotrain.parallel.collectives`.

Initialisation is layout-independent: each layer draws the *full* tensor from the default RNG
exactly as ``torch.nn`` would and keeps its own slice. All ranks of a tensor-parallel group must
therefore hold the same RNG state when layers are built (seed every rank alike). This costs one
full-size temporary per layer at build time and buys identical weights under every ``tp``.

Every layer exposes ``tp_partition_dims`` (parameter name -> sharded dim, ``None`` when the
parameter is replicated over the group) and the three helpers built on it:
``shard_full_state_dict``, ``load_full_state_dict`` and ``gather_full_state_dict``.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from nanotrain.parallel.collectives import (
    all_gather_along_dim,
    enter_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    group_rank,
    group_size,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from nanotrain.parallel.sp_regather import RegatheredInput, cast_in_region

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "pad_vocab_size",
    "shard_tensor",
]


def pad_vocab_size(vocab_size: int, tp_size: int) -> int:
    """Smallest multiple of ``tp_size`` that is ``>= vocab_size``."""
    return -(-vocab_size // tp_size) * tp_size


def shard_tensor(full: Tensor, dim: int | None, rank: int, size: int) -> Tensor:
    """Rank ``rank``'s contiguous slice of ``full`` split in ``size`` equal parts along ``dim``.

    ``dim=None`` means the tensor is replicated: a copy of ``full`` is returned.

    Raises:
        ValueError: if ``full.shape[dim]`` is not divisible by ``size``.
    """
    if dim is None or size == 1:
        return full.clone()
    if full.shape[dim] % size != 0:
        raise ValueError(
            f"cannot shard dim {dim} of shape {tuple(full.shape)} into {size} parts; "
            f"{full.shape[dim]} is not divisible by {size}"
        )
    return full.chunk(size, dim=dim)[rank].clone()


def _check_divisible(what: str, value: int, tp_size: int) -> None:
    if value % tp_size != 0:
        valid = [d for d in range(1, value + 1) if value % d == 0]
        raise ValueError(
            f"{what}={value} is not divisible by the tensor-parallel size {tp_size}; "
            f"choose tp from {valid} or change {what}"
        )


class _TensorParallelModule(nn.Module):
    """Shared state-dict helpers for layers whose parameters are sharded over ``tp_group``."""

    tp_partition_dims: ClassVar[dict[str, int | None]] = {}
    tp_group: ProcessGroup | None

    @property
    def tp_size(self) -> int:
        """Number of ranks in the tensor-parallel group (1 without one)."""
        return group_size(self.tp_group)

    @property
    def tp_rank(self) -> int:
        """This rank's index in the tensor-parallel group (0 without one)."""
        return group_rank(self.tp_group)

    def _shard_full(self, name: str, full: Tensor) -> Tensor:
        return shard_tensor(full, self.tp_partition_dims[name], self.tp_rank, self.tp_size)

    def shard_full_weight(self, full: Tensor) -> Tensor:
        """This rank's slice of an unsharded ``weight`` (shape as in the ``torch.nn`` layer)."""
        return self._shard_full("weight", full)

    def shard_full_state_dict(self, full: dict[str, Tensor]) -> dict[str, Tensor]:
        """Map an unsharded state dict (``torch.nn`` shapes) to this rank's shards (copies).

        Raises:
            ValueError: if a key is missing or a shape does not match this layer.
        """
        out = {}
        for name, param in self.named_parameters(recurse=False):
            if name not in full:
                raise ValueError(f"full state dict lacks {name!r}; it has {sorted(full)}")
            shard = self._shard_full(name, full[name])
            if shard.shape != param.shape:
                raise ValueError(
                    f"{name!r}: full tensor {tuple(full[name].shape)} sharded to "
                    f"{tuple(shard.shape)}, but this rank's parameter is {tuple(param.shape)}"
                )
            out[name] = shard
        return out

    @torch.no_grad()
    def load_full_state_dict(self, full: dict[str, Tensor]) -> None:
        """Copy this rank's shards of an unsharded state dict into the parameters."""
        for name, shard in self.shard_full_state_dict(full).items():
            getattr(self, name).copy_(shard)

    @torch.no_grad()
    def gather_full_state_dict(self) -> dict[str, Tensor]:
        """Unsharded copies of the parameters (a collective: every rank of the group calls it)."""
        out = {}
        for name, param in self.named_parameters(recurse=False):
            dim = self.tp_partition_dims[name]
            out[name] = (
                param.clone() if dim is None else all_gather_along_dim(param, dim, self.tp_group)
            )
        return out


def _init_linear_like_torch(
    layer: _TensorParallelModule, in_features: int, out_features: int
) -> None:
    """Initialise like ``nn.Linear.reset_parameters`` on the full weight, then keep a slice
    (nothing on the meta device: no values to set, and `build_model` initialises after it
    materialises; the planner builds hundreds of meta models, where this took half)."""
    w = layer.weight
    if w.is_meta:
        return
    full_w = torch.empty(out_features, in_features, device=w.device, dtype=w.dtype)
    # kaiming_uniform_(a=sqrt(5)) is U(-1/sqrt(in), 1/sqrt(in)): the nn.Linear default.
    nn.init.kaiming_uniform_(full_w, a=math.sqrt(5))
    w.copy_(layer.shard_full_weight(full_w))
    if layer.bias is not None:
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
        full_b = torch.empty(out_features, device=w.device, dtype=w.dtype)
        nn.init.uniform_(full_b, -bound, bound)
        layer.bias.copy_(layer._shard_full("bias", full_b))


class ColumnParallelLinear(_TensorParallelModule):
    """``y = x W^T + b`` with ``W`` split by output rows over the tensor-parallel group.

    Megatron-LM's column split (Shoeybi et al. 2019, section 3, eq. 3): in the paper's
    ``Y = X A`` (``A = W^T``) the weight is split by columns, ``A = [A_1, ..., A_tp]``, so rank
    i computes ``Y_i = X A_i`` from the whole input and an elementwise nonlinearity after it
    (GeLU in the paper; SwiGLU's ``silu(gate) * up`` here) runs on ``Y_i`` without
    communication.

    Parameters: ``weight [out_features // tp, in_features]``, ``bias [out_features // tp]``.

    Forward: ``x [..., in_features] -> y [..., out_features // tp]``, or
    ``[..., out_features]`` with ``gather_output=True``. Communication: the input goes through
    *f* (identity forward, all-reduce of its grad in backward). With ``sequence_parallel=True``
    the input is ``[batch, seq // tp, in_features]`` (sequence dim ``seq_dim``) and is
    all-gathered along the sequence in forward; its grad is reduce-scattered in backward (the
    *g* of Korthikanti et al. 2022).
    With ``shared_input=True`` the layer does no input collective at all: the caller has
    passed the input through ``enter_tensor_parallel_region`` once for every column-parallel
    layer that reads it (q/k/v, gate/up), so the backward sums their grads in one collective
    instead of one per layer (Megatron gets the same from its fused qkv / gate-up weights).

    Raises:
        ValueError: if ``out_features`` is not divisible by the group size.
    """

    tp_partition_dims: ClassVar[dict[str, int | None]] = {"weight": 0, "bias": 0}

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        tp_group: ProcessGroup | None = None,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        shared_input: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp_group = tp_group
        _check_divisible("out_features", out_features, self.tp_size)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel, self.seq_dim = (
            gather_output,
            sequence_parallel,
            seq_dim,
        )
        self.shared_input = shared_input
        factory = {"device": device, "dtype": dtype}
        local_out = out_features // self.tp_size
        self.weight = nn.Parameter(torch.empty(local_out, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(local_out, **factory)) if bias else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``nn.Linear`` initialisation of the full weight; this rank keeps its rows."""
        _init_linear_like_torch(self, self.in_features, self.out_features)

    def forward(self, x: Tensor) -> Tensor:
        """``x [..., in] -> [..., out // tp]`` (``[..., out]`` with ``gather_output``).

        With ``shared_input`` the input must already be the whole (entered) activation.
        Under sequence parallelism the gathered input is saved as this rank's shard and
        gathered again in backward (`nanotrain.parallel.sp_regather`; with ``shared_input``
        inside the caller's `RegatheredInput`).
        """
        if self.shared_input:
            y = F.linear(cast_in_region(x), self.weight, self.bias)  # [..., out // tp]
        elif self.sequence_parallel and self.tp_size > 1:
            # the gathered sequence is saved as this rank's shard (`sp_regather`)
            full = enter_tensor_parallel_region(
                x, self.tp_group, sequence_parallel=True, seq_dim=self.seq_dim
            )
            with RegatheredInput(full, x, self.tp_group, self.seq_dim):
                y = F.linear(cast_in_region(full), self.weight, self.bias)
        else:
            x = enter_tensor_parallel_region(x, self.tp_group, seq_dim=self.seq_dim)
            y = F.linear(cast_in_region(x), self.weight, self.bias)
        if self.gather_output:
            y = gather_from_tensor_parallel_region(y, self.tp_group)  # [..., out]
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, tp={self.tp_size}, "
            f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}, "
            f"shared_input={self.shared_input}"
        )


class RowParallelLinear(_TensorParallelModule):
    """``y = x W^T + b`` with ``W`` split by input columns over the tensor-parallel group.

    Megatron-LM's row split (Shoeybi et al. 2019, section 3): the second GEMM ``Z = Y B``
    (``B = W^T``) has ``B`` split by rows, ``B = [B_1; ...; B_tp]``, matching the column-split
    ``Y_i`` a ``ColumnParallelLinear`` left on rank i, so ``Z = sum_i Y_i B_i`` needs one
    reduction over the group, after this layer, and none between the two.

    Parameters: ``weight [out_features, in_features // tp]``, ``bias [out_features]``
    (replicated, added once after the reduction).

    Forward: ``x [..., in_features // tp] -> y [..., out_features]``; the partial products are
    summed with *g* (all-reduce forward, identity backward). With ``input_is_parallel=False``
    the input is the full ``[..., in_features]`` and is split first. With
    ``sequence_parallel=True`` the sum is a reduce-scatter along ``seq_dim`` instead (*g-bar*,
    Korthikanti et al. 2022), so the output is ``[batch, seq // tp, out_features]``; the bias
    grad is then a partial sum over this rank's tokens and must be all-reduced over the group
    (see ``partial_grad_names``).

    Raises:
        ValueError: if ``in_features`` is not divisible by the group size.
    """

    tp_partition_dims: ClassVar[dict[str, int | None]] = {"weight": 1, "bias": None}

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        tp_group: ProcessGroup | None = None,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp_group = tp_group
        _check_divisible("in_features", in_features, self.tp_size)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel, self.seq_dim = (
            input_is_parallel,
            sequence_parallel,
            seq_dim,
        )
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features // self.tp_size, **factory)
        )
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self.reset_parameters()

    @property
    def partial_grad_names(self) -> tuple[str, ...]:
        """Replicated parameters whose grads are per-rank partial sums (need a TP all-reduce)."""
        if self.sequence_parallel and self.bias is not None and self.tp_size > 1:
            return ("bias",)
        return ()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``nn.Linear`` initialisation of the full weight; this rank keeps its columns."""
        _init_linear_like_torch(self, self.in_features, self.out_features)

    def forward(self, x: Tensor) -> Tensor:
        """``x [..., in // tp] -> [..., out]`` (sequence-sharded output with sequence_parallel)."""
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.tp_group)  # [..., in // tp]
        y = F.linear(x, self.weight)  # partial sum over this rank's input columns
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group, self.seq_dim)
        else:
            y = reduce_from_tensor_parallel_region(y, self.tp_group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, tp={self.tp_size}, "
            f"input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(_TensorParallelModule):
    """Token embedding whose vocabulary rows are split over the tensor-parallel group.

    The vocabulary is padded to ``padded_num_embeddings = pad_vocab_size(num_embeddings, tp)``;
    padding rows are zero and never looked up by valid ids. Parameter:
    ``weight [padded_num_embeddings // tp, embedding_dim]`` (``[num_embeddings, dim]`` at tp=1,
    exactly ``nn.Embedding``). Initialisation: ``N(0, 1)`` like ``nn.Embedding``.

    Forward: ``ids [...]`` (global ids in ``[0, num_embeddings)``, not checked, to avoid a host
    sync) ``-> [..., embedding_dim]``. Each rank looks up the ids in its own range, zeroes the
    others and the partial results are all-reduced; with ``sequence_parallel=True`` they are
    reduce-scattered along ``seq_dim`` instead, giving ``[batch, seq // tp, dim]``.

    This is Megatron-LM's input embedding (Shoeybi et al. 2019, section 3): the table is split
    along the vocabulary and the partial lookups are summed by *g* (all-reduce forward,
    identity backward), or by sequence parallelism's *g-bar* (reduce-scatter forward,
    all-gather backward).
    """

    tp_partition_dims: ClassVar[dict[str, int | None]] = {"weight": 0}

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_group: ProcessGroup | None = None,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        self.padded_num_embeddings = pad_vocab_size(num_embeddings, self.tp_size)
        self.rows_per_rank = self.padded_num_embeddings // self.tp_size
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.weight = nn.Parameter(
            torch.empty(self.rows_per_rank, embedding_dim, device=device, dtype=dtype)
        )
        self.reset_parameters()

    def _pad(self, full: Tensor) -> Tensor:
        """Append zero rows so a ``[num_embeddings, ...]`` tensor splits evenly."""
        extra = self.padded_num_embeddings - full.shape[0]
        if extra == 0:
            return full
        return torch.cat([full, full.new_zeros(extra, *full.shape[1:])], dim=0)

    def _shard_full(self, name: str, full: Tensor) -> Tensor:
        if full.shape[0] != self.num_embeddings:
            raise ValueError(
                f"full embedding has {full.shape[0]} rows; expected num_embeddings="
                f"{self.num_embeddings} (unpadded)"
            )
        return shard_tensor(self._pad(full), 0, self.tp_rank, self.tp_size)

    @torch.no_grad()
    def gather_full_state_dict(self) -> dict[str, Tensor]:
        """Unsharded ``{"weight": [num_embeddings, dim]}`` (padding dropped); a collective."""
        full = all_gather_along_dim(self.weight, 0, self.tp_group)
        return {"weight": full[: self.num_embeddings].clone()}

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``nn.Embedding`` initialisation (``N(0, 1)``) of the full table; keep this shard."""
        full = torch.empty(
            self.num_embeddings,
            self.embedding_dim,
            device=self.weight.device,
            dtype=self.weight.dtype,
        )
        nn.init.normal_(full)
        self.weight.copy_(self.shard_full_weight(full))

    def forward(self, ids: Tensor) -> Tensor:
        """``ids [...] -> [..., embedding_dim]`` (sequence-sharded with sequence_parallel)."""
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        # Out-of-range ids look up row 0 and are zeroed, so only the owning rank contributes.
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.tp_group, self.seq_dim)
        return reduce_from_tensor_parallel_region(out, self.tp_group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}, "
            f"padded_num_embeddings={self.padded_num_embeddings}"
        )
