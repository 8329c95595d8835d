"""Data parallelism: gradients in one flat buffer, reduced in buckets while backward still runs.

Every trainable parameter's ``.grad`` is a view into one flat buffer, laid out in (roughly)
the order backward produces gradients: the module's parameters reversed. The buffer is cut
into buckets of about ``bucket_numel`` elements, each padded to a multiple of the data-parallel
size ``dp`` so that it splits into ``dp`` equal, contiguous slices::

    flat buffer  | bucket 0 (params ..., pad) | bucket 1 (params ..., pad) | ...
    dp rank r    |   owns slice r of bucket 0 |   owns slice r of bucket 1 | ...

A post-accumulate-grad hook counts down each bucket's parameters; once a bucket is complete on
the last microbatch of a step, its collective is launched asynchronously (``all_reduce``, or
``reduce_scatter`` into a shard buffer for ZeRO-2) while backward continues on earlier layers
(PyTorch DDP's gradient bucketing and overlap, Li et al. 2020, "PyTorch Distributed").
Buckets are launched strictly in index order, as DDP does: ranks with different data (MoE
routing) can finish gradients in a different order, and collectives on one group must be
issued in the same order everywhere.

Gradients are divided by ``dp`` before the sum, so the result is the mean over replicas.
Together with the strategy's per-microbatch weights (``tokens_i * dp / global_tokens``, see
`nanotrain.strategies.base.weigh_microbatches`) this is the gradient of the mean loss over
every token of the global batch.

Expert parallelism needs two such buffers (`GradBucketSets`): dense weights reduced over the
data-parallel group, expert weights over the smaller expert-data-parallel group. The expert
buffer still divides by the full ``dp`` (its ``divisor``): each expert's local gradient already
sums the token gradients of every rank of its expert-parallel group (the all-to-all brought
them), so summing over the ``dp / ep`` expert-data ranks adds up all ``dp`` replicas' terms.

This module knows nothing of the Trainer; it needs only a process group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from nanotrain.parallel.collectives import group_rank, group_size

# torch 2.13 renamed the single-tensor forms (the old names warn); older torch has only those.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = ["Bucket", "FlatLayout", "GradBucketSets", "GradBuckets", "ShardPiece", "backward_order"]


@dataclass(frozen=True)
class Bucket:
    """Elements ``[start, end)`` of the flat buffer (padding included), holding `param_indices`.

    ``end - start`` is a multiple of the data-parallel size, so every rank owns an equal slice.
    """

    start: int
    end: int
    param_indices: tuple[int, ...]

    def owned(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        """Flat range ``[lo, hi)`` of this bucket owned by ``dp_rank``."""
        width = (self.end - self.start) // dp_size
        lo = self.start + dp_rank * width
        return lo, lo + width


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter that falls into one rank's slice of one bucket.

    Attributes:
        param_index: index into `FlatLayout.params`.
        flat_start, flat_end: the piece in flat-buffer coordinates.
        param_start: where the piece starts inside the flattened parameter.
        shard_start: where the piece starts in this rank's shard buffer (``numel / dp`` long).
    """

    param_index: int
    flat_start: int
    flat_end: int
    param_start: int
    shard_start: int

    @property
    def numel(self) -> int:
        """Number of elements in the piece."""
        return self.flat_end - self.flat_start


class FlatLayout:
    """Offsets of parameters in a flat buffer, the buckets, and each rank's owned slices.

    Pure arithmetic on shapes: no process group, no allocation.

    Args:
        params: parameters in buffer order (put the ones whose grads are ready first, first).
        dp_size: data-parallel size; every bucket is padded to a multiple of it.
        bucket_numel: a bucket is closed once it holds at least this many elements.

    Raises:
        ValueError: for a non-positive ``dp_size`` or ``bucket_numel``.
    """

    def __init__(self, params: Sequence[Tensor], dp_size: int, bucket_numel: int) -> None:
        if dp_size < 1 or bucket_numel < 1:
            raise ValueError(
                f"dp_size and bucket_numel must be >= 1, got {dp_size} and {bucket_numel}"
            )
        self.params = list(params)
        self.dp_size = dp_size
        self.offsets: list[int] = []
        self.buckets: list[Bucket] = []
        start = offset = 0
        members: list[int] = []
        for i, p in enumerate(self.params):
            self.offsets.append(offset)
            offset += p.numel()
            members.append(i)
            if offset - start >= bucket_numel or i == len(self.params) - 1:
                end = start + -(-(offset - start) // dp_size) * dp_size  # pad to a dp multiple
                self.buckets.append(Bucket(start, end, tuple(members)))
                start = offset = end
                members = []
        self.numel = start
        self.bucket_of = [b for b, bucket in enumerate(self.buckets) for _ in bucket.param_indices]

    @property
    def shard_numel(self) -> int:
        """Elements each data-parallel rank owns: ``numel / dp`` (padding included)."""
        return self.numel // self.dp_size

    def pieces(self, dp_rank: int) -> list[ShardPiece]:
        """Every piece of every parameter inside ``dp_rank``'s owned slices, in flat order."""
        out = []
        for bucket in self.buckets:
            lo, hi = bucket.owned(dp_rank, self.dp_size)
            shard_base = bucket.start // self.dp_size
            for i in bucket.param_indices:
                p_lo = self.offsets[i]
                a, b = max(lo, p_lo), min(hi, p_lo + self.params[i].numel())
                if a < b:
                    out.append(ShardPiece(i, a, b, a - p_lo, shard_base + a - lo))
        return out

    def view(self, flat: Tensor, index: int) -> Tensor:
        """Parameter ``index``'s slice of ``flat``, shaped like the parameter."""
        p, off = self.params[index], self.offsets[index]
        return flat[off : off + p.numel()].view(p.shape)


class GradBuckets:
    """Flat gradient buffer of `params` with bucketed, backward-overlapped data-parallel reduction.

    Usage per optimizer step::

        grads.attach()                       # .grad of every param = a view of the buffer
        for i, mb in enumerate(microbatches):
            grads.set_sync(i == last)        # launch collectives only on the last microbatch
            loss.backward()
        grads.finish()                       # launch what is left, wait; grads are averaged

    Args:
        layout: where each parameter lives (its params must be the ones given here).
        group: the data-parallel process group (None or size 1: nothing is communicated).
        reduce_scatter: False: all-reduce, every rank ends with the whole averaged gradient.
            True (ZeRO-2): each rank receives only its owned slices, in `shard_grad`
            ``[numel / dp]``; call `release()` afterwards to drop the full buffer.
        divisor: what each gradient is divided by before the sum; None: the group's size
            (the mean over replicas). Expert weights pass the full dp size (module docstring).
        grad_dtype: dtype of the buffer; None: the parameters' dtype, and ``.grad`` is a view
            of it. A different dtype (fp32 for bf16 parameters) accumulates each backward's
            ``.grad`` into ``param.main_grad`` (a view) and frees ``.grad``.
        reduce_dtype: dtype on the wire; None: the buffer's. bf16 halves the bytes; the result
            is copied back into the buffer.

    Raises:
        TypeError: when the parameters do not all share one dtype and device.
        ValueError: when the layout was padded for another group size, or ``divisor < 1``.
    """

    def __init__(
        self,
        layout: FlatLayout,
        group: ProcessGroup | None,
        *,
        reduce_scatter: bool = False,
        divisor: int | None = None,
        grad_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        params = layout.params
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) > 1:
            raise TypeError(
                "data-parallel gradient buckets need every trainable parameter in one dtype "
                f"and on one device; got {sorted(str(k) for k in kinds)}. Cast the model "
                "with module.to(dtype) before training"
            )
        self.layout = layout
        self.group = group
        self.dp_size = group_size(group)
        self.dp_rank = group_rank(group)
        if layout.dp_size != self.dp_size:
            raise ValueError(
                f"the flat layout is padded for {layout.dp_size} ranks but the group has "
                f"{self.dp_size}; build FlatLayout with dp_size={self.dp_size}"
            )
        self.divisor = self.dp_size if divisor is None else divisor
        if self.divisor < 1:
            raise ValueError(f"divisor must be >= 1, got {self.divisor}")
        self.reduce_scatter = reduce_scatter
        self._dtype, self._device = grad_dtype or params[0].dtype, params[0].device
        #: grads live in ``param.main_grad`` (buffer dtype differs from the parameters')
        self.main_grads = self._dtype != params[0].dtype
        self.reduce_dtype = reduce_dtype or self._dtype
        self._copy_back: list[tuple[Tensor, Tensor]] = []
        self.buffer: Tensor | None = None
        self.shard_grad: Tensor | None = None
        if reduce_scatter:
            self.shard_grad = torch.zeros(
                layout.shard_numel, dtype=self._dtype, device=self._device
            )
        self._index = {id(p): i for i, p in enumerate(params)}
        self._sync = False
        self._pending: list[int] = []
        self._next_bucket = 0
        self._handles: list[dist.Work] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]
        self._reset_counts()
        self.attach()

    # -- buffer --------------------------------------------------------------------------------
    def attach(self) -> None:
        """Make sure the full buffer exists and every ``param.grad`` is a view of it."""
        if self.buffer is None:
            self.buffer = torch.zeros(self.layout.numel, dtype=self._dtype, device=self._device)
        for i, p in enumerate(self.layout.params):
            if self.main_grads:
                p.main_grad = self.layout.view(self.buffer, i)
            else:
                p.grad = self.layout.view(self.buffer, i)

    def release(self) -> None:
        """Drop the full buffer and set every ``param.grad`` to None (ZeRO-2 after `finish`)."""
        for p in self.layout.params:
            p.grad = None
            if self.main_grads:
                p.main_grad = None
        self.buffer = None

    def zero_(self) -> None:
        """Zero the gradients (full buffer and shard buffer) for the next step."""
        if self.buffer is not None:
            self.buffer.zero_()
        if self.shard_grad is not None:
            self.shard_grad.zero_()

    # -- reduction -------------------------------------------------------------------------------
    def set_sync(self, sync: bool) -> None:
        """Whether gradients completed from now on are reduced (True on the last microbatch)."""
        self._sync = sync

    def _reset_counts(self) -> None:
        self._pending = [len(b.param_indices) for b in self.layout.buckets]
        self._next_bucket = 0
        self._handles = []

    def _on_grad_ready(self, param: Tensor) -> None:
        if self.main_grads:
            param.main_grad.add_(param.grad)  # accumulate in the buffer's (fp32) dtype
            param.grad = None
        if not self._sync:
            return
        b = self.layout.bucket_of[self._index[id(param)]]
        self._pending[b] -= 1
        # Launch in bucket order only (see the module docstring).
        while self._next_bucket < len(self._pending) and self._pending[self._next_bucket] == 0:
            self._launch(self._next_bucket)

    def _launch(self, b: int) -> None:
        assert self.buffer is not None, "attach() must run before backward"
        bucket = self.layout.buckets[b]
        self._next_bucket = b + 1
        view = self.buffer[bucket.start : bucket.end]
        if self.divisor != 1:
            view.div_(self.divisor)  # sum of grads / dp = the mean over replicas
        if self.dp_size == 1:
            if self.shard_grad is not None:
                self.shard_grad[bucket.start : bucket.end].copy_(view)
            return
        if self.reduce_dtype != self._dtype:  # e.g. bf16 on the wire, copied back after wait
            wire = view.to(self.reduce_dtype)
        else:
            wire = view
        if self.reduce_scatter:
            assert self.shard_grad is not None
            lo = bucket.start // self.dp_size
            out = self.shard_grad[lo : lo + (bucket.end - bucket.start) // self.dp_size]
            out_wire = out if wire is view else out.new_empty(out.shape, dtype=self.reduce_dtype)
            work = _reduce_scatter_single(out_wire, wire, group=self.group, async_op=True)
            if out_wire is not out:
                self._copy_back.append((out_wire, out))
        else:
            work = dist.all_reduce(wire, group=self.group, async_op=True)
            if wire is not view:
                self._copy_back.append((wire, view))
        self._handles.append(work)

    def launch_remaining(self) -> None:
        """Launch the buckets not yet launched (e.g. holding params that got no grad)."""
        while self._next_bucket < len(self.layout.buckets):
            self._launch(self._next_bucket)

    def wait(self) -> None:
        """Wait for every launched collective; the gradients are then reduced."""
        for work in self._handles:
            work.wait()
        for wire, dst in self._copy_back:
            dst.copy_(wire)
        self._copy_back = []
        self._reset_counts()
        self._sync = False

    def finish(self) -> None:
        """Launch the buckets not yet launched, wait for all of them."""
        self.launch_remaining()
        self.wait()

    def remove_hooks(self) -> None:
        """Unregister the gradient hooks (call when the strategy is torn down)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def remove(self) -> None:
        """Unregister the hooks and drop the buffer with every view of it (teardown; the
        counterpart of `nanotrain.precision.MainGrads.remove`)."""
        self.remove_hooks()
        self.release()


class GradBucketSets:
    """Several `GradBuckets` (each over its own group) driven as one, e.g. dense weights over
    the data-parallel group and expert weights over the expert-data-parallel group.

    Offers the per-step interface of `GradBuckets` (`attach`, `set_sync`, `finish`, `release`,
    `zero_`, `remove_hooks`) and numbers the parameters of all sets one after another:
    `params` is set 0's parameters, then set 1's, ...; `offset(k)` is where set ``k`` starts.

    Args:
        sets: at least one `GradBuckets`, over disjoint parameters.

    Raises:
        ValueError: for no set, or a parameter in two sets.
    """

    def __init__(self, sets: Sequence[GradBuckets]) -> None:
        self.sets = list(sets)
        if not self.sets:
            raise ValueError("GradBucketSets needs at least one GradBuckets")
        self.params = [p for s in self.sets for p in s.layout.params]
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("a parameter appears in two gradient bucket sets; split them apart")
        self._offsets = [0]
        for s in self.sets[:-1]:
            self._offsets.append(self._offsets[-1] + len(s.layout.params))

    def offset(self, k: int) -> int:
        """Index in `params` of set ``k``'s first parameter."""
        return self._offsets[k]

    def attach(self) -> None:
        """`GradBuckets.attach` on every set."""
        for s in self.sets:
            s.attach()

    def set_sync(self, sync: bool) -> None:
        """`GradBuckets.set_sync` on every set."""
        for s in self.sets:
            s.set_sync(sync)

    def finish(self) -> None:
        """Launch what is left in every set, then wait for all (sets overlap each other)."""
        for s in self.sets:
            s.launch_remaining()
        for s in self.sets:
            s.wait()

    def release(self) -> None:
        """`GradBuckets.release` on every set (ZeRO-2)."""
        for s in self.sets:
            s.release()

    def zero_(self) -> None:
        """`GradBuckets.zero_` on every set."""
        for s in self.sets:
            s.zero_()

    def remove_hooks(self) -> None:
        """`GradBuckets.remove_hooks` on every set."""
        for s in self.sets:
            s.remove_hooks()


def backward_order(module: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters of ``module`` (each once, tied ones included once), reversed.

    Backward visits layers last to first, so reversing registration order makes the first
    buckets complete first and their communication overlap with the rest of backward.
    """
    return [p for p in reversed(list(module.parameters())) if p.requires_grad]
