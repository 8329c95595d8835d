"""One rank's model, built on the meta device from the code's own constructors, and its counts.

The planner never re-derives how a layout splits a model: it builds, for each pipeline rank,
exactly what `MegatronStrategy` builds there (`build_model` / `PipelineStage`, with the
tensor- and expert-parallel layers sized by stand-in groups) on the meta device, where even
the 671B model costs no memory, and counts what is there. The stand-in `LayoutGroup` has the
two methods the layers ask a process group (`size()`, `rank()`).

Every rank of a pipeline stage holds tensors of the same shapes (tp and ep ranks hold equal
slices), so one build per pipeline rank covers the whole world.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nanotrain.models.build import build_model
from nanotrain.models.stages import PipelineStage
from nanotrain.parallel.data_parallel import FlatLayout
from nanotrain.parallel.expert import is_expert_param
from nanotrain.planning.layout import PlanLayout
from nanotrain.strategies.megatron_grads import bucket_numel_for

__all__ = ["LayoutGroup", "RankModel", "build_rank_model", "rank_models"]


@dataclass(frozen=True)
class LayoutGroup:
    """Stand-in for a process group of `n` ranks seen from rank `r` (no communication)."""

    n: int
    r: int = 0

    def size(self) -> int:
        """Ranks in the group."""
        return self.n

    def rank(self) -> int:
        """This rank's index in the group."""
        return self.r


@dataclass(frozen=True)
class _Mesh:
    """The attributes of a `ParallelMesh` that the model builders read."""

    tp_group: LayoutGroup | None
    ep_group: LayoutGroup | None
    pp_size: int
    pp_rank: int


@dataclass(frozen=True)
class RankModel:
    """What one rank of pipeline stage `pp_rank` holds, read from its meta-device model.

    Attributes:
        pp_rank: the pipeline rank.
        chunks: layer indices of each of its chunks.
        dense: its non-expert trainable parameters in gradient-buffer order (tied once).
        experts: its routed-expert parameters (its 1/ep of the experts).
        buffers: elements of its buffers (router bias and load counters, RoPE caches).
        buffer_bytes: their bytes, each in its own dtype.
        module: the meta-device model (a `PipelineStage` under pp > 1).
        sizes_id: (dense, experts): the same number for lists of parameters with the same
            elements, in order: all the flat buffers and ZeRO's owned slices depend on
            (ranks share `flat_numels` and `memory.optimizer_pieces` through it).
    """

    pp_rank: int
    chunks: list[list[int]]
    dense: list[torch.Tensor]
    experts: list[torch.Tensor]
    buffers: int
    buffer_bytes: int
    module: nn.Module
    _units: list[Any] = field(default_factory=list, compare=False, repr=False)  # ZeRO-3's
    sizes_id: tuple[int, int] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes_id", (_sizes_id(self.dense), _sizes_id(self.experts)))

    @property
    def dense_params(self) -> int:
        """Elements of the non-expert trainable parameters."""
        return sum(p.numel() for p in self.dense)

    @property
    def expert_params(self) -> int:
        """Elements of the routed-expert parameters."""
        return sum(p.numel() for p in self.experts)

    @property
    def params(self) -> int:
        """All trainable parameter elements on this rank."""
        return self.dense_params + self.expert_params

    def flat_numels(self, layout: PlanLayout, element_size: int) -> tuple[int, int]:
        """Elements of the dense and expert flat buffers the strategy allocates for gradients
        (and ZeRO for parameters): buckets of `layout.bucket_size_mb` MiB of parameters of
        `element_size` bytes, each padded to a multiple of dp (dense) or dp / ep (experts)."""
        numel = bucket_numel_for(element_size, layout.bucket_size_mb)
        dense = _flat_numel(self.dense, self.sizes_id[0], layout.dp, numel)
        return dense, _flat_numel(self.experts, self.sizes_id[1], layout.expert_dp, numel)


def _flat_numel(params: list[torch.Tensor], sizes_id: int, size: int, bucket: int) -> int:
    """``FlatLayout(params, size, bucket).numel`` (0 without parameters), kept per sizes."""
    if not params:
        return 0
    key = (sizes_id, size, bucket)
    if key not in _FLAT:
        if len(_FLAT) > 16384:
            _FLAT.clear()
        _FLAT[key] = FlatLayout(params, size, bucket).numel
    return _FLAT[key]


def _sizes_id(params: list[torch.Tensor]) -> int:
    """The same number for parameter lists of the same elements, in order."""
    numels = tuple(p.numel() for p in params)
    if numels not in _SIZES:
        if len(_SIZES) > 65536:
            _SIZES.clear()  # the counter goes on: no id is given twice
        _SIZES[numels] = next(_SIZE_IDS)
    return _SIZES[numels]


#: `_sizes_id` per parameter elements; the ids never repeat
_SIZES: dict[tuple[int, ...], int] = {}
_SIZE_IDS = itertools.count()
#: `_flat_numel` per (sizes id, group size, bucket elements)
_FLAT: dict[tuple[int, int, int], int] = {}


def build_rank_model(config: Any, layout: PlanLayout, pp_rank: int = 0) -> nn.Module:
    """The model pipeline rank `pp_rank` of `layout` builds, on the meta device.

    A whole `CausalLM` for pp == 1, else its `PipelineStage` (the same chunks and the same
    embedding / head / MTP placement as `build_pipeline_stage`).
    """
    full = _full_model(config, layout.tp, layout.ep, layout.sequence_parallel)
    if layout.pp == 1:
        return full
    chunks = layout.stage_chunks(config, pp_rank)
    return PipelineStage(full, chunks, layout.pp, pp_rank, layout.placement.v_shape)


_FULL: dict[tuple[str, int, int, bool], nn.Module] = {}
_CONFIG_KEYS: dict[int, tuple[Any, dict[str, Any], str]] = {}


def config_key(config: Any) -> str:
    """`repr(config)`, the planner's cache key of a model config, made again only when the
    config changed (a search asks for it hundreds of thousands of times; comparing its fields
    with a copy taken with the key costs about a fifth of a repr)."""
    hit = _CONFIG_KEYS.get(id(config))
    if hit is None or hit[0] is not config or vars(config) != hit[1]:
        if len(_CONFIG_KEYS) > 64:
            _CONFIG_KEYS.clear()
        hit = (config, copy.deepcopy(vars(config)), repr(config))
        _CONFIG_KEYS[id(config)] = hit
    return hit[2]


def _full_model(config: Any, tp: int, ep: int, sequence_parallel: bool) -> nn.Module:
    """The whole model one rank of a tp x ep layout builds (meta device), cached: a
    `PipelineStage` only picks modules of it, so every pipeline rank can share one build."""
    key = (config_key(config), tp, ep, sequence_parallel)
    if key not in _FULL:
        if len(_FULL) > 256:
            _FULL.clear()
        mesh = _Mesh(LayoutGroup(tp) if tp > 1 else None, LayoutGroup(ep) if ep > 1 else None, 1, 0)
        _FULL[key] = build_model(
            config, mesh=mesh, device="meta", sequence_parallel=sequence_parallel
        )
    return _FULL[key]


def _rank_model(config: Any, layout: PlanLayout, pp_rank: int) -> RankModel:
    module = build_rank_model(config, layout, pp_rank)
    # `backward_order(module)` and `expert_param_ids(module)`, from the modules' cached lists
    params, buffers = _members(module)
    params = [p for p in reversed(params) if p.requires_grad]
    expert_ids = {id(p) for p in params if is_expert_param(p)}
    if layout.pp > 1:
        chunks = layout.stage_chunks(config, pp_rank)
    else:
        chunks = [list(range(config.num_layers))]
    dense = [p for p in params if id(p) not in expert_ids]
    experts = [p for p in params if id(p) in expert_ids]
    return RankModel(
        pp_rank=pp_rank,
        chunks=chunks,
        dense=dense,
        experts=experts,
        buffers=sum(b.numel() for b in buffers),
        buffer_bytes=sum(b.numel() * b.element_size() for b in buffers),
        module=module,
    )


#: per module object: (the module, its parameters, its buffers) as `module.parameters()` and
#: `module.buffers()` list them
_MEMBERS: dict[int, tuple[nn.Module, list[torch.Tensor], list[torch.Tensor]]] = {}


def _members(module: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(parameters, buffers) of `module` in the order `module.parameters()` and
    `module.buffers()` give them (its own, then each child's in registration order, each
    tensor at its first place), made once per module object: a search builds thousands of
    pipeline stages from the modules of the same few whole models, and walking every
    stage's module tree anew dominated it."""
    hit = _MEMBERS.get(id(module))
    if hit is not None and hit[0] is module:
        return hit[1], hit[2]
    params = list(module.parameters(recurse=False))
    buffers = list(module.buffers(recurse=False))
    for child in module.children():
        child_params, child_buffers = _members(child)
        params.extend(child_params)
        buffers.extend(child_buffers)
    params, buffers = _unique(params), _unique(buffers)
    if len(_MEMBERS) > 262144:
        _MEMBERS.clear()
    _MEMBERS[id(module)] = (module, params, buffers)
    return params, buffers


def _unique(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` with each object only at its first place (as `nn.Module` lists members)."""
    seen: set[int] = set()
    return [t for t in tensors if not (id(t) in seen or seen.add(id(t)))]


_CACHE: dict[tuple[str, PlanLayout, int], RankModel] = {}
_VALID: set[tuple[str, PlanLayout]] = set()  # (config, layout) pairs already validated
_BY_LAYOUT: dict[tuple[str, PlanLayout], list[RankModel]] = {}  # rank_models' answers


def rank_models(config: Any, layout: PlanLayout) -> list[RankModel]:
    """`RankModel` of every pipeline rank (index = pp rank), cached per config and layout.

    Raises:
        ValueError: when the layout does not fit the model (`PlanLayout.validate`).
    """
    checked = (config_key(config), layout)
    built = _BY_LAYOUT.get(checked)
    if built is not None:
        return list(built)
    if checked not in _VALID:
        layout.validate(config)
        if len(_VALID) > 4096:
            _VALID.clear()
        _VALID.add(checked)
    # dp, zero, recompute and the schedule (but for its placement) do not change what a
    # rank builds: share the builds
    v_schedule = layout.schedule if layout.placement.v_shape else None
    shape = layout.replace(
        dp=layout.ep,
        zero_stage=0,
        cpu_offload=False,
        reshard_after_forward=True,
        reduce_scatter_every_microbatch=False,
        recompute=None,
        recompute_full_layers=0,
        schedule=v_schedule,
    )
    out = []
    for r in range(layout.pp):
        key = (config_key(config), shape, r)
        if key not in _CACHE:
            if len(_CACHE) > 4096:
                _CACHE.clear()
            _CACHE[key] = _rank_model(config, shape, r)
        out.append(_CACHE[key])
    if len(_BY_LAYOUT) > 16384:
        _BY_LAYOUT.clear()
    _BY_LAYOUT[checked] = out
    return list(out)
