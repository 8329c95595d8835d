"""ZeRO-1 and ZeRO-2 (the distributed optimizer): optimizer state sharded over data parallelism.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", section 5: stage 1 is the paper's P_os (optimizer states partitioned over the
data-parallel ranks), stage 2 its P_os+g (gradients partitioned too: each rank keeps the
reduced gradient of its own slice only). Stage 3 (P_os+g+p, parameters partitioned) is not
implemented: after the step every rank again holds every parameter. Megatron-LM calls the
same design its distributed optimizer.

Parameters are moved into one flat buffer with the layout of the gradient buckets
(`nanotrain.parallel.data_parallel.FlatLayout`): ``param.data`` becomes a view of it. Each
data-parallel rank owns one equal slice of every bucket. The optimizer the module configured
(`configure_optimizers`) is kept, but its parameter groups are rewritten in place to hold only
this rank's *pieces*: 1-D views of the flat buffer covering the owned slices, each in the group
its parameter was in, so per-group hyperparameters (weight decay, lr) are kept.

Why rewrite the module's optimizer instead of building a new one: the LR scheduler the module
created is bound to that optimizer object and writes ``lr`` into its ``param_groups``; callbacks
read the lr from the same place. Keeping the object keeps all of that working unchanged. The
price: ``optimizer.param_groups[i]["params"]`` lists flat pieces, not the model's parameters,
and ``optimizer.state_dict()`` is this rank's shard.

One step::

    ZeRO-1: grads all-reduced (every rank has them whole); each rank updates its own pieces
    ZeRO-2: grads reduce-scattered (each rank receives only its own slices); same update
    then:   all-gather every bucket's slices, so every rank again holds all parameters

ZeRO-2 thus splits plain data parallelism's all-reduce into its two halves, reduce-scatter
(gradients) and all-gather (parameters), and moves the same volume (the paper's section
7.2.1); ZeRO-1 here all-reduces the gradients and then all-gathers the parameters as well.

Optimizer state (e.g. AdamW's two moments) exists only for the pieces: ``full / dp`` per rank.
Under expert parallelism the expert weights form a second flat buffer, sharded over the
expert-data-parallel group (``dp / ep`` ranks) instead; since each rank holds only ``1 / ep``
of the experts, its share of their state is again ``full / dp``.
The update is exact for optimizers whose update is elementwise (`ELEMENTWISE_OPTIMIZERS`): the
same numbers come out whether a tensor is updated whole or in flat pieces. Master weights for
low-precision parameters (bf16-true): with ``master_dtype=torch.float32`` each rank keeps fp32
copies of only its own pieces (``1 / dp`` of the model), the optimizer (and its state) works on
those, and the result is cast into the bf16 flat buffer before the all-gather.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from nanotrain.parallel.data_parallel import FlatLayout, GradBuckets, GradBucketSets, ShardPiece

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

__all__ = ["ELEMENTWISE_OPTIMIZERS", "ZeroOptimizer", "flatten_parameters", "state_bytes"]

#: torch.optim optimizers whose update of one element reads only that element's state.
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.ASGD,
    torch.optim.Rprop,
)


@torch.no_grad()
def flatten_parameters(layout: FlatLayout) -> Tensor:
    """Copy the layout's parameters into one flat buffer and make each ``param.data`` a view.

    Returns: the flat buffer ``[layout.numel]`` (padding is zero). The parameter objects stay
    the same, so optimizers and hooks that hold them keep working.
    """
    first = layout.params[0]
    flat = torch.zeros(layout.numel, dtype=first.dtype, device=first.device)
    for i, p in enumerate(layout.params):
        view = layout.view(flat, i)
        view.copy_(p.data)
        p.data = view
    return flat


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` (moments, step counters, ...)."""
    return sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, Tensor)
    )


def _check_optimizer(
    optimizer: torch.optim.Optimizer, params: list[nn.Parameter]
) -> dict[int, int]:
    """Validate that ``optimizer`` can be sharded; return ``id(param) -> group index``."""
    if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        raise TypeError(
            f"ZeRO shards parameters into flat slices, which is exact only for optimizers "
            f"whose update is elementwise; {type(optimizer).__name__} is not one of: {names}. "
            "Use zero_stage=0 for it"
        )
    if optimizer.state:
        raise ValueError(
            "ZeRO must shard the optimizer before its first step, but it already has state; "
            "load optimizer checkpoints after the strategy's setup_optimizers"
        )
    known = {id(p) for p in params}
    group_of = {}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in known:
                raise ValueError(
                    f"optimizer group {gi} holds a tensor of shape {tuple(p.shape)} that is not "
                    "a trainable parameter of the module; ZeRO can only shard the module's "
                    "own parameters"
                )
            group_of[id(p)] = gi
    return group_of


class ZeroOptimizer:
    """Shards ``optimizer`` (in place) over data-parallel groups and runs its step.

    Each gradient bucket set is sharded over its own group: with expert parallelism, dense
    weights over the data-parallel group and expert weights over the expert-data-parallel
    group (`nanotrain.parallel.data_parallel.GradBucketSets`). Parameter indices are those of
    `GradBucketSets.params` (set 0's parameters first, then set 1's, ...).

    Args:
        optimizer: the module's optimizer over the sets' parameters, not yet stepped.
        grads: the gradient buckets (one `GradBuckets` or a `GradBucketSets`): ZeRO-1 reads
            each set's full buffer, ZeRO-2 its `shard_grad`; the group of each set is the
            group its parameters and optimizer state are sharded over.
        stage: 1 (the paper's P_os: optimizer state sharded) or 2 (P_os+g: gradients
            reduce-scattered, so each rank also keeps only its slice of them).
        master_dtype: None: update the parameters' pieces in place. A dtype (fp32) different
            from the parameters': keep master copies of this rank's pieces in it (see module).

    Raises:
        TypeError: for an optimizer whose update is not elementwise.
        ValueError: for a stage other than 1 or 2, an optimizer that already has state, or
            one holding tensors that are not the sets' parameters.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        grads: GradBuckets | GradBucketSets,
        stage: int,
        master_dtype: torch.dtype | None = None,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(f"ZeRO stage must be 1 or 2, got {stage}")
        sets = grads if isinstance(grads, GradBucketSets) else GradBucketSets([grads])
        group_of = _check_optimizer(optimizer, sets.params)
        self.optimizer, self.sets, self.stage = optimizer, sets, stage
        #: per set, the flat parameter buffer its parameters are views of
        self.flat_params = [flatten_parameters(s.layout) for s in sets.sets]
        #: (bf16 view of the flat buffer, its fp32 master) when master weights are kept
        self._master_views: list[tuple[Tensor, nn.Parameter]] = []
        #: (set index, piece, the optimizer's 1-D parameter over that piece)
        self.pieces: list[tuple[int, ShardPiece, nn.Parameter]] = []
        new_groups: list[list[nn.Parameter]] = [[] for _ in optimizer.param_groups]
        for k, buckets in enumerate(sets.sets):
            for piece in buckets.layout.pieces(buckets.dp_rank):
                gi = group_of.get(id(buckets.layout.params[piece.param_index]))
                if gi is None:
                    continue  # trainable but not optimized: reduced, never updated
                view = self.flat_params[k][piece.flat_start : piece.flat_end]
                if master_dtype is not None and master_dtype != view.dtype:
                    shard = nn.Parameter(view.detach().to(master_dtype).clone())
                    self._master_views.append((view, shard))
                else:
                    shard = nn.Parameter(view)
                new_groups[gi].append(shard)
                self.pieces.append((k, piece, shard))
        for group_dict, params in zip(optimizer.param_groups, new_groups, strict=True):
            group_dict["params"] = params

    def grad_of(self, k: int, piece: ShardPiece) -> Tensor:
        """This rank's reduced gradient for ``piece`` of set ``k`` (a view: scaling it scales
        the update)."""
        buckets = self.sets.sets[k]
        if self.stage == 2:
            assert buckets.shard_grad is not None
            return buckets.shard_grad[piece.shard_start : piece.shard_start + piece.numel]
        assert buckets.buffer is not None
        return buckets.buffer[piece.flat_start : piece.flat_end]

    def owned_grads(self, k: int | None = None) -> list[tuple[int, Tensor]]:
        """``(param_index, grad piece)`` for every piece this rank owns, optimized or not, of
        set ``k`` (None: of every set). ``param_index`` indexes `GradBucketSets.params`."""
        out = []
        for j, buckets in enumerate(self.sets.sets):
            if k is not None and j != k:
                continue
            base = self.sets.offset(j)
            for pc in buckets.layout.pieces(buckets.dp_rank):
                out.append((base + pc.param_index, self.grad_of(j, pc)))
        return out

    @torch.no_grad()
    def step(self) -> None:
        """Update this rank's pieces with the module's optimizer, then all-gather parameters."""
        for k, piece, shard in self.pieces:
            grad = self.grad_of(k, piece)
            shard.grad = grad if grad.dtype == shard.dtype else grad.to(shard.dtype)
        self.optimizer.step()
        for _, _, shard in self.pieces:
            shard.grad = None
        for view, master in self._master_views:
            view.copy_(master)
        self.all_gather_parameters()

    @property
    def masters(self) -> list[Tensor]:
        """This rank's fp32 master pieces (empty without master weights)."""
        return [m for _, m in self._master_views]

    @torch.no_grad()
    def refresh_from_params(self) -> None:
        """Set every master piece to the current (low-precision) parameter values."""
        for view, master in self._master_views:
            master.copy_(view)

    @torch.no_grad()
    def all_gather_parameters(self) -> None:
        """Give every rank of each set's group every bucket's updated slices (one async
        all-gather per bucket)."""
        works = []
        for buckets, flat in zip(self.sets.sets, self.flat_params, strict=True):
            if buckets.dp_size == 1:
                continue
            for bucket in buckets.layout.buckets:
                lo, hi = bucket.owned(buckets.dp_rank, buckets.dp_size)
                # a copy: the gather writes into the same buffer the input slice lives in
                mine = flat[lo:hi].clone()
                out = flat[bucket.start : bucket.end]
                works.append(_all_gather_single(out, mine, group=buckets.group, async_op=True))
        for work in works:
            work.wait()

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (about the unsharded amount / dp)."""
        return state_bytes(self.optimizer)
