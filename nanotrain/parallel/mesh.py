"""The parallel mesh: which ranks share which process group, and where this rank sits.

Rank order (as in Megatron-LM): tensor parallel is the fastest-varying axis, then data
parallel, then pipeline parallel::

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

so the ranks of one tensor-parallel group are neighbours (one node, the fastest links).
Context parallelism (``cp``) is carved out of the data-parallel axis, context rank fastest,
so the order of the axes is Megatron-Core's tp-cp-ep-dp-pp::

    dp_rank = cp_rank + cp * data_rank

Context-parallel ranks hold replicas of the weights and different parts of the same
sequences: the ``dp`` axis is the group of weight replicas (Megatron's "dp x cp" group, over
which gradients are reduced, ZeRO shards and the grad norm is taken), and the ``dp / cp``
ranks with the same ``cp_rank`` read different samples (`ParallelMesh.data_rank`). Expert
parallelism is carved out of the same replica axis, expert rank fastest::

    dp_rank = ep_rank + ep * expert_dp_rank

Dense weights are replicated over the ``dp`` ranks of a data-parallel group; expert weights
are split over the ``ep`` ranks of an expert-parallel group and replicated over the ``dp / ep``
ranks of an expert-data-parallel group.

Worked example, world 8, tp=2, pp=2, dp=2, ep=1::

    rank   0 1 2 3 4 5 6 7
    tp     0 1 0 1 0 1 0 1
    dp     0 0 1 1 0 0 1 1
    pp     0 0 0 0 1 1 1 1

    tp groups: [0,1] [2,3] [4,5] [6,7]
    dp groups: [0,2] [1,3] [4,6] [5,7]
    pp groups: [0,4] [1,5] [2,6] [3,7]
    mp groups (tp x pp: the ranks that together hold one model replica): [0,1,4,5] [2,3,6,7]

With ep=2 on that layout the expert-parallel groups equal the dp groups and each
expert-data-parallel group is a single rank.

Everything except ``ParallelMesh.build`` is pure and needs no ``torch.distributed``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import ProcessGroup

from nanotrain.parallel.layout_checks import check_context, check_sizes, validate_layout
from nanotrain.parallel.node_dispatch import NodeGroups, node_split
from nanotrain.parallel.placement import StagePlacement

__all__ = [
    "AXES",
    "Channel",
    "MeshLayout",
    "MeshCoords",
    "ParallelMesh",
    "check_sizes",
    "validate_layout",
]

#: a pipeline channel: (sender, receiver, whether it carries gradients) global ranks
Channel = tuple[int, int, bool]

#: Mesh axes, in the order their process groups are created (the same on every rank); the
#: ``cp`` groups are created only when cp > 1 (`ParallelMesh.cp_group` is None otherwise).
AXES: tuple[str, ...] = ("tp", "pp", "dp", "ep", "expert_dp", "mp", "cp")


@dataclass(frozen=True)
class MeshCoords:
    """Where one rank sits on each mesh axis (all 0 for a single process)."""

    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep_rank: int
    expert_dp_rank: int
    cp_rank: int = 0
    data_rank: int = 0


@dataclass(frozen=True)
class MeshLayout:
    """Axis sizes of a mesh and the pure rank arithmetic on them (no process groups).

    ``dp`` counts the weight replicas (data x context parallel ranks); ``cp`` of them hold
    parts of the same sequences, so ``dp // cp`` read different samples (`data`).

    Raises:
        TypeError, ValueError: as ``validate_layout`` for an inconsistent layout.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        validate_layout(self.tp * self.pp * self.dp, self.tp, self.pp, self.ep, self.dp)
        check_context(self.dp, self.cp)

    @property
    def data(self) -> int:
        """Ranks reading different samples in one replica group, ``dp // cp``."""
        return self.dp // self.cp

    @property
    def world_size(self) -> int:
        """``tp * pp * dp``."""
        return self.tp * self.pp * self.dp

    @property
    def expert_dp(self) -> int:
        """Size of an expert-data-parallel group, ``dp // ep``."""
        return self.dp // self.ep

    def size(self, axis: str) -> int:
        """Number of ranks in one group of ``axis`` (one of ``AXES``)."""
        sizes = {"tp": self.tp, "pp": self.pp, "dp": self.dp, "ep": self.ep}
        sizes.update(expert_dp=self.expert_dp, mp=self.tp * self.pp, cp=self.cp)
        if axis not in sizes:
            raise ValueError(f"unknown mesh axis {axis!r}; choose one of {AXES}")
        return sizes[axis]

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        """Global rank at the given coordinates (tensor fastest, then data, then pipeline)."""
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def coords(self, rank: int) -> MeshCoords:
        """Coordinates of global ``rank``.

        Raises:
            ValueError: if ``rank`` is outside ``[0, world_size)``.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside [0, {self.world_size}) for {self}")
        tp_rank, rest = rank % self.tp, rank // self.tp
        dp_rank, pp_rank = rest % self.dp, rest // self.dp
        ep_rank, expert_dp_rank = dp_rank % self.ep, dp_rank // self.ep
        cp_rank, data_rank = dp_rank % self.cp, dp_rank // self.cp
        return MeshCoords(
            rank, tp_rank, pp_rank, dp_rank, ep_rank, expert_dp_rank, cp_rank, data_rank
        )

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of ``axis`` as sorted global ranks, in creation order; they partition
        ``range(world_size)``."""
        tp, pp, dp, ep = self.tp, self.pp, self.dp, self.ep
        r = self.rank_of
        if axis == "tp":
            return [[r(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)]
        if axis == "dp":
            return [[r(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)]
        if axis == "pp":
            return [[r(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)]
        if axis == "ep":
            return [
                [r(t, e + ep * x, p) for e in range(ep)]
                for p in range(pp)
                for x in range(dp // ep)
                for t in range(tp)
            ]
        if axis == "expert_dp":
            return [
                [r(t, e + ep * x, p) for x in range(dp // ep)]
                for p in range(pp)
                for e in range(ep)
                for t in range(tp)
            ]
        if axis == "mp":
            return [sorted(r(t, d, p) for p in range(pp) for t in range(tp)) for d in range(dp)]
        if axis == "cp":
            cp = self.cp
            return [
                [r(t, c + cp * x, p) for c in range(cp)]
                for p in range(pp)
                for x in range(dp // cp)
                for t in range(tp)
            ]
        raise ValueError(f"unknown mesh axis {axis!r}; choose one of {AXES}")

    def pipeline_channels(self, v_shape: bool = False) -> list[Channel]:
        """Every pipeline channel, in creation order: (sender, receiver, gradient?) for the
        activations a virtual stage sends the next one (gradient False) and the gradients
        that come back (True), between every two ranks that exchange them. Each gets a
        two-rank group of its own (`ParallelMesh.pp_channels`): on NCCL the transfers of one
        group run one after another, so traffic of two directions, or of two kinds whose
        orders differ, would hold each other up and could deadlock a schedule.

        Args:
            v_shape: the stages sit in DualPipeV's V (`nanotrain.parallel.placement`);
                False: interleaved, with the last-to-first wrap whatever virtual_pp is.
        """
        if self.pp == 1:
            return []
        placement = StagePlacement(self.pp, 2, v_shape)
        found: dict[Channel, None] = {}
        for ranks in self.groups("pp"):
            for k in range(placement.num_virtual - 1):
                a, b = ranks[placement.locate(k)[0]], ranks[placement.locate(k + 1)[0]]
                if a != b:
                    found.setdefault((a, b, False))
                    found.setdefault((b, a, True))
        return list(found)

    def group_of(self, axis: str, rank: int) -> list[int]:
        """The global ranks of the ``axis`` group that contains ``rank`` (the same list as
        the one in `groups`, computed from the rank's coordinates alone)."""
        c = self.coords(rank)  # validates the rank
        r, ep = self.rank_of, self.ep
        x = c.expert_dp_rank
        if axis == "tp":
            return [r(t, c.dp_rank, c.pp_rank) for t in range(self.tp)]
        if axis == "dp":
            return [r(c.tp_rank, d, c.pp_rank) for d in range(self.dp)]
        if axis == "pp":
            return [r(c.tp_rank, c.dp_rank, p) for p in range(self.pp)]
        if axis == "ep":
            return [r(c.tp_rank, e + ep * x, c.pp_rank) for e in range(ep)]
        if axis == "expert_dp":
            return [r(c.tp_rank, c.ep_rank + ep * y, c.pp_rank) for y in range(self.dp // ep)]
        if axis == "mp":
            return sorted(r(t, c.dp_rank, p) for p in range(self.pp) for t in range(self.tp))
        if axis == "cp":
            base = self.cp * c.data_rank
            return [r(c.tp_rank, base + k, c.pp_rank) for k in range(self.cp)]
        raise ValueError(f"unknown mesh axis {axis!r}; choose one of {AXES}")


def _node_groups(
    splits: list[tuple[list[int], int, int]],
    rank: int,
    new_group: Callable[[list[int]], ProcessGroup],
) -> NodeGroups | None:
    """Create, in one order on every rank, the intra-node and rail groups of every ep group
    (ranks, nodes, per_node) spanning several nodes; return this rank's."""
    mine = None
    for ranks, nodes, per_node in splits:
        if nodes == 1:
            continue
        intra, inter = {}, {}
        if per_node > 1:
            for n in range(nodes):
                members = ranks[n * per_node : (n + 1) * per_node]
                intra[n] = new_group(members)
        for j in range(per_node):
            inter[j] = new_group(ranks[j::per_node])
        if rank in ranks:
            i = ranks.index(rank)
            n, j = divmod(i, per_node)
            mine = NodeGroups(nodes, per_node, n, intra.get(n), inter[j])
    return mine


class ParallelMesh:
    """Process groups of every mesh axis plus this rank's coordinates; pass it, never a global.

    Build it with ``ParallelMesh.build(...)`` under ``torch.distributed`` or
    ``ParallelMesh.single()`` for one process. When ``world_size > 1`` every axis has a real
    process group, even an axis of size 1, so a group is never ``None`` (which
    ``torch.distributed`` would read as "the whole world"). In ``single()`` all groups are
    ``None`` and the collectives of ``nanotrain.parallel`` are no-ops.

    Args:
        layout: the axis sizes.
        rank: this process's global rank.
        groups: axis name -> this rank's process group (missing axes are ``None``).
        channels: (sender, receiver, gradient?) -> the two-rank group of that pipeline
            channel, for the channels this rank is in (`MeshLayout.pipeline_channels`), in
            creation order.
        paired_ep_group: a second group over this rank's expert-parallel ranks, for the
            second of two pipeline chunks that run side by side (`ParallelMesh.build`'s
            ``paired_chunks``); None when not made.
        ep_node_groups: this rank's expert-parallel group split by node, for node-limited
            dispatch (`nanotrain.parallel.node_dispatch`; `ParallelMesh.build`'s
            ``ranks_per_node``); None when not made or when the group is on one node.
        paired_ep_node_groups: the same for `paired_ep_group` (made with both options).
    """

    def __init__(
        self,
        layout: MeshLayout,
        rank: int,
        groups: Mapping[str, ProcessGroup | None] | None = None,
        channels: Mapping[Channel, ProcessGroup] | None = None,
        paired_ep_group: ProcessGroup | None = None,
        ep_node_groups: NodeGroups | None = None,
        paired_ep_node_groups: NodeGroups | None = None,
    ) -> None:
        self.layout = layout
        self.coords = layout.coords(rank)
        groups = dict(groups or {})
        unknown = set(groups) - set(AXES)
        if unknown:
            raise ValueError(f"unknown mesh axes {sorted(unknown)}; choose from {AXES}")
        self._groups = {axis: groups.get(axis) for axis in AXES}
        self.pp_channels: dict[Channel, ProcessGroup] = dict(channels or {})
        self.paired_ep_group = paired_ep_group
        self.ep_node_groups = ep_node_groups
        self.paired_ep_node_groups = paired_ep_node_groups

    @classmethod
    def single(cls) -> ParallelMesh:
        """The one-process mesh: every size 1, every group ``None``; no ``torch.distributed``."""
        return cls(MeshLayout(), rank=0)

    @classmethod
    def build(
        cls,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        dp: int | None = None,
        *,
        cp: int = 1,
        world_size: int | None = None,
        rank: int | None = None,
        timeout: timedelta | None = None,
        backend: str | None = None,
        new_group: Callable[[list[int]], ProcessGroup] | None = None,
        pipeline_v_shape: bool = False,
        paired_chunks: bool = False,
        ranks_per_node: int | None = None,
        **model_dims: int | None,
    ) -> ParallelMesh:
        """Validate the layout, then create every group of every axis.

        Every rank must call this with the same arguments: creating a group is collective over
        the world, so groups are created in one fixed order (``AXES``, then
        ``MeshLayout.groups``) and each rank keeps the ones that contain it.

        Args:
            tp, pp, ep, dp: axis sizes (``dp=None``: inferred from the world size); ``dp``
                counts the weight replicas, context-parallel ranks included.
            cp: context-parallel size, carved out of ``dp`` (must divide it); its groups are
                created (after those of every other axis) only when cp > 1.
            world_size, rank: default to ``dist.get_world_size()`` / ``dist.get_rank()``.
            timeout: per-group collective timeout (``None``: torch's default for the backend,
                which does not inherit the timeout given to ``init_process_group``).
            backend: backend of the new groups (``None``: that of the default group).
            new_group: ``ranks -> group`` factory called once per group, in creation order;
                ``None`` uses ``torch.distributed.new_group`` (with ``timeout``/``backend``).
                Pass your own to build a mesh on another group API, or to inspect the order.
            pipeline_v_shape: create the pipeline channels of DualPipeV's V placement
                (`MeshLayout.pipeline_channels`).
            paired_chunks: also create a second set of expert-parallel groups
                (`paired_ep_group`): when a forward of one chunk and a backward of another
                run side by side, each chunk's all-to-alls need a group of their own to keep
                one order on every rank.
            ranks_per_node: global ranks per node (consecutive ranks share a node); given,
                every expert-parallel group that spans several nodes also gets its node
                groups (`ep_node_groups`, for node-limited dispatch; with
                ``paired_chunks`` a second set, `paired_ep_node_groups`).
            **model_dims: ``num_heads``, ``num_kv_heads``, ``vocab_size``, ``num_experts``,
                ``num_layers`` forwarded to ``validate_layout``.

        Raises:
            ValueError: invalid layout (before any group exists), the world does not match,
                or an expert-parallel group that does not split evenly over the nodes of
                `ranks_per_node` ranks.
            RuntimeError: if ``torch.distributed`` is not initialised, ``world_size > 1`` and
                no ``new_group`` factory is given.
        """
        initialized = dist.is_available() and dist.is_initialized()
        if world_size is None or rank is None:
            if not initialized:
                if world_size in (None, 1) and rank in (None, 0):
                    validate_layout(1, tp, pp, ep, dp, **model_dims)
                    check_context(1, cp)
                    return cls.single()
                raise RuntimeError(
                    "torch.distributed is not initialised; call init_process_group first, "
                    "pass world_size, rank and new_group, or use ParallelMesh.single()"
                )
            world_size = dist.get_world_size() if world_size is None else world_size
            rank = dist.get_rank() if rank is None else rank
        dp = validate_layout(world_size, tp, pp, ep, dp, **model_dims)
        layout = MeshLayout(tp=tp, pp=pp, dp=dp, ep=ep, cp=cp)
        coords = layout.coords(rank)  # rejects a rank outside the world before any group
        # every ep group's node split, checked before any group exists
        splits = [] if ranks_per_node is None or ep == 1 else layout.groups("ep")
        splits = [(ranks, *node_split(ranks, ranks_per_node)) for ranks in splits]
        if world_size == 1:
            return cls(layout, rank)
        if new_group is None:
            if not initialized:
                raise RuntimeError(
                    f"world_size={world_size} but torch.distributed is not initialised; call "
                    "init_process_group first or pass a new_group factory"
                )
            if dist.get_world_size() != world_size:
                raise ValueError(
                    f"world_size={world_size} but torch.distributed has "
                    f"{dist.get_world_size()} ranks; pass the real world size (or leave it unset)"
                )
            new_group = functools.partial(dist.new_group, timeout=timeout, backend=backend)
        groups: dict[str, ProcessGroup | None] = {}
        for axis in AXES:
            if axis == "cp" and cp == 1:
                continue  # no group: the context-parallel collectives are then no-ops
            for ranks in layout.groups(axis):
                # Collective over the whole world: every rank creates every group, in order,
                # even the groups it is not part of.
                group = new_group(ranks)
                if coords.rank in ranks:
                    groups[axis] = group
        channels = {}
        for channel in layout.pipeline_channels(pipeline_v_shape):
            pair = sorted(channel[:2])
            group = new_group(pair)
            if coords.rank in pair:
                channels[channel] = group
        paired_ep_group = None
        if paired_chunks:
            for ranks in layout.groups("ep"):
                group = new_group(ranks)
                if coords.rank in ranks:
                    paired_ep_group = group
        node_groups = _node_groups(splits, coords.rank, new_group)
        paired_node_groups = _node_groups(splits, coords.rank, new_group) if paired_chunks else None
        return cls(layout, rank, groups, channels, paired_ep_group, node_groups, paired_node_groups)

    # -- groups, sizes and coordinates -------------------------------------------------------

    def group(self, axis: str) -> ProcessGroup | None:
        """This rank's process group on ``axis`` (``None`` only in a one-process mesh)."""
        if axis not in self._groups:
            raise ValueError(f"unknown mesh axis {axis!r}; choose one of {AXES}")
        return self._groups[axis]

    def size(self, axis: str) -> int:
        """Number of ranks in this rank's ``axis`` group."""
        return self.layout.size(axis)

    def group_ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's ``axis`` group, in group-rank order."""
        return self.layout.group_of(axis, self.coords.rank)

    @property
    def world_size(self) -> int:
        """Total number of ranks, ``tp * pp * dp``."""
        return self.layout.world_size

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.coords.rank

    tp_group = property(lambda self: self._groups["tp"], doc="Tensor-parallel group.")
    pp_group = property(lambda self: self._groups["pp"], doc="Pipeline-parallel group.")
    dp_group = property(lambda self: self._groups["dp"], doc="Data-parallel group (dense).")
    ep_group = property(lambda self: self._groups["ep"], doc="Expert-parallel group.")
    expert_dp_group = property(
        lambda self: self._groups["expert_dp"], doc="Data-parallel group of expert weights."
    )
    mp_group = property(lambda self: self._groups["mp"], doc="Model-parallel group (tp x pp).")
    cp_group = property(
        lambda self: self._groups["cp"],
        doc="Context-parallel group (parts of the same sequences); None when cp = 1.",
    )

    tp_size = property(lambda self: self.layout.tp, doc="Tensor-parallel size.")
    pp_size = property(lambda self: self.layout.pp, doc="Pipeline-parallel size.")
    dp_size = property(
        lambda self: self.layout.dp, doc="Weight replicas (data x context parallel ranks)."
    )
    cp_size = property(lambda self: self.layout.cp, doc="Context-parallel size.")
    data_size = property(
        lambda self: self.layout.data, doc="Ranks reading different samples, dp // cp."
    )
    ep_size = property(lambda self: self.layout.ep, doc="Expert-parallel size.")
    expert_dp_size = property(lambda self: self.layout.expert_dp, doc="dp // ep.")

    tp_rank = property(lambda self: self.coords.tp_rank, doc="Rank in the tp group.")
    pp_rank = property(lambda self: self.coords.pp_rank, doc="Pipeline stage index.")
    dp_rank = property(lambda self: self.coords.dp_rank, doc="Rank in the dp group.")
    cp_rank = property(lambda self: self.coords.cp_rank, doc="Rank in the cp group.")
    data_rank = property(
        lambda self: self.coords.data_rank, doc="Which samples this rank reads, dp_rank // cp."
    )
    ep_rank = property(lambda self: self.coords.ep_rank, doc="Rank in the ep group.")
    expert_dp_rank = property(
        lambda self: self.coords.expert_dp_rank, doc="Rank in the expert-dp group."
    )

    @property
    def is_first_stage(self) -> bool:
        """Whether this is pipeline rank 0 (which holds the first virtual stage; in
        DualPipeV's V also the last, `nanotrain.parallel.placement`)."""
        return self.coords.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this is pipeline rank pp - 1 (which holds the last virtual stage under the
        interleaved placement; in a V it holds the turn, the last is on rank 0)."""
        return self.coords.pp_rank == self.layout.pp - 1

    @property
    def prev_stage_rank(self) -> int | None:
        """Global rank of pipeline rank pp_rank - 1 (same tp/dp coords); None on rank 0."""
        return None if self.is_first_stage else self.group_ranks("pp")[self.pp_rank - 1]

    @property
    def next_stage_rank(self) -> int | None:
        """Global rank of pipeline rank pp_rank + 1 (same tp/dp coords); None on rank pp - 1."""
        return None if self.is_last_stage else self.group_ranks("pp")[self.pp_rank + 1]

    def __repr__(self) -> str:
        c, lay = self.coords, self.layout
        return (
            f"ParallelMesh(rank={c.rank}/{lay.world_size}, tp={c.tp_rank}/{lay.tp}, "
            f"pp={c.pp_rank}/{lay.pp}, dp={c.dp_rank}/{lay.dp}, ep={c.ep_rank}/{lay.ep}, "
            f"cp={c.cp_rank}/{lay.cp})"
        )
